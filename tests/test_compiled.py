"""The compiled decode step (`--opt compile`) on the tiny model, against transformers' eager
forward pass on the same caches: the same answers and logits, one graph compiled once per
capacity, buffers that never move, no host synchronization inside the step."""

from __future__ import annotations

import gc
import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from helpers import make_model, make_tokenizer, needs_kernels

from chatbot.config import ChatConfig, EngineConfig, SamplingConfig
from chatbot.conversation.session import ChatSession
from chatbot.engine.backends.base import HFBackend, NativeBackend
from chatbot.engine.backends.choose import backend_for
from chatbot.engine.backends.compiled import CompiledBackend, StaticLayer, bucket
from chatbot.engine.generate import Engine

pytestmark = pytest.mark.usefixtures("one_thread")

# A repetition penalty makes the tiny model's greedy answers vary (without, it repeats one id).
GREEDY = SamplingConfig(temperature=0.0, repetition_penalty=1.3, max_new_tokens=24)
MESSAGES = ["hello there", "tell me more about the fox", "and the lazy dog?", "why so?", "again", "bye"]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles its own graphs (and counts them)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.config.error_on_recompile = False
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def model_and_tok():
    tok = make_tokenizer()
    return make_model(len(tok)), tok


def session(backend, model, tok, recent: int | None = None, sampling=GREEDY) -> ChatSession:
    engine = Engine(model, tok, backend=backend)
    cfg = EngineConfig(enable_streaming=True, recent_size=recent) if recent else EngineConfig()
    return ChatSession(engine, ChatConfig(sampling=sampling, engine=cfg))


def text(chunks) -> str:
    return "".join(c.text for c in chunks)


def script(s: ChatSession, steps: list[int], after_warmup=None) -> list[str]:
    """Six turns with /undo, /retry and /reset among them; the answers in order. Counts the
    decode steps into `steps` and calls `after_warmup` after the first turn."""
    out = []
    for i, message in enumerate(MESSAGES):
        if i == 3:
            s.undo()
            out.append(text(s.retry()) if s.turns else "")
        if i == 5:
            steps.append(-s.kv.evicted_total)  # evictions so far, recorded as a negative count
            s.reset()
        out.append(text(s.send(message)))
        steps.append(s.turns[-1].stats.generated_tokens)
        if i == 0 and after_warmup is not None:
            after_warmup()
    out.append(text(s.retry()))
    return out


def buffer_ptrs(s: ChatSession) -> set[int]:
    return {t.data_ptr() for layer in s.kv.cache.layers for t in (layer.key_buffer, layer.value_buffer)}


def test_sink_chat_equals_eager_with_one_compile_and_fixed_buffers(model_and_tok):
    model, tok = model_and_tok
    sampling = SamplingConfig(temperature=0.0, repetition_penalty=1.3, max_new_tokens=40)
    ref = script(session(HFBackend(model), model, tok, recent=64, sampling=sampling), [])
    backend = CompiledBackend(model)
    s = session(backend, model, tok, recent=64, sampling=sampling)
    steps: list[int] = []
    seen: dict[str, set[int]] = {}

    def warmed() -> None:
        torch._dynamo.config.error_on_recompile = True  # any recompile from here fails the test
        seen["ptrs"] = buffer_ptrs(s)

    got = script(s, steps, warmed)
    assert got == ref
    assert sum(n for n in steps if n > 0) >= 200 and -min(steps) > 100  # steps, evictions
    assert all(isinstance(layer, StaticLayer) for layer in s.kv.cache.layers)
    assert buffer_ptrs(s) == seen["ptrs"]  # /reset and evictions kept the addresses
    assert backend.figures.compiles == 1 and backend.figures.graph_breaks == 0
    assert backend.failure is None


def test_growing_chat_compiles_once_per_capacity(model_and_tok):
    model, tok = model_and_tok
    sampling = SamplingConfig(temperature=0.0, repetition_penalty=1.3, max_new_tokens=100)
    ref = script(session(HFBackend(model), model, tok, sampling=sampling), [])
    backend = CompiledBackend(model)
    s = session(backend, model, tok, sampling=sampling)
    got = script(s, [])
    assert got == ref
    assert backend._compiled_at == {256, 512}  # grew past 256 once (a /reset starts again at 256)
    assert backend.figures.compiles == 2
    # the next conversation (this one gone) starts again at 256, on that graph and in the
    # buffers the first one gave back when it grew
    before = backend.pool.addresses()
    del s
    gc.collect()
    t = session(backend, model, tok, sampling=sampling)
    text(t.send("hello"))
    assert {layer.capacity for layer in t.kv.cache.layers} == {256}
    assert backend.figures.compiles == 2 and backend.pool.addresses() <= before


