"""Decode and prefill speed, side by side: transformers `generate()`, our engine at each
optimization level, and llama.cpp when llama-cpp-python is installed.

Every set-up runs in its own worker process (so its peak memory is its own, and no set-up
inherits another's threads or caches), and the set-ups take turns: round 1 runs each once,
then round 2, and so on; the figures are medians over the rounds. On a shared machine the
load changes from minute to minute, and interleaving spreads it evenly over the set-ups.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

from chatbot.engine.seq import common_prefix
from chatbot.measure.bench_timing import DECODE_PROMPT, rss_mb, task_message, timed
from chatbot.measure.decode_report import BASELINE, LLAMA_CPP, LLAMA_CPP_NGRAM
from chatbot.measure.llama_worker import llama_cpp_worker
from chatbot.measure.quality import judge_decoder, write_reference
from chatbot.measure.report import loadavg
from chatbot.models.gc_pause import pause_until_ready
from chatbot.models.gc_pause import ready as gc_ready

PREFILL_SIZES = (50, 500, 2000)
LEVEL_SETUPS = (
    "chatbot-off",
    "chatbot-f32",
    "chatbot-auto",
    "chatbot-exact",
    "chatbot-fast",
    "chatbot-int8",
    "chatbot-int4",
)
# On an NVIDIA GPU (scripts/gpu-check): our engine (transformers forward passes, no native
# kernels) in bfloat16, and with bitsandbytes 4-bit (NF4) and 8-bit (LLM.int8) weights.
CUDA_SETUPS = {"cuda-bf16": None, "cuda-4bit": "4bit", "cuda-8bit": "8bit"}
# The same through the compiled step (`--opt compile`).
CUDA_SETUPS.update({f"{name}-compile": quantize for name, quantize in list(CUDA_SETUPS.items())})
REFERENCE = "float32-reference"  # not a set-up: the distributions `--ppl-tokens` judges against
WORKER_TIMEOUT_S = 3600


def llama_cpp_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def default_setups() -> list[str]:
    """Every set-up measured when none is named; llama.cpp's row says why where it cannot run."""
    return [BASELINE, *LEVEL_SETUPS, LLAMA_CPP]


"""llama-cpp-python's prompt lookup (`LlamaPromptLookupDecoding`, its defaults) in its `generate`
loop, greedy: the peer of `chatbot-auto-ngram`; only where named."""


def why_not_measured(name: str, other_model: bool) -> str | None:
    """Why set-up `name` cannot run here (None: it can): llama.cpp needs its Python package
    and the GGUF file of the model the others run."""
    if name not in (LLAMA_CPP, LLAMA_CPP_NGRAM):
        return None
    if not llama_cpp_available():
        return "llama-cpp-python is not installed: pip install llama-cpp-python"
    if other_model:
        return "llama.cpp reads GGUF files: give --gguf FILE (the same model)"
    return None


def task_prompt(tokenizer: Any, task: str) -> list[int] | None:
    """The ids of `task`'s chat prompt (None for "text": the caller's cut of the text)."""
    content = task_message(task)
    if content is None:
        return None
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True)  # fmt: skip
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])


def answer_end(tokens: list[int], end_ids: set[int]) -> int | None:
    """Where the answer in `tokens` ends: the index of its first end-of-text token (None: none)."""
    return next((i for i, t in enumerate(tokens) if t in end_ids), None)


def bench_text(path: Path | None) -> str:
    """The text prompts are cut from: a file, or the shipped conversation repeated."""
    if path is not None:
        return Path(path).read_text(encoding="utf-8")
    turns = json.loads(resources.files("chatbot").joinpath("data/conversation.json").read_text())["turns"]
    return "\n\n".join(turns * 40)


# --- in the worker process --------------------------------------------------------------------


def _runtime_mb() -> float | None:
    """The resident set of the runtime alone, before any model: after importing what every
    load imports (torch, transformers' model and cache classes, tokenizers). Those imports
    happen during the load anyway, so taking them first changes no other figure."""
    import tokenizers  # noqa: F401
    import torch  # noqa: F401
    import transformers.cache_utils
    import transformers.modeling_utils  # noqa: F401

    return rss_mb()


