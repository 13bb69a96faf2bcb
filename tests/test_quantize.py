"""--quantize 4bit|8bit through bitsandbytes: what runs on this machine, tiny models in
both modes, one-line refusals for what does not, and the real default model (slow)."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_one_line_error, make_model, make_tokenizer

from chatbot.config import ChatConfig, EngineConfig, SamplingConfig
from chatbot.conversation.session import ChatSession
from chatbot.engine.generate import Engine
from chatbot.errors import ModelLoadError
from chatbot.models import quantize
from chatbot.models.loader import load_model
from chatbot.models.quantize import bnb_version, check_quantization, compute_dtype, describe_quantization

needs_bnb = pytest.mark.skipif(bnb_version() is None, reason="bitsandbytes is not installed")
CPU = torch.device("cpu")
LAYER = {"4bit": "Linear4bit", "8bit": "Linear8bitLt"}


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    tok = make_tokenizer()
    folder = tmp_path_factory.mktemp("tiny")
    make_model(len(tok)).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@needs_bnb
@pytest.mark.parametrize(
    "mode, dtype", [("4bit", torch.float32), ("4bit", torch.bfloat16), ("8bit", torch.float32)]
)
def test_both_modes_run_on_this_cpu(mode, dtype):
    check_quantization(mode, CPU, dtype)  # raises if the kernels are missing


def test_auto_compute_dtype():
    assert compute_dtype("4bit", "auto", CPU) == torch.float32  # CPU: float32 prefills faster
    assert compute_dtype("8bit", "auto", CPU) == torch.float32
    assert compute_dtype("4bit", "bfloat16", CPU) == torch.bfloat16  # an explicit --dtype wins
    assert compute_dtype("8bit", "auto", torch.device("mps")) == torch.float16


@needs_bnb
@pytest.mark.parametrize("mode", ["4bit", "8bit"])
def test_tiny_model_quantized(mode, tiny_folder):
    """Every linear layer of the decoder is quantized, the output stays close to the
    float model's, and a two-turn chat runs on both caches."""
    loaded = load_model(str(tiny_folder), device="cpu", quantize=mode)
    layers = [m for m in loaded.model.modules() if type(m).__name__ == LAYER[mode]]
    assert len(layers) == 2 * 7  # q, k, v, o, gate, up, down in each of the 2 layers
    assert loaded.describe()["quantization"] == (
        "bitsandbytes 4-bit nf4 (compute float32, double quant)"
        if mode == "4bit"
        else "bitsandbytes 8-bit (LLM.int8)"
    )
    assert loaded.num_parameters == sum(p.numel() for p in make_model(400).parameters())
    reference = make_model(400)
    x = torch.tensor([[5, 60, 70, 80, 90, 100, 120, 7]])
    with torch.no_grad():
        got, want = loaded.model(x).logits.float(), reference(x).logits
    assert torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.99
    for engine in (EngineConfig(), EngineConfig(enable_streaming=True, recent_size=16)):
        session = ChatSession(
            Engine(loaded.model, loaded.tokenizer),
            ChatConfig(sampling=SamplingConfig(temperature=0, max_new_tokens=6), engine=engine),
        )
        for text in ("Hello there, how are you today?", "The quick brown fox jumps."):
            assert list(session.send(text))[-1].finish_reason in ("stop", "length")
        assert loaded.tokenizer.decode(session.all_ids) == session.rendered


def test_unsupported_combination_is_one_line(capsys, tiny_folder, monkeypatch):
    monkeypatch.setattr(quantize, "bnb_version", lambda: "0.42.0")
    monkeypatch.setattr(quantize, "_probe", lambda mode, device, dtype: "NotImplementedError: no cpu kernel")
    line = assert_one_line_error(
        capsys, "run", "--model", str(tiny_folder), "--quantize", "4bit", "--device", "cpu"
    )
    assert line == (
        "chatbot: error: 4bit quantization does not run on cpu with bitsandbytes 0.42.0 "
        "(NotImplementedError: no cpu kernel); it needs CUDA, or drop --quantize"
    )


