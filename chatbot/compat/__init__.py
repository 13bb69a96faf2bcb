"""The three published streaming APIs, as thin adapters over our engine, one module each.

- `chatbot.compat.colossal`: ColossalAI (Colossal-LLaMA ``stream_chat_patch``):
  `get_prompt_template`, `streaming_chat`, `stream_generate`.
- `chatbot.compat.tinychat`: TinyChat (mit-han-lab/llm-awq ``stream_gen``): `StreamGenerator`.
- `chatbot.compat.streaming_llm`: StreamingLLM (mit-han-lab/streaming-llm):
  `enable_streaming_llm`, `StartRecentKVCache`, and the helpers its example scripts import
  (`load_jsonl`, `download_url`, `parse_args`).

None of them has a decoding loop of its own: each drives `Engine.generate` (and
`Engine.prefill` to top up a cache) on the engine's caches, a `DynamicCache` or our
`SinkCache`, through their `TrackedCache` records, exactly as the CLI does. Everything is
re-exported here, so ``from chatbot.compat import streaming_chat`` works. The
originals' known faults are fixed and listed in docs/api.md. Arguments are checked as the
CLI checks its flags; a bad one raises `CompatArgumentError` (a `ConfigError` and a
`ValueError`).
"""

from chatbot.compat._common import CompatArgumentError
from chatbot.compat.colossal import (
    CHATS,  # noqa: F401 - for tests
    DEFAULT_ROLES,
    get_prompt_template,
    stream_generate,
    streaming_chat,
)
from chatbot.compat.streaming_llm import (
    StartRecentKVCache,
    download_url,
    enable_streaming_llm,
    load_jsonl,
    parse_args,
)
from chatbot.compat.tinychat import StreamGenerator, persistent_cache, reset_persistent_cache

__all__ = [
    "DEFAULT_ROLES",
    "CompatArgumentError",
    "StartRecentKVCache",
    "StreamGenerator",
    "download_url",
    "enable_streaming_llm",
    "get_prompt_template",
    "load_jsonl",
    "parse_args",
    "persistent_cache",
    "reset_persistent_cache",
    "stream_generate",
    "streaming_chat",
]
