"""Per-turn timing and memory figures, as numbers; only the renderer formats them."""

from __future__ import annotations

import dataclasses
import itertools
import os
import resource
import statistics
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from chatbot.engine.seq import quantile
from chatbot.limits import finite

if TYPE_CHECKING:
    import torch

    from chatbot.engine.cache.tracked import CacheLayout


@dataclass
class TurnStats:
    """What one turn cost.

    `context_tokens` are the tokens prefilled this turn (only what the conversation gained);
    `token_latencies_s` holds one entry per generated token after the first.
    `thinking_tokens` of the `generated_tokens` were the model's thinking (`<think>…</think>`
    or a server's `reasoning_content`), which took `thinking_time_s` from the first token.
    """

    context_tokens: int = 0
    context_time_s: float = 0.0
    ttft_s: float = 0.0
    generated_tokens: int = 0
    decode_time_s: float = 0.0
    token_latencies_s: list[float] = field(default_factory=list)
    cache_tokens: int = 0
    cache_capacity: int | None = None
    sinks: int = 0
    evicted_total: int = 0
    peak_memory_bytes: int = 0
    finish_reason: str = ""
    thinking_tokens: int = 0
    thinking_time_s: float = 0.0
    # The first turn after a resume that took its history from the chat's disk cache: the
    # tokens taken from it, of the tokens the history holds.
    reused_tokens: int = 0
    reused_of: int = 0
    # With `--draft ngram`: the draft tokens proposed and those kept, this turn.
    draft_tokens: int = 0
    draft_accepted: int = 0

    @property
    def draft_acceptance(self) -> float | None:
        """The share of proposed draft tokens kept (None: nothing was proposed)."""
        return self.draft_accepted / self.draft_tokens if self.draft_tokens else None

    @property
    def decode_tps(self) -> float:
        n = len(self.token_latencies_s)
        return n / self.decode_time_s if self.decode_time_s > 0 else 0.0

    @property
    def ms_per_token_mean(self) -> float:
        return 1000 * statistics.fmean(self.token_latencies_s) if self.token_latencies_s else 0.0

    def ms_per_token_quantile(self, q: float) -> float:
        return 1000 * quantile(self.token_latencies_s, q)

    @property
    def ms_per_token_p50(self) -> float:
        return self.ms_per_token_quantile(0.5)

    @property
    def ms_per_token_p90(self) -> float:
        return self.ms_per_token_quantile(0.9)

    def as_dict(self) -> dict[str, float | int | str | None]:
        return {
            "context_tokens": self.context_tokens,
            "context_time_s": round(self.context_time_s, 4),
            "ttft_s": round(self.ttft_s, 4),
            "generated_tokens": self.generated_tokens,
            "decode_tps": round(self.decode_tps, 2),
            "ms_per_token_mean": round(self.ms_per_token_mean, 2),
            "ms_per_token_p50": round(self.ms_per_token_p50, 2),
            "ms_per_token_p90": round(self.ms_per_token_p90, 2),
            "cache_tokens": self.cache_tokens,
            "cache_capacity": self.cache_capacity,
            "evicted_total": self.evicted_total,
            "peak_memory_bytes": self.peak_memory_bytes,
            "finish_reason": self.finish_reason,
            "thinking_tokens": self.thinking_tokens,
            "thinking_time_s": round(self.thinking_time_s, 4),
            "draft_tokens": self.draft_tokens,
            "draft_accepted": self.draft_accepted,
        }


def synchronize(device: torch.device) -> None:
    """Wait for queued device work so that a timer read after it is honest."""
    import torch  # here: the terminal's start-up imports this module without torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def proc_status_kb(field: str, pid: int | str = "self") -> int | None:
    """A figure of a process's `/proc/PID/status` in kB (e.g. "VmRSS"; this process's unless
    `pid` is given); None off Linux, or when the process is gone."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def peak_rss_bytes() -> int:
    """This process's peak resident set: Linux's VmHWM, else `ru_maxrss`.

    Not `ru_maxrss` on Linux: a process started by another keeps, in its `ru_maxrss`, the peak
    of the parent it was forked from (exec records the old memory map's high-water mark), so
    a worker would report at least its parent's peak. VmHWM is the high-water mark of the
    process's own memory map.
    """
    hwm = proc_status_kb("VmHWM")
    if hwm is not None:
        return hwm * 1024
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def rss_bytes() -> int:
    """This process's resident set now (Linux), else its peak."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_rss_bytes()


def peak_memory_bytes(device: torch.device) -> int:
    """Peak accelerator memory on a GPU; the process's peak resident set on the CPU."""
    if device.type == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated(device))
    return peak_rss_bytes()