def _engine_worker(
    loaded: Any, level: str, ids: list[int], sizes: tuple[int, ...], spec: dict[str, Any]
) -> dict[str, Any]:
    from chatbot.config import OutputFormat, SamplingConfig
    from chatbot.engine.backends.choose import backend_for
    from chatbot.engine.draft_model import check_vocabulary
    from chatbot.engine.generate import Engine

    t0 = time.perf_counter()
    # `LEVEL-json`: the level's backend, every answer under a JSON-object grammar (what
    # `response_format` costs a step: its token mask)
    json_format = OutputFormat.json_object() if level.endswith("-json") else None
    level = level.removesuffix("-json")
    # `LEVEL-ngram`: the level's backend with speculative decoding by n-gram lookup;
    # `LEVEL-draft`: with the draft model of `--draft FILE`, on the level's backend too
    draft = "ngram" if level.endswith("-ngram") else "model" if level.endswith("-draft") else "off"
    level = level.removesuffix("-ngram").removesuffix("-draft")
    task = task_prompt(loaded.tokenizer, spec.get("task") or "text")
    # `auto-model`: `auto` packed from the float32 model rather than the GGUF file's own
    # matrices (a K-quant matrix then decodes as float32), for before/after figures
    backend, reason = backend_for(
        loaded.model, level.removesuffix("-model"), spec["threads"], use_gguf=level != "auto-model"
    )
    setup_s = time.perf_counter() - t0
    gc_ready()  # as `chatbot run` at its prompt
    ready = time.time()  # the first usable state: model loaded, weights packed
    if reason:
        return {"error": reason}
    engine = Engine(loaded.model, loaded.tokenizer, backend=backend)
    if draft == "model":
        if not spec.get("draft_model"):
            return {"error": "a -draft set-up needs a draft model: --draft FILE"}
        engine.draft_model = _draft_model(spec["draft_model"], level, spec["threads"])
        check_vocabulary(loaded.tokenizer, engine.draft_model.engine.tokenizer)

    def run(prompt: list[int], n_new: int) -> tuple[Any, list[int]]:
        sampling = SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=n_new,
                                  output_format=json_format, draft=draft)  # fmt: skip
        stats: Any = None
        tokens: list[int] = []
        kv = engine.new_cache()  # a conversation of its own, freed after it as a chat frees it
        for chunk in engine.generate(kv, prompt, sampling):
            tokens.extend(chunk.token_ids)
            stats = chunk.stats or stats
        return stats, tokens

    def prefill(prompt: list[int]) -> tuple[float, float]:
        stats = run(prompt, 1)[0]
        return stats.context_time_s, stats.ttft_s

    def decode(prompt: list[int], n: int) -> tuple[list[float], list[int]]:
        if engine.compiled:  # compile every capacity the measured run meets, apart from it
            run(prompt, n)
        stats, tokens = run(task or prompt, n)
        drafts.update(draft_tokens=stats.draft_tokens, draft_accepted=stats.draft_accepted)
        return stats.token_latencies_s, tokens

    drafts: dict[str, int] = {}

    out = {
        **timed(prefill, decode, ids, sizes, spec["decode_tokens"]),
        "setup_s": setup_s,
        "ready_at": ready,
        **(drafts if draft != "off" else {}),
    }
    if engine.decoder is not None:
        info = engine.decoder.info()
        out.update(weights=info.formats, weight_mb=info.weight_bytes / 2**20,
                   bytes_per_weight=info.bytes_per_weight, weights_from=info.source)  # fmt: skip
    figures = getattr(backend, "figures", None)
    if figures is not None:  # the compiled step: what compiling cost, apart from the figures
        out.update(compiles=figures.compiles, compile_s=figures.compile_s, graph_breaks=figures.graph_breaks,
                   compile_failure=getattr(backend, "failure", None))  # fmt: skip
    if spec.get("reference"):
        out.update(judge_decoder(loaded.model, engine.decoder, spec["reference"]))
    return out


