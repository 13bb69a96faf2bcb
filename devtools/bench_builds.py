"""Decode and prefill speed of the kernels' builds side by side: gcc with OpenMP, gcc without
it (the kernels' own thread pool), and clang without OpenMP where clang is installed, each at
1 and 2 threads.

Each measurement is a fresh `chatbot.measure.bench_decode` worker (the ``chatbot-auto``
set-up: the GGUF file's own matrices, int16 activations) whose environment picks the build
as a user's would: ``CC=gcc``; ``CC=`` a wrapper of gcc that refuses ``-fopenmp``, as clang
without libomp does; ``CC=clang``. The worker reports which threads the loaded library runs
on, so a build that silently fell back is seen. The builds take turns within each round, so
a load that changes over minutes falls on all of them; every figure is the median and the
range over the rounds, with the load average beside it. Run it with `scripts/bench-builds`.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from chatbot.engine.backends.native.threads import wait_policy_env
from devtools import child_env

WORKER_TIMEOUT_S = 1800


def _refusing_openmp(folder: Path, cc: str) -> Path:
    """A compiler that is `cc` but fails on -fopenmp, as clang without libomp does. Its
    version says so: the kernels' cache key holds the version, and `cc`'s own OpenMP build
    must not be the one found there."""
    wrapper = folder / f"{Path(cc).name}-no-openmp"
    version = f'if [ "$1" = --version ]; then {cc} --version; echo "(-fopenmp refused)"; exit 0; fi'
    refuse = 'for a in "$@"; do [ "$a" = -fopenmp ] && { echo "omp.h: not found" >&2; exit 1; }; done'
    wrapper.write_text(f'#!/bin/sh\n{version}\n{refuse}\nexec {cc} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def build_envs(folder: Path) -> dict[str, str]:
    """The builds to compare: name -> the CC a worker runs with."""
    gcc = shutil.which("gcc") or "cc"
    envs = {"gcc + OpenMP": gcc, "gcc, own pool": str(_refusing_openmp(folder, gcc))}
    clang = shutil.which("clang")
    if clang:
        envs["clang, own pool"] = clang
    return envs


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """bench_decode's worker for ``chatbot-auto``, and whether the kernels ran on OpenMP."""
    from chatbot.engine.backends.native import kernels
    from chatbot.measure import bench_decode

    out = bench_decode.worker(spec)
    lib = kernels.loaded()
    out["threads_on"] = None if lib is None else ("OpenMP" if kernels.uses_openmp(lib) else "own pool")
    return out


def _run(spec: dict[str, Any], cc: str) -> dict[str, Any]:
    env = child_env({**os.environ, "CC": cc})
    env.update(wait_policy_env(env))  # the wait `chatbot` sets for OpenMP (engine/backends/native/threads.py)
    cmd = [sys.executable, "-m", "devtools.bench_builds", json.dumps(spec)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=WORKER_TIMEOUT_S, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"error": f"worker failed ({proc.returncode}): {tail[0]}"}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def _summary(out: dict[str, Any], size: int) -> str:
    if "error" in out:
        return str(out["error"])
    return (
        f"decode {out['decode_tps']:.1f} tok/s, prefill {size} {out['prefill_tps'][str(size)]:.0f} tok/s, "
        f"threads on {out['threads_on']}, load {out['loadavg']:.2f}"
    )


def run_builds_bench(
    *,
    rounds: int = 3,
    threads: tuple[int, ...] = (1, 2),
    decode_tokens: int = 128,
    prefill: tuple[int, ...] = (50, 500),
    progress: Any = None,
) -> dict[str, Any]:
    """Every (build, threads) once per round, the builds taking turns; all runs kept."""
    from chatbot.measure.report import machine_info

    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        envs = build_envs(Path(tmp))
        for r in range(rounds):
            for n in threads:
                for name, cc in envs.items():
                    spec = {"name": "chatbot-auto", "threads": n, "decode_tokens": decode_tokens,
                            "prefill_sizes": list(prefill), "ppl_tokens": 0}  # fmt: skip
                    out = _run(spec, cc)
                    runs.setdefault(name, {}).setdefault(str(n), []).append(out)
                    if progress:
                        where = f"round {r + 1}/{rounds}: {name}, {n} thread(s)"
                        progress(f"{where}: {_summary(out, prefill[-1])}")
    settings = {
        "rounds": rounds,
        "threads": list(threads),
        "decode_tokens": decode_tokens,
        "prefill": list(prefill),
    }
    return {"runs": runs, "machine": machine_info(), "settings": settings}


def _spread(values: list[float], digits: int = 1) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def format_builds(result: dict[str, Any]) -> str:
    """A Markdown table: one row per (build, threads): median (min-max) over the rounds."""
    s, m = result["settings"], result["machine"]
    size = str(s["prefill"][-1])
    lines = [
        (
            f"default model at --opt auto, decode: {s['decode_tokens']} greedy tokens after a 50-token "
            f"prompt; prefill: a {size}-token prompt; median (min-max) of {s['rounds']} rounds, builds "
            "taking turns"
        ),
        "",
        f"| build | threads on | threads | decode tok/s | prefill {size} tok/s | load avg (1 min) |",
        "|---|---|---|---|---|---|",
    ]
    for name, by_threads in result["runs"].items():
        for n, outs in by_threads.items():
            ok = [o for o in outs if "error" not in o]
            if not ok:
                lines.append(f"| {name} | | {n} | {outs[0]['error']} | | |")
                continue
            on = "/".join(sorted({str(o.get("threads_on")) for o in ok}))
            decode = _spread([o["decode_tps"] for o in ok])
            fill = _spread([o["prefill_tps"][size] for o in ok], 0)
            load = _spread([o["loadavg"] for o in ok if o.get("loadavg") is not None], 2)
            lines.append(f"| {name} | {on} | {n} | {decode} | {fill} | {load} |")
    lines += ["", f"CPU: {m['cpu_model']} ({m['cpu_count']} CPUs); load average at the end {m['loadavg']}"]
    return "\n".join(lines)


if __name__ == "__main__":
    from chatbot.models.gc_pause import pause_until_ready

    pause_until_ready()  # as bench_decode's own worker starts
    print(json.dumps(worker(json.loads(sys.argv[1]))))
