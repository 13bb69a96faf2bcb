"""`chatbot bench decode` from the command line: the parent's rounds, medians and JSON (with
the worker faked), and `--also turns` on a tiny model."""

from __future__ import annotations

import json

from helpers import assert_one_line_error, cli, make_model

from chatbot.cli.app import main
from chatbot.measure import bench_decode


def test_bench_decode_rows_and_json(monkeypatch, tmp_path, capsys):
    """The parent side of `chatbot bench decode`: interleaved rounds, medians, the JSON shape."""
    order = []

    def fake_worker(spec):
        order.append(spec["name"])
        base = {"transformers-generate": 8.0, "chatbot-auto": 30.0}[spec["name"]]
        n = len(order)
        return {
            "name": spec["name"],
            "decode_tps": base + n,
            "ms_per_token_p50": 1000 / (base + n),
            "ms_per_token_p90": 1200 / (base + n),
            "prefill_tps": {"50": 100.0 + n, "500": 300.0, "2000": 250.0},
            "ttft_s": 0.5,
            "ttft_s_by_prompt": {"50": 0.5, "500": 1.6, "2000": 8.0},
            "peak_mem_mb": 900.0,
            "tokens": [1, 2, 3] if spec["name"] == "transformers-generate" else [1, 2, 4],
        }

    monkeypatch.setattr(bench_decode, "_run_worker", fake_worker)
    out = tmp_path / "bench.json"
    main(
        [
            "bench",
            "decode",
            "--setups",
            "transformers-generate,chatbot-auto",
            "--rounds",
            "3",
            "--json",
            str(out),
        ]
    )
    assert order == ["transformers-generate", "chatbot-auto"] * 3
    data = json.loads(out.read_text())
    rows = {r["name"]: r for r in data["results"]}
    assert rows["chatbot-auto"]["decode_tps"] == 34.0  # median of 32, 34, 36
    assert set(rows["chatbot-auto"]["prefill_tps"]) == {"50", "500", "2000"}
    for key in ("ttft_s", "ms_per_token_p50", "ms_per_token_p90", "peak_mem_mb"):
        assert key in rows["chatbot-auto"]
    assert rows["chatbot-auto"]["same_tokens_as_baseline"] == 2
    assert "machine" in data and data["machine"]["torch_threads"] >= 1
    assert "chatbot-auto" in capsys.readouterr().out


def test_bench_decode_also_runs_the_turns_bench_into_the_same_json(
    monkeypatch, tmp_path, capsys, tiny_tokenizer
):
    """`--also turns` adds the multi-turn figures (persistent cache vs re-encoding) of the
    same model to the decode bench's table and JSON; a bench it does not know is a one-line
    error before anything runs."""
    ran = []
    monkeypatch.setattr(
        bench_decode,
        "_run_worker",
        lambda spec: ran.append(spec) or {"name": spec["name"], "error": "skipped"},
    )
    assert_one_line_error(capsys, "bench", "decode", "--also", "turns,latency", match="unknown bench latency")
    assert ran == []
    folder = tmp_path / "tiny"
    make_model(len(tiny_tokenizer), max_position_embeddings=4096).save_pretrained(folder)  # room for 12 turns
    tiny_tokenizer.save_pretrained(folder)
    out = tmp_path / "bench.json"
    code, stdout, _ = cli(capsys, "bench", "decode", "--setups", "chatbot-auto", "--rounds", "1",
                          "--also", "turns", "--model", str(folder), "--json", str(out))  # fmt: skip
    assert code == 0
    turns = json.loads(out.read_text())["turns"]
    assert len(turns["turns"]) == 12  # the shipped twelve-turn conversation
    last = turns["turns"][-1]
    assert last["persistent"]["prefill_tokens"] < last["reencode"]["prefill_tokens"]
    assert "multi-turn chat" in stdout
