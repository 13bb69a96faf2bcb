"""gpt-oss GGUF files (llama.cpp's ``gpt-oss``) run as stored: MXFP4 experts with biases on the
file's map, attention sinks, a sliding window on every other layer, YaRN rope.

The reference is a float32 forward pass written in torch from the model's definition
(`gpt_oss_reference`; transformers' own GGUF reader cannot load llama.cpp's gpt-oss files),
itself checked against llama.cpp where llama-cpp-python is installed. The tiny file's window
(16) is shorter than the test prompt, so the window layers are crossed.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.constants import MODEL_ARCH, MODEL_TENSORS, TENSOR_NAMES
from gguf_edit import rewrite_gguf
from gpt_oss_reference import GptOssReference
from helpers import full_logits, needs_kernels
from moe_helpers import decode_logits, one_by_one, routes

from devtools.gguf_synthetic import SHAPES, write_synthetic_gguf

CHATBOT = str(Path(sys.executable).with_name("chatbot"))
PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs far away into the dark woods."
SHAPE = SHAPES["gpt-oss"]["tiny"]
ATOL = 1e-4  # float32 against float32 (the packed model: ~2e-6 measured)

pytestmark = [pytest.mark.usefixtures("one_thread"), needs_kernels]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gptoss")
    made = {}
    for kind in ("Q8_0", "Q4_K_M"):
        made[kind] = folder / f"gpt-oss-{kind}.gguf"
        write_synthetic_gguf(made[kind], "gpt-oss", SHAPE, kind, seed=3)
    return made


@pytest.fixture(scope="module")
def references(files):
    return {kind: GptOssReference(path) for kind, path in files.items()}


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def test_file_has_llama_cpps_gpt_oss_layout(files):
    """Tensor names are those gguf-py lists for gpt-oss (with their biases); the experts are
    3-D MXFP4; the sinks one float per head; the metadata holds the window and YaRN."""
    reader = GGUFReader(str(files["Q4_K_M"]))
    names = {re.sub(r"blk\.\d+\.", "blk.{bid}.", t.name).rsplit(".", 1)[0] for t in reader.tensors}
    assert names == {TENSOR_NAMES[t] for t in MODEL_TENSORS[MODEL_ARCH.GPT_OSS]}
    tensors = {t.name: t for t in reader.tensors}
    assert tensors["blk.0.ffn_gate_exps.weight"].tensor_type.name == "MXFP4"
    down = tensors["blk.0.ffn_down_exps.weight"]
    assert [int(n) for n in down.shape] == [SHAPE.expert_ffn, SHAPE.hidden, 8]
    assert [int(n) for n in tensors["blk.0.ffn_gate_exps.bias"].shape] == [SHAPE.expert_ffn, 8]
    assert [int(n) for n in tensors["blk.1.attn_sinks.weight"].shape] == [SHAPE.heads]
    assert {"attn_q.bias", "attn_output.bias", "ffn_gate_inp.bias", "ffn_down_exps.bias"} <= {
        n.split(".", 2)[2] for n in tensors if n.startswith("blk.0.")
    }
    keys = ("attention.sliding_window", "rope.scaling.type", "expert_count", "expert_used_count")
    meta = {k: reader.fields[f"gpt-oss.{k}"].contents() for k in keys}
    assert meta == dict(zip(keys, (16, "yarn", 8, 2), strict=True))


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K_M"])
def test_packed_model_equals_the_reference(files, references, kind):
    """Loaded as stored (the MXFP4 experts a module over the file's map, no float copy): the
    logits of a prompt longer than the window equal the reference's."""
    from chatbot.gguf.gpt_oss import PackedOaiExperts
    from chatbot.models.loader import load_model

    loaded = load_model(str(files[kind]))
    experts = [m for m in loaded.model.modules() if isinstance(m, PackedOaiExperts)]
    assert len(experts) == SHAPE.layers and experts[0].gate.format_name == "mxfp4"
    windows = [layer.self_attn.sliding_window for layer in loaded.model.model.layers]
    assert windows == [16, None]
    ids = loaded.tokenizer(PROMPT)["input_ids"]
    assert len(ids) > 16
    torch.testing.assert_close(
        full_logits(loaded.model, ids), references[kind].logits(ids), rtol=0, atol=ATOL
    )


@pytest.mark.parametrize(("kind", "level", "atol"), [("Q8_0", "exact", 2e-3), ("Q4_K_M", "exact", 2e-3),
                                                     ("Q4_K_M", "auto", 0.2)])  # fmt: skip
def test_native_decode_follows_the_reference(files, references, kind, level, atol):
    """The kernels' decode step, token by token, against the reference at each position:
    within int16 rounding at `exact`, int8 rounding at `auto`; the top token the same where
    the reference's top two are further apart than that."""
    from chatbot.engine.backends.native.decoder import FastDecoder
    from chatbot.models.loader import load_model

    loaded = load_model(str(files[kind]))
    ids = loaded.tokenizer(PROMPT)["input_ids"]
    want = references[kind].logits(ids)
    dec = FastDecoder(loaded.model, level)
    info = dec.info()
    assert info.experts == (8, 2, 256) and "mxfp4" in info.label()
    cache = dec.new_cache()
    got = torch.stack([dec.prefill_rows(cache, ids[:1])] + [dec.decode(cache, t) for t in ids[1:]])
    torch.testing.assert_close(got, want, rtol=0, atol=atol)
    top2 = want.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 2 * atol
    assert bool(clear.any())
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


def _one_by_one(ex, x, ids, w, act):
    """gpt-oss's experts token by token through the one-input products (the decode step's),
    with their biases and the clamped SwiGLU, as the step's loop adds them."""
    from chatbot.engine.backends.native import kernels
    from chatbot.gguf.gpt_oss import SWIGLU_ALPHA, SWIGLU_LIMIT

    def expert_out(e, xt):
        gate, up, down = ex.expert(e)
        g = (kernels.matvec(gate, xt, act=act) + ex.gate_bias[e]).clamp(max=SWIGLU_LIMIT)
        u = (kernels.matvec(up, xt, act=act) + ex.up_bias[e]).clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT)
        h = g * torch.sigmoid(SWIGLU_ALPHA * g) * (u + 1)
        return kernels.matvec(down, h, act=act) + ex.down_bias[e]

    return one_by_one(x, ids, w, expert_out)


