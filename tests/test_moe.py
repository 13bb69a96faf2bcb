"""Mixtures of experts (qwen3moe and qwen2moe GGUF files) run as stored: the experts' 3-D tensors on the
file's memory map, in the packed model (prefill, `--opt off`) and in the native kernels (decode).

The reference is transformers' own GGUF load of the same file, every tensor dequantized by the
`gguf` package, with the experts' width passed through (transformers' reader misses it); the
tiny files are written as llama.cpp's converter writes qwen3moe (`devtools.gguf_synthetic`).
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
from helpers import full_logits, needs_kernels

from devtools.gguf_synthetic import SHAPES, write_synthetic_gguf

CHATBOT = str(Path(sys.executable).with_name("chatbot"))
PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs far away into the dark woods."
SHAPE = SHAPES["qwen3moe"]["tiny"]
# float32 against float32 (prefill: the same weights through torch's GEMM, ~1e-6 measured)
ATOL = 1e-4

pytestmark = [pytest.mark.usefixtures("one_thread"), needs_kernels]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("moe")
    made = {}
    for kind in ("Q4_K_M", "Q8_0"):
        made[kind] = folder / f"qwen3moe-{kind}.gguf"
        write_synthetic_gguf(made[kind], "qwen3moe", SHAPE, kind, seed=5)
    made["qwen2moe"] = folder / "qwen2moe-Q4_K_M.gguf"
    write_synthetic_gguf(made["qwen2moe"], "qwen2moe", SHAPES["qwen2moe"]["tiny"], "Q4_K_M", seed=6)
    return made


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def reference(path: Path):
    """transformers' own float32 model of the file, told the experts' width."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    reader = GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()
    config.moe_intermediate_size = int(reader.fields[f"{arch}.expert_feed_forward_length"].contents())
    if arch == "qwen2moe":
        key = "qwen2moe.expert_shared_feed_forward_length"
        config.shared_expert_intermediate_size = int(reader.fields[key].contents())
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, config=config, dtype=torch.float32
    )
    return model.eval()


def test_file_has_llama_cpps_qwen3moe_layout(files):
    """Tensor names are those gguf-py lists for qwen3moe; the experts are 3-D; the router is
    float32; the metadata holds the experts' count, use and width."""
    reader = GGUFReader(str(files["Q4_K_M"]))
    names = {t.name for t in reader.tensors}
    known = {TENSOR_NAMES[t] for t in MODEL_TENSORS[MODEL_ARCH.QWEN3MOE]}
    assert {n.removesuffix(".weight").replace("blk.0.", "blk.{bid}.").replace("blk.1.", "blk.{bid}.")
            for n in names} <= known  # fmt: skip
    exps = {t.name: t for t in reader.tensors if t.name.endswith("_exps.weight")}
    assert len(exps) == 3 * SHAPE.layers
    assert [int(n) for n in exps["blk.0.ffn_gate_exps.weight"].shape] == [SHAPE.hidden, SHAPE.expert_ffn, 8]
    assert [int(n) for n in exps["blk.0.ffn_down_exps.weight"].shape] == [SHAPE.expert_ffn, SHAPE.hidden, 8]
    router = next(t for t in reader.tensors if t.name == "blk.0.ffn_gate_inp.weight")
    assert router.tensor_type.name == "F32"
    sizes = [int(reader.fields[f"qwen3moe.{key}"].contents()) for key in
             ("expert_count", "expert_used_count", "expert_feed_forward_length")]  # fmt: skip
    assert sizes == [8, 2, 256]


@pytest.mark.parametrize("kind", ["Q4_K_M", "Q8_0", "qwen2moe"])
def test_packed_model_equals_transformers(files, kind):
    """Loaded as stored (the experts a `PackedExperts` over the file's map, no float copy):
    the logits of a prompt equal transformers' dequantized float32 model's."""
    from chatbot.engine.backends.native.packed import PackedExperts
    from chatbot.models.loader import load_model

    loaded = load_model(str(files[kind]))
    experts = [m for m in loaded.model.modules() if isinstance(m, PackedExperts)]
    assert len(experts) == SHAPE.layers
    # the experts' bytes are the file's pages, not a copy
    mapped = np.memmap(files[kind], dtype=np.uint8, mode="r")
    assert all(e.gate.data.untyped_storage().nbytes() < mapped.nbytes for e in experts)
    floats = sum(p.numel() for p in loaded.model.parameters())  # norms, routers, biases
    assert floats < 0.01 * SHAPE.params()
    ids = loaded.tokenizer(PROMPT)["input_ids"]
    ref = reference(files[kind])
    torch.testing.assert_close(full_logits(loaded.model, ids), full_logits(ref, ids), rtol=0, atol=ATOL)


