"""`chatbot serve`: our engine behind the OpenAI-compatible HTTP API.

`pool` keeps conversation caches as a prefix cache (no web imports); `app` is the ASGI app.
"""