@pytest.mark.parametrize("threads", [1, 2])
def test_experts_in_one_call_equal_the_one_input_products(files, threads):
    """The MXFP4 experts of a batch in one native call (`kernels.experts`, with the experts'
    biases and the clamped SwiGLU): each token's output that of its experts' one-input
    products with int16 and int8 inputs, up to float32 rounding (int16 from 16 tokens an
    expert: the batched product's rounding per 32 values, as the step's; below, the
    multi-input MXFP4 product, the step's bits)."""
    from chatbot.engine.backends.native import kernels
    from chatbot.gguf.gpt_oss import PackedOaiExperts
    from chatbot.models.loader import load_model

    loaded = load_model(str(files["Q8_0"]))
    experts = [m for m in loaded.model.modules() if isinstance(m, PackedOaiExperts)]
    assert experts
    for layer, ex in enumerate(experts):
        g = torch.Generator().manual_seed(layer)
        n, k = 16 * ex.num_experts // 2 + 3, 2  # ~16 tokens an expert, some more, some fewer
        ids, w = routes(ex.num_experts, k, n, g)
        x = 2 * torch.randn(n, ex.hidden_dim, generator=g)  # the clamps are reached
        mats, biases = (ex.gate, ex.up, ex.down), (ex.gate_up_bias, ex.down_bias)
        counts = torch.bincount(ids.reshape(-1), minlength=ex.num_experts)
        few = [t for t in range(n) if bool((counts[ids[t]] < 16).all())]  # all its experts under 16
        assert few
        for act in (kernels.ACT_I16, kernels.ACT_Q8):
            acts = (act, act, kernels.ACT_FN_SWIGLU_OAI)
            got = kernels.experts(mats, ex.num_experts, x, ids, w, acts, threads, biases)
            assert got is not None
            want = _one_by_one(ex, x, ids, w, act)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * float(want.abs().max()))
            one = [
                kernels.experts(
                    mats, ex.num_experts, x[t : t + 1], ids[t : t + 1], w[t : t + 1], acts, 1, biases
                )
                for t in few
            ]  # the multi-input MXFP4 product: the step's bits, whatever else is in the batch
            assert torch.equal(torch.cat(one), got[few])
            no_bias = kernels.experts(mats, ex.num_experts, x, ids, w, acts, threads)
            assert no_bias is not None and float((no_bias - got).abs().max()) > 1e-2


@pytest.mark.parametrize(("kind", "level", "atol"), [("Q8_0", "exact", 2e-3), ("Q4_K_M", "auto", 0.2)])
def test_prefill_follows_the_reference(files, references, kind, level, atol):
    """A prompt's logits through the decoder's prefill model (the experts in one native call a
    layer, int16 inputs) within the decode step's distance of the float32 reference."""
    from chatbot.engine.backends.native.decoder import FastDecoder
    from chatbot.models.loader import load_model

    loaded = load_model(str(files[kind]))
    ids = loaded.tokenizer(PROMPT)["input_ids"]
    dec = FastDecoder(loaded.model, level)
    got = full_logits(dec.prefill_model, ids)
    torch.testing.assert_close(got, references[kind].logits(ids), rtol=0, atol=atol)


def test_decode_on_two_threads_equals_one(files):
    """The decode step's experts shared out whole over two threads (their biases and the
    clamped SwiGLU in each thread's share) give the one-thread step's logits bit for bit."""
    from chatbot.models.loader import load_model

    loaded = load_model(str(files["Q8_0"]))
    ids = loaded.tokenizer(PROMPT)["input_ids"][:12]
    assert torch.equal(decode_logits(loaded.model, ids, 1), decode_logits(loaded.model, ids, 2))


