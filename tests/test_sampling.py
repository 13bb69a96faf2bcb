"""Sampling: our logits processors (each, and the chain the engine builds) against
transformers' processors of the same role, the fused top-k/top-p filter against transformers'
two warpers in a row."""

from __future__ import annotations

import pytest
import torch
from transformers.generation import logits_process as hf
from transformers.generation.logits_process import LogitsProcessorList, TopKLogitsWarper, TopPLogitsWarper

from chatbot.config import SamplingConfig
from chatbot.engine import sampling as ours
from chatbot.engine.sampling import TopKTopPLogitsWarper, build_logits_processor


def _random_scores(trial):
    g = torch.Generator().manual_seed(1000 + trial)
    scores = torch.randn(2, 3000, generator=g) * (0.3 + 10 * float(torch.rand(1, generator=g)))
    if trial % 5 == 0:
        scores[:, :200] = scores[:, :1]  # ties
    ids = torch.randint(0, 3000, (2, 40), generator=g)
    return g, scores, ids


def test_each_processor_computes_what_transformers_processor_computes():
    for trial in range(40):
        g, scores, ids = _random_scores(trial)
        t = 0.05 + 3 * float(torch.rand(1, generator=g))
        k = int(torch.randint(1, 3500, (1,), generator=g))  # past the vocabulary too
        p = float(torch.rand(1, generator=g))
        pairs = [
            (ours.TemperatureLogitsWarper(t), hf.TemperatureLogitsWarper(t)),
            (ours.TopKLogitsWarper(k), hf.TopKLogitsWarper(k)),
            (ours.TopPLogitsWarper(p), hf.TopPLogitsWarper(p)),
            (ours.TopPLogitsWarper(p, min_tokens_to_keep=5), hf.TopPLogitsWarper(p, min_tokens_to_keep=5)),
        ]
        for mine, theirs in pairs:
            assert torch.equal(mine(ids, scores), theirs(ids, scores)), (type(mine).__name__, t, k, p)


def test_the_built_chain_computes_what_transformers_chain_computes():
    """Penalty over the whole context, temperature, top-k, top-p: the chain `build_logits_processor`
    makes against transformers' processors in the same order (top-k with top-p fused on our
    side, equal to the last bit where no cumulative probability sits at the threshold)."""
    for trial in range(40):
        g, scores, ids = _random_scores(trial)
        penalty = 1.0 + float(torch.rand(1, generator=g))
        t = 0.1 + 2 * float(torch.rand(1, generator=g))
        k = int(torch.randint(0, 500, (1,), generator=g))
        p = 0.05 + float(torch.rand(1, generator=g))  # >= 1 in some trials: no top-p
        sampling = SamplingConfig(
            temperature=t, top_k=k, top_p=min(p, 1.0), repetition_penalty=penalty, repeat_last_n=-1
        )
        theirs = hf.LogitsProcessorList(
            [hf.RepetitionPenaltyLogitsProcessor(penalty), hf.TemperatureLogitsWarper(t)]
        )
        if k > 0:
            theirs.append(hf.TopKLogitsWarper(k))
        if p < 1.0:
            theirs.append(hf.TopPLogitsWarper(p))
        got, want = build_logits_processor(sampling)(ids, scores), theirs(ids, scores)
        assert torch.equal(torch.isinf(got), torch.isinf(want)), trial
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_fused_top_k_top_p_keeps_what_transformers_keeps():
    for trial in range(60):
        g = torch.Generator().manual_seed(trial)
        scores = torch.randn(2, 5000, generator=g) * (0.5 + 8 * float(torch.rand(1, generator=g)))
        if trial % 6 == 0:
            scores[:, :300] = scores[:, :1]  # ties at the k-th score
        k = int(torch.randint(1, 400, (1,), generator=g))
        p = 0.01 + 0.98 * float(torch.rand(1, generator=g))
        chain = LogitsProcessorList([TopKLogitsWarper(k), TopPLogitsWarper(p)])
        assert torch.equal(TopKTopPLogitsWarper(k, p)(None, scores), chain(None, scores)), (k, p)


