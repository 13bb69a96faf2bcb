"""How many CPU threads the native kernels decode with, and how those threads wait.

- `available_cpus`: the CPUs this process may run on (`sched_getaffinity`, capped by a
  cgroup v2 quota, `cgroup_cpu_limit`).
- `busy_cpus`, `pick_threads`, `default_threads`: that count less the CPUs other processes
  keep busy right now.
- `wait_policy_env`, `apply_wait_policy`: OpenMP barrier waits that spin briefly
  (`SPIN_COUNT`: a barrier all threads reach together costs no system call), then sleep in
  the kernel (a thread waiting for a parked one gives its CPU away); set before torch loads
  libgomp.
- `ThreadTuner`: 1 thread or `most`, whichever the measured step times say is faster.
- `capped_threads`, `cap_threads`: a per-thread cap on the native products' thread count.

Why: a decode step is one OpenMP region with a few barriers per layer. On a machine with
more runnable threads than CPUs the scheduler parks one of ours for a time slice, and its
partners wait for it at the next barrier, spinning on CPUs that others could use under
OpenMP's default wait (`scripts/bench-threads`; docs/benchmarks.md has figures).

The module imports nothing from the terminal layer. It reads /proc and /sys, and falls back
quietly where they are missing (macOS, containers without cgroup files).
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from pathlib import Path

# libgomp spins this many pause-loop iterations before it sleeps on a futex: well under a
# millisecond, against its default of 300,000 (several milliseconds, about a time slice). Long
# enough to catch a partner that is running, short enough not to starve one that is parked.
SPIN_COUNT = 10_000
# The OpenMP settings a user may have chosen already; any of them means: leave it alone.
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs allowed by a cgroup v2 quota (``cpu.max``: "quota period"), or None (no limit,
    or no cgroup v2 here)."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    try:
        return max(int(quota) / int(period), 0.0) or None
    except (ValueError, ZeroDivisionError):
        return None


def available_cpus() -> int:
    """CPUs this process may run on: its affinity mask, capped by a cgroup quota."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cpus = os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    if limit is not None:
        cpus = min(cpus, math.ceil(limit))
    return max(1, cpus)


def parse_loadavg(text: str) -> tuple[float, int]:
    """(1-minute load average, runnable tasks right now) from the text of /proc/loadavg
    ("0.52 0.58 0.59 3/467 12345"); the runnable count includes the task that reads it."""
    fields = text.split()
    return float(fields[0]), int(fields[3].split("/")[0])


def busy_cpus(loadavg: Path = Path("/proc/loadavg")) -> float:
    """How many CPUs other processes keep busy: the smaller of the runnable tasks now (less
    this one) and the 1-minute load average. The instant count alone jumps with every short
    job; the average alone lags a minute behind, and counts our own earlier decoding. 0 where
    /proc is missing."""
    try:
        average, running = parse_loadavg(loadavg.read_text())
    except (OSError, ValueError, IndexError):
        if hasattr(os, "getloadavg"):
            return max(0.0, os.getloadavg()[0] - 1)
        return 0.0
    return max(0.0, min(float(running - 1), average))


def pick_threads(cpus: int, busy: float, most: int | None = None) -> int:
    """The thread count for a decode: the CPUs left free by `busy` others, at least 1 and at
    most `most` (e.g. the physical cores, where hyper-threads add nothing).

    A CPU counts as taken when it is at least half busy, so a 2-CPU machine with one other
    busy process decodes on one thread, and one with a brief 0.3 blip still uses both.
    """
    free = cpus - math.floor(busy + 0.5)
    ceiling = cpus if most is None else min(most, cpus)
    return max(1, min(ceiling, free))


def default_threads(most: int | None = None) -> int:
    """`pick_threads` for this machine, now."""
    return pick_threads(available_cpus(), busy_cpus(), most)


def wait_policy_env(env: Mapping[str, str]) -> dict[str, str]:
    """The OpenMP settings to add to `env` for spin-then-sleep waits: none when the user
    chose a wait policy or spin count already."""
    if any(name in env for name in WAIT_VARIABLES):
        return {}
    return {"GOMP_SPINCOUNT": str(SPIN_COUNT)}


def apply_wait_policy(env: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set the spin-then-sleep wait in `env` (default: this process's environment) and
    return what was set. libgomp reads it once, when it is loaded (with torch), so this must
    run before torch is imported to take effect in this process; it always reaches the
    processes started after it."""
    target = os.environ if env is None else env
    added = wait_policy_env(target)
    target.update(added)
    return added


class ThreadTuner:
    """Picks the kernels' thread count, 1 or `most`, from the step times it is given.

    `pick` returns a count not timed yet, else the faster one, and the other again after
    `explore_every` picks times how much slower it was, so that re-checking a bad choice
    costs at most ~1/`explore_every` of the steps. `record` smooths a count's time by
    `smoothing`; the time of a re-check replaces the old one.

    Why: which count is faster depends on how busy the machine is right now (a descheduled
    thread stalls its partners at every barrier), so both are timed as decoding goes.
    """

    def __init__(self, most: int, explore_every: int = 32, smoothing: float = 0.25) -> None:
        self.candidates = sorted({1, max(1, most)})
        self.explore_every = explore_every
        self.smoothing = smoothing
        self.seconds: dict[int, float] = {}
        self.since_explore = 0
        self.exploring: int | None = None

    def pick(self) -> int:
        for n in self.candidates:
            if n not in self.seconds:
                return n
        best = min(self.candidates, key=lambda n: self.seconds[n])
        if len(self.candidates) == 1:
            return best
        other = next(n for n in self.candidates if n != best)
        self.since_explore += 1
        if self.since_explore >= self.explore_every * self.seconds[other] / self.seconds[best]:
            self.since_explore = 0
            self.exploring = other
            return other
        return best

    def record(self, threads: int, seconds: float) -> None:
        old = self.seconds.get(threads)
        if old is None or threads == self.exploring:
            # A re-check replaces what is known of that count: the old figure is stale.
            self.seconds[threads] = seconds
            self.exploring = None
        else:
            self.seconds[threads] = old + self.smoothing * (seconds - old)


_cap = threading.local()


@contextmanager
def capped_threads(rule: Callable[[], int | None]) -> Iterator[None]:
    """In this thread, for the block's length, the native products take at most `rule()`
    threads (asked at each product; None: no cap). A server's prefill running beside the
    batched decode steps takes one while generations decode (`DecodeBatcher.prefilling`).
    Torch's own thread count is left alone: it is per thread, and a thread that first used
    torch inside a changed count would keep that count for good."""
    old = getattr(_cap, "rule", None)
    _cap.rule = rule
    try:
        yield
    finally:
        _cap.rule = old


def cap_threads(n: int) -> int:
    """`n`, or less inside `capped_threads` in this thread."""
    rule = getattr(_cap, "rule", None)
    limit = rule() if rule is not None else None
    return max(1, min(n, limit)) if limit else n
