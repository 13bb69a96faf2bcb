"""eval_ppl on a tiny random Llama, checked against independent references: one full
forward pass for "dense", recomputation for the window set-ups."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch
import torch.nn.functional as F
from helpers import make_model
from transformers import LlamaForCausalLM

from chatbot.errors import ConfigError
from chatbot.measure.eval_ppl import SETUPS, format_table, run_eval_ppl, run_eval_ppl_ids, write_plot


def random_ids(n: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return make_model(sharp=False)


def test_dense_equals_one_full_forward_pass(model):
    ids = random_ids(40)
    result = run_eval_ppl_ids(model, ids, setups=("dense",))
    with torch.no_grad():
        logits = model(input_ids=ids[None]).logits[0]
    nll = F.cross_entropy(logits[:-1], ids[1:], reduction="none")
    assert len(result["dense"]["nll"]) == 39
    assert torch.allclose(torch.tensor(result["dense"]["nll"]), nll, atol=1e-5)
    assert math.isclose(result["dense"]["ppl"], math.exp(nll.mean().item()), rel_tol=1e-5)
    assert result["dense"]["tokens_per_s"] > 0
    assert result["dense"]["wall_s"] > 0


def test_all_setups_equal_dense_before_the_window_fills(model):
    ids = random_ids(20)  # 19 steps, window of 4 + 16 = 20 never overflows
    result = run_eval_ppl_ids(model, ids, start_size=4, recent_size=16)
    assert list(result) == list(SETUPS)
    dense = torch.tensor(result["dense"]["nll"])
    for setup in ("window", "sinks", "recompute"):
        assert torch.allclose(torch.tensor(result[setup]["nll"]), dense, atol=1e-5), setup


def test_after_the_window_fills_the_setups_part_ways(model):
    ids = random_ids(60)
    result = run_eval_ppl_ids(model, ids, start_size=4, recent_size=12)
    dense = torch.tensor(result["dense"]["nll"])
    sinks = torch.tensor(result["sinks"]["nll"])
    window = torch.tensor(result["window"]["nll"])
    # identical while the 16-token window holds everything (15 steps), different after
    assert torch.allclose(sinks[:15], dense[:15], atol=1e-5)
    assert not torch.allclose(sinks[15:], dense[15:], atol=1e-4)
    assert not torch.allclose(sinks[15:], window[15:], atol=1e-4)
    assert result["sinks"]["cache_tokens"] == 16
    assert result["window"]["cache_tokens"] == 16
    assert result["dense"]["cache_tokens"] == 59


def test_one_layer_window_equals_recompute_everywhere():
    # With one layer a cached key depends only on its token and position, so a re-rotated
    # sliding window must equal re-encoding the window from scratch at every step.
    model = make_model(layers=1, sharp=False)
    ids = random_ids(50)
    result = run_eval_ppl_ids(model, ids, start_size=2, recent_size=10, setups=("window", "recompute"))
    window = torch.tensor(result["window"]["nll"])
    recompute = torch.tensor(result["recompute"]["nll"])
    assert torch.allclose(window, recompute, atol=1e-5)


def test_two_layer_window_differs_from_recompute_after_the_window_fills(model):
    ids = random_ids(40)
    result = run_eval_ppl_ids(model, ids, start_size=2, recent_size=10, setups=("window", "recompute"))
    window = torch.tensor(result["window"]["nll"])
    recompute = torch.tensor(result["recompute"]["nll"])
    assert torch.allclose(window[:11], recompute[:11], atol=1e-5)
    assert not torch.allclose(window[11:], recompute[11:], atol=1e-4)


def test_progress_is_reported(model):
    calls: list[tuple[str, int, int]] = []
    run_eval_ppl_ids(model, random_ids(6), setups=("sinks", "dense"), progress=lambda *a: calls.append(a))
    assert calls[0] == ("sinks", 1, 5)
    assert calls[-1] == ("dense", 5, 5)
    assert len(calls) == 10


def test_run_eval_ppl_tokenizes_and_truncates(model):
    class Tokenizer:
        def __call__(self, text, return_tensors=None):
            class Encoding:
                input_ids = torch.tensor([[ord(c) % 128 for c in text]])

            return Encoding()

    result = run_eval_ppl(model, Tokenizer(), "hello streaming world", num_tokens=10, setups=("dense",))
    assert len(result["dense"]["nll"]) == 9


def test_bad_arguments(model):
    with pytest.raises(ConfigError, match="at least 2 tokens"):
        run_eval_ppl_ids(model, [5])
    with pytest.raises(ConfigError, match="unknown eval set-up"):
        run_eval_ppl_ids(model, [5, 6, 7], setups=("dense", "bogus"))


def test_table_and_plot(model, tmp_path):
    result = run_eval_ppl_ids(model, random_ids(30), start_size=2, recent_size=8)
    table = format_table(result)
    for setup in SETUPS:
        assert setup in table
    assert f"{result['sinks']['ppl']:.3f}" in table
    path = write_plot(result, tmp_path / "out" / "ppl.png")
    assert path.exists()
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 5000


# -- the command, where matplotlib is missing ----------------------------------------------------


@pytest.fixture
def tiny_dir(tmp_path_factory, tiny_model, tiny_tokenizer):
    path = tmp_path_factory.mktemp("tiny-model")
    tiny_model.save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


def test_without_matplotlib_the_table_and_json_are_kept_and_the_plot_is_one_line(
    capsys, monkeypatch, tiny_dir, tmp_path
):
    """The run's work is never lost to a missing plotting library: the table and the JSON
    come out, then one line saying how to get the plot; `--plot` asked by name is refused
    before the run."""
    from helpers import cli

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # any import of it fails
    monkeypatch.chdir(tmp_path)
    args = ["eval-ppl", "--model", str(tiny_dir), "--tokens", "12", "--setups", "dense", "--threads", "1"]
    code, out, err = cli(capsys, *args, "--json", str(tmp_path / "ppl.json"))
    assert code == 0, err
    assert "dense" in out and json.loads((tmp_path / "ppl.json").read_text())["dense"]["ppl"] > 0
    notes = [line for line in err.splitlines() if line.strip()]
    assert notes == [f"no plot: matplotlib is not installed: {sys.executable} -m pip install matplotlib"]
    assert not list(tmp_path.glob("*.png"))

    code, out, err = cli(capsys, *args, "--plot", str(tmp_path / "ppl.png"))
    assert code == 2 and out == "", out
    missing = f"matplotlib is not installed: {sys.executable} -m pip install matplotlib"
    assert err.strip() == f"chatbot: error: --plot: {missing}"