def test_logits_equal_eager_over_220_steps_with_evictions(model_and_tok):
    model, tok = model_and_tok
    eager = Engine(model, tok, backend=HFBackend(model))
    compiled = Engine(model, tok, backend=CompiledBackend(model))
    kv_e, kv_c = eager.new_cache(4, 60), compiled.new_cache(4, 60)
    prompt = tok("The quick brown fox jumps over the lazy dog.")["input_ids"]
    with torch.inference_mode():
        le, lc = eager.prefill(kv_e, prompt), compiled.prefill(kv_c, prompt)
        worst = (le - lc).abs().max().item()
        gen = torch.Generator().manual_seed(0)
        for _ in range(220):
            token = int(torch.multinomial(torch.softmax(le, -1), 1, generator=gen))
            le, lc = eager.step(kv_e, token), compiled.step(kv_c, token)
            worst = max(worst, (le - lc).abs().max().item())
    assert kv_c.evicted_total == kv_e.evicted_total > 100
    assert kv_c.ids == kv_e.ids
    assert worst < 1e-4, worst


def test_continue_after_an_interrupted_compiled_step_equals_uninterrupted(model_and_tok):
    model, tok = model_and_tok
    sampling = SamplingConfig(temperature=0.0, repetition_penalty=1.3, max_new_tokens=30)
    backend = CompiledBackend(model)
    whole = text(session(backend, model, tok, sampling=sampling).send("The quick brown fox"))
    s = session(backend, model, tok, sampling=sampling)
    inner = backend._step
    calls = {"n": 0}

    def interrupting(*args):
        out = inner(*args)  # the token is written, not yet counted: as a Ctrl-C mid-step
        calls["n"] += 1
        if calls["n"] == 12:
            raise KeyboardInterrupt
        return out

    backend._step = interrupting
    shown = ""
    with pytest.raises(KeyboardInterrupt):
        for chunk in s.send("The quick brown fox"):
            shown += chunk.text
    backend._step = inner
    assert s.turns[-1].interrupted
    s.kv.check()
    left = 30 - s.turns[-1].stats.generated_tokens
    text(s.continue_answer(SamplingConfig(temperature=0.0, repetition_penalty=1.3, max_new_tokens=left)))
    assert s.turns[-1].answer == whole


def test_the_step_is_one_graph_without_host_syncs(model_and_tok):
    from torch._dynamo.backends.common import aot_autograd

    model, tok = model_and_tok
    graphs: list[torch.fx.GraphModule] = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    backend = CompiledBackend(model, compiler=aot_autograd(fw_compiler=record))
    s = session(backend, model, tok, recent=64)
    text(s.send("hello there"))
    text(s.send("and again"))
    # the forward step and the choice of the next token (greedy: one kind), each one graph
    assert len(graphs) == 2 and backend.failure is None
    ops = [{str(node.target) for node in g.graph.nodes if node.op == "call_function"} for g in graphs]
    for found in ops:
        assert not {op for op in found if "_local_scalar_dense" in op or "nonzero" in op or ".item" in op}
    step, choose = sorted(ops, key=len, reverse=True)
    assert any("index_copy" in op for op in step)  # the cache is written in place, in the graph
    assert any("argmax" in op for op in choose) and any(
        "index_copy" in op for op in choose
    )  # the token takes its place