def test_engine_sampling_uses_the_fused_filter():
    names = [type(p) for p in build_logits_processor(SamplingConfig(temperature=0.7, top_k=50, top_p=0.9))]
    assert TopKTopPLogitsWarper in names and len(names) == 3  # penalty, temperature, fused


def _penalised(scores, ids, penalty):
    """The repetition penalty computed directly: each id's score divided by the penalty when
    above 0, multiplied when below."""
    out = scores.clone()
    for i in ids:
        v = float(out[0, i])
        out[0, i] = v * penalty if v < 0 else v / penalty
    return out


def test_repetition_penalty_covers_only_the_last_n_ids_and_never_special_ones():
    from chatbot.engine.backends.device_sampling import DeviceSampler
    from chatbot.engine.sampling import WindowedRepetitionPenalty

    torch.manual_seed(0)
    scores = torch.randn(1, 40)
    context = [3, 7, 7, 9, 1, 12, 4, 9, 30, 2]  # 1 and 2: the template's special ids
    special = {1, 2}
    for last_n, covered in ((4, {4, 9, 30}), (-1, {3, 7, 9, 12, 4, 30}), (1, set()), (0, set())):
        sampling = SamplingConfig(temperature=0.0, repetition_penalty=1.3, repeat_last_n=last_n)
        got = build_logits_processor(sampling, special)(torch.tensor([context]), scores)
        torch.testing.assert_close(got, _penalised(scores, covered, 1.3))
        device = DeviceSampler(torch.device("cpu"))
        device.begin(sampling, context, 40, None, special=special)
        place, size = device.window.tolist()  # an id is covered where it last stood in the window
        seen = (device.last >= 0) & (device.last >= place - size)
        assert set(torch.nonzero(seen).flatten().tolist()) == covered, last_n
    # the whole context, special ids included, as transformers' own processor
    whole = WindowedRepetitionPenalty(1.3, -1)(torch.tensor([context]), scores)
    torch.testing.assert_close(whole, _penalised(scores, set(context), 1.3))


def test_repeat_last_n_is_a_setting_of_set_presets_and_requests(tmp_path):
    from chatbot.conversation.remote_backend import request_fields
    from chatbot.models.presets import parse_preset
    from chatbot.server.protocol import ChatRequest, sampling_of
    from chatbot.terminal.commands import parse_command

    assert SamplingConfig().repeat_last_n == 64
    assert parse_command("/set repeat_last_n 0").values == {"repeat_last_n": 0}
    assert parse_command("/set last_n -1").values == {"repeat_last_n": -1}
    preset = parse_preset({"sampling": {"repeat_last_n": 128}})
    assert preset.config.sampling.repeat_last_n == 128
    body = ChatRequest(model="m", messages=[{"role": "user", "content": "hi"}], repeat_last_n=32)
    assert sampling_of(body, SamplingConfig(), None).repeat_last_n == 32
    sent = request_fields(SamplingConfig().with_value("repeat_last_n", 16))
    assert sent["extra_body"]["repeat_last_n"] == 16 and "repeat_last_n" not in sent


@pytest.mark.parametrize(
    ("effort", "think"), [("none", "off"), ("minimal", "low"), ("low", "low"), ("high", "high"), (None, None)]
)
def test_openais_reasoning_efforts_are_taken(effort, think):
    """OpenAI's `reasoning_effort` values `none` and `minimal` (which its client sends) are
    taken as off and low; a value no template knows is a 400 that names the field."""
    from chatbot.config import SamplingConfig
    from chatbot.server.protocol import APIError, ChatRequest, sampling_of

    body = ChatRequest(model="m", messages=[{"role": "user", "content": "hi"}], reasoning_effort=effort)
    assert sampling_of(body, SamplingConfig(), None).think == think
    with pytest.raises(APIError, match="reasoning_effort must be one of none, minimal"):
        sampling_of(
            ChatRequest(model="m", messages=body.messages, reasoning_effort="huge"), SamplingConfig(), None
        )
