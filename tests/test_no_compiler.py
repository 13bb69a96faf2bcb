"""Without a C compiler (a minimal container, a Mac without its command-line tools) the
native kernels cannot be built: a GGUF file still chats, through transformers from a
dequantized copy, with one note that says why, and answers as the native path does."""

from __future__ import annotations

import os
import subprocess
import sys

from helpers import make_model, make_tokenizer, write_tiny_gguf


def _chat(gguf, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "chatbot.cli.app",
            "run",
            "--model",
            str(gguf),
            "--greedy",
            "--max-new-tokens",
            "8",
        ],
        input="Hi\nSay yes.\n",
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )


def test_an_empty_path_chats_through_transformers_with_one_note(tmp_path):
    tok = make_tokenizer()
    gguf = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf, make_model(len(tok)), tok)
    base = {**os.environ, "XDG_DATA_HOME": str(tmp_path / "data"), "PYTHONPATH": os.getcwd()}
    base.pop("CC", None)
    native = _chat(gguf, {**base, "XDG_CACHE_HOME": str(tmp_path / "cache-native")})
    assert native.returncode == 0, native.stderr
    assert native.stderr.count("tok/s") == 2, native.stderr

    bare = {**base, "PATH": "", "XDG_CACHE_HOME": str(tmp_path / "cache-bare")}
    for run in (1, 2):  # the first run converts the file; the second reads the copy
        done = _chat(gguf, bare)
        assert done.returncode == 0, done.stderr
        assert done.stderr.count("tok/s") == 2, done.stderr
        assert "error" not in done.stderr, done.stderr
        notes = [line for line in done.stderr.splitlines() if "compiler" in line]
        assert len(notes) == 1, done.stderr
        assert "no C compiler found" in notes[0] and "runs through transformers" in notes[0]
        assert done.stdout == native.stdout, (run, done.stdout, native.stdout)