def test_the_step_attends_on_the_stored_key_value_heads(model_and_tok):
    """Grouped-query attention in the compiled step reads the static cache as it is stored: no
    copy of every key and value head per query head (`repeat_kv`), which on a static cache
    would copy the whole capacity of every layer at every step."""
    from torch._dynamo.backends.common import aot_autograd

    model, tok = model_and_tok
    kv_heads, heads = model.config.num_key_value_heads, model.config.num_attention_heads
    assert kv_heads < heads  # the tiny model groups its query heads
    graphs: list[torch.fx.GraphModule] = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    backend = CompiledBackend(model, compiler=aot_autograd(fw_compiler=record))
    ref = text(session(HFBackend(model), model, tok).send("hello there"))
    assert text(session(backend, model, tok).send("hello there")) == ref
    step = max(graphs, key=lambda g: len(g.graph.nodes))
    (capacity,) = {shape[2] for shape, _, _ in backend.pool.held}  # one bucket: the buffers'
    shapes = [
        tuple(n.meta["val"].shape) for n in step.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)
    ]
    assert (1, kv_heads, capacity, model.config.head_dim) in shapes  # the cache, as stored
    repeated = [shape for shape in shapes if len(shape) >= 4 and shape[1] == heads and capacity in shape[2:]]
    assert not repeated  # no tensor of the capacity per query head


def test_a_model_that_cannot_compile_falls_back_to_eager_steps(model_and_tok):
    model, tok = model_and_tok
    ref = text(session(HFBackend(model), model, tok).send("hello there"))

    def breaks(*_):
        torch._dynamo.graph_break()

    handle = model.model.layers[0].register_forward_hook(breaks)
    try:
        backend = CompiledBackend(model)
        got = text(session(backend, model, tok).send("hello there"))
    finally:
        handle.remove()
    assert got == ref
    assert backend.failure is not None and "compile failed" in backend.describe()


@needs_kernels
def test_a_gguf_model_compiles_with_its_packed_products_as_ops(tiny_gguf):
    """A GGUF file loaded as stored (packed modules calling C kernels): the compiled graph
    calls each packed product as a custom op, and answers as the eager path does."""
    from chatbot.engine.backends.native.packed import PackedLinear
    from chatbot.models.loader import load_model

    path, _, _ = tiny_gguf
    loaded = load_model(str(path), device="cpu", dtype="float32")
    model, tok = loaded.model, loaded.tokenizer
    assert any(isinstance(m, PackedLinear) for m in model.modules())
    from torch._dynamo.backends.common import aot_autograd

    graphs: list[torch.fx.GraphModule] = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    ref = script(session(HFBackend(model), model, tok, recent=64), [])
    backend = CompiledBackend(model, compiler=aot_autograd(fw_compiler=record))
    assert script(session(backend, model, tok, recent=64), []) == ref
    assert backend.failure is None and backend.figures.compiles == 1
    step = max(graphs, key=lambda g: len(g.graph.nodes))  # (the other: choosing the next token)
    ops = [str(node.target) for node in step.graph.nodes if node.op == "call_function"]
    linears = sum(isinstance(m, PackedLinear) for m in model.modules())
    assert sum("packed_matmul" in op for op in ops) == linears and any("packed_rows" in op for op in ops)
    inductor = CompiledBackend(model)  # and through inductor, as `--opt compile` runs it
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:  # the step's products on 1 and 2 threads, each timed over whole steps, alike in text
        assert script(session(inductor, model, tok, recent=64), []) == ref and inductor.failure is None
    finally:
        torch.set_num_threads(before)
    assert set(inductor.tuners[2].seconds) == {1, 2}


def test_backend_for_chooses_once(model_and_tok):
    model, _ = model_and_tok
    assert isinstance(backend_for(model, "compile")[0], CompiledBackend)
    assert type(backend_for(model, "off")[0]) is HFBackend
    auto = backend_for(model, "auto")[0]
    assert isinstance(auto, (NativeBackend, HFBackend)) and not isinstance(auto, CompiledBackend)
    assert [bucket(n) for n in (1, 256, 257, 3000)] == [256, 256, 512, 4096]


@pytest.mark.slow
def test_piped_chat_on_the_default_model_is_the_same_with_opt_compile():
    """The CLI end to end on the real default model: six greedy turns piped in, with evictions
    inside (recent 64), and the default growing cache: --opt compile prints what --opt off
    prints."""
    stdin = "".join(f"{m}\n" for m in DEFAULT_MODEL_MESSAGES)
    env = {**os.environ, "CHATBOT_DEBUG_CACHE": "1"}

    def run(*flags: str) -> str:
        argv = [sys.executable, "-m", "chatbot.cli", "run", "--greedy", "--max-new-tokens", "32"]
        argv.append("--no-stats")
        done = subprocess.run([*argv, *flags], input=stdin, capture_output=True, text=True, env=env,
                              timeout=900, check=False)  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout

    for extra in (("--enable-streaming", "--recent-size", "64"), ()):
        off = run("--opt", "off", *extra)
        assert len(off.split()) > 60  # real answers
        assert run("--opt", "compile", *extra) == off


