"""Speculative decoding with a draft model (`--draft MODEL`, `chatbot.engine.draft_model`): the
greedy answer is token for token the plain one, whatever the draft model guesses (the target
itself: every guess kept; another model: most rejected); the draft's cache follows the chat
across turns, /undo and a bounded window; a draft model that does not pay is hardly run; a
tokenizer of another vocabulary is refused."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import make_model, make_tokenizer

from chatbot.config import ChatConfig, EngineConfig, SamplingConfig
from chatbot.conversation.session import ChatSession
from chatbot.engine import draft_model, speculative
from chatbot.engine.draft_model import DraftModel, ModelDrafter, VocabularyMismatch, check_vocabulary
from chatbot.engine.generate import Engine

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=40)
DRAFTING = dataclasses.replace(GREEDY, draft="model", draft_tokens=4)


@pytest.fixture
def cheap_drafts(monkeypatch):
    """Drafts priced by a fixed table (cheap: a draft always pays), not by this machine's
    timings, so that drafts run whatever the load."""
    monkeypatch.setattr(speculative, "PRIOR_FIXED", 0.5)
    monkeypatch.setattr(speculative, "PRIOR_ROW", 0.1)
    monkeypatch.setattr(draft_model, "PRIOR_DRAFT", 0.01)
    monkeypatch.setattr(speculative.DraftPolicy, "step_took", lambda self, seconds: None)
    monkeypatch.setattr(speculative.DraftPolicy, "pass_took", lambda self, rows, seconds: None)
    monkeypatch.setattr(draft_model.ModelDraftPolicy, "drafted", lambda self, tokens, seconds: None)


@pytest.fixture(scope="module")
def target(tiny_tokenizer):
    """A tiny model whose greedy answers wander (transformers' plain init, a sharper head)."""
    model = make_model(len(tiny_tokenizer), sharp=False)
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)
    return model


def _engine(model, tokenizer, draft=None) -> Engine:
    engine = Engine(model, tokenizer)
    if draft is not None:
        engine.draft_model = DraftModel(Engine(draft, tokenizer))
    return engine


def _run(engine: Engine, prompt: list[int], sampling: SamplingConfig, kv=None):
    kv = kv if kv is not None else engine.new_cache()
    tokens: list[int] = []
    stats = None
    for chunk in engine.generate(kv, prompt, sampling):
        tokens.extend(chunk.token_ids)
        stats = chunk.stats or stats
    return tokens, stats, kv


PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12] * 3, list(range(20, 60)), [7, 30, 31, 9, 12, 44, 3]]


@pytest.mark.usefixtures("cheap_drafts")
def test_greedy_answer_is_the_plain_one_with_any_draft_model(target, tiny_tokenizer):
    plain_engine = _engine(target, tiny_tokenizer)
    other = make_model(len(tiny_tokenizer), sharp=False, seed=7)
    for draft, all_kept in ((target, True), (other, False)):
        engine = _engine(target, tiny_tokenizer, draft)
        drafted = kept = 0
        for prompt in PROMPTS:
            plain, _, plain_kv = _run(plain_engine, prompt, GREEDY)
            tokens, stats, kv = _run(engine, prompt, DRAFTING)
            assert tokens == plain, prompt
            assert kv.ids == plain_kv.ids
            kv.check()
            drafted += stats.draft_tokens
            kept += stats.draft_accepted
        assert drafted > 0
        assert (kept == drafted) if all_kept else (kept < drafted)


@pytest.mark.usefixtures("cheap_drafts")
def test_the_draft_cache_follows_the_chat_across_turns_and_undo(target, tiny_tokenizer):
    engine = _engine(target, tiny_tokenizer, target)
    plain = ChatSession(_engine(target, tiny_tokenizer), ChatConfig(sampling=GREEDY, engine=EngineConfig()))
    chat = ChatSession(engine, ChatConfig(sampling=DRAFTING, engine=EngineConfig()))
    fed: list[int] = []
    draft = engine.draft_model
    original = draft.engine.prefill

    def counting(kv, ids, *args, **kwargs):
        fed.append(len(ids))
        return original(kv, ids, *args, **kwargs)

    draft.engine.prefill = counting
    for text in ("abc abc abc abc", "say it again: abc abc abc abc", "and once more"):
        answers = ["".join(c.text for c in s.send(text)) for s in (chat, plain)]
        assert answers[0] == answers[1]
        assert chat.all_ids == plain.all_ids
    # each turn fed the draft model what it lacked: never the whole conversation again
    assert sum(fed) < 2 * len(chat.all_ids)
    chat.undo()
    plain.undo()
    assert "".join(c.text for c in chat.retry()) == "".join(c.text for c in plain.retry())
    assert chat.all_ids == plain.all_ids and chat.cache_ids == plain.cache_ids


