"""`chatbot bench resume`: a logged chat resumed from its KV cache on disk against re-encoding
its history, in one run.

A chat of about `history_tokens` tokens (each message a passage of the packaged long text to
summarize, each answer its first sentence) is encoded once, its cache written to a file as
`chatbot run` writes it.
Then, `repeats` times each and taking turns, a new session restores the conversation from the
file (`--resume` with the disk cache) or re-encodes it (no file), and the time from the start
of the restore to the first token of the next message is measured: what a user waits after
`chatbot run --resume` before the answer starts, less loading the model.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from chatbot.config import ChatConfig, EngineConfig, SamplingConfig
from chatbot.conversation.kvstore import KVStore
from chatbot.conversation.session import ChatSession
from chatbot.engine.generate import Engine
from chatbot.measure.report import conditions
from chatbot.models.loader import LoadedModel

PASSAGE_CHARS = 2000  # characters of the long text per message (~500 tokens)
NEXT = "Thank you! Now in one word?"


def passages(text: str, chars: int = PASSAGE_CHARS) -> list[str]:
    """The messages of the played chat: `text`'s paragraphs joined into passages of about
    `chars` characters, each to summarize."""
    out, chunk = [], ""
    for para in text.split("\n\n"):
        chunk += " ".join(para.split()) + " "
        if len(chunk) >= chars:
            out.append("Summarize this in one sentence: " + chunk.strip())
            chunk = ""
    return out


def conversation(session: ChatSession, text: str, tokens: int) -> list[dict[str, str]]:
    """Messages of at least `tokens` tokens in `session`'s template: passages of `text` to
    summarize, each answered by its first sentence (answers a model of random weights could
    not write back as the same tokens)."""
    messages: list[dict[str, str]] = []
    for passage in passages(text):
        body = passage.split(": ", 1)[-1]
        answer = body.split(". ", 1)[0][:300].rstrip(".") + "."
        messages += [{"role": "user", "content": passage}, {"role": "assistant", "content": answer}]
        if len(session.encode(session.render(messages, False))) >= tokens:
            break
    return messages


def run_resume_bench(
    loaded: LoadedModel,
    text: str,
    backend: Any = None,
    history_tokens: int = 4000,
    repeats: int = 3,
    engine_config: EngineConfig | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """The figures (see the module docstring).

    Args:
        loaded: the model.
        text: the long text the messages are cut from.
        backend: the decode path (`make_backend`); None: the engine's default.
        history_tokens: the chat holds at least this many tokens.
        repeats: restores of each kind, taken in turns.
        engine_config: the cache (e.g. `--enable-streaming`), as `chatbot run` has it.
        progress: told what is being done.
    """
    say = progress or (lambda _: None)
    engine = Engine(loaded.model, loaded.tokenizer, backend=backend)
    sampling = SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=32)
    config = ChatConfig(sampling=sampling, engine=engine_config or EngineConfig())
    with tempfile.TemporaryDirectory(prefix="chatbot-resume-") as tmp:
        played = Path(tmp) / "played.safetensors"
        first = ChatSession(engine, config, loaded.template)
        first.keep_cache_in(KVStore(played, first.kv_identity))
        say(f"encoding a chat of {history_tokens:,} tokens")
        first.restore({"messages": conversation(first, text, history_tokens)})
        assert first.kv_store is not None
        first.kv_store.save(first.kv)
        first.kv_store.wait()
        saved, history, size = first.to_dict(loaded.name), len(first.all_ids), played.stat().st_size
        runs: dict[str, list[dict[str, float]]] = {"disk": [], "reencode": []}
        for i in range(max(1, repeats)):
            for mode, rows in runs.items():
                say(f"restoring ({mode}), {i + 1} of {repeats}")
                session = ChatSession(engine, config, loaded.template)
                if mode == "disk":
                    copy = Path(tmp) / f"play{i}.safetensors"
                    shutil.copy(played, copy)
                    session.keep_cache_in(KVStore(copy, session.kv_identity), resuming=True)
                rows.append(_first_token(session, saved))
    medians = {
        mode: {
            "first_token_s": statistics.median(r["first_token_s"] for r in rows),
            "encoded_tokens": rows[0]["encoded_tokens"],
            "runs_s": [r["first_token_s"] for r in rows],
        }
        for mode, rows in runs.items()
    }
    disk = statistics.median(r["first_token_s"] for r in runs["disk"])
    again = statistics.median(r["first_token_s"] for r in runs["reencode"])
    return {
        "model": loaded.name,
        "history_tokens": history,
        "file_bytes": size,
        "bytes_per_1k_tokens": size * 1000 // max(1, history),
        "streaming": bool(config.engine.enable_streaming),
        "repeats": max(1, repeats),
        "conditions": conditions(),
        **medians,
        "ratio": again / disk if disk else None,
    }


def _first_token(session: ChatSession, saved: dict[str, Any]) -> dict[str, float]:
    """Restore `saved` into `session` and ask the next message: seconds to its first token,
    and the tokens encoded on the way (the history's, and the message's)."""
    start = time.perf_counter()
    encoded = session.restore(saved)
    fed = session.n_fed
    chunks = session.send(NEXT)
    chunk = next(chunks)
    while not chunk.token_ids:
        chunk = next(chunks)
    seconds = time.perf_counter() - start
    encoded += session.n_fed - fed  # the message's prompt (and what the history left pending)
    chunks.close()
    if session.kv_store is not None:
        session.kv_store.wait()
    return {"first_token_s": seconds, "encoded_tokens": encoded}