DEFAULT_MODEL_MESSAGES = [
    "Name three colors.",
    "Why is the sky blue?",
    "Tell me a joke.",
    "Write a haiku about the sea.",
    "What is two plus two?",
    "Say goodbye.",
]


def test_warm_up_compiles_before_the_first_answer_and_leaves_the_cache_as_made(model_and_tok):
    model, tok = model_and_tok
    backend = CompiledBackend(model)
    s = session(backend, model, tok, recent=64)
    s.kv.pin(9)
    before = (s.kv.length, s.kv.pinned, s.kv.evicted_total, list(s.kv.seen))
    s.engine.warm_up(s.kv)
    assert backend.figures.compiles == 1
    assert (s.kv.length, s.kv.pinned, s.kv.evicted_total, list(s.kv.seen)) == before
    torch._dynamo.config.error_on_recompile = True
    ref = text(session(HFBackend(model), model, tok, recent=64).send("hello there"))
    s.kv.pin(4)
    assert text(s.send("hello there")) == ref and backend.figures.compiles == 1
    eager = session(HFBackend(model), model, tok)
    eager.engine.warm_up(eager.kv)  # a no-op there
    assert eager.kv.length == 0


@pytest.mark.slow
def test_serve_with_opt_compile_answers_as_opt_off_and_reuses_prefixes(tmp_path):
    """`chatbot serve --opt compile` through the openai client: a four-turn conversation
    answers as `--opt off` does (sampled, seeded), and each later turn reuses the cached
    prefix (the prefix cache copies keys and values into the compiled step's buffers)."""
    import openai
    from serve_helpers import running_server, save_tiny_model

    folder = save_tiny_model(tmp_path / "tiny")

    def conversation(opt: str) -> list[tuple[str, int]]:
        with running_server("--model", str(folder), "--opt", opt, "--served-model-name", "tiny",
                            log=tmp_path / f"{opt}.log") as url:  # fmt: skip
            client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
            messages: list[dict[str, str]] = [{"role": "system", "content": "Answer briefly."}]
            out = []
            for user in MESSAGES[:4]:
                messages.append({"role": "user", "content": user})
                reply = client.chat.completions.create(
                    model="tiny", messages=messages, max_tokens=16, temperature=1.0, seed=7,
                    extra_body={"cache_salt": "one", "repetition_penalty": 1.3},
                )  # fmt: skip
                text = reply.choices[0].message.content or ""
                cached = (
                    reply.usage.prompt_tokens_details.cached_tokens
                    if reply.usage.prompt_tokens_details
                    else 0
                )
                out.append((text, cached))
                messages.append({"role": "assistant", "content": text})
            return out

    off, compiled = conversation("off"), conversation("compile")
    assert compiled == off
    assert all(cached > 0 for _, cached in compiled[1:]) and "".join(t for t, _ in off).strip()


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes")
@pytest.mark.parametrize("mode", ["4bit", "8bit"])
def test_a_bitsandbytes_model_compiles_whole_and_answers_as_eager(mode, tmp_path):
    """`--quantize 4bit|8bit` weights (bitsandbytes' Linear4bit / Linear8bitLt) go through the
    same one-graph step, with no break, and answer as transformers' eager step does; so on
    CUDA `--opt auto` compiles them too."""
    from chatbot.models.loader import load_model

    tok = make_tokenizer()
    make_model(len(tok)).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), device="cpu", quantize=mode)
    model = loaded.model
    layer = {"4bit": "Linear4bit", "8bit": "Linear8bitLt"}[mode]
    assert any(type(m).__name__ == layer for m in model.modules())
    want = script(session(HFBackend(model), model, tok, recent=64), [])
    backend = CompiledBackend(model)
    assert script(session(backend, model, tok, recent=64), []) == want
    assert backend.failure is None and backend.figures.compiles == 1 and backend.figures.graph_breaks == 0
