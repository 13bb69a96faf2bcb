"""`chatbot bench load` across client counts, and `scripts/bench-servers` (devtools), which
starts real `chatbot serve` (and llama-cpp-python's server where it is installed) on the
default model itself, for short runs; llama.cpp's absence is simulated by a `llama_cpp` that
fails to import."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
from helpers import assert_one_line_error
from rich.console import Console
from serve_helpers import free_port

from chatbot.measure.bench_load import print_load_comparison
from devtools import run_tool
from devtools.bench_servers import llama_server_missing
from devtools.bench_servers import main as bench_servers

SHORT = ("--duration", "2", "--max-new-tokens", "4")


@pytest.fixture
def no_llama_cpp(tmp_path, monkeypatch):
    """A `llama_cpp` package first on the path of every Python started from here, whose
    import fails as a broken or missing install's would."""
    fake = tmp_path / "fake" / "llama_cpp"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('simulated: no llama_cpp here')\n")
    paths = [str(fake.parent), *filter(None, [os.environ.get("PYTHONPATH")])]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths))
    return fake


def servers(capsys, *args: str) -> tuple[int | str | None, str, str]:
    """Run `scripts/bench-servers ARGS` in this process: the exit code, stdout and stderr."""
    capsys.readouterr()
    try:
        code: int | str | None = run_tool("bench-servers", bench_servers, list(args))
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_servers_error(capsys, *args: str, match: str) -> None:
    """`scripts/bench-servers ARGS` fails as a user error should: status 2, one line."""
    code, _, err = servers(capsys, *args)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert match in lines[0], lines[0]


def _compare(capsys, tmp_path, monkeypatch, *args: str) -> tuple[dict, str]:
    monkeypatch.setenv("COLUMNS", "120")  # rich's width: no cell cut short
    out_json = tmp_path / "load.json"
    short = SHORT if "--max-new-tokens" not in args else SHORT[:2]
    code, out, err = servers(capsys, *args, *short, "--json", str(out_json))
    assert code == 0, out + err
    assert "Traceback" not in out + err
    return json.loads(out_json.read_text()), out


def _check_runs(
    runs: list[dict], setup: str, counts: list[int], max_tokens: int = 4, rounds: int = 1
) -> None:
    """Every answer complete and within max_tokens; the ratio is the tok/s over 1 client's."""
    assert [r["clients"] for r in runs] == counts and {r["setup"] for r in runs} == {setup}
    for r in runs:
        assert r["rounds"] == rounds and len(r["tokens_per_s_rounds"]) == rounds
        assert r["errors"] == 0 and r["incomplete"] == 0 and r["complete"] >= r["clients"], r
        assert r["complete"] <= r["tokens"] <= max_tokens * r["complete"], r
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["elapsed_s"])
        assert 0 < r["ttft_p50_s"] <= r["ttft_p90_s"] <= r["ttft_p99_s"], r
        assert r["single_turn"] and r["max_new_tokens"] == max_tokens
        assert r["rss_max_bytes"] > 50 * 2**20  # the server process's, read from /proc
    one = runs[0]
    assert one["vs_one_client"] is None
    for r in runs[1:]:
        assert r["vs_one_client"] == pytest.approx(r["tokens_per_s"] / one["tokens_per_s"])
        by_round = [n / o for n, o in zip(r["tokens_per_s_rounds"], one["tokens_per_s_rounds"])]
        assert r["vs_one_client_rounds"] == pytest.approx(by_round)