@pytest.mark.parametrize(
    ("file", "level", "atol"),
    [("Q4_K_M", "exact", 2e-3), ("Q4_K_M", "auto", 0.2), ("Q4_K_M", "fast", 0.2), ("qwen2moe", "exact", 2e-3),
     ("qwen2moe", "auto", 0.2)],
)  # fmt: skip
def test_native_decode_follows_the_reference(files, file, level, atol):
    """The kernels' decode step, token by token from an empty cache, against the reference's
    logits at each position: within int16 rounding at `exact` (the experts' inputs are int16
    per block), within int8 rounding at `auto`/`fast` (so the top token is the same wherever
    the reference's top two are further apart than twice that). qwen2moe: with its
    shared expert (wider than the routed ones) and q/k/v biases."""
    from chatbot.engine.backends.native.decoder import FastDecoder
    from chatbot.models.loader import load_model

    loaded = load_model(str(files[file]))
    ids = loaded.tokenizer(PROMPT)["input_ids"]
    want = full_logits(reference(files[file]), ids)
    dec = FastDecoder(loaded.model, level)
    info = dec.info()
    assert info.experts == (8, 2, 256)
    assert "8 experts of 256, 2 per token" in info.label()
    cache = dec.new_cache()
    got = [dec.prefill_rows(cache, ids[:1])] + [dec.decode(cache, t) for t in ids[1:]]
    torch.testing.assert_close(torch.stack(got), want, rtol=0, atol=atol)


def test_batched_calls_equal_one_by_one(files):
    """`prefill_rows` and `decode_batch` (which a mixture runs one row at a time) give what
    `decode` gives, bit for bit."""
    from chatbot.engine.backends.native.decoder import FastDecoder
    from chatbot.models.loader import load_model

    loaded = load_model(str(files["Q4_K_M"]))
    ids = loaded.tokenizer(PROMPT)["input_ids"][:9]
    dec = FastDecoder(loaded.model, "auto")
    one = dec.new_cache()
    steps = [dec.decode(one, t) if i else dec.prefill_rows(one, [t]) for i, t in enumerate(ids)]
    rows = dec.new_cache()
    assert torch.equal(dec.prefill_rows(rows, ids[:5]), steps[4])
    other = dec.new_cache()
    dec.prefill_rows(other, ids[:4])
    both = dec.decode_batch([rows, other], [ids[5], ids[4]])
    assert torch.equal(both[0], steps[5]) and torch.equal(both[1], steps[4])


def test_decode_reads_only_the_chosen_experts(files, tmp_path):
    """A token's step reads its chosen experts' rows and no other: with every expert the
    router does not choose for the first token made garbage (NaN scales) in a copy of the
    file, that token's logits are the same bit for bit; with one chosen expert damaged, they change."""
    from chatbot.engine.backends.native.decoder import FastDecoder
    from chatbot.models.loader import load_model

    src = files["Q8_0"]
    token = 1000
    ref = reference(src)
    chosen = []  # per layer, the experts the router picks for `token` at position 0
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda _m, _i, out: chosen.append(set(out[2][0].tolist())))
        for layer in ref.model.layers
    ]
    with torch.no_grad():
        ref(torch.tensor([[token]]))
    for h in hooks:
        h.remove()
    assert len(chosen) == SHAPE.layers and all(len(c) == SHAPE.experts_used for c in chosen)

    def damaged(experts_of_layer):
        def nan_scales(blocks: np.ndarray, layer: int) -> np.ndarray:
            out = blocks.copy().reshape(SHAPE.experts, -1, 34)  # Q8_0 blocks: fp16 d, then 32 int8
            for e in experts_of_layer(layer):
                out[e, :, 0:2] = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)
            return out.reshape(blocks.shape)

        edits = {
            f"blk.{i}.ffn_{part}_exps.weight": (lambda a, i=i: nan_scales(a, i))
            for i in range(SHAPE.layers)
            for part in ("gate", "up", "down")
        }
        return edits

    def first_logits(path: Path) -> torch.Tensor:
        dec = FastDecoder(load_model(str(path)).model, "exact")
        return dec.prefill_rows(dec.new_cache(), [token])

    clean = first_logits(src)
    idle = tmp_path / "idle.gguf"
    rewrite_gguf(src, idle, tensor_data=damaged(lambda i: set(range(SHAPE.experts)) - chosen[i]))
    assert torch.equal(first_logits(idle), clean)
    busy = tmp_path / "busy.gguf"
    rewrite_gguf(src, busy, tensor_data=damaged(lambda i: {min(chosen[i])} if i == 0 else set()))
    assert not torch.equal(first_logits(busy), clean)


