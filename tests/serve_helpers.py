"""Real `chatbot serve` processes on 127.0.0.1 for the HTTP tests: a tiny random Llama saved to
a folder, a free port, and a bounded wait for /health.

Imported as a plain module (`from serve_helpers import ...`): pytest puts tests/ on the path.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

CHATBOT = str(Path(sys.executable).with_name("chatbot"))
START_TIMEOUT_S = 120.0  # importing torch and transformers on a busy 2-core machine
PIDS: dict[str, int] = {}  # base URL -> the server's process id, while it runs
PROCS: dict[str, subprocess.Popen] = {}  # base URL -> the server's process, while it runs


def printable_tiny_model(max_position_embeddings: int = 4096) -> tuple[Any, Any]:
    """The test tokenizer and a tiny random Llama that writes printable ASCII only and never
    ends by itself (answers run to max_tokens).

    Random weights would also pick lone bytes of multi-byte characters, whose text ("�")
    does not encode back to the same ids; a client sending such an answer back would then
    differ from what the server generated. So one hidden dimension is made a large constant
    (embedding column 0) and the head's column 0 pushes every other token far down.
    """
    import torch
    from helpers import make_model, make_tokenizer

    tok = make_tokenizer()
    model = make_model(len(tok), max_position_embeddings=max_position_embeddings, tie_word_embeddings=False)
    special = set(tok.all_special_ids)
    bad = [
        i
        for i in range(len(tok))
        if i in special or not all(32 <= ord(ch) < 127 for ch in tok.decode([i])) or not tok.decode([i])
    ]
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 0.5
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[bad, 0] = -200
    return model, tok


def save_tiny_model(folder: Path, max_position_embeddings: int = 4096) -> Path:
    """`printable_tiny_model` saved in `folder` (weights and tokenizer)."""
    model, tok = printable_tiny_model(max_position_embeddings)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def running_server(*args: str, env: dict[str, str] | None = None, log: Path | None = None) -> Iterator[str]:
    """Start `chatbot serve ARGS --port P` and yield its base URL (http://127.0.0.1:P/v1)
    once /health answers; stop it afterwards."""
    port = free_port()
    full_env = {**os.environ, **(env or {})}
    out = open(log, "w") if log is not None else subprocess.DEVNULL  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [CHATBOT, "serve", *args, "--port", str(port), "--threads", "1"],
        stdout=out,
        stderr=subprocess.STDOUT,
        env=full_env,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                detail = log.read_text() if log is not None else ""
                raise RuntimeError(f"chatbot serve exited with {proc.returncode}: {detail[-2000:]}")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("chatbot serve did not start in time")
            time.sleep(0.3)
        PIDS[f"{base}/v1"] = proc.pid
        PROCS[f"{base}/v1"] = proc
        yield f"{base}/v1"
    finally:
        PIDS.pop(f"{base}/v1", None)
        PROCS.pop(f"{base}/v1", None)
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)
        if out is not subprocess.DEVNULL:
            out.close()


def health(base_url: str) -> dict:
    return httpx.get(base_url.removesuffix("/v1") + "/health", timeout=10).json()
