"""Long-text perplexity of four cache set-ups, as in StreamingLLM's eval_long_ppl.py.

Every set-up reads the text one token per step and scores the next token:

- ``dense``: full history in a `DynamicCache` (the reference; memory grows without bound);
- ``window``: sliding window of start+recent tokens, re-rotated, no attention sinks;
- ``sinks``: StreamingLLM, ``start_size`` sinks + ``recent_size`` recent tokens;
- ``recompute``: sliding window with recomputation: each step re-encodes the last
  start+recent tokens from scratch at positions 0.. (exact for a window, and slow).

The computing functions return numbers only; `format_table` and `write_plot` present them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from chatbot.engine.cache.sinks import SinkCache
from chatbot.errors import ConfigError
from chatbot.measure.report import conditions, loadavg

SETUPS = ("dense", "window", "sinks", "recompute")

Progress = Callable[[str, int, int], None]
"""progress(setup, steps_done, steps_total), called after every step."""


def run_eval_ppl(
    model: Any,
    tokenizer: Any,
    text: str,
    num_tokens: int = 4000,
    start_size: int = 4,
    recent_size: int = 252,
    setups: Sequence[str] = SETUPS,
    progress: Progress | None = None,
) -> dict[str, dict[str, Any]]:
    """Tokenize `text` and run `run_eval_ppl_ids` on its first `num_tokens` tokens.

    Raises:
        ConfigError: the text has fewer than 2 tokens, or a set-up name is unknown.
        StreamingUnsupportedError: "window" or "sinks" asked of a model that cannot stream.
    """
    ids = tokenizer(text, return_tensors="pt").input_ids[0, :num_tokens]
    return run_eval_ppl_ids(
        model, ids, start_size=start_size, recent_size=recent_size, setups=setups, progress=progress
    )


def run_eval_ppl_ids(
    model: Any,
    ids: torch.Tensor | Sequence[int],
    start_size: int = 4,
    recent_size: int = 252,
    setups: Sequence[str] = SETUPS,
    progress: Progress | None = None,
) -> dict[str, dict[str, Any]]:
    """Score every next token of `ids`, feeding one token per step, for each set-up.

    Args:
        model: a causal LM taking ``input_ids`` and ``cache``.
        ids: the token ids (1-D); ``len(ids) - 1`` tokens are scored.
        start_size: attention sinks of "sinks".
        recent_size: recent window of "sinks"; "window" and "recompute" keep
            ``start_size + recent_size`` tokens, the same budget without sinks.
        setups: any of "dense", "window", "sinks", "recompute", run in this order.
        progress: optional callback ``(setup, done, total)``.

    Returns:
        ``{setup: {"ppl", "tokens_per_s", "wall_s", "nll", "cache_tokens"}}`` where ``nll``
        is the list of per-token negative log-likelihoods (natural log) and
        ``cache_tokens`` the most tokens the set-up attended to in one step.

    Raises:
        ConfigError: fewer than 2 ids, a bad size, or an unknown set-up name.
        StreamingUnsupportedError: "window" or "sinks" asked of a model that cannot stream.
    """
    unknown = [s for s in setups if s not in SETUPS]
    if unknown:
        raise ConfigError(f"unknown eval set-up {unknown[0]!r}; choose from {', '.join(SETUPS)}")
    if start_size < 0 or recent_size <= 0:
        raise ConfigError(f"need start_size >= 0 and recent_size > 0, got {start_size}, {recent_size}")
    device = _model_device(model)
    ids = torch.as_tensor(ids, dtype=torch.long).flatten().to(device)
    if ids.numel() < 2:
        raise ConfigError(f"the text must have at least 2 tokens to score, it has {ids.numel()}")

    results: dict[str, dict[str, Any]] = {}
    for setup in setups:
        start = time.perf_counter()
        with torch.inference_mode():
            nll, cache_tokens = _score(model, ids, setup, start_size, recent_size, progress)
        wall_s = time.perf_counter() - start
        nll_list = nll.tolist()
        results[setup] = {
            "ppl": math.exp(sum(nll_list) / len(nll_list)),
            "tokens_per_s": len(nll_list) / wall_s if wall_s > 0 else float("inf"),
            "wall_s": wall_s,
            "nll": nll_list,
            "cache_tokens": cache_tokens,
            "loadavg": loadavg()[0],
        }
    return results


def _model_device(model: Any) -> torch.device:
    device = getattr(model, "device", None)
    if isinstance(device, torch.device):
        return device
    return next(model.parameters()).device


def _score(
    model: Any, ids: torch.Tensor, setup: str, start_size: int, recent_size: int, progress: Progress | None
) -> tuple[torch.Tensor, int]:
    """The NLL of every next token of `ids` under `setup`, a token a step, and the most tokens
    the set-up attended to in one step."""
    window = start_size + recent_size
    steps = ids.numel() - 1
    cache: DynamicCache | SinkCache | None = None  # None: recompute
    if setup == "dense":
        cache = DynamicCache()
    elif setup != "recompute":  # "window": the budget of "sinks", without sinks
        sinks = start_size if setup == "sinks" else 0
        cache = SinkCache.for_model(model, start_size=sinks, recent_size=window - sinks, evict_block=1)

    def logits(t: int) -> torch.Tensor:  # [1, S, V]
        if cache is None:  # the last `window` tokens re-encoded from scratch at positions 0..
            lo = max(0, t + 1 - window)
            return model(input_ids=ids[None, lo : t + 1], cache=DynamicCache(), use_cache=True).logits
        if isinstance(cache, SinkCache):
            cache.evict_for_space(1)
        return model(input_ids=ids[None, t : t + 1], cache=cache, use_cache=True).logits

    nll = torch.empty(steps, device=ids.device)  # kept on the device: no sync a step
    for t in range(steps):
        nll[t] = -torch.log_softmax(logits(t)[0, -1].float(), dim=-1)[ids[t + 1]]
        if progress is not None:
            progress(setup, t + 1, steps)
    if isinstance(cache, SinkCache):
        return nll.cpu(), cache.get_seq_length()
    return nll.cpu(), steps if cache is not None else min(window, steps)


# --- presentation -----------------------------------------------------------------------


def format_table(result: dict[str, dict[str, Any]]) -> str:
    """A plain-text table: set-up, perplexity, tokens/s, wall time, tokens attended."""
    header = f"{'set-up':<10} {'ppl':>10} {'tok/s':>9} {'wall s':>9} {'kv tokens':>10} {'load avg':>9}"
    lines = [header, "-" * len(header)]
    for name, row in result.items():
        load = "" if row.get("loadavg") is None else f"{row['loadavg']:.2f}"
        lines.append(
            f"{name:<10} {row['ppl']:>10.3f} {row['tokens_per_s']:>9.2f} "
            f"{row['wall_s']:>9.1f} {row.get('cache_tokens', 0):>10d} {load:>9}"
        )
    lines.append(f"{conditions()}; load avg: the 1-minute load average as each set-up ended")
    return "\n".join(lines)


def plotting_missing() -> str | None:
    """Why no plot can be drawn here, with the command that installs what it needs; None
    when it can (matplotlib, an optional dependency: the `plot` extra)."""
    import shlex
    import sys

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return f"matplotlib is not installed: {shlex.quote(sys.executable)} -m pip install matplotlib"
    return None


def write_plot(result: dict[str, dict[str, Any]], path: str | Path, title: str | None = None) -> Path:
    """Draw the running mean log-perplexity of each set-up against position, as a PNG.

    Returns:
        The path written.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    steady: list[float] = []  # running means past the noisy first tokens, to set the y range
    window_end = None
    for name, row in result.items():
        nll = torch.tensor(row["nll"], dtype=torch.float64)
        running = torch.cumsum(nll, 0) / torch.arange(1, nll.numel() + 1)
        positions = torch.arange(1, nll.numel() + 1)
        ax.plot(positions.numpy(), running.numpy(), label=f"{name} (ppl {row['ppl']:.2f})", linewidth=1.2)
        steady.extend(running[max(8, nll.numel() // 10) :].tolist())
        if name != "dense" and row.get("cache_tokens", 0) < nll.numel():
            window_end = row["cache_tokens"]
    if window_end is not None:
        ax.axvline(window_end, color="grey", linestyle="--", linewidth=0.8, label="cache full")
    if steady:
        low, high = min(steady), max(steady)
        pad = max(0.05, 0.15 * (high - low))
        ax.set_ylim(low - pad, high + pad)
    ax.set_xlabel("tokens read")
    ax.set_ylabel("running mean log perplexity (nats)")
    ax.set_title(title or "Long-text perplexity, one token per step")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path