def test_greedy_text_exact_equals_off(files):
    """`chatbot run` on the file: the native kernels' greedy answer (`--opt exact`) is the
    float32 transformers forward's (`--opt off`), word for word."""
    out = {}
    for level in ("off", "exact"):
        run = subprocess.run(
            [CHATBOT, "run", "--model", str(files["Q8_0"]), PROMPT, "--greedy", "--max-new-tokens", "24",
             "--opt", level, "--no-stats"],
            check=False, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert run.returncode == 0, run.stderr
        out[level] = run.stdout
    assert out["exact"].strip() and out["exact"] == out["off"]


@pytest.mark.parametrize(
    ("values", "keep", "message"),
    [
        ({"qwen3moe.expert_used_count": 0}, None, "expert_used_count is 0, which is out of range"),
        ({"qwen3moe.expert_used_count": 9}, None, "9 experts per token (qwen3moe.expert_used_count) of 8"),
        ({"qwen3moe.expert_count": 4, "qwen3moe.expert_used_count": 2}, None,
         "blk.0.ffn_gate_inp.weight is 256x8, the metadata's sizes give 256x4"),
        ({"qwen3moe.expert_feed_forward_length": 128}, None,
         "blk.0.ffn_gate_exps.weight is 256x256x8, the metadata's sizes give 256x128x8"),
        ({}, lambda name: name != "blk.1.ffn_up_exps.weight", "no blk.1.ffn_up_exps.weight"),
    ],
)  # fmt: skip
def test_damaged_expert_metadata_is_refused_in_one_line(files, tmp_path, values, keep, message):
    """Metadata that disagrees with the experts' tensors: `chatbot run` refuses the file in one
    line naming what is wrong, exit 2 (a model that cannot load), no answer."""
    bad = tmp_path / "bad.gguf"
    rewrite_gguf(files["Q8_0"], bad, values=values, keep_tensor=keep or (lambda name: True))
    run = subprocess.run(
        [CHATBOT, "run", "--model", str(bad), "Hi", "--max-new-tokens", "4"],
        check=False, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 2 and run.stdout == ""
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], run.stderr


@pytest.mark.parametrize("file", ["Q8_0", "qwen2moe"])
def test_llama_cpp_reads_the_mixture_the_same_way(files, file):
    """llama.cpp (a bench tool, when installed) runs the same file to about the same logits
    (its products take 8-bit activations: near, not equal) and the same top tokens: it routes
    the tokens to the same experts, with the same weights, as we do."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from chatbot.engine.backends.native.decoder import FastDecoder
    from chatbot.models.loader import load_model

    path = files[file]
    loaded = load_model(str(path))
    ids = loaded.tokenizer(PROMPT)["input_ids"]
    llm = llama_cpp.Llama(str(path), n_ctx=128, n_threads=1, verbose=False, logits_all=True)
    assert llm.tokenize(PROMPT.encode(), add_bos=False) == ids
    llm.eval(ids)
    theirs = torch.tensor(np.array(llm.scores[: len(ids)]), dtype=torch.float32)
    dec = FastDecoder(loaded.model, "fast")  # int8 inputs, as llama.cpp's
    cache = dec.new_cache()
    ours = torch.stack([dec.prefill_rows(cache, ids[:1])] + [dec.decode(cache, t) for t in ids[1:]])
    assert float((theirs - ours).abs().max()) < 0.1 * float(ours.abs().max())
    assert float((theirs.argmax(-1) == ours.argmax(-1)).float().mean()) > 0.9


def test_a_mixture_chats_in_the_sink_window(files):
    """`--enable-streaming` on a mixture: a prompt past the window is answered, the stats
    line showing the sink cache full and tokens evicted, as on a dense model."""
    prompt = "The quick brown fox jumps over the lazy dog. " * 6
    run = subprocess.run(
        [CHATBOT, "run", "--model", str(files["qwen2moe"]), prompt, "--enable-streaming", "--start-size", "4",
         "--recent-size", "24", "--max-new-tokens", "40", "--greedy"],
        check=False, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip()
    stats = run.stdout + run.stderr
    assert "cache 28/28" in stats and "4 sinks" in stats and "evicted" in stats


def test_doctor_names_the_experts_and_the_bytes_a_token_reads(files):
    """`chatbot doctor --model F` says the file decodes natively, its experts and how many a
    token uses, and the megabytes one token reads (less than the whole file's matrices)."""
    run = subprocess.run(
        [CHATBOT, "doctor", "--model", str(files["Q4_K_M"])],
        check=False, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    line = next(x for x in run.stdout.splitlines() if x.startswith("decode:"))
    assert line.startswith("decode: native") and "8 experts of 256, 2 per token: " in line
    total = float(re.search(r"matrices[^,]*, ([\d,]+) MB", line)[1].replace(",", ""))
    read = float(re.search(r"2 per token: ([\d,]+) MB read per token", line)[1].replace(",", ""))
    assert 0 < read < total
