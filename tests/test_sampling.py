"""Sampling: the fused top-k/top-p filter against transformers' two warpers in a row, and
the engine's logits processors."""

from __future__ import annotations

import torch
from transformers.generation.logits_process import LogitsProcessorList, TopKLogitsWarper, TopPLogitsWarper

from chatbot.config import SamplingConfig
from chatbot.engine.sampling import TopKTopPLogitsWarper, build_logits_processor


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
