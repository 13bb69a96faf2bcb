"""Benchmarks as functions that return figures; the CLI prints them."""

from __future__ import annotations

import json
import statistics
from importlib import resources
from pathlib import Path
from typing import Any

from chatbot.config import ChatConfig, SamplingConfig
from chatbot.conversation.session import ChatSession
from chatbot.engine.generate import Engine
from chatbot.errors import ConfigError
from chatbot.measure.report import conditions, loadavg
from chatbot.models.loader import LoadedModel


def load_conversation(path: Path | None) -> list[str]:
    """User turns from `{"turns": [...]}`; None means the conversation shipped with us.

    Raises:
        ConfigError: the file is missing or not in that format.
    """
    try:
        if path is None:
            text = resources.files("chatbot").joinpath("data/conversation.json").read_text()
        else:
            text = Path(path).read_text()
        turns = json.loads(text)["turns"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f'cannot read conversation {path}: expected {{"turns": ["...", ...]}} ({exc})'
        ) from None
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise ConfigError(f"{path}: turns must be a non-empty list of non-empty strings")
    return turns


def _play(session: ChatSession, turns: list[str], reencode: bool) -> list[dict[str, Any]]:
    rows = []
    for text in turns:
        if reencode:
            session.drop_cache()
        stats = None
        for chunk in session.send(text):
            stats = chunk.stats or stats
        assert stats is not None
        rows.append(
            {
                "prefill_tokens": stats.context_tokens,
                "ttft_s": stats.ttft_s,
                "decode_tps": stats.decode_tps,
                "cache_tokens": stats.cache_tokens,
                "loadavg": loadavg()[0],
            }
        )
    return rows


def _median_rows(plays: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Turn by turn, the median of each timing over the plays (token counts are the same in
    every play: greedy decoding), with every play's time to first token kept."""
    out = []
    for samples in zip(*plays):
        row = dict(samples[0])
        for key in ("ttft_s", "decode_tps", "loadavg"):
            row[key] = statistics.median(s[key] for s in samples)
        row["ttft_s_runs"] = [s["ttft_s"] for s in samples]
        out.append(row)
    return out


def run_turns_bench(
    loaded: LoadedModel, turns: list[str], max_new_tokens: int = 64, repeats: int = 3, decoder: Any = None
) -> dict[str, Any]:
    """Play the user turns greedy, on the persistent cache and re-encoding the whole history
    every turn (what `transformers chat` and friends do), `repeats` times each, taking turns
    (persistent, re-encode, persistent...) so that a change of load hits both; every figure is
    the median over the plays, with the 1-minute load average beside it."""
    engine = Engine(loaded.model, loaded.tokenizer, decoder=decoder)
    sampling = SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=max_new_tokens)
    plays: dict[str, list[list[dict[str, Any]]]] = {"persistent": [], "reencode": []}
    for _ in range(max(1, repeats)):
        for mode, runs in plays.items():
            session = ChatSession(engine, ChatConfig(sampling=sampling), loaded.template)
            runs.append(_play(session, turns, reencode=(mode == "reencode")))
    results = {mode: _median_rows(p) for mode, p in plays.items()}
    last_p, last_r = results["persistent"][-1], results["reencode"][-1]
    return {
        "model": loaded.name,
        "max_new_tokens": max_new_tokens,
        "repeats": max(1, repeats),
        "conditions": conditions(),
        "turns": [
            {"turn": i + 1, "persistent": p, "reencode": r}
            for i, (p, r) in enumerate(zip(results["persistent"], results["reencode"]))
        ],
        "ratio_last_turn": last_r["ttft_s"] / last_p["ttft_s"] if last_p["ttft_s"] else None,
        "prefill_ratio_last_turn": last_r["prefill_tokens"] / max(1, last_p["prefill_tokens"]),
    }
