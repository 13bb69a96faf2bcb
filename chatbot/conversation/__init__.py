"""The conversation: messages, the token ids in the cache, turns, logs and saved chats,
and the remote client that stands in for the engine against another server."""
