"""Decode speed of a Llama-3-8B-shaped model (random weights) on one device, side by side in
one process: our eager loop, our compiled step (`--opt compile`), and transformers'
`generate()` with its static cache (which compiles its forward pass on CUDA), in bfloat16 and
with bitsandbytes NF4 / int8 layers; and the cost of one attention-sink eviction.

    python -m devtools.gpu_shape_bench [--shape llama3-8b|tiny] [--device cuda|cpu]
        [--jobs MODE:SETUP,...] [--tokens N] [--budget-s S] [--json FILE]

`scripts/gpu-check` runs it (issue 36's criterion: >= 200 tok/s bf16 on an H200, NF4 at least
as fast as bf16). Each figure is printed as a JSON line as soon as it exists, so a run cut
short by `--budget-s` keeps what it measured; a job that would start after the budget is
skipped and says so. The default order puts the criterion's figures first (compiled bf16 and
NF4). `--shape tiny --device cpu` runs every path in seconds (the test).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from typing import Any

import torch

SHAPES: dict[str, dict[str, Any]] = {
    "llama3-8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                  "max_position_embeddings": 8192, "rope_theta": 500000.0},
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 1024},
}  # fmt: skip
PROMPT = 64  # tokens before the decoded ones


def build(shape: str, device: str, mode: str) -> Any:
    """The model with random weights (seed 0), made on `device` in bfloat16; `nf4` / `int8`
    swap every linear layer but the head for bitsandbytes' (quantized as it moves there)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPES[shape], tie_word_embeddings=False)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default)
    if mode != "bf16":
        quantize_linears(model, mode, device)
    return model


def quantize_linears(model: Any, mode: str, device: str) -> None:
    import bitsandbytes as bnb

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, torch.nn.Linear) or name == "lm_head":
                continue
            weight = child.weight.data.to("cpu")
            layer: Any
            if mode == "nf4":
                layer = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=False,
                                          compute_dtype=torch.bfloat16, quant_type="nf4")  # fmt: skip
                layer.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4")
            else:
                layer = bnb.nn.Linear8bitLt(child.in_features, child.out_features, bias=False,
                                            has_fp16_weights=False, threshold=6.0)  # fmt: skip
                layer.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
            setattr(parent, name, layer.to(device))
            del child


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ours(model: Any, compiled: bool, n: int) -> dict[str, Any]:
    """Our loop (`Engine`'s prefill, then the token steps `Engine.generate` runs), greedy,
    timed per token; the compiled one after a warm-up run that compiles its capacity."""
    from transformers.generation.logits_process import LogitsProcessorList

    from chatbot.config import SamplingConfig
    from chatbot.engine.backends.base import HFBackend
    from chatbot.engine.backends.compiled import CompiledBackend
    from chatbot.engine.backends.device_sampling import device_token_steps
    from chatbot.engine.generate import Engine, token_steps
    from chatbot.engine.sampling import Sampler

    backend = CompiledBackend(model) if compiled else HFBackend(model)
    engine = Engine(model, None, backend=backend)
    sampling = SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=n)
    prompt = list(range(10, 10 + PROMPT))

    def run() -> list[float]:
        kv = engine.new_cache()
        with torch.inference_mode():
            logits = engine.prefill(kv, prompt)
            if compiled:
                sampler = backend.sampler  # type: ignore[attr-defined]
                sampler.begin(sampling, prompt, logits.shape[-1], None)
                steps = device_token_steps(backend, kv, logits, sampler)  # type: ignore[arg-type]
            else:
                host = Sampler(sampling, prompt, LogitsProcessorList(), None, engine.device)
                steps = token_steps(lambda token: engine.step(kv, token), kv, logits, host)
            sync(engine.device)
            times = [time.perf_counter()]
            for i, _ in enumerate(steps):  # each token is read back before it is yielded
                times.append(time.perf_counter())
                if i + 1 == n:
                    break
            steps.close()
        return [b - a for a, b in itertools.pairwise(times[1:])]

    t0 = time.perf_counter()
    run()
    warm_s = time.perf_counter() - t0
    latencies = run()
    out = {"tok_s": len(latencies) / sum(latencies), "p50_ms": 1000 * sorted(latencies)[len(latencies) // 2],
           "warm_up_s": warm_s}  # fmt: skip
    if compiled:
        figures = backend.figures  # type: ignore[attr-defined]
        out.update(compiles=figures.compiles, graph_breaks=figures.graph_breaks,
                   failure=backend.failure)  # type: ignore[attr-defined]  # fmt: skip
    return out


def generate(model: Any, n: int) -> dict[str, Any]:
    """transformers' `generate()` with `cache_implementation="static"` (compiled on CUDA by
    transformers itself), greedy: (time for n tokens - time for 1) / (n - 1)."""
    device = model.get_input_embeddings().weight.device
    x = torch.arange(10, 10 + PROMPT, device=device)[None]

    def timed(k: int) -> float:
        sync(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=k, min_new_tokens=k,
                           do_sample=False, cache_implementation="static", pad_token_id=0)  # fmt: skip
        sync(device)
        return time.perf_counter() - t0

    t0 = time.perf_counter()
    timed(n)  # compiles (on CUDA)
    warm_s = time.perf_counter() - t0
    per = (timed(n) - timed(1)) / (n - 1)
    return {"tok_s": 1 / per, "p50_ms": 1000 * per, "warm_up_s": warm_s}


def eviction(model: Any, recent: int = 512) -> dict[str, Any]:
    """One eviction of the compiled step's sink cache (4 sinks, `recent` tokens), once full:
    the block dropped and the kept keys moved and re-rotated in place."""
    from chatbot.engine.backends.compiled import CompiledBackend
    from chatbot.engine.generate import Engine

    engine = Engine(model, None, backend=CompiledBackend(model))
    kv = engine.new_cache(4, recent)
    with torch.inference_mode():
        engine.prefill(kv, [i % 400 + 10 for i in range(recent + 4)])
        times = []
        for _ in range(3):
            sync(engine.device)
            t0 = time.perf_counter()
            dropped = kv.evict_for(64)
            sync(engine.device)
            times.append(time.perf_counter() - t0)
            engine.prefill(kv, [11] * dropped)
    return {"evict_ms": 1000 * sorted(times)[1], "tokens_dropped": dropped, "window": recent + 4}


DEFAULT_JOBS = (
    "bf16:compile,nf4:compile,bf16:eager,nf4:eager,bf16:eviction,bf16:generate,int8:compile,int8:eager"
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--jobs", default=DEFAULT_JOBS,
                        help="MODE:SETUP pairs in the order to run them (modes bf16, nf4, int8; "
                             "set-ups eager, compile, generate, eviction)")  # fmt: skip
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--budget-s", type=float, default=300.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    models: dict[str, Any] = {}  # each mode's model, built when a job first needs it

    for job in args.jobs.split(","):
        mode, setup = job.split(":")
        row: dict[str, Any] = {"shape": args.shape, "mode": mode, "setup": setup}
        if time.perf_counter() - start > args.budget_s:
            row["skipped"] = f"past the budget of {args.budget_s:.0f} s"
        else:
            try:
                if mode not in models:
                    models[mode] = build(args.shape, args.device, mode)
                model = models[mode]
                if setup == "eviction":
                    row.update(eviction(model))
                elif setup == "generate":
                    row.update(generate(model, args.tokens))
                else:
                    row.update(ours(model, setup == "compile", args.tokens))
            except Exception as exc:  # noqa: BLE001 - a job that fails is a row saying why, not the end
                row["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(
                {"device": args.device, "elapsed_s": time.perf_counter() - start, "rows": rows}, f, indent=1
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