def stats_to_dict(stats: TurnStats) -> dict[str, Any]:
    """Every field of a TurnStats (unlike `TurnStats.as_dict`), times to the microsecond."""
    data = dataclasses.asdict(stats)
    for key, value in data.items():
        if isinstance(value, float):
            data[key] = round(value, 6)
        elif isinstance(value, list):
            data[key] = [round(v, 6) for v in value]
    return data


MAX_COUNT = 10**12
"""The most tokens a restored figure may count (far beyond any context)."""
MAX_SECONDS = 1e7
"""The longest time a restored figure may hold (about 115 days): larger is no real timing, and
a sum of such latencies would overflow to infinity."""


def _figure(value: Any, default: Any) -> Any:
    """`value` as the type of the field whose default is `default`, or None where it is no
    real figure: a negative or non-integral count, a time that is negative or beyond
    MAX_SECONDS, a list with such a time in it."""
    if isinstance(default, list):
        if (
            isinstance(value, list)
            and len(value) <= 1_000_000
            and all(_figure(v, 0.0) is not None for v in value)
        ):
            return [float(v) for v in value]
        return None
    if isinstance(default, str):
        return value if isinstance(value, str) else None
    if not finite(value) or value < 0:  # NaN / infinity in a hand-edited file are left out
        return None
    if isinstance(default, float):
        return float(value) if value <= MAX_SECONDS else None
    # counts (and cache_capacity, whose default is None)
    return int(value) if float(value).is_integer() and value <= MAX_COUNT else None


def stats_from_dict(data: Any, rejected: list[str] | None = None) -> TurnStats:
    """A TurnStats from `stats_to_dict` output; unknown keys are ignored, and a value that is
    no real figure for its field (`_figure`) is left out, its name added to `rejected`."""
    stats = TurnStats()
    if not isinstance(data, dict):
        return stats
    for f in dataclasses.fields(TurnStats):
        value = data.get(f.name)
        if value is None:
            continue
        figure = _figure(value, getattr(stats, f.name))
        if figure is None:
            if rejected is not None:
                rejected.append(f.name)
            continue
        setattr(stats, f.name, figure)
    return stats


def merge_stats(first: TurnStats, more: TurnStats) -> TurnStats:
    """The figures of an answer generated in two parts (`continue_answer`)."""
    return TurnStats(
        context_tokens=first.context_tokens + more.context_tokens,
        context_time_s=first.context_time_s + more.context_time_s,
        ttft_s=first.ttft_s,
        generated_tokens=first.generated_tokens + more.generated_tokens,
        decode_time_s=first.decode_time_s + more.decode_time_s,
        token_latencies_s=[*first.token_latencies_s, *more.token_latencies_s],
        cache_tokens=more.cache_tokens,
        cache_capacity=more.cache_capacity,
        sinks=more.sinks,
        evicted_total=more.evicted_total,
        peak_memory_bytes=max(first.peak_memory_bytes, more.peak_memory_bytes),
        thinking_tokens=first.thinking_tokens + more.thinking_tokens,
        thinking_time_s=first.thinking_time_s + more.thinking_time_s,
        draft_tokens=first.draft_tokens + more.draft_tokens,
        draft_accepted=first.draft_accepted + more.draft_accepted,
        finish_reason=more.finish_reason,
    )


def stats_from_arrivals(
    context: int, generated: int, t0: float, times: list[tuple[float, int]], cache: CacheLayout
) -> TurnStats:
    """Approximate figures for an answer cut short, from the chunks' arrival times."""
    latencies: list[float] = []
    for (prev, _), (now, n) in itertools.pairwise(times):
        latencies.extend([(now - prev) / n] * n if n else [])
    first = times[0][0] - t0 if times else 0.0
    return TurnStats(
        context_tokens=context,
        context_time_s=first,
        ttft_s=first,
        generated_tokens=generated,
        decode_time_s=sum(latencies),
        token_latencies_s=latencies,
        cache_tokens=cache.length,
        cache_capacity=cache.capacity,
        evicted_total=cache.evicted_total,
        finish_reason="interrupted",
    )


def summarize(stats: list[TurnStats], cache_tokens: int) -> dict[str, Any]:
    """Totals over a conversation's turns, for /stats."""
    dec = sum(s.decode_time_s for s in stats)
    lat = sum(len(s.token_latencies_s) for s in stats)
    return {
        "turns": len(stats),
        "context_tokens": sum(s.context_tokens for s in stats),
        "generated_tokens": sum(s.generated_tokens for s in stats),
        "thinking_tokens": sum(s.thinking_tokens for s in stats),
        "thinking_time_s": sum(s.thinking_time_s for s in stats),
        "decode_tps": lat / dec if dec else 0.0,
        "cache_tokens": cache_tokens,
    }