def test_probe_failure_is_caught(monkeypatch):
    """A kernel that raises inside bitsandbytes becomes the reason, not a traceback."""
    if bnb_version() is None:
        pytest.skip("bitsandbytes is not installed")
    import bitsandbytes as bnb

    def broken(*args, **kwargs):
        raise NotImplementedError("no kernel for this device")

    monkeypatch.setattr(bnb.nn, "Linear8bitLt", broken)
    monkeypatch.setattr(quantize, "_probed", {})
    with pytest.raises(
        ModelLoadError, match=r"8bit quantization does not run on cpu .*\(no kernel for this device\)"
    ):
        check_quantization("8bit", CPU, torch.float32)


def test_missing_bitsandbytes_is_one_line(capsys, tiny_folder, monkeypatch):
    monkeypatch.setattr(quantize, "bnb_version", lambda: None)
    line = assert_one_line_error(capsys, "run", "--model", str(tiny_folder), "--quantize", "8bit")
    assert "--quantize 8bit needs bitsandbytes: pip install 'bitsandbytes>=" in line
    assert "chatbot[" not in line  # PyPI's chatbot is another project


def test_unknown_mode_is_one_line(capsys, tiny_folder):
    line = assert_one_line_error(capsys, "run", "--model", str(tiny_folder), "--quantize", "3bit")
    assert line == "chatbot: error: unknown --quantize '3bit': use 4bit or 8bit"


def test_describe_quantization():
    from types import SimpleNamespace as NS

    assert describe_quantization(NS()) == "none"
    assert describe_quantization(NS(quantization_config={"quant_method": "gptq", "bits": 4})) == "gptq 4-bit"
    assert describe_quantization(NS(quantization_config={"quant_method": "awq"})) == "awq"
    assert (
        describe_quantization(
            NS(
                quantization_config={
                    "quant_method": "bitsandbytes",
                    "load_in_4bit": True,
                    "bnb_4bit_quant_type": "nf4",
                    "bnb_4bit_compute_dtype": "bfloat16",
                    "bnb_4bit_use_double_quant": True,
                }
            )
        )
        == "bitsandbytes 4-bit nf4 (compute bfloat16, double quant)"
    )


@needs_bnb
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["4bit", "8bit"])
def test_default_model_quantized_still_answers(mode):
    """SmolLM2-135M in 4-bit NF4 and 8-bit LLM.int8 on this CPU: the greedy answer to an
    easy question is still right."""
    loaded = load_model(None, device="cpu", quantize=mode)
    assert loaded.quantization.startswith(f"bitsandbytes {mode[0]}-bit")
    session = ChatSession(
        Engine(loaded.model, loaded.tokenizer),
        ChatConfig(sampling=SamplingConfig(temperature=0, max_new_tokens=12)),
    )
    answer = "".join(c.text for c in session.send("What is the capital of France?"))
    assert "Paris" in answer


@needs_bnb
@pytest.mark.slow  # six CLI processes
@pytest.mark.parametrize(
    "flags", [["--quantize", "4bit"], ["--quantize", "8bit"], ["--max-memory", "cpu=300KB"]]
)
def test_cli_default_decode_path_matches_transformers(flags, tiny_folder, tmp_path):
    """Through the CLI with its default decode path, a quantized or offloaded model answers
    as with `--opt off` (plain transformers). Run in a subprocess: a native crash must not
    take the test session down."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "XDG_DATA_HOME": str(tmp_path / "data")}
    answers = []
    for opt in ("off", "auto"):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "chatbot.cli.app",
                "run",
                "--model",
                str(tiny_folder),
                "--device",
                "cpu",
                "--greedy",
                "--max-new-tokens",
                "8",
                "--opt",
                opt,
                *flags,
            ],
            input="Hello there\n",
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
            check=False,
        )
        assert proc.returncode == 0, (opt, proc.returncode, proc.stderr[-500:])
        answers.append(proc.stdout)
    assert answers[0] == answers[1]
