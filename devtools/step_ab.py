"""One decode step of `--opt off` (transformers' eager forward) against the compiled step
(`--opt compile`) on the same loaded model, alternating in one process, so that the
machine's drift and the process's own state fall on both sides alike:

    python -m devtools.step_ab [--model M] [--threads N] [--tokens N] [--rounds R]

Each round runs `--tokens` greedy steps after a 60-token prompt on each backend (a fresh
cache each) and prints both medians in ms and their ratio off / compiled (above 1: the
compiled step is faster). Compiling comes first and is reported apart. `chatbot bench decode`
measures each set-up in a process of its own; this separates the step's speed from
whatever differs between those processes.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from chatbot.engine.backends.base import Backend


def _steps(backend: Backend, prompt: list[int], n: int) -> list[float]:
    cache = backend.new_cache()
    backend.reserve(cache, len(prompt) + n + 1)
    times = []
    with torch.inference_mode():
        token = int(backend.prefill(cache, prompt).argmax())
        for _ in range(n):
            t0 = time.perf_counter()
            token = int(backend.step(cache, token).argmax())
            times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="as `chatbot run --model` (default: embedded)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from chatbot.engine.backends.base import HFBackend
    from chatbot.engine.backends.compiled import CompiledBackend
    from chatbot.models.loader import load_model

    loaded = load_model(args.model, device="cpu", dtype="float32")
    prompt = list(loaded.tokenizer("The quick brown fox jumps over the lazy dog. " * 10)["input_ids"])[:60]
    eager, compiled = HFBackend(loaded.model), CompiledBackend(loaded.model)
    t0 = time.perf_counter()
    _steps(compiled, prompt, 8)
    print(f"compiling: {time.perf_counter() - t0:.1f} s, {compiled.figures}", flush=True)
    for r in range(args.rounds):
        off = statistics.median(_steps(eager, prompt, args.tokens))
        comp = statistics.median(_steps(compiled, prompt, args.tokens))
        ratio = off / comp
        print(
            f"round {r + 1}: off {off * 1e3:.2f} ms, compiled {comp * 1e3:.2f} ms, off/compiled {ratio:.2f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()