@pytest.mark.slow
def test_chatbot_serve_one_then_two_clients_and_llama_cpp_skipped(
    capsys, tmp_path, monkeypatch, no_llama_cpp
):
    """chatbot serve started by the bench on the default model: a row per client count with
    the ratio (two rounds: 1, 2, 1, 2 clients), the two clients' decode steps batched;
    llama.cpp skipped, saying why."""
    data, out = _compare(
        capsys, tmp_path, monkeypatch, "--setups", "chatbot,llama.cpp", "--clients", "1,2", "--rounds", "2",
        "--max-new-tokens", "48",
    )  # fmt: skip
    runs = data["runs"]
    _check_runs(runs, "chatbot", [1, 2], rounds=2, max_tokens=48)
    assert all(len(r["loadavg_ends"]) == 2 for r in runs)
    # one client: one row a step; two at once: their steps share a batch, but while one
    # request prefills the other decodes alone (with answers of 24 tokens that was about half
    # the steps, and 1.197 rows a step with other jobs on the machine: answers of 48)
    assert runs[0]["batch_rows_per_step"] == pytest.approx(1.0)
    assert runs[1]["batch_rows_per_step"] > 1.2, runs[1]
    assert [s["setup"] for s in data["skipped"]] == ["llama.cpp"]
    assert "simulated: no llama_cpp here" in data["skipped"][0]["reason"]
    # the printed table: a row per run, the ratio, the skip and the conditions
    rows = [line.split() for line in out.splitlines() if line.strip().startswith("chatbot ")]
    assert [row[1] for row in rows] == ["1", "2"], out
    assert rows[0][5] == "-" and rows[1][5] == f"{runs[1]['vs_one_client']:.2f}x", out
    each = ", ".join(f"{x:.2f}x" for x in runs[1]["vs_one_client_rounds"])
    assert (
        f"chatbot: 2 clients {runs[1]['vs_one_client']:.2f}x the tok/s of 1 client (by round: {each})" in out
    )
    assert "llama.cpp: skipped: llama_cpp.server does not import (ImportError: simulated" in out
    assert "load average" in out and "threads: chatbot default (" in " ".join(out.split())


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed")
def test_llama_cpp_server_one_then_two_clients(capsys, tmp_path, monkeypatch):
    """llama-cpp-python's server on the same file: every answer whole (its default would cut
    a stream short when the next request comes), tokens counted per chunk."""
    why = llama_server_missing()
    if why is not None:
        pytest.skip(why)
    data, out = _compare(
        capsys, tmp_path, monkeypatch, "--setups", "llama.cpp", "--clients", "1,2", "--threads", "1"
    )
    _check_runs(data["runs"], "llama.cpp", [1, 2])
    for r in data["runs"]:
        assert r["tokens_counted_as_chunks"] == r["complete"] and r["threads"] == "1"
        assert r["batch_rows_per_step"] is None
    assert data["skipped"] == [] and "llama.cpp: 2 clients" in out


def test_llama_cpp_alone_and_not_importable_is_one_line(capsys, no_llama_cpp):
    assert_servers_error(
        capsys,
        "--setups",
        "llama.cpp",
        match="bench-servers: error: no set-up was measured: llama.cpp: llama_cpp.server does not import "
        "(ImportError: simulated",
    )


@pytest.mark.parametrize("clients", ["1,4", "8"])
def test_unreachable_server_is_one_line(capsys, clients):
    url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    assert_one_line_error(
        capsys,
        "bench",
        "load",
        "--server",
        url,
        "--clients",
        clients,
        "--duration",
        "1",
        match=f"cannot list the models of the server at {url}: Connection error",
    )


@pytest.mark.parametrize(
    "args, match",
    [
        ([], "give --server URL"),
        (["--server", "http://127.0.0.1:9/v1", "--clients", "1,0"], "--clients: expected a count or counts"),
        (["--server", "http://127.0.0.1:9/v1", "--clients", "one"], "--clients: expected a count or counts"),
    ],
)
def test_bad_options_are_one_line(capsys, args, match):
    assert_one_line_error(capsys, "bench", "load", *args, match=match)


@pytest.mark.parametrize(
    "args, match",
    [
        (["--setups", "chatbot,vllm"], "--setups: unknown set-up vllm; choose from chatbot, llama.cpp"),
        (["--setups", "chatbot", "--clients", "1,0"], "--clients: expected a count or counts"),
        (["--setups", "chatbot", "--gguf", "/no/such.gguf"], "--gguf: /no/such.gguf is not a file"),
    ],
)
def test_bench_servers_bad_options_are_one_line(capsys, args, match):
    assert_servers_error(capsys, *args, match=match)


