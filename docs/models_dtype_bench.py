"""Prefill and decode speed of the default model per dtype (or quantization), for the
`--dtype auto` choice in docs/models.md.

The set-ups run interleaved in one process, round after round, so that load from other
processes hits each of them alike; the medians of 3 rounds are printed last.

    .venv/bin/python docs/models_dtype_bench.py threads=1 prefill=300 decode=24
    .venv/bin/python docs/models_dtype_bench.py --quant threads=1 prefill=100 decode=16
"""

import json
import statistics
import sys
import time
import warnings

import torch
from transformers import DynamicCache

from chatbot.models.loader import load_model

warnings.filterwarnings("ignore")
ARGS = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)
torch.set_num_threads(int(ARGS.get("threads", 2)))
PREFILL = int(ARGS.get("prefill", 500))
DECODE = int(ARGS.get("decode", 16))
if "--quant" in sys.argv:
    SETUPS = {
        "4bit/float32": {"quantize": "4bit", "dtype": "float32"},
        "4bit/bfloat16": {"quantize": "4bit", "dtype": "bfloat16"},
        "8bit/float32": {"quantize": "8bit", "dtype": "float32"},
    }
else:
    SETUPS = {"float32": {"dtype": "float32"}, "bfloat16": {"dtype": "bfloat16"}}

models = {name: load_model(None, device="cpu", **kw).model for name, kw in SETUPS.items()}
torch.manual_seed(0)
ids = torch.randint(100, 40000, (1, PREFILL))
rates: dict[str, dict[str, list[float]]] = {k: {"prefill": [], "decode": []} for k in models}
with torch.inference_mode():
    for m in models.values():
        m(ids[:, :8])  # warm-up
    for rnd in range(3):
        for name, m in models.items():
            cache = DynamicCache(config=m.config)
            t = time.perf_counter()
            out = m(ids, cache=cache, logits_to_keep=1)
            rates[name]["prefill"].append(PREFILL / (time.perf_counter() - t))
            tok = out.logits[:, -1:].argmax(-1)
            t = time.perf_counter()
            for _ in range(DECODE):
                out = m(tok, cache=cache, logits_to_keep=1)
                tok = out.logits[:, -1:].argmax(-1)
            rates[name]["decode"].append(DECODE / (time.perf_counter() - t))
        print(rnd, {k: {s: round(v[-1], 1) for s, v in r.items()} for k, r in rates.items()}, flush=True)
print(json.dumps({k: {s: round(statistics.median(v), 1) for s, v in r.items()} for k, r in rates.items()}))
