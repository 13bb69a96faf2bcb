"""Shared fixtures: a tiny random Llama with a tokenizer trained in the test, the native
kernels built once per session, and the real default model (slow tier).

Only fixtures and hooks live here; what tests import (the model factory, the tokenizer, the
references) is in helpers.py."""

from __future__ import annotations

import os
import signal

# Every TrackedCache checks its invariant after each change (also in REPL subprocesses).
os.environ.setdefault("CHATBOT_DEBUG_CACHE", "1")

import pytest
import torch
from helpers import make_model, make_tokenizer, write_tiny_gguf


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "needs_kernels: calls the native C kernels; skipped where they cannot be built"
    )
    # A suite started in the background inherits signals ignored (SIGHUP under nohup, SIGINT
    # where a shell without job control runs `cmd &`), and so would every chat it starts: the
    # Ctrl-C and hang-up tests would test the runner's shell. They get their defaults back.
    for signum, handler in ((signal.SIGINT, signal.default_int_handler), (signal.SIGHUP, signal.SIG_DFL)):
        if signal.getsignal(signum) is signal.SIG_IGN:
            signal.signal(signum, handler)


@pytest.fixture(scope="session")
def native_kernels():
    """The C kernels, compiled (or found in the build cache) once per session; skips the
    test that asks, with the reason, where they cannot be built (no C compiler). pytest
    keeps the skip too, so a machine without a compiler tries once."""
    from chatbot.engine.backends.native import kernels

    try:
        return kernels.load_library()
    except kernels.KernelsUnavailable as exc:  # pragma: no cover - depends on the machine
        pytest.skip(f"needs the native kernels: {exc}")


@pytest.fixture(autouse=True)
def _kernels_for_marked_tests(request):
    """Tests marked `needs_kernels` (helpers.needs_kernels) get the session's kernels."""
    if request.node.get_closest_marker("needs_kernels") is not None:
        request.getfixturevalue("native_kernels")


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="session")
def tiny_model(tiny_tokenizer):
    return make_model(len(tiny_tokenizer))


@pytest.fixture
def tiny_engine(tiny_model, tiny_tokenizer):
    from chatbot.engine.generate import Engine

    return Engine(tiny_model, tiny_tokenizer)


@pytest.fixture
def tiny_gguf(tmp_path, monkeypatch):
    """A llama GGUF written from a tiny model (helpers.write_tiny_gguf): (path, model,
    tokenizer); the conversion cache in tmp_path."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    tok = make_tokenizer()
    model = make_model(len(tok))
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, model, tok)
    return path, model, tok


@pytest.fixture(scope="session")
def _default_model_once():
    from chatbot.models.loader import load_model

    return load_model(None)


@pytest.fixture
def default_model(_default_model_once):
    """The real SmolLM2-135M-Instruct (converted once into the user cache), shared by the
    tests: nothing they build on it (a `FastDecoder` included) changes it."""
    return _default_model_once


@pytest.fixture(autouse=True)
def _isolated_dirs(tmp_path_factory, monkeypatch):
    """Keep session logs and history out of the real home; share the model cache."""
    data = tmp_path_factory.mktemp("data")
    monkeypatch.setenv("XDG_DATA_HOME", str(data))
    # the chats' KV caches too (they are written after every logged turn); subprocesses inherit it
    monkeypatch.setenv("CHATBOT_KV_DIR", str(data / "kv"))
    if "CHATBOT_TEST_CACHE" in os.environ:
        monkeypatch.setenv("XDG_CACHE_HOME", os.environ["CHATBOT_TEST_CACHE"])


@pytest.fixture(scope="module")
def one_thread():
    """torch on one thread for a module's tests: the tiny model's many small forward passes
    run fastest so (two threads spin against each other on a busy machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def terminals():
    """Pseudo-terminals a test opens (tests/screen.py), closed after it."""
    opened: list = []
    yield opened
    for term in opened:
        term.close()
