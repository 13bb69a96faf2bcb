"""Reads of the user's files stay bounded: `chatbot sessions` reads the head of a huge log
(a 2 GB sparse file among the logs took 34.5 s and 235 MB), and `/load` restores no stats field
that is not a real figure (issue 38, cases 6 and 7)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from chatbot.conversation import log as session_log


def _read_bytes() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def _log(path: Path, user: str, turns: int, pad: int = 0) -> None:
    events = [{"event": "start", "model": "tiny", "system": None, "settings": {}}]
    for i in range(turns):
        events.append({"event": "send", "user": f"{user} {i}"})
        events.append({"event": "turn", "user": f"{user} {i}", "answer": "x" * pad, "stats": {}})
    path.write_text("".join(json.dumps(e) + "\n" for e in events))


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs /proc/self/io")
def test_a_listing_reads_only_the_head_of_a_huge_log(tmp_path):
    logs = tmp_path / "sessions"
    logs.mkdir()
    _log(logs / "20261201-100000-aaaa.jsonl", "small chat", 3)
    _log(logs / "20261202-100000-bbbb.jsonl", "long chat", 400, pad=30_000)  # 12 MB
    with open(logs / "20261203-100000-cccc.jsonl", "wb") as f:  # 2 GB of zeros, sparse
        f.truncate(2 * 1024**3)
    os.utime(logs / "20261203-100000-cccc.jsonl")
    before = _read_bytes()
    infos = session_log.list_sessions(logs)
    read = _read_bytes() - before
    assert read < 4 * 1024 * 1024, read  # every log's head (1 MiB), the small one whole
    by_id = {i.id: i for i in infos}
    assert set(by_id) == {"20261201-100000-aaaa", "20261202-100000-bbbb"}  # the zeros: no log
    assert by_id["20261201-100000-aaaa"].turns == 3
    assert by_id["20261202-100000-bbbb"].turns is None  # too large to count for a listing
    assert by_id["20261202-100000-bbbb"].first_words == "long chat 0"
    # --resume still replays the whole long log
    assert len(session_log.replay(logs / "20261202-100000-bbbb.jsonl")["turns"]) == 400


def test_chatbot_sessions_shows_a_large_logs_turns_as_unknown(tmp_path):
    data = tmp_path / "data"
    logs = data / "chatbot" / "sessions"
    logs.mkdir(parents=True)
    _log(logs / "20261202-100000-bbbb.jsonl", "long chat", 300, pad=30_000)
    env = {**os.environ, "XDG_DATA_HOME": str(data)}
    out = subprocess.run(
        [sys.executable, "-m", "chatbot.cli", "sessions"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if line.startswith("20261202-100000-bbbb"))
    assert " ? " in row and "long chat 0" in row


def test_load_leaves_out_stats_that_are_no_real_figures(tiny_model, tiny_tokenizer, tmp_path):
    """A saved chat whose stats say -1 tokens, latencies of 1e308 s (their sum overflows to
    infinity) or a fractional token count: /load keeps the turns, leaves those figures out
    with one note naming them, and /stats shows no -1, inf or nan."""
    from test_repl import Chat

    good = {"context_tokens": 5, "generated_tokens": 3, "decode_time_s": 0.3, "token_latencies_s": [0.1] * 3}
    bad = {
        "context_tokens": 2.5,
        "generated_tokens": -1,
        "decode_time_s": 1e308,
        "ttft_s": -0.5,
        "token_latencies_s": [1e308, 1e308],
        "cache_tokens": 7,
    }
    saved = tmp_path / "odd.json"
    saved.write_text(
        json.dumps(
            {
                "turns": [
                    {"user": "Hi", "answer": "Hello", "stats": bad},
                    {"user": "A", "answer": "B", "stats": good},
                ]
            }
        )
    )
    chat = Chat(tiny_model, tiny_tokenizer, None)
    chat.lines(f"/load {saved}", "/stats")
    err = chat.err.getvalue()
    assert [t.user for t in chat.session.turns] == ["Hi", "A"]
    first, second = (t.stats for t in chat.session.turns)
    assert first.generated_tokens == 0 and first.token_latencies_s == [] and first.decode_time_s == 0.0
    assert first.context_tokens == 0 and first.ttft_s == 0.0 and first.cache_tokens == 7
    assert second.generated_tokens == 3 and second.token_latencies_s == [0.1] * 3
    note = next(line for line in err.splitlines() if "turn 1: stats" in line)
    for name in ("context_tokens", "generated_tokens", "decode_time_s", "ttft_s", "token_latencies_s"):
        assert name in note
    stats_table = err[err.index("/stats") if "/stats" in err else 0 :]
    assert not re.search(r"(?<![\w.])-1(?![\w.])|\binf\b|\bnan\b", stats_table, re.IGNORECASE), stats_table