@pytest.mark.usefixtures("cheap_drafts")
def test_a_bounded_chat_keeps_the_draft_bounded_too(target, tiny_tokenizer):
    engine = _engine(target, tiny_tokenizer, target)
    sampling = dataclasses.replace(DRAFTING, max_new_tokens=120)
    plain_engine = _engine(target, tiny_tokenizer)
    plain, _, plain_kv = _run(plain_engine, PROMPTS[0], sampling, kv=plain_engine.new_cache(4, 28))
    tokens, stats, kv = _run(engine, PROMPTS[0], sampling, kv=engine.new_cache(4, 28))
    assert tokens == plain and stats.draft_accepted > 0
    assert kv.ids == plain_kv.ids and kv.evicted_total == plain_kv.evicted_total > 0
    draft_kv = engine.draft_model.kv
    assert draft_kv.is_bounded and draft_kv.length <= 4 + 28


def test_a_draft_model_that_does_not_pay_is_hardly_run(target, tiny_tokenizer, monkeypatch):
    """Priced at a full target step a token and never right, the draft model guesses only a
    token per probe, the probes ever further apart."""
    monkeypatch.setattr(draft_model.ModelDraftPolicy, "drafting", lambda self, tokens: 1.0 * tokens)
    engine = _engine(target, tiny_tokenizer, make_model(len(tiny_tokenizer), sharp=False, seed=7))
    guesses: list[int] = []
    fed: list[int] = []
    original, prefill = DraftModel.guess, engine.draft_model.engine.prefill

    def counting(self, kv, context, n, vocab, tail=None):
        guesses.append(n)
        return original(self, kv, context, n, vocab, tail)

    def feeding(kv, ids, *args, **kwargs):
        fed.append(len(ids))
        return prefill(kv, ids, *args, **kwargs)

    monkeypatch.setattr(DraftModel, "guess", counting)
    engine.draft_model.engine.prefill = feeding
    sampling = dataclasses.replace(GREEDY, draft="model", max_new_tokens=300)
    plain, _, _ = _run(
        _engine(target, tiny_tokenizer), PROMPTS[1], dataclasses.replace(sampling, draft="off")
    )
    tokens, stats, _ = _run(engine, PROMPTS[1], sampling)
    assert tokens == plain
    assert stats.draft_tokens == 0  # no pass ran
    assert set(guesses) == {1} and len(guesses) <= 300 // draft_model.PROBE_FIRST
    # each probe fed the draft model at most its last PROBE_TAIL tokens, not all it had missed
    assert fed and max(fed) <= draft_model.PROBE_TAIL


def test_probes_resume_drafting_when_the_guesses_come_right(target, tiny_tokenizer):
    """A drafter that declined (a poor acceptance) probes, and once its probes are kept the
    policy finds drafts worth a pass again."""
    draft = DraftModel(Engine(target, tiny_tokenizer))
    kv = Engine(target, tiny_tokenizer).new_cache()
    drafter = ModelDrafter(draft, kv, [5, 6, 7], max_tokens=4, vocab=target.config.vocab_size)
    drafter.policy.kept, drafter.policy.lost = 0.01, 5.0  # it was wrong for a long while
    proposals = []
    for _ in range(400):
        proposals.append(drafter.propose(4))
        guess = drafter.shadow[0] if drafter.shadow else 3
        drafter.extend([guess])  # the model would have chosen the probe's guess
    assert any(proposals[-50:])  # drafting again


def test_a_tokenizer_of_another_vocabulary_is_refused():
    tokenizer = make_tokenizer()
    check_vocabulary(tokenizer, make_tokenizer())

    class Other:
        def __init__(self, vocab):
            self.vocab = vocab

        def get_vocab(self):
            return self.vocab

    vocab = tokenizer.get_vocab()
    with pytest.raises(VocabularyMismatch, match="tokens"):
        check_vocabulary(tokenizer, Other({**vocab, "<extra>": len(vocab)}))
    swapped = dict(vocab)
    a, b = sorted(vocab)[5:7]
    swapped[a], swapped[b] = vocab[b], vocab[a]
    with pytest.raises(VocabularyMismatch, match="another id"):
        check_vocabulary(tokenizer, Other(swapped))


