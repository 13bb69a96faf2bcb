"""Non-finite numbers never become an answer: a K-quant file with NaN block scales in a middle
layer ends the answer with one line naming the cause and the check (exit 1 on a pipe), and
`chatbot doctor --check-model` names the tensor and the block; a GGUF file whose metadata lies
is refused at load in one line (exit 2). Each file is a small synthetic K-quant model with
its bytes or metadata changed."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_edit import rewrite_gguf
from helpers import make_model, make_tokenizer

from chatbot.config import SamplingConfig
from chatbot.engine.finite import checked_token, sampled_token
from chatbot.engine.generate import Engine
from chatbot.errors import NonFiniteOutputError
from chatbot.gguf.metadata import InconsistentMetadata, check_metadata
from chatbot.gguf.table import read_tensor_table
from chatbot.models.tensor_scan import scan_gguf
from devtools.gguf_synthetic import SHAPES, write_synthetic_gguf

NAN16 = np.array([0x7E00], dtype="<u2").view(np.uint8)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """Good tiny files: llama Q4_K_M (Q4_K and Q6_K matrices), llama Q5_K_M, qwen2 Q4_K_M."""
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for name, arch, kind in (
        ("llama", "llama", "Q4_K_M"),
        ("q5", "llama", "Q5_K_M"),
        ("qwen2", "qwen2", "Q4_K_M"),
    ):
        out[name] = root / f"{name}.gguf"
        write_synthetic_gguf(out[name], arch, SHAPES[arch]["tiny"], kind, seed=1)
    return out


def _nan_scales(good: Path, dst: Path, tensor: str, field: str) -> str:
    """Copy `good` with every block of `tensor` given a NaN `field` ("d" or "dmin"); returns its type."""
    from chatbot.engine.backends.native.gguf_weights import BLOCK_SCALES

    shutil.copy(good, dst)
    info = next(t for t in read_tensor_table(dst)[1] if t.name == tensor)
    block_bytes, offsets = BLOCK_SCALES[info.type_name]
    at = offsets[0] if field == "d" else offsets[1]
    mm = np.memmap(dst, dtype=np.uint8, mode="r+")
    blocks = mm[info.offset : info.offset + info.nbytes].reshape(-1, block_bytes)
    blocks[:, at : at + 2] = NAN16
    mm.flush()
    del mm
    return info.type_name


def _env(tmp: Path) -> dict[str, str]:
    return {**os.environ, "XDG_CACHE_HOME": str(tmp / "cache"), "XDG_DATA_HOME": str(tmp / "data")}


def _cli(tmp: Path, *args: str, stdin: str = "hello\n") -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "chatbot.cli", *args], input=stdin, capture_output=True, text=True,
        env=_env(tmp), timeout=120, check=False,
    )  # fmt: skip
    return result, time.perf_counter() - start


def _error_lines(result: subprocess.CompletedProcess[str]) -> list[str]:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert "Traceback" not in result.stderr, result.stderr
    assert 1 <= len(lines) <= 2, result.stderr
    return lines


# -- the decode loop's check ----------------------------------------------------------------


def test_checked_token_reads_the_token_and_refuses_a_nonfinite_logit():
    logits = torch.tensor([0.0, 3.0, 1.0])
    assert checked_token(logits, logits.argmax()) == 1
    for bad in (math.nan, math.inf, -math.inf):
        damaged = logits.clone()
        damaged[2] = bad
        with pytest.raises(NonFiniteOutputError, match="doctor --check-model"):
            checked_token(damaged, damaged.argmax() if bad != -math.inf else torch.tensor(2))
    with pytest.raises(NonFiniteOutputError):
        sampled_token(torch.full((3,), math.nan), torch.full((1, 3), math.nan), None)


@pytest.mark.parametrize("greedy", [True, False])
def test_nan_weights_end_the_answer_in_the_engine(greedy):
    """A tiny random Llama with one middle weight NaN: every logit is NaN; `generate` raises
    instead of yielding token 0 over and over (what argmax picks from NaN)."""
    tok = make_tokenizer()
    model = make_model(len(tok))
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = math.nan
    engine = Engine(model, tok)
    sampling = SamplingConfig(temperature=0.0 if greedy else 0.7, max_new_tokens=8)
    with pytest.raises(NonFiniteOutputError):
        list(engine.generate(engine.new_cache(), tok("hello")["input_ids"], sampling))


@pytest.mark.parametrize(
    "tensor,field,file",
    [("blk.1.ffn_gate.weight", "d", "llama"), ("blk.1.attn_q.weight", "dmin", "llama"),
     ("blk.1.ffn_down.weight", "d", "llama"), ("blk.1.ffn_gate.weight", "d", "q5")],
)  # fmt: skip
def test_nan_block_scales_in_a_middle_layer(files, tmp_path, tensor, field, file):
    """Q4_K d, Q4_K dmin, Q6_K d, Q5_K d of every block of one blk.1 matrix: the chat ends
    with one line naming the cause and the check, exit 1 (before: `<|endoftext|>` repeated,
    exit 0); the scan names the tensor and the first block."""
    bad = tmp_path / "bad.gguf"
    kind = _nan_scales(files[file], bad, tensor, field)
    assert kind == {"llama": {"blk.1.ffn_down.weight": "Q6_K"}, "q5": {}}[file].get(tensor, kind)
    result = scan_gguf(bad)
    assert result.bad is not None and repr(tensor) in result.bad and f"{field} of block 0 " in result.bad
    chat, seconds = _cli(tmp_path, "run", "--model", str(bad), "--temperature", "0", "--max-new-tokens", "40")
    lines = _error_lines(chat)
    assert chat.returncode == 1 and seconds < 60
    assert "NaN or infinite" in lines[-1] and f"doctor --check-model {bad}" in lines[-1]
    assert "<|endoftext|>" not in chat.stdout


def test_doctor_check_model_names_the_tensor_and_passes_a_good_file(files, tmp_path):
    bad = tmp_path / "bad.gguf"
    _nan_scales(files["llama"], bad, "blk.1.ffn_up.weight", "d")
    result, seconds = _cli(tmp_path, "doctor", "--check-model", str(bad), stdin="")
    (line,) = _error_lines(result)
    assert result.returncode == 2 and seconds < 60
    assert "'blk.1.ffn_up.weight' (Q4_K)" in line and "block 0 of" in line
    result, _ = _cli(tmp_path, "doctor", "--check-model", str(files["llama"]), stdin="")
    assert result.returncode == 0, result.stderr
    assert "20 tensors" in result.stdout and "no NaN or infinity" in result.stdout


# -- metadata that lies --------------------------------------------------------------------


def _keep_layers(n: int):
    return lambda name: not name.startswith("blk.") or int(name.split(".")[1]) < n


LIES = {
    "block_count 1, two layers": ("llama", {"values": {"llama.block_count": 1}}, "holds blk.1"),
    "block_count 3, layer 2 missing": ("llama", {"values": {"llama.block_count": 3}}, "no tensors of blk.2"),
    "llama over qwen2 keys": ("qwen2", {"arch": "llama"}, "qwen2.block_count is not of its architecture"),
    "llama over qwen2 biases": (
        "qwen2", {"arch": "llama", "rename": lambda k: k.replace("qwen2.", "llama.")},
        "bias, which a llama layer does not use"),
    "token_type of 100": ("llama", {"values": {"tokenizer.ggml.token_type": [1] * 100}}, "100 entries"),
    "rope base NaN": ("llama", {"values": {"llama.rope.freq_base": math.nan}}, "freq_base is nan"),
    "rms epsilon -1": ("llama", {"values": {"llama.attention.layer_norm_rms_epsilon": -1.0}}, "is -1"),
    "embedding length": ("llama", {"values": {"llama.embedding_length": 128}}, "the metadata's sizes"),
    "eos outside the vocabulary": ("llama", {"values": {"tokenizer.ggml.eos_token_id": 60000}}, "60000"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(LIES))
def test_metadata_that_lies_is_named(files, tmp_path, case):
    source, edit, words = LIES[case]
    lying = tmp_path / "lying.gguf"
    rewrite_gguf(files[source], lying, **edit)
    with pytest.raises(InconsistentMetadata, match=words.replace(".", r"\.")):
        check_metadata(lying)


def test_good_files_pass_the_metadata_check(files):
    from chatbot.models.source import default_gguf_path

    for path in (*files.values(), default_gguf_path()):
        check_metadata(path)


@pytest.mark.parametrize("case", ["block_count 1, two layers", "llama over qwen2 biases", "rope base NaN"])
def test_a_lying_file_is_refused_at_load_in_one_line(files, tmp_path, case):
    source, edit, words = LIES[case]
    lying = tmp_path / "lying.gguf"
    rewrite_gguf(files[source], lying, **edit)
    result, seconds = _cli(tmp_path, "run", "--model", str(lying))
    (line,) = _error_lines(result)
    assert result.returncode == 2 and seconds < 60 and result.stdout.strip() == ""
    assert line.startswith(f"chatbot: error: cannot use GGUF file {lying}: ") and words in line
