"""A mixture's experts for a batch of tokens in one native call (`kernels.experts`, llama.cpp's
mul_mat_id, prefill at ``auto``/``exact``/``fast``): each expert's rows read once for all its
tokens, the experts shared out over the threads.

The reference is the one-input product the decode step runs (`kernels.matvec`, the same input
form), expert by expert and token by token: the int8 multi-input Q4_K/Q6_K product must give it
up to float32 rounding; and the prefill of a tiny file through the packed model must follow
transformers' float32 model as the decode step does.
"""

from __future__ import annotations

import pytest
import torch
from helpers import full_logits, needs_kernels
from moe_helpers import decode_logits, one_by_one, routes
from test_moe import PROMPT, files, reference  # noqa: F401  (files: the module's fixture)

pytestmark = [pytest.mark.usefixtures("one_thread"), needs_kernels]


def _experts(path):
    from chatbot.engine.backends.native.packed import PackedExperts
    from chatbot.models.loader import load_model

    loaded = load_model(str(path))
    return loaded, [m for m in loaded.model.modules() if isinstance(m, PackedExperts)]


def _one_by_one(ex, x, ids, w, act):
    """The experts token by token through the one-input product (the decode step's)."""
    from chatbot.engine.backends.native import kernels

    def expert_out(e, xt):
        gate, up, down = ex.expert(e)
        h = torch.nn.functional.silu(kernels.matvec(gate, xt, act=act)) * kernels.matvec(up, xt, act=act)
        return kernels.matvec(down, h, act=act)

    return one_by_one(x, ids, w, expert_out)


def _batch(n_experts, k, n, seed):
    return routes(n_experts, k, n, torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", ["Q4_K_M", "Q8_0", "qwen2moe"])
@pytest.mark.parametrize("threads", [1, 2])
def test_batched_experts_equal_the_one_input_products(files, kind, threads):  # noqa: F811
    """int8 and int16 inputs, 1..12 tokens an expert (the int16 batched product from 6): each
    token's output that of its experts' one-input products, up to float32 rounding (int8: the
    multi-input Q4_K/Q6_K product, or the one-input products themselves) or int16 rounding
    (the batched product rounds per 32 values, the step per 256); a token's int8 result the
    same bits whatever else is in the batch and at any thread count."""
    from chatbot.engine.backends.native import kernels

    _, experts = _experts(files[kind])
    for layer, ex in enumerate(experts):
        k = 2
        n = 6 * ex.num_experts // k + 3  # ~6 tokens an expert, some more, some fewer
        ids, w = _batch(ex.num_experts, k, n, seed=layer)
        x = torch.randn(n, ex.hidden_dim, generator=torch.Generator().manual_seed(layer))
        for act, atol in ((kernels.ACT_Q8, 2e-3), (kernels.ACT_I16, 2e-4)):
            got = kernels.experts(
                (ex.gate, ex.up, ex.down), ex.num_experts, x, ids, w, (act, act, 0), threads
            )
            assert got is not None
            want = _one_by_one(ex, x, ids, w, act)
            scale = float(want.abs().max())
            torch.testing.assert_close(got, want, rtol=0, atol=atol * scale)
            if act == kernels.ACT_Q8:
                one = [
                    kernels.experts((ex.gate, ex.up, ex.down), ex.num_experts, x[t : t + 1], ids[t : t + 1],
                                    w[t : t + 1], (act, act, 0), 1)
                    for t in range(0, n, 7)
                ]  # fmt: skip
                assert torch.equal(torch.cat(one), got[::7])


def test_bad_expert_ids_are_refused(files):  # noqa: F811
    from chatbot.engine.backends.native import kernels

    _, experts = _experts(files["Q4_K_M"])
    ex = experts[0]
    x = torch.randn(3, ex.hidden_dim)
    ids, w = _batch(ex.num_experts, 2, 3, seed=0)
    ids[1, 0] = ex.num_experts
    assert kernels.experts((ex.gate, ex.up, ex.down), ex.num_experts, x, ids, w, (1, 1, 0), 1) is None


@pytest.mark.parametrize(("kind", "level", "atol"), [("Q4_K_M", "auto", 0.2), ("Q4_K_M", "exact", 2e-3),
                                                     ("qwen2moe", "auto", 0.2)])  # fmt: skip
def test_prefill_follows_the_reference(files, kind, level, atol):  # noqa: F811
    """A prompt's logits through the decoder's prefill model (the experts in one native call
    per layer: int8 inputs at ``auto``, int16 at ``exact``) within the decode step's distance
    of transformers' float32 model."""
    from chatbot.engine.backends.native.decoder import FastDecoder
    from chatbot.engine.backends.native.packed import PackedExperts

    loaded, _ = _experts(files[kind])
    dec = FastDecoder(loaded.model, level)
    forms = {(m.act_gate_up, m.act_down) for m in dec.prefill_model.modules() if isinstance(m, PackedExperts)}
    assert forms == ({(1, 1)} if level == "auto" else {(2, 2)})
    ids = loaded.tokenizer(PROMPT)["input_ids"]
    got = full_logits(dec.prefill_model, ids)
    want = full_logits(reference(files[kind]), ids)
    torch.testing.assert_close(got, want, rtol=0, atol=atol)


@pytest.mark.parametrize("kind", ["Q4_K_M", "qwen2moe"])
def test_decode_on_two_threads_equals_one(files, kind):  # noqa: F811
    """The decode step's experts shared out whole over two threads (one barrier a layer) give
    the one-thread step's logits bit for bit."""
    loaded, _ = _experts(files[kind])
    ids = loaded.tokenizer(PROMPT)["input_ids"][:12]
    assert torch.equal(decode_logits(loaded.model, ids, 1), decode_logits(loaded.model, ids, 2))