def _draft_model(ref: str, level: str, threads: int) -> Any:
    """The draft model of a `-draft` set-up, on the set-up's backend level."""
    from chatbot.engine.backends.choose import backend_for
    from chatbot.engine.draft_model import DraftModel
    from chatbot.engine.generate import Engine
    from chatbot.models.loader import load_model

    loaded = load_model(ref, device="cpu", dtype="auto")
    backend, _ = backend_for(loaded.model, level, threads)
    return DraftModel(Engine(loaded.model, loaded.tokenizer, backend=backend), loaded.name)


def _generate_worker(
    loaded: Any, ids: list[int], sizes: tuple[int, ...], spec: dict[str, Any]
) -> dict[str, Any]:
    """transformers' own `generate()`, greedy, timed per token through a streamer."""
    import torch
    from transformers.generation.streamers import BaseStreamer

    model = loaded.model

    class Clock(BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.tokens: list[int] = []

        def put(self, value: Any) -> None:
            self.times.append(time.perf_counter())
            if len(self.times) > 1:  # the first call echoes the prompt
                self.tokens.extend(int(t) for t in value.reshape(-1))

        def end(self) -> None:
            pass

    def run(prompt: list[int], n_new: int) -> tuple[float, Clock]:
        clock = Clock()
        x = torch.tensor([prompt])
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=n_new, min_new_tokens=n_new,
                do_sample=False, streamer=clock, pad_token_id=loaded.tokenizer.eos_token_id,
            )  # fmt: skip
        return start, clock

    def prefill(prompt: list[int]) -> tuple[float, float]:
        start, clock = run(prompt, 1)
        return (clock.times[1] - start,) * 2  # times[0] is the prompt being echoed

    def decode(prompt: list[int], n: int) -> tuple[list[float], list[int]]:
        clock = run(prompt, n)[1]
        return [b - a for a, b in zip(clock.times[1:], clock.times[2:])], clock.tokens

    gc_ready()
    out = {"ready_at": time.time(), **timed(prefill, decode, ids, sizes, spec["decode_tokens"])}
    if spec.get("reference"):
        out.update(judge_decoder(model, None, spec["reference"]))
    return out


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Measure one set-up (run in a fresh process by `run_decode_bench`)."""
    name = spec["name"]
    sizes = tuple(sorted({DECODE_PROMPT, *(spec.get("prefill_sizes") or PREFILL_SIZES)}))
    text = bench_text(Path(spec["text"]) if spec.get("text") else None)
    if name in (LLAMA_CPP, LLAMA_CPP_NGRAM):
        # llama.cpp's process imports neither torch nor transformers: its load time is its own
        out = llama_cpp_worker(text, sizes, spec)
    else:
        import torch

        from chatbot.models.loader import load_model

        torch.set_num_threads(spec["threads"])
        runtime = _runtime_mb()
        if name in CUDA_SETUPS:
            loaded = load_model(
                spec.get("model"), device="cuda", dtype="bfloat16", quantize=CUDA_SETUPS[name]
            )
        else:
            if name == BASELINE:  # transformers' own class, whose generate() this is
                os.environ["CHATBOT_OWN_MODEL"] = "0"
            loaded = load_model(spec.get("model"), device="cpu", dtype="float32")
        ids = list(loaded.tokenizer(text, add_special_tokens=False)["input_ids"])
        need = max(*sizes, spec.get("ppl_tokens") or 0)
        if len(ids) < need:
            return {"name": name, "error": f"the text has {len(ids)} tokens; {need} are needed"}
        if name == REFERENCE:
            write_reference(loaded, ids[: spec["ppl_tokens"]], Path(spec["reference"]))
            return {"name": name}
        if name == BASELINE:
            out = _generate_worker(loaded, ids, sizes, spec)
        else:
            cuda_level = "compile" if name.endswith("-compile") else "off"
            level = cuda_level if name in CUDA_SETUPS else name.removeprefix("chatbot-")
            out = _engine_worker(loaded, level, ids, sizes, spec)
        out["runtime_mb"] = runtime
        eos = loaded.tokenizer.eos_token_id
        if "tokens" in out and eos is not None:
            out["answer_end"] = answer_end(out["tokens"], {eos})
    out["name"] = name
    from chatbot.engine.stats import peak_rss_bytes

    out.setdefault("peak_mem_mb", peak_rss_bytes() / 2**20)
    if name in CUDA_SETUPS:
        import torch

        out["gpu_peak_mem_mb"] = torch.cuda.max_memory_allocated() / 2**20
    out["loadavg"] = loadavg()[0]
    return out


# --- in the parent process --------------------------------------------------------------------


def _run_worker(spec: dict[str, Any]) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "chatbot.measure.bench_decode", json.dumps(spec)]
    started = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"name": spec["name"], "error": f"worker failed ({proc.returncode}): {tail[0]}"}
    out = json.loads(lines[-1])
    if "ready_at" in out:
        # From starting the process (Python, imports, reading the file, packing) to the first
        # usable state: what a user waits for before the prompt, the same way on every side.
        out["load_s"] = out.pop("ready_at") - started
    return out


def _median_result(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A set-up's runs as one: the median of each figure in seconds, tok/s or MB (of each
    prompt length's, for prefill), every run's decode tok/s and load average kept beside; a
    count, a name or the tokens (the same in every run) from the first run that has it."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"name": runs[0]["name"], "error": runs[0]["error"]}
    out: dict[str, Any] = {"name": ok[0]["name"], "runs": len(ok)}
    for key in dict.fromkeys(k for r in ok for k in r if k != "name"):
        values = [r[key] for r in ok if r.get(key) is not None]
        if key in ("prefill_tps", "ttft_s_by_prompt"):
            out[key] = {size: statistics.median(v[size] for v in values) for size in values[0]}
        elif values and all(isinstance(v, float) for v in values):
            out[key] = statistics.median(values)
        else:
            out[key] = values[0] if values else None
    out["decode_tps_runs"] = [r["decode_tps"] for r in ok]
    if out.get("loadavg") is not None:  # the 1-minute load average as each of this set-up's runs ended
        out["loadavg"] = round(out["loadavg"], 2)
        out["loadavg_runs"] = [round(r["loadavg"], 2) for r in ok if r.get("loadavg") is not None]
    return out


Progress = Callable[[str, int, int], None]
"""progress(what starts now, workers finished, workers in all)."""


def _run_rounds(
    runs: dict[str, list[dict[str, Any]]],
    rounds: int,
    progress: Progress | None,
    other_model: bool,
    reference: str | None,
    common: dict[str, Any],
    finished: int = 0,
) -> None:
    """Each set-up of `runs` `rounds` times, interleaved, into its list; the first round also
    judges the distributions against `reference` (`--ppl-tokens`). A set-up that cannot run
    here gets its reason in place of figures, and no worker. `finished`: workers already run
    (the reference's), for `progress`."""
    why = {name: why_not_measured(name, other_model) for name in runs}
    total = finished + rounds * sum(reason is None for reason in why.values())
    for round_no in range(rounds):
        for name, done in runs.items():
            if why[name] is not None:
                done.append({"name": name, "error": why[name]})
                continue
            if progress:
                progress(f"round {round_no + 1}/{rounds}: {name}", finished, total)
            finished += 1
            first = round_no == 0
            spec = {**common, "name": name, "ppl_tokens": common["ppl_tokens"] if first else 0,
                    "reference": reference if first else None}  # fmt: skip
            done.append(_run_worker(spec))


def _compared(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`results` with each set-up's greedy tokens compared with the baseline's (and dropped)."""
    reference = next((r.get("tokens") for r in results if r["name"] == BASELINE), None)
    for r in results:
        decoded = r.pop("tokens", None)
        if reference and decoded is not None:
            same = common_prefix(decoded, reference)
            r["same_tokens_as_baseline"] = same
            r["compared_tokens"] = min(len(decoded), len(reference))
            # generate() is held to decode_tokens (min_new_tokens), so it never ends the
            # answer: a set-up that does, and goes on, parts from it there
            r["parts_at_answer_end"] = r["name"] != BASELINE and same == r.get("answer_end")
    return results


def run_decode_bench(
    setups: list[str] | None = None,
    *,
    model: str | None = None,
    threads: int | None = None,
    rounds: int = 3,
    decode_tokens: int = 128,
    text: Path | None = None,
    ppl_tokens: int = 0,
    gguf: Path | None = None,
    prefill_sizes: tuple[int, ...] | None = None,
    progress: Progress | None = None,
    task: str = "text",
    draft_model: str | None = None,
) -> dict[str, Any]:
    """Run every set-up `rounds` times, interleaved; return medians per set-up.

    Args:
        setups: names among `default_setups()` (default: all that can run here).
        model: what `load_model` takes (default: the embedded default model).
        threads: CPU threads for every set-up (default: torch's choice, the physical cores).
        rounds: how many times each set-up runs; figures are medians.
        decode_tokens: tokens decoded after a 50-token prompt.
        text: the text prompts are cut from (default: the shipped conversation, repeated).
        ppl_tokens: also measure next-token perplexity over this many tokens of the text
            (first round only; 0: skip).
        gguf: the GGUF file for llama.cpp (default: the embedded default model's).
        prefill_sizes: prompt lengths prefill is timed at (default 50, 500, 2000; 50 is
            always one: decoding starts after a 50-token prompt).
        progress: told of each worker as it starts (`Progress`).
        task: what our set-ups decode (`TASKS`): a cut of the text, or a chat message
            repeating or proofreading ~300 words of prose ("repeat", "edit") or writing freely
            ("write").
        draft_model: the draft model of the `-draft` set-ups.

    Returns:
        ``{"results": [...], "machine": {...}, "settings": {...}}``; each result has
        decode_tps, prefill_tps {"50", "500", "2000"}, ttft_s, ms_per_token_p50/p90 and
        peak_mem_mb, or an "error".
    """
    import torch

    from chatbot.measure.report import machine_info

    if gguf is None and model and model.lower().endswith(".gguf"):
        gguf = Path(model)  # llama.cpp runs the very file we load
    if gguf is None and model is None:
        from chatbot.models.loader import default_gguf_path

        gguf = default_gguf_path()
    # Given another model and no GGUF, llama.cpp would run the default model: no comparison.
    other_model = model is not None and gguf is None
    if setups is None:
        setups = default_setups()
    threads = threads or torch.get_num_threads()
    sizes = tuple(sorted({DECODE_PROMPT, *(prefill_sizes or PREFILL_SIZES)}))
    load_before = loadavg()
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in setups}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="chatbot-quality-") as scratch:
        reference = str(Path(scratch) / "reference.npz") if ppl_tokens else None
        if reference:  # the float32 distributions every set-up is judged against
            if progress:
                runnable = sum(why_not_measured(name, other_model) is None for name in setups)
                progress("float32 reference for --ppl-tokens", 0, 1 + rounds * runnable)
            made = _run_worker({"name": REFERENCE, "model": model, "threads": threads, "decode_tokens": 0,
                                "text": str(text) if text else None, "ppl_tokens": ppl_tokens,
                                "reference": reference})  # fmt: skip
            if "error" in made:
                return {"results": [made], "machine": machine_info(), "settings": {"ppl_tokens": ppl_tokens}}
        common = {"model": model, "threads": threads, "decode_tokens": decode_tokens,
                  "ppl_tokens": ppl_tokens, "text": str(text) if text else None,
                  "gguf": str(gguf) if gguf else None, "prefill_sizes": list(sizes),
                  "task": task, "draft_model": draft_model}  # fmt: skip
        _run_rounds(runs, rounds, progress, other_model, reference, common, finished=1 if reference else 0)
    results = _compared([_median_result(runs[name]) for name in setups])
    machine = {**machine_info(), "torch_threads": threads, "loadavg_start": list(load_before)}
    return {
        "results": results,
        "machine": {**machine, "loadavg_end": list(loadavg())},
        "settings": {
            "model": model or "default (SmolLM2-135M-Instruct)",
            "rounds": rounds,
            "decode_tokens": decode_tokens,
            "decode_prompt_tokens": DECODE_PROMPT,
            "task": task,
            "prefill_sizes": list(sizes),
            "ppl_tokens": ppl_tokens,
            **({"draft_model": draft_model} if draft_model else {}),
            "text": str(text) if text else "shipped conversation, repeated",
            "wall_s": round(time.perf_counter() - started, 1),
        },
    }


if __name__ == "__main__":
    pause_until_ready()  # start up as `chatbot run` does (chatbot.models.gc_pause), every set-up alike
    print(json.dumps(worker(json.loads(sys.argv[1]))))