def _run(setup: str, clients: int, tps: float, ratio: float | None) -> dict:
    return {
        "setup": setup,
        "model": "m",
        "clients": clients,
        "threads": "1",
        "complete": 10 * clients,
        "incomplete": 0,
        "errors": 0,
        "tokens_per_s": tps,
        "vs_one_client": ratio,
        "ttft_p50_s": 0.2,
        "ttft_p90_s": 0.61,
        "batch_rows_per_step": 3.5 if setup == "chatbot" and clients > 1 else None,
        "rss_max_bytes": 600 * 2**20,
        "loadavg_end": 1.5,
        "tokens_counted_as_chunks": 10 * clients if setup == "llama.cpp" else 0,
    }


def test_the_table_fits_80_columns_with_every_figure():
    result = {
        "duration_s": 30.0,
        "max_new_tokens": 64,
        "server": None,
        "runs": [
            _run("chatbot", 1, 64.0, None),
            _run("chatbot", 4, 96.5, 1.5078),
            _run("llama.cpp", 1, 70.0, None),
            _run("llama.cpp", 4, 71.4, 1.02),
        ],
        "skipped": [],
        "conditions": "AMD EPYC, 2 CPUs, load average 1.50 / 1.40 / 1.30 (1/5/15 min)",
    }
    console = Console(width=80, record=True)
    print_load_comparison(console, result)
    text = console.export_text()
    assert "…" not in text  # nothing cut short
    assert " chatbot         4      40      0  96.5 1.51x  0.20  0.61  3.50 600 1.50" in text, text
    assert " llama.cpp       1      10      0  70.0     -  0.20  0.61     - 600 1.50" in text, text
    assert "chatbot: 4 clients 1.51x the tok/s of 1 client, first token p90 0.61 s" in text
    assert "llama.cpp: no usage streamed, a token counted per chunk of text" in " ".join(text.split())


def _one_run(clients: int, tokens: int, elapsed: float, ttfts: list[float], load: float) -> dict:
    return {
        "server": "u",
        "model": "m",
        "clients": clients,
        "duration_s": 2.0,
        "max_new_tokens": 4,
        "single_turn": True,
        "complete": len(ttfts),
        "incomplete": 0,
        "errors": 1,
        "tokens": tokens,
        "tokens_counted_as_chunks": 0,
        "elapsed_s": elapsed,
        "tokens_per_s": tokens / elapsed,
        "ttfts_s": ttfts,
        "batch_steps": 10,
        "batch_rows": 10 * clients,
        "rss_max_bytes": int(load * 1000),
        "loadavg_end": load,
        "error_samples": [f"e{load}"],
    }


def test_rounds_are_pooled():
    """Counts and times summed, tok/s over all of them (not the mean of the rounds' rates),
    first-token quantiles over every answer."""
    from chatbot.measure.bench_load import pooled

    merged = pooled([_one_run(2, 40, 2.0, [0.1, 0.2], 1.0), _one_run(2, 20, 3.0, [0.3, 0.4, 2.0], 3.0)])
    assert merged["rounds"] == 2 and merged["complete"] == 5 and merged["errors"] == 2
    assert merged["tokens"] == 60 and merged["elapsed_s"] == 5.0
    assert merged["tokens_per_s"] == pytest.approx(12.0) and merged["tokens_per_s_rounds"] == [20.0, 20 / 3]
    assert merged["ttft_p50_s"] == 0.3 and merged["ttft_p90_s"] == 2.0
    assert merged["batch_rows_per_step"] == pytest.approx(2.0) and merged["rss_max_bytes"] == 3000
    assert merged["loadavg_end"] == pytest.approx(2.0) and merged["error_samples"] == ["e1.0", "e3.0"]
