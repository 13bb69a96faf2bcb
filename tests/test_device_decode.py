"""The next token chosen on the device and read one step late (`chatbot.engine.backends.device_sampling`,
`--opt compile`): the same choice as the host `Sampler` (transformers' processors and
`torch.multinomial`), compiled as the eager function, the step after a token launched before
the token is read, taken back on a stop, and no device read per token."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import make_model, make_tokenizer

from chatbot.config import ChatConfig, EngineConfig, SamplingConfig
from chatbot.conversation.session import ChatSession
from chatbot.engine.backends.base import HFBackend
from chatbot.engine.backends.compiled import CompiledBackend
from chatbot.engine.backends.device_sampling import DeviceSampler, choose_token
from chatbot.engine.generate import Engine
from chatbot.engine.sampling import Sampler, build_logits_processor
from chatbot.errors import NonFiniteOutputError

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 5000
KINDS = [
    SamplingConfig(temperature=0.0, repetition_penalty=1.3),
    SamplingConfig(temperature=0.7, top_k=50, top_p=0.9, repetition_penalty=1.1),
    SamplingConfig(temperature=1.3, top_k=0, top_p=0.8, repetition_penalty=1.0),
    SamplingConfig(temperature=1.0, top_k=20, top_p=1.0, repetition_penalty=1.2),
    SamplingConfig(temperature=0.9, top_k=0, top_p=1.0, repetition_penalty=1.0),
    SamplingConfig(temperature=0.5, top_k=VOCAB + 10, top_p=0.5, repetition_penalty=0.8),
]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def host_choice(logits, sampling, context, seed):
    """The host loop's token: transformers' processors, then argmax or multinomial."""
    generator = torch.Generator().manual_seed(seed)
    sampler = Sampler(sampling, context, build_logits_processor(sampling), generator, torch.device("cpu"))
    return sampler(logits), torch.softmax(sampler.scores[0], -1)


def device_choice(logits, sampling, context, seed, fn=choose_token):
    sampler = DeviceSampler(torch.device("cpu"))
    sampler.begin(sampling, context, logits.shape[-1], torch.Generator().manual_seed(seed))
    sampler.draw()
    out = fn(logits, sampler.last, sampler.window, sampler.params, sampler.noise, sampler.next_ids,
             sampler.greedy, sampler.top_k, sampler.nucleus)  # fmt: skip
    assert int(sampler.next_ids) == int(out[0])
    assert int(sampler.last[out[0]]) == len(context) and int(sampler.window[0]) == len(context) + 1
    return int(out[0]), bool(out[1]), sampler


@pytest.mark.parametrize("last_n", [1, 3, 7, -1, 0])
def test_the_penalty_window_moves_with_the_answer_as_the_host_loops(last_n):
    """Greedy steps past the window, with special ids in the context: the device's places
    penalise what the host's `WindowedRepetitionPenalty` penalises over context + answer, at
    every step (the answer's own ids leave the window as it moves)."""
    sampling = SamplingConfig(temperature=0.0, repetition_penalty=3.0, repeat_last_n=last_n)
    special = {1, 2}
    torch.manual_seed(1)
    vocab = 12  # a small vocabulary: the penalised ids are often the best ones
    context = [1, 5, 6, 2, 7, 5]
    sampler = DeviceSampler(torch.device("cpu"))
    sampler.begin(sampling, context, vocab, None, special=special)
    host = build_logits_processor(sampling, special)
    ids = list(context)
    for step in range(24):
        logits = torch.randn(vocab)
        if step % 4 == 0:
            logits[1] = logits.max() + 0.5  # a special id penalised would lose its lead
        want = int(host(torch.tensor([ids]), logits[None].clone()).argmax(-1))
        got = int(choose_token(logits, sampler.last, sampler.window, sampler.params, sampler.noise,
                               sampler.next_ids, True, 0, False)[0])  # fmt: skip
        assert got == want, ids
        ids.append(want)


@pytest.mark.parametrize("sampling", KINDS, ids=lambda s: f"t{s.temperature}-k{s.top_k}-p{s.top_p}")
def test_choice_equals_the_host_samplers_for_each_seed(sampling):
    """Per seed, the token the host loop picks (processors, then multinomial's draw), and the
    kept tokens are the processors' (a draw lands only on tokens they keep)."""
    torch.manual_seed(0)
    for trial in range(40):
        logits = torch.randn(VOCAB) * (1 + trial % 4)
        context = torch.randint(0, VOCAB, (30,)).tolist()
        want, probs = host_choice(logits, sampling, context, seed=trial)
        got, bad, _ = device_choice(logits, sampling, context, seed=trial)
        assert (got, bad) == (want, False)
    if not sampling.greedy:  # many draws from one set of logits stay inside the kept set
        kept = set(torch.nonzero(probs).flatten().tolist())
        drawn = {device_choice(logits, sampling, context, seed=s)[0] for s in range(300)}
        assert drawn <= kept and (len(drawn) > 1 or len(kept) == 1)


def test_compiled_choice_equals_the_eager_function():
    compiled = torch.compile(choose_token, fullgraph=True, dynamic=False)
    torch.manual_seed(1)
    for sampling in KINDS:
        for trial in range(5):
            logits = torch.randn(VOCAB) * 2
            context = torch.randint(0, VOCAB, (20,)).tolist()
            eager = device_choice(logits, sampling, context, seed=trial)[:2]
            assert device_choice(logits, sampling, context, seed=trial, fn=compiled)[:2] == eager


def test_non_finite_logits_are_flagged_whatever_token_is_drawn():
    logits = torch.randn(VOCAB)
    logits[17] = float("nan")
    for sampling in KINDS:
        assert device_choice(logits, sampling, [], seed=0)[1]
    assert not device_choice(torch.randn(VOCAB), KINDS[1], [], seed=0)[1]


# -- the loop --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_and_tok():
    tok = make_tokenizer()
    return make_model(len(tok)), tok


def chat(backend, model, tok, sampling, recent=None, seed=None) -> ChatSession:
    cfg = EngineConfig(enable_streaming=True, recent_size=recent) if recent else EngineConfig()
    sampling = dataclasses.replace(sampling, seed=seed)
    return ChatSession(Engine(model, tok, backend=backend), ChatConfig(sampling=sampling, engine=cfg))


def answers(s: ChatSession, messages) -> list[str]:
    return ["".join(c.text for c in s.send(m)) for m in messages]


MESSAGES = ["hello there", "tell me more about the fox", "and the lazy dog?", "why so?"]


@pytest.mark.parametrize("recent", [None, 48])
def test_seeded_sampled_chat_equals_the_host_loops(model_and_tok, recent):
    """Sampled with a seed (top-k, top-p, a repetition penalty), growing and with evictions:
    the answers of the device loop are the host loop's."""
    model, tok = model_and_tok
    sampling = SamplingConfig(temperature=0.9, top_k=40, top_p=0.9, repetition_penalty=1.2, max_new_tokens=40)
    want = answers(chat(HFBackend(model), model, tok, sampling, recent, seed=5), MESSAGES)
    backend = CompiledBackend(model)
    s = chat(backend, model, tok, sampling, recent, seed=5)
    assert answers(s, MESSAGES) == want
    assert backend.sampler.n_history > 0  # the device loop ran
    if recent:
        assert s.kv.evicted_total > 0


def test_the_next_step_is_launched_before_a_token_is_read_and_taken_back_at_the_end(model_and_tok):
    model, tok = model_and_tok
    backend = CompiledBackend(model)
    events: list[str] = []
    launch, take = backend.launch, backend.sampler.reader.take

    def launching(*args):
        events.append("launch")
        return launch(*args)

    def taking():
        events.append("take")
        return take()

    backend.launch = launching
    backend.sampler.reader.take = taking
    sampling = SamplingConfig(temperature=0.0, repetition_penalty=1.3, max_new_tokens=12)
    s = chat(backend, model, tok, sampling)
    answer = "".join(c.text for c in s.send("hello there"))
    n = s.turns[-1].stats.generated_tokens
    assert n == 12
    # token 1 is read after the step that feeds it was launched; so is every token after it
    assert events == ["launch", "take"] * 12
    s.kv.check()  # the step launched for the last token was cut: the cache holds what it recorded
    assert s.kv.length == len(s.kv.ids) == len(s.kv.seen)
    ref = chat(HFBackend(model), model, tok, sampling)
    assert "".join(c.text for c in ref.send("hello there")) == answer
    assert [layer.length for layer in s.kv.cache.layers] == [ref.kv.length] * len(s.kv.cache.layers)


def test_no_device_read_per_token(model_and_tok, monkeypatch):
    """Over a turn the values read back from tensors (int(), bool(), .item(), .tolist(), an
    index) do not grow with the answer's length on the device loop, but one per token
    on the host loop (which the spy sees, so it can fail)."""
    model, tok = model_and_tok
    reads = {"n": 0}
    allowed: set[int] = set()

    def spy(name):
        real = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            if id(self) not in allowed:
                reads["n"] += 1
            return real(self, *args, **kwargs)

        return read

    def count(backend, n_tokens):
        sampling = SamplingConfig(temperature=0.8, top_k=30, top_p=0.9, repetition_penalty=1.2,
                                  max_new_tokens=n_tokens)  # fmt: skip
        s = chat(backend, model, tok, sampling, seed=3)
        "".join(c.text for c in s.send("hello there"))  # warm-up
        s.reset()
        with monkeypatch.context() as m:
            for name in ("__int__", "__bool__", "__index__", "__float__", "item", "tolist"):
                m.setattr(torch.Tensor, name, spy(name))
            reads["n"] = 0
            "".join(c.text for c in s.send("hello there"))
            assert s.turns[-1].stats.generated_tokens == n_tokens
            return reads["n"]

    compiled = CompiledBackend(model)
    allowed.add(id(compiled.sampler.reader.host))  # the one read, one step late
    assert count(compiled, 40) == count(compiled, 10)
    host = HFBackend(model)
    assert count(host, 40) - count(host, 10) >= 30


def test_a_nan_model_stops_in_one_error(model_and_tok):
    _, tok = model_and_tok
    broken = make_model(len(tok))
    with torch.no_grad():
        broken.lm_head.weight[5].fill_(float("nan"))
    s = chat(CompiledBackend(broken), broken, tok, SamplingConfig(temperature=0.8, max_new_tokens=8))
    with pytest.raises(NonFiniteOutputError, match="NaN or infinite"):
        "".join(c.text for c in s.send("hello there"))
    s.kv.check()


def test_a_second_turn_at_once_reads_on_the_host(model_and_tok):
    """While one turn holds the device sampler (a server's other request), another runs the
    host loop on the same backend, with the same answer."""
    model, tok = model_and_tok
    sampling = SamplingConfig(temperature=0.0, repetition_penalty=1.3, max_new_tokens=16)
    backend = CompiledBackend(model)
    want = answers(chat(backend, model, tok, sampling), MESSAGES[:2])
    with backend.device_sampling() as held:
        assert held is backend.sampler
        with backend.device_sampling() as other:
            assert other is None
        backend.sampler.n_history = -1  # marks that the held sampler is not touched
        assert answers(chat(backend, model, tok, sampling), MESSAGES[:2]) == want
        assert backend.sampler.n_history == -1


def test_the_gpu_shape_bench_runs_every_path_on_a_tiny_shape(tmp_path):
    """`devtools/gpu_shape_bench.py` (scripts/gpu-check's 8B figures) runs each of its paths on
    the CPU: decode figures for eager, compiled (one compile, no break) and generate(), one
    eviction of a block, and a job past the budget skipped with the reason."""
    import json
    import subprocess
    import sys

    out = tmp_path / "shape.json"

    def bench(*args: str) -> list[dict]:
        command = [sys.executable, "-m", "devtools.gpu_shape_bench", "--shape", "tiny", "--device", "cpu"]
        subprocess.run([*command, *args, "--json", str(out)], check=True, capture_output=True)
        return json.loads(out.read_text())["rows"]

    rows = {
        r["setup"]: r
        for r in bench("--tokens", "8", "--jobs", "bf16:compile,bf16:eager,bf16:generate,bf16:eviction")
    }
    assert all("error" not in r for r in rows.values()), rows
    assert all(rows[s]["tok_s"] > 0 for s in ("compile", "eager", "generate"))
    compiled = rows["compile"]
    assert compiled["compiles"] == 1 and compiled["graph_breaks"] == 0 and not compiled["failure"]
    assert rows["eviction"]["tokens_dropped"] == 64 and rows["eviction"]["evict_ms"] > 0
    skipped = bench("--jobs", "bf16:eager", "--budget-s", "-1")
    assert skipped[0]["skipped"].startswith("past the budget")


def test_ctrl_c_then_continue_retry_undo_sampled_equal_the_host_loops(model_and_tok):
    """Sampled and seeded, with evictions: Ctrl-C in the middle of an answer, /continue,
    /retry, /undo and a new message give the host loop's texts (the step run ahead and its
    draw are taken back at the interrupt)."""
    model, tok = model_and_tok
    sampling = SamplingConfig(temperature=0.9, top_k=40, top_p=0.9, repetition_penalty=1.2, max_new_tokens=60)

    def flow(backend) -> list[str]:
        s = chat(backend, model, tok, sampling, recent=48, seed=11)
        out = answers(s, MESSAGES[:1])
        shown = ""
        with pytest.raises(KeyboardInterrupt):
            for i, chunk in enumerate(s.send(MESSAGES[1])):
                shown += chunk.text
                if i == 9:
                    raise KeyboardInterrupt
        out.append(shown)
        out.append("".join(c.text for c in s.continue_answer(sampling)))
        out.append("".join(c.text for c in s.retry()))
        s.undo()
        out += answers(s, MESSAGES[2:3])
        s.kv.check()
        return out

    assert flow(CompiledBackend(model)) == flow(HFBackend(model))
