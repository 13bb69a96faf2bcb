"""`chatbot serve`: our engine behind the OpenAI-compatible HTTP API.

`pool` keeps conversation caches as a prefix cache (no web imports); `protocol` holds the
request models and their checks, `worker` the engine's thread, and `app` the ASGI app.
"""