def _cli(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    chatbot = str(Path(sys.executable).with_name("chatbot"))
    return subprocess.run(
        [chatbot, "run", *args], input=stdin, capture_output=True, text=True, timeout=600, check=False
    )


@pytest.mark.slow
def test_run_with_a_draft_model_answers_as_without_one():
    """`chatbot run --draft FILE` (the default model guessing for itself, greedy: its guesses
    are the answer's tokens) answers the plain run's text, in a one-shot and in a piped chat,
    where `/set draft off` and back work and the stats line shows the share kept."""
    from chatbot.models.loader import default_gguf_path

    gguf = str(default_gguf_path())
    ask = "Repeat this sentence: the quick brown fox jumps over the lazy dog."
    common = ["--greedy", "--repetition-penalty", "1", "--max-new-tokens", "24", "--threads", "1"]
    plain = _cli(*common, ask)
    drafted = _cli(*common, "--draft", gguf, ask)
    assert plain.returncode == drafted.returncode == 0, drafted.stderr
    assert drafted.stdout == plain.stdout and plain.stdout.strip()
    assert "draft model: SmolLM2-135M-Instruct" in drafted.stderr
    chat = _cli(*common, "--draft", gguf, stdin=f"{ask}\n/set draft off\n{ask}\n/set draft model\n{ask}\n")
    assert chat.returncode == 0, chat.stderr
    answers = [line for line in chat.stdout.splitlines() if line.strip()]
    assert answers[0] == plain.stdout.strip()
    assert len(answers) >= 3


@pytest.mark.slow
def test_bad_draft_models_are_refused_in_one_line(tmp_path):
    none = tmp_path / "none.gguf"
    missing = _cli("--draft", str(none), "Hi")
    assert missing.returncode == 2
    said = f"chatbot: error: --draft {none}: no such file or folder: {none}"
    assert missing.stderr.strip().splitlines() == [said]
    chat = _cli("--max-new-tokens", "4", stdin="/set draft model\nHi\n")
    assert chat.returncode == 0, chat.stderr
    assert "draft model: none is loaded" in chat.stderr and chat.stdout.strip()  # the chat went on


def test_serve_with_a_draft_model_answers_as_without_one(tmp_path):
    """`chatbot serve --draft FOLDER` (the model guessing for itself): requests answered with
    the draft model, by default and when they ask for it, give the plain server's answers, and
    one that turns drafting off too; the official `openai` client. A server with no draft
    model refuses a request for one (400 naming the field), not answering it plainly."""
    from openai import BadRequestError, OpenAI
    from serve_helpers import running_server, save_tiny_model

    folder = str(save_tiny_model(tmp_path / "tiny"))
    messages = [{"role": "user", "content": "Say hello and count: one two three one two three"}]

    def ask(url: str, **extra: object) -> str:
        client = OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
        reply = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=24, temperature=0, extra_body=extra or None
        )
        return reply.choices[0].message.content or ""

    serve = ("--model", folder, "--served-model-name", "tiny")
    with running_server(*serve, log=tmp_path / "plain.log") as url:
        plain = ask(url)
        with pytest.raises(BadRequestError, match="no draft model") as refused:
            ask(url, draft="model")
        assert refused.value.status_code == 400 and "--draft FILE" in str(refused.value)
    log = tmp_path / "draft.log"
    with running_server(*serve, "--draft", folder, log=log) as url:
        answers = [ask(url), ask(url, draft="model"), ask(url, draft="off"), ask(url, draft="ngram")]
    assert answers == [plain] * 4 and plain
    assert "draft model: tiny" in log.read_text()


def test_bench_decode_runs_a_draft_set_up_beside_the_plain_one(tmp_path):
    """`chatbot bench decode --setups chatbot-off,chatbot-off-draft --draft FOLDER`: the draft
    set-up decodes the same tokens and reports its drafts; without --draft it says what it
    needs."""
    from serve_helpers import save_tiny_model

    from chatbot.measure.bench_decode import run_decode_bench

    folder = str(save_tiny_model(tmp_path / "tiny"))
    common = {"model": folder, "threads": 1, "rounds": 1, "decode_tokens": 12, "prefill_sizes": (50,)}
    out = run_decode_bench(["chatbot-off", "chatbot-off-draft"], draft_model=folder, task="repeat", **common)
    plain, drafted = out["results"]
    assert "error" not in drafted and "error" not in plain, (plain, drafted)
    assert drafted["name"] == "chatbot-off-draft" and "draft_tokens" in drafted
    assert out["settings"]["draft_model"] == folder
    alone = run_decode_bench(["chatbot-off-draft"], **common)["results"][0]
    assert alone["error"] == "a -draft set-up needs a draft model: --draft FILE"
