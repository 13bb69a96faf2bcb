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


def _fake_decode_worker(spec):
    """A worker's figures, distinct per set-up (each cell can be found), without a model: the
    baseline's 12 greedy tokens, and the others' the same up to where they end the answer
    (token 2 at index 9) and go on."""
    i = [*bench_decode.default_setups()].index(spec["name"])
    baseline = spec["name"] == "transformers-generate"
    return {
        "name": spec["name"],
        "decode_tps": 10.0 + 11.1 * i,
        "ms_per_token_p50": 40.25 + i,
        "ms_per_token_p90": 100.5 + i,
        "prefill_tps": {"50": 1001.0 + i, "500": 2002.0 + i, "2000": 3003.0 + i},
        "ttft_s": 0.4123 + i / 1000,
        "ttft_s_by_prompt": {"50": 0.4, "500": 1.6, "2000": 8.0},
        "peak_mem_mb": 1200.0 + i,
        "bytes_per_weight": None if baseline else 1.0625,
        "load_s": 2.5 + i,
        "loadavg": 7.5 + i / 100,
        "tokens": list(range(10, 22)) if baseline else [*range(10, 19), 2, 5, 6],
        **({} if baseline else {"answer_end": 9}),
    }


def _decode_cells(i: int) -> list[str]:
    """Every figure `_fake_decode_worker`'s set-up `i` shows, as printed."""
    cells = [f"{10.0 + 11.1 * i:.1f}", f"{40.25 + i:.1f}", f"{100.5 + i:.1f}", f"{1200 + i}"]
    cells += [f"{n + i}" for n in (1001, 2002, 3003)]
    cells += [f"{0.4123 + i / 1000:.3f}", f"{2.5 + i:.1f}", f"{7.5 + i / 100:.2f}"]
    return [*cells, "12/12" if i == 0 else "9/12*"] + ([] if i == 0 else ["1.062"])


def test_bench_decode_fits_80_and_60_columns_and_says_why_llama_cpp_is_missing(monkeypatch, capsys):
    """At 80 and 60 columns every header and figure of `bench decode` is printed whole (the
    tables split into parts that fit, never an ellipsis); without llama-cpp-python a line
    says why llama.cpp has no row and how to get it; `same tok` is N of the compared, and a
    legend says what it counts and why every set-up parts where it ends the answer."""
    monkeypatch.setattr(bench_decode, "_run_worker", _fake_decode_worker)
    monkeypatch.setattr(bench_decode, "llama_cpp_available", lambda: False)
    measured = [s for s in bench_decode.default_setups() if s != "llama.cpp"]
    for width in (80, 60):
        monkeypatch.setenv("COLUMNS", str(width))
        code, stdout, _ = cli(capsys, "bench", "decode", "--rounds", "1")
        assert code == 0
        assert "…" not in stdout
        assert max(len(line) for line in stdout.splitlines()) <= width
        for header in ("tok/s", "p50", "p90", "peak", "B/", "weight", "same", "TTFT", "@2000", "load"):
            assert f" {header} " in stdout, header
        for i, name in enumerate(measured):
            row = [cell.strip() for line in stdout.splitlines() if line.startswith(f"│ {name} ")
                   for cell in line.split("│")]  # fmt: skip
            assert set(_decode_cells(i)) <= set(row), (name, row)
        words = " ".join(stdout.split())
        missing = "llama.cpp: not measured (llama-cpp-python is not installed: pip install llama-cpp-python)"
        assert missing in words
        assert "same tok: greedy tokens equal to transformers-generate's up to the first difference" in words
        assert "*: the set-up ended the answer there (end-of-text token)" in words


def test_bench_decode_progress_is_a_bar_on_a_terminal_and_lines_in_a_pipe(monkeypatch, capsys):
    """In a pipe, a plain line per worker on stderr (stdout keeps the figures); on a
    terminal, a bar with the worker now running and the count done."""
    import io

    from rich.console import Console

    from chatbot.cli.bench import workers_progress

    monkeypatch.setattr(bench_decode, "_run_worker", _fake_decode_worker)
    code, stdout, err = cli(capsys, "bench", "decode", "--setups", "transformers-generate,chatbot-auto",
                            "--rounds", "2")  # fmt: skip
    assert code == 0 and "round 1/2" not in stdout
    assert err.splitlines() == [f"round {r}/2: {name}" for r in (1, 2)
                                for name in ("transformers-generate", "chatbot-auto")]  # fmt: skip
    screen = io.StringIO()
    with workers_progress(Console(file=screen, force_terminal=True, width=80)) as progress:
        progress("round 2/2: transformers-generate", 2, 4)
    assert "round 2/2: transformers-generate" in screen.getvalue()
    assert "2/4" in screen.getvalue() and "━" in screen.getvalue()


def test_bench_decode_llama_cpp_ngram_says_why_it_is_missing(monkeypatch, capsys):
    """`llama.cpp-ngram` (llama-cpp-python's prompt lookup) is a set-up only where named, and
    without llama-cpp-python it gets a line saying why, beside the rows measured."""
    monkeypatch.setattr(bench_decode, "_run_worker", _fake_decode_worker)
    monkeypatch.setattr(bench_decode, "llama_cpp_available", lambda: False)
    assert "llama.cpp-ngram" not in bench_decode.default_setups()
    code, stdout, _ = cli(
        capsys, "bench", "decode", "--setups", "chatbot-auto,llama.cpp-ngram", "--rounds", "1"
    )
    assert code == 0
    words = " ".join(stdout.split())
    assert (
        "llama.cpp-ngram: not measured (llama-cpp-python is not installed: pip install llama-cpp-python)"
        in words
    )
    assert any(line.startswith("│ chatbot-auto ") for line in stdout.splitlines())


def test_bench_decode_tasks_are_chat_messages_of_prose_and_a_wrong_one_is_refused(capsys):
    """The grounded tasks ask about ~300 words of the shipped text's prose, in its order, with
    its headings and directives left out (the default model answers `edit` with the whole text);
    an unknown `--task` is one line naming the choices."""
    import re
    from importlib import resources

    from chatbot.measure.bench_timing import TASK_WORDS, task_message

    shipped = " ".join(resources.files("chatbot").joinpath("data/long_text.txt").read_text().split())
    for task in ("repeat", "edit"):
        message = task_message(task)
        assert message is not None
        instruction, _, text = message.partition("\n\n")
        assert instruction.endswith(":") and len(text.split()) == TASK_WORDS
        assert text.startswith("Python is an interpreted, interactive, object-oriented programming language.")
        assert not re.search(r"^[=\-.]|::|={3}", text, re.MULTILINE)
        for sentence in re.split(r"(?<=\.) ", text)[:-1]:  # each whole sentence is the text's own
            assert sentence in shipped, sentence
    assert task_message("text") is None and "lighthouse" in (task_message("write") or "")
    assert_one_line_error(capsys, "bench", "decode", "--task", "summary", match="text, repeat, edit, write")
