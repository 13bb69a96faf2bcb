"""Streaming benchmark: decode speed and cache bytes stay flat as text passes through the
sink cache, against sliding window with recomputation on the same text."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from chatbot.config import SamplingConfig
from chatbot.engine.generate import Engine
from chatbot.errors import ConfigError
from chatbot.measure.report import loadavg
from chatbot.models.loader import LoadedModel

# About 160 KB of English prose with code: the FAQ chapters of the Python 3.11 documentation
# (reStructuredText source, PSF documentation licence), shipped so the benches run anywhere.
PACKAGED_TEXT = Path(__file__).resolve().parents[1] / "data" / "long_text.txt"


def default_text_path() -> Path:
    """The long text shipped in the package (`chatbot/data/long_text.txt`).

    Raises:
        ConfigError: it is missing (a broken install): pass --text FILE.
    """
    if PACKAGED_TEXT.is_file():
        return PACKAGED_TEXT
    raise ConfigError("the packaged long text is missing: pass --text FILE (a long plain-text file)")


def _recompute_decode_tps(model: Any, window: list[int], n_tokens: int) -> float:
    """Greedy decode where every step re-encodes the last len(window) tokens from scratch."""
    ids = list(window)
    size = len(window)
    device = model.get_input_embeddings().weight.device
    start = time.perf_counter()
    with torch.inference_mode():
        for _ in range(n_tokens):
            x = torch.tensor([ids[-size:]], device=device)
            logits = model(input_ids=x, use_cache=False, logits_to_keep=1).logits[0, -1]
            ids.append(int(logits.argmax()))
    return n_tokens / (time.perf_counter() - start)


def run_streaming_bench(
    loaded: LoadedModel,
    text: str,
    recent_sizes: tuple[int, ...] = (256, 1024),
    start_size: int = 4,
    multiples: tuple[int, ...] = (1, 4, 16),
    decode_tokens: int = 32,
    recompute_tokens: int = 8,
    decoder: Any | None = None,
) -> dict[str, Any]:
    """For each window size, feed the text (prefilled in chunks, evicting as it goes) until
    `multiples` x the window have passed; at each mark decode `decode_tokens` greedily and
    record tokens/s and cache bytes, and decode `recompute_tokens` by recomputation.
    `decoder`: the engine's one-token step (`chatbot.engine.backends.native.decoder.FastDecoder`), or None for
    transformers; recomputation always runs the model's forward pass.

    Raises:
        ConfigError: the text is too short for the largest mark.
    """
    engine = Engine(loaded.model, loaded.tokenizer, decoder=decoder)
    # the model as the engine's prefill runs it (the decoder's arithmetic at --opt auto)
    recompute_model = loaded.model if decoder is None else decoder.prefill_model
    ids = loaded.tokenizer(text, add_special_tokens=False)["input_ids"]
    greedy = SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=decode_tokens)
    runs = []
    for recent in recent_sizes:
        window = start_size + recent
        need = max(multiples) * window + 1
        if len(ids) < need:
            raise ConfigError(f"the text has {len(ids):,} tokens; {need:,} are needed for window {window}")
        cache = engine.new_cache(start_size, recent)
        fed = 0
        marks = []
        for m in multiples:
            target = m * window
            if target > fed:
                engine.prefill(cache, ids[fed:target], prefill_chunk=min(512, recent))
                fed = target
            stats = None
            for chunk in engine.generate(cache, [ids[fed]], greedy):
                stats = chunk.stats or stats
            assert stats is not None
            tail = ids[max(0, fed + 1 - window) : fed + 1]
            marks.append(
                {
                    "multiple": m,
                    "tokens_passed": fed + 1 + stats.generated_tokens,
                    "decode_tps": stats.decode_tps,
                    "cache_tokens": cache.length,
                    "cache_bytes": cache.nbytes,
                    "recompute_tps": _recompute_decode_tps(recompute_model, tail, recompute_tokens),
                    "loadavg": loadavg()[0],
                }
            )
            # Drop what the decode added so the next mark starts from the text again.
            fed += 1
        last = marks[-1]
        runs.append(
            {
                "recent_size": recent,
                "window": window,
                "marks": marks,
                "speedup_vs_recompute": last["decode_tps"] / last["recompute_tps"],
            }
        )
    level = decoder.info().level if decoder is not None else "off"
    return {"model": loaded.name, "start_size": start_size, "opt": level, "runs": runs}
