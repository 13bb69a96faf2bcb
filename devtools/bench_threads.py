"""Decode speed by thread count and OpenMP wait policy, on a quiet and on a busy machine.

One worker process per wait policy (libgomp reads its wait settings once, when torch loads
it): OpenMP's default (spin ~300,000 iterations at a barrier, then sleep) against
spin-then-sleep (`chatbot.engine.backends.native.threads.SPIN_COUNT`). Each worker loads the model once,
then takes turns between its thread counts, each measured with nothing of ours running
beside it and with `busy` competing processes that spin (a build, a test run, another
agent); the figures are medians over the rounds. Run it with `scripts/bench-threads`.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import devtools
from chatbot.engine.backends.native.threads import WAIT_VARIABLES, wait_policy_env
from chatbot.measure.report import loadavg

WAITS = {"omp-default": {}, "spin-then-sleep": wait_policy_env({})}
"""Each wait policy's OpenMP variables (the worker starts with none of its own)."""
PROMPT_TOKENS = 50


def _spinner() -> subprocess.Popen[bytes]:
    """A competing process that keeps one CPU busy until killed."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def _decode_tps(model: Any, decoder: Any, ids: list[int], tokens: int) -> float:
    import torch

    cache = decoder.new_cache()
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids[:PROMPT_TOKENS]]), cache=cache, use_cache=True).logits[
            0, -1
        ]
        start = time.perf_counter()
        for _ in range(tokens):
            logits = decoder.decode(cache, int(torch.argmax(logits)))
    return tokens / (time.perf_counter() - start)


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Measure every (threads, load) pair of `spec` with this process's wait policy."""
    import torch

    from chatbot.engine.backends.native.decoder import make_decoder
    from chatbot.engine.backends.native.threads import default_threads
    from chatbot.measure.bench_decode import bench_text
    from chatbot.models.loader import load_model

    most = spec["most"]
    torch.set_num_threads(most)
    loaded = load_model(spec.get("model"), device="cpu", dtype="float32")
    ids = list(loaded.tokenizer(bench_text(None), add_special_tokens=False)["input_ids"])
    decoders = {}
    for label in spec["threads"]:
        fixed = None if label in ("tuner", "policy") else int(label)
        decoder, reason = make_decoder(loaded.model, "auto", threads=fixed)
        if decoder is None:
            return {"error": reason or "no fast decoder"}
        decoders[label] = decoder
    _decode_tps(loaded.model, decoders[spec["threads"][0]], ids, 8)  # warm-up
    samples: dict[str, dict[str, list[float]]] = {t: {"quiet": [], "busy": []} for t in spec["threads"]}
    loads: dict[str, list[float]] = {"quiet": [], "busy": []}
    picked: list[int] = []
    for _ in range(spec["rounds"]):
        for phase in ("quiet", "busy"):
            spinners = [_spinner() for _ in range(spec["busy"] if phase == "busy" else 0)]
            try:
                time.sleep(0.3 if spinners else 0.0)  # let the spinners get scheduled
                for label in spec["threads"]:
                    decoder = decoders[label]
                    if label == "policy":
                        decoder.threads = default_threads(most)
                        picked.append(decoder.threads)
                    samples[label][phase].append(_decode_tps(loaded.model, decoder, ids, spec["tokens"]))
                loads[phase].append(loadavg()[0])
            finally:
                for proc in spinners:
                    proc.kill()
                    proc.wait()
    return {
        "tps": {t: {p: statistics.median(v) for p, v in phases.items()} for t, phases in samples.items()},
        "tps_runs": samples,
        "loadavg": {p: statistics.median(v) for p, v in loads.items()},
        "policy_picked": picked,
        "env": {k: os.environ.get(k) for k in WAIT_VARIABLES},
    }


def run_threads_bench(
    model: str | None = None,
    *,
    rounds: int = 3,
    tokens: int = 64,
    busy: int = 1,
    most: int | None = None,
    progress: Any = None,
) -> dict[str, Any]:
    """Decode tok/s for threads 1..`most`, the measured tuner and the load policy, under
    each wait policy, quiet and with `busy` spinning processes; medians of `rounds`."""
    from chatbot.engine.backends.native.threads import available_cpus
    from chatbot.measure.report import machine_info

    most = most or available_cpus()
    labels = [str(n) for n in sorted({1, most})] + ["tuner", "policy"]
    spec = {"model": model, "rounds": rounds, "tokens": tokens, "busy": busy, "most": most, "threads": labels}
    results = {}
    for wait, env in WAITS.items():
        if progress:
            progress(f"wait policy {wait}: {rounds} rounds of {', '.join(labels)} threads, quiet and busy")
        child_env = {k: v for k, v in os.environ.items() if k not in WAIT_VARIABLES}
        child_env.update(env)
        cmd = [sys.executable, "-m", "devtools.bench_threads", json.dumps(spec)]
        proc = subprocess.run(
            cmd, capture_output=True, text=True, env=devtools.child_env(child_env), check=False
        )
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode != 0 or not lines:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            results[wait] = {"error": f"worker failed ({proc.returncode}): {tail[0]}"}
        else:
            results[wait] = json.loads(lines[-1])
    return {"results": results, "machine": machine_info(), "settings": {**spec, "model": model or "default"}}


def format_threads(result: dict[str, Any]) -> str:
    """A Markdown table: one row per (wait policy, threads), quiet and busy tok/s."""
    s, m = result["settings"], result["machine"]
    lines = [
        (
            f"decode tok/s, {s['model']} at --opt auto, {s['tokens']} tokens after a "
            f"{PROMPT_TOKENS}-token prompt, "
            f"medians of {s['rounds']} rounds; busy = {s['busy']} competing spinning process(es)"
        ),
        "",
        "| wait policy | threads | quiet tok/s | busy tok/s | busy / quiet | load avg quiet / busy |",
        "|---|---|---|---|---|---|",
    ]
    for wait, r in result["results"].items():
        if "error" in r:
            lines.append(f"| {wait} | | {r['error']} | | | |")
            continue
        load = f"{r['loadavg']['quiet']:.2f} / {r['loadavg']['busy']:.2f}"
        for label, tps in r["tps"].items():
            name = label
            if label == "policy" and r["policy_picked"]:
                name = f"policy (picked {'/'.join(str(n) for n in r['policy_picked'])})"
            ratio = tps["busy"] / tps["quiet"] if tps["quiet"] else float("nan")
            lines.append(
                f"| {wait} | {name} | {tps['quiet']:.1f} | {tps['busy']:.1f} | {ratio:.2f} | {load} |"
            )
    lines += ["", f"CPU: {m['cpu_model']} ({m['cpu_count']} CPUs); load average at the end {m['loadavg']}"]
    return "\n".join(lines)


if __name__ == "__main__":
    print(json.dumps(worker(json.loads(sys.argv[1]))))