def test_sinks_and_window_matter(files, references, tmp_path):
    """The test would see a missing sink or window: with the sinks at -1e4 (no share) the
    reference's logits move, and our decode follows them there too."""
    from chatbot.engine.backends.native.decoder import FastDecoder
    from chatbot.models.loader import load_model

    src = files["Q8_0"]
    flat = tmp_path / "no-sinks.gguf"
    edits = {f"blk.{i}.attn_sinks.weight": (lambda a: np.full_like(a, -1e4)) for i in range(SHAPE.layers)}
    rewrite_gguf(src, flat, tensor_data=edits)
    loaded = load_model(str(flat))
    ids = loaded.tokenizer(PROMPT)["input_ids"]
    want = GptOssReference(flat).logits(ids)
    assert float((want - references["Q8_0"].logits(ids)).abs().max()) > 0.05
    dec = FastDecoder(loaded.model, "exact")
    cache = dec.new_cache()
    got = torch.stack([dec.prefill_rows(cache, ids[:1])] + [dec.decode(cache, t) for t in ids[1:]])
    torch.testing.assert_close(got, want, rtol=0, atol=2e-3)


@pytest.mark.parametrize("threads", [1, 2])
def test_greedy_text_exact_equals_off(files, threads):
    """`chatbot run` on the file: the kernels' greedy answer (`--opt exact`: the prompt's experts
    in one native call, the decode step's split over the threads at 2) is the float32 packed
    model's (`--opt off`), word for word."""
    out = {}
    for level in ("off", "exact"):
        run = subprocess.run(
            [CHATBOT, "run", "--model", str(files["Q8_0"]), PROMPT, "--greedy", "--max-new-tokens", "24",
             "--opt", level, "--no-stats", "--threads", str(threads)],
            check=False, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert run.returncode == 0, run.stderr
        out[level] = run.stdout
    assert out["exact"].strip() and out["exact"] == out["off"]


def test_llama_cpp_reads_the_file_the_same_way(files):
    """llama.cpp (when installed) runs the same file to about the same logits (8-bit
    activations: near, not equal) and the same greedy tokens up to near ties."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from chatbot.engine.backends.native.decoder import FastDecoder
    from chatbot.models.loader import load_model

    path = files["Q8_0"]
    loaded = load_model(str(path))
    ids = loaded.tokenizer(PROMPT)["input_ids"]
    llm = llama_cpp.Llama(str(path), n_ctx=128, n_threads=1, verbose=False, logits_all=True)
    assert llm.tokenize(PROMPT.encode(), add_bos=False) == ids
    llm.eval(ids)
    theirs = torch.tensor(np.array(llm.scores[: len(ids)]), dtype=torch.float32)
    dec = FastDecoder(loaded.model, "fast")
    cache = dec.new_cache()
    ours = torch.stack([dec.prefill_rows(cache, ids[:1])] + [dec.decode(cache, t) for t in ids[1:]])
    assert float((theirs - ours).abs().max()) < 0.1
    top2 = ours.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 0.1
    assert torch.equal(theirs.argmax(-1)[clear], ours.argmax(-1)[clear])


@pytest.mark.parametrize(
    ("values", "keep", "message"),
    [
        ({"gpt-oss.expert_used_count": 9}, None, "9 experts per token (gpt-oss.expert_used_count) of 8"),
        ({"gpt-oss.attention.head_count": 8, "gpt-oss.attention.head_count_kv": 4}, None,
         "blk.0.attn_q.weight is 256x256, the metadata's sizes give 256x512"),
        ({"gpt-oss.expert_feed_forward_length": 128}, None,
         "blk.0.ffn_gate_exps.weight is 256x256x8, the metadata's sizes give 256x128x8"),
        ({}, lambda name: name != "blk.1.attn_sinks.weight", "no blk.1.attn_sinks.weight"),
        ({}, lambda name: name != "blk.0.ffn_down_exps.bias", "no blk.0.ffn_down_exps.bias"),
    ],
)  # fmt: skip
def test_damaged_metadata_is_refused_in_one_line(files, tmp_path, values, keep, message):
    """Metadata that disagrees with the tensors, or a tensor missing: `chatbot run` refuses
    the file in one line naming what is wrong, exit 2, no answer."""
    bad = tmp_path / "bad.gguf"
    rewrite_gguf(files["Q8_0"], bad, values=values, keep_tensor=keep or (lambda name: True))
    run = subprocess.run(
        [CHATBOT, "run", "--model", str(bad), "Hi", "--max-new-tokens", "4"],
        check=False, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 2 and run.stdout == ""
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], run.stderr


def test_doctor_says_native_and_the_experts(files):
    """`chatbot doctor --model F`: native, the MXFP4 experts, how many a token uses, and the
    megabytes one token reads."""
    run = subprocess.run(
        [CHATBOT, "doctor", "--model", str(files["Q4_K_M"])],
        check=False, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    line = next(x for x in run.stdout.splitlines() if x.startswith("decode:"))
    assert line.startswith("decode: native") and "mxfp4" in line, line
    assert "8 experts of 256, 2 per token: " in line and "MB read per token" in line
