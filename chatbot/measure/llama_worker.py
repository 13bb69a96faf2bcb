"""llama.cpp's set-ups of `chatbot bench decode` (`llama.cpp`, `llama.cpp-ngram`), through
llama-cpp-python, an optional peer that is never a dependency; run in a worker process."""

from __future__ import annotations

import time
from typing import Any

from chatbot.measure.bench_timing import rss_mb, task_message, timed
from chatbot.measure.decode_report import LLAMA_CPP_NGRAM
from chatbot.measure.quality import judge_llama_cpp
from chatbot.models.gc_pause import ready as gc_ready


def _llama_task_prompt(llm: Any, task: str) -> list[int] | None:
    """`task_prompt` for llama.cpp: the same chat message through the GGUF file's own chat
    template and tokenizer (None for "text")."""
    content = task_message(task)
    if content is None:
        return None
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    meta = llm.metadata
    vocab = llm._model  # the template's special tokens, as llama-cpp-python's own chat handler
    formatter = Jinja2ChatFormatter(
        template=meta["tokenizer.chat_template"],
        eos_token=vocab.token_get_text(vocab.token_eos()),
        bos_token=vocab.token_get_text(vocab.token_bos()),
    )
    rendered = formatter(messages=[{"role": "user", "content": content}]).prompt
    return list(llm.tokenize(rendered.encode("utf-8"), add_bos=False, special=True))


def _llama_generate_decode(llm: Any, prompt: list[int], n: int) -> list[float]:
    """Greedy tokens through llama-cpp-python's `generate` loop (its drafts verified there,
    where it has a draft model): the time between tokens, the prompt's pass left out."""
    latencies: list[float] = []
    start = time.perf_counter()
    for _ in llm.generate(prompt, temp=0.0, repeat_penalty=1.0, reset=True):
        now = time.perf_counter()
        latencies.append(now - start)
        start = now
        if len(latencies) > n:
            break
    return latencies[1:]


def llama_cpp_worker(text: str, sizes: tuple[int, ...], spec: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp through llama-cpp-python (an optional peer), on the GGUF file itself; as
    `llama.cpp-ngram`, with its prompt lookup decoding in its own generate loop."""
    import numpy as np
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    runtime = rss_mb()  # Python, numpy and the llama.cpp library, before the model
    t0 = time.perf_counter()
    threads = spec["threads"]
    lookup = spec["name"] == LLAMA_CPP_NGRAM
    # A draft model needs every position's logits (n_ctx x vocab floats): logits_all, which
    # llama-cpp-python 0.3 turns on itself but sizes its array without (n_batch rows only).
    llm = Llama(model_path=spec["gguf"], n_ctx=4096, n_batch=512, n_threads=threads, n_threads_batch=threads,
                verbose=False, logits_all=lookup,
                draft_model=LlamaPromptLookupDecoding() if lookup else None)  # fmt: skip
    setup_s = time.perf_counter() - t0
    gc_ready()
    ready = time.time()
    ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
    vocab = llm.n_vocab()
    task = _llama_task_prompt(llm, spec.get("task") or "text")

    def prefill(prompt: list[int]) -> tuple[float, float]:
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        return (time.perf_counter() - start,) * 2

    def decode(prompt: list[int], n: int) -> tuple[list[float], None]:
        if task is not None or lookup:  # the chat message, or drafts: its generate loop
            return _llama_generate_decode(llm, task or prompt, n), None
        prefill(prompt)
        latencies = []
        for _ in range(n):
            start = time.perf_counter()
            # Without logits_all, llama-cpp-python keeps no scores; the context has the last row.
            llm.eval([int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,))))])
            latencies.append(time.perf_counter() - start)
        return latencies[1:], None  # its own tokenizer's ids: not comparable with transformers'

    out = timed(prefill, decode, ids, sizes, spec["decode_tokens"])
    out.update(setup_s=setup_s, ready_at=ready, runtime_mb=runtime)
    if spec.get("reference"):
        from chatbot.engine.stats import peak_rss_bytes

        out["peak_mem_mb"] = peak_rss_bytes() / 2**20  # before the judge's arrays
        out.update(judge_llama_cpp(llm, spec["reference"]))
    return out
