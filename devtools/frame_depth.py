"""The eager decode step (`--opt off`: transformers' forward pass over the model's packed
products) called at a range of depths of the caller's Python stack, bare and through
`chatbot.engine.backends.native.pystack.call_with_room`, alternating at each depth in one process:

    python -m devtools.frame_depth [--model M] [--threads N] [--depths 0:240:2] [--steps N]

Prints, per depth, each side's median ms a step and page faults a step (a frame-stack chunk
mapped afresh costs at least one), then the worst depth of each side. Where the bare step's
faults jump at some depths and its time with them, CPython's frame stack maps and unmaps a
chunk per module call there (chatbot/engine/backends/native/pystack.py says why).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from collections.abc import Callable

import torch


def _at_depth(depth: int, fn: Callable[[], object]) -> object:
    if depth:
        return _at_depth(depth - 1, fn)
    return fn()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="as `chatbot run --model` (default: embedded)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--depths", default="0:240:2", help="first:last:stride, as range()")
    parser.add_argument("--steps", type=int, default=6, help="steps per depth and side")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from chatbot.engine.backends.base import HFBackend
    from chatbot.engine.backends.native.pystack import call_with_room
    from chatbot.models.loader import load_model

    loaded = load_model(args.model, device="cpu", dtype="float32")
    backend = HFBackend(loaded.model)
    cache = backend.new_cache()
    prompt = list(loaded.tokenizer("The quick brown fox jumps over the lazy dog. " * 10)["input_ids"])[:60]
    ids = torch.tensor([[int(prompt[-1])]])

    def forward() -> object:
        return backend.forward_model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)

    sides: dict[str, Callable[[], object]] = {"bare": forward, "with room": lambda: call_with_room(forward)}

    def measure(depth: int, fn: Callable[[], object]) -> tuple[float, float]:
        times = []
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(args.steps):
            t0 = time.perf_counter()
            _at_depth(depth, fn)
            times.append(time.perf_counter() - t0)
            cache.crop(-1)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        return statistics.median(times) * 1e3, faults / args.steps

    first, last, stride = (int(x) for x in (args.depths + ":1").split(":")[:3])
    worst: dict[str, tuple[float, float, int]] = {}
    with torch.inference_mode():
        backend.prefill(cache, prompt)
        for fn in sides.values():
            measure(first, fn)  # warm
        print(
            f"{'depth':>5}  " + "  ".join(f"{name + ' ms':>13} {'faults':>7}" for name in sides), flush=True
        )
        for depth in range(first, last, stride):
            row = []
            for name, fn in sides.items():
                ms, faults = measure(depth, fn)
                row.append(f"{ms:13.1f} {faults:7.0f}")
                if name not in worst or ms > worst[name][0]:
                    worst[name] = (ms, faults, depth)
            print(f"{depth:5d}  " + "  ".join(row), flush=True)
    for name, (ms, faults, depth) in worst.items():
        print(f"slowest {name}: {ms:.1f} ms a step, {faults:.0f} faults a step, at depth {depth}")


if __name__ == "__main__":
    main()
