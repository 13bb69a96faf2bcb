"""A damaged compiled-kernel cache (`~/.cache/chatbot/kernels/*.so`) is built again, not
loaded: a file cut short used to kill every chat with SIGBUS, one with zeroed pages with
SIGSEGV, and garbage, an empty file, another library or a directory in its place turned the
native kernels off on every start until the user found and deleted the file.

Real `chatbot run` and `chatbot serve` processes on the tiny GGUF file (helpers), each with
its own cache folder holding a copy of one good build (made once for the module), damaged.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from helpers import make_model, make_tokenizer, write_tiny_gguf
from serve_helpers import running_server

from chatbot.engine.backends.native import build as kernel_build
from chatbot.engine.backends.native import kernels
from chatbot.errors import ChatbotError

PAGE = 4096


def _system_libm() -> Path | None:
    """The C math library this process has loaded: a real shared library that is not ours."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        maps = []
    for line in maps:
        path = Path(line.split()[-1])
        if path.name.startswith(("libm.so", "libm-")) and path.is_file():
            return path
    found = sorted(Path("/").glob("usr/lib*/**/libm.so.6")) + sorted(Path("/").glob("lib*/**/libm.so.6"))
    return found[0] if found else None


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """(the good library's bytes, its checksum file's text or None, the library's file name,
    the tiny GGUF file, the answer a clean cache gives)."""
    cc = kernels.find_compiler()
    if cc is None:
        pytest.skip("needs a C compiler to build the kernels")
    root = tmp_path_factory.mktemp("kernels")
    name = kernels.library_path(cc).name  # the folder comes from XDG_CACHE_HOME; the name does not
    target = root / "cache" / "chatbot" / "kernels" / name
    kernels.build(cc, target)
    sidecar = kernels.checksum_path(target) if hasattr(kernels, "checksum_path") else None
    recorded = sidecar.read_text() if sidecar is not None and sidecar.exists() else None
    tok = make_tokenizer()
    gguf = root / "tiny.gguf"
    write_tiny_gguf(gguf, make_model(len(tok)), tok)
    clean = _chat(gguf, root / "clean")
    assert clean.returncode == 0 and "tok/s" in clean.stderr, clean.stderr
    return target.read_bytes(), recorded, name, gguf, clean.stdout


def _env(cache: Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, "XDG_CACHE_HOME": str(cache), "XDG_DATA_HOME": str(cache / "data")}
    env["PYTHONPATH"] = os.getcwd()
    env.pop("CC", None)
    return {**env, **extra}


def _chat(gguf: Path, cache: Path, **env: str) -> subprocess.CompletedProcess[str]:
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
        input="Hi\n",
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(cache, **env),
        check=False,
    )


def _library_in(cache: Path, name: str) -> Path:
    return cache / "chatbot" / "kernels" / name


def _place(good, cache: Path, name: str | None = None) -> Path:
    """A copy of the good build (and its checksum) in `cache`, under `name` (default: the
    name `library_path` gives); returns the library's path."""
    data, recorded, default, _, _ = good
    lib = _library_in(cache, name or default)
    lib.parent.mkdir(parents=True)
    lib.write_bytes(data)
    lib.chmod(0o755)
    if recorded is not None:
        Path(f"{lib}.sha256").write_text(recorded)
    return lib


def _truncated(lib: Path) -> None:
    lib.write_bytes(lib.read_bytes()[: lib.stat().st_size // 2])


def _zeroed_pages(lib: Path) -> None:
    data = bytearray(lib.read_bytes())
    data[PAGE : PAGE * 8] = bytes(PAGE * 7)
    lib.write_bytes(bytes(data))


def _garbage(lib: Path) -> None:
    lib.write_bytes(random.Random(0).randbytes(lib.stat().st_size))


def _empty(lib: Path) -> None:
    lib.write_bytes(b"")


def _wrong_library(lib: Path) -> None:
    libm = _system_libm()
    if libm is None:
        pytest.skip("no libm found to stand in for the kernels")
    shutil.copyfile(libm, lib)


def _wrong_library_with_its_checksum(lib: Path) -> None:
    """Another library with a checksum that matches it: it loads, and only `check_abi`
    can tell it is not the kernels."""
    _wrong_library(lib)
    data = lib.read_bytes()
    Path(f"{lib}.sha256").write_text(f"{hashlib.sha256(data).hexdigest()} {len(data)}\n")


def _directory(lib: Path) -> None:
    lib.unlink()
    lib.mkdir()
    (lib / "something").write_text("x")


def _no_checksum(lib: Path) -> None:
    """A good build from a version that kept no checksum: not trusted, so built again."""
    Path(f"{lib}.sha256").unlink(missing_ok=True)


def _assert_rebuilt(lib: Path, size: int) -> None:
    assert lib.is_file() and lib.stat().st_size == size
    recorded = Path(f"{lib}.sha256").read_text().split()
    assert recorded == [hashlib.sha256(lib.read_bytes()).hexdigest(), str(size)]


@pytest.mark.parametrize(
    "damage",
    [
        _truncated,
        _zeroed_pages,
        _garbage,
        _empty,
        _wrong_library,
        _wrong_library_with_its_checksum,
        _directory,
        _no_checksum,
    ],
    ids=lambda f: f.__name__.strip("_"),
)
def test_a_damaged_library_is_built_again_and_the_chat_answers(good, tmp_path, damage):
    data, _, _, gguf, answer = good
    lib = _place(good, tmp_path)
    damage(lib)
    done = _chat(gguf, tmp_path)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stderr.count("tok/s") == 1, done.stderr
    assert "error" not in done.stderr.lower(), done.stderr
    assert "transformers" not in done.stderr, done.stderr  # the native path answered
    assert done.stdout == answer
    _assert_rebuilt(lib, len(data))


def _failing_compiler(folder: Path) -> Path:
    """A compiler that states its version (so the library has a name) but builds nothing."""
    cc = folder / "fakecc"
    cc.write_text(
        '#!/bin/sh\nif [ "$1" = "--version" ]; then echo "fakecc 1.0"; exit 0; fi\n'
        'echo "fakecc: cannot compile here" >&2\nexit 1\n'
    )
    cc.chmod(0o755)
    return cc


def test_an_edit_to_any_part_of_the_source_names_another_library(tmp_path, monkeypatch):
    """The cache key hashes every file of csrc/, not only the kernels.c the compiler is given
    (it includes the others): after an edit to any part, or a part added, the build cached
    before is not the one loaded. Where the folder lies does not count."""
    cc = str(_failing_compiler(tmp_path))  # library_path only asks it for its version
    first = kernels.library_path(cc)
    copy = tmp_path / "csrc"
    shutil.copytree(kernel_build.SOURCE_DIR, copy)
    monkeypatch.setattr(kernel_build, "SOURCE_DIR", copy)
    assert kernels.library_path(cc) == first
    parts = sorted(copy.iterdir())
    assert {"kernels.c", "kernels.h", "formats.c"} <= {p.name for p in parts}
    seen = {first}
    for part in parts:
        part.write_text(part.read_text() + "/* edited */\n")
        seen.add(kernels.library_path(cc))
    (copy / "added.c").write_text("")
    seen.add(kernels.library_path(cc))
    assert len(seen) == len(parts) + 2


def test_a_damaged_library_that_cannot_be_rebuilt_leaves_one_note_naming_it(good, tmp_path, monkeypatch):
    """The compiler fails: the damaged file is not loaded, the chat answers through
    transformers, and one note says what happened to which file."""
    _, _, _, gguf, answer = good
    cc = _failing_compiler(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    lib = kernels.library_path(str(cc))
    _place(good, tmp_path / "cache", lib.name)
    _truncated(lib)
    done = _chat(gguf, tmp_path / "cache", CC=str(cc))
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stderr.count("tok/s") == 1, done.stderr
    assert "error" not in done.stderr.lower(), done.stderr
    notes = [line for line in done.stderr.splitlines() if "native kernels" in line]
    assert len(notes) == 1, done.stderr
    assert "cannot compile here" in notes[0] and str(lib) in notes[0] and "is damaged" in notes[0]
    assert "runs through transformers" in notes[0]
    assert done.stdout == answer


def test_a_damaged_library_without_a_compiler_chats_through_transformers(good, tmp_path):
    """No compiler at all (PATH emptied): the cache is not looked at; one note says why."""
    _, _, _, gguf, answer = good
    _truncated(_place(good, tmp_path))
    done = subprocess.run(
        [str(Path(sys.executable).absolute()), "-m", "chatbot.cli", "run", "--model", str(gguf)]
        + ["--greedy", "--max-new-tokens", "8"],
        input="Hi\n",
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(tmp_path, PATH=""),
        check=False,
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stderr.count("tok/s") == 1, done.stderr
    notes = [line for line in done.stderr.splitlines() if "compiler" in line]
    assert len(notes) == 1 and "no C compiler found" in notes[0], done.stderr
    assert done.stdout == answer


def test_two_processes_on_a_fresh_cache(good, tmp_path):
    """Started at once on an empty cache: both answer natively, one build is left, and its
    checksum matches it."""
    data, _, name, gguf, answer = good
    results: list[subprocess.CompletedProcess[str]] = []
    runs = [threading.Thread(target=lambda: results.append(_chat(gguf, tmp_path))) for _ in range(2)]
    for run in runs:
        run.start()
    for run in runs:
        run.join()
    for done in results:
        assert done.returncode == 0, done.stderr[-2000:]
        assert "transformers" not in done.stderr and done.stdout == answer, done.stderr
    _assert_rebuilt(_library_in(tmp_path, name), len(data))
    assert sorted(p.name for p in _library_in(tmp_path, name).parent.iterdir()) == sorted(
        [".lock", name, f"{name}.sha256"]
    )  # no temporary file left behind


def test_serve_with_a_damaged_library_rebuilds_it_and_answers(good, tmp_path):
    data, _, _, gguf, _ = good
    lib = _place(good, tmp_path)
    _truncated(lib)
    env = {"XDG_CACHE_HOME": str(tmp_path), "XDG_DATA_HOME": str(tmp_path / "data")}
    with running_server(
        "--model", str(gguf), "--served-model-name", "tiny", env=env, log=tmp_path / "serve.log"
    ) as url:
        reply = httpx.post(
            f"{url}/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
            timeout=120,
        )
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"]
    assert "transformers" not in (tmp_path / "serve.log").read_text()
    _assert_rebuilt(lib, len(data))


@pytest.mark.parametrize(
    ("where", "error", "status"),
    [
        ("checkout", kernels.KernelsUnavailable("the native kernels do not load"), 500),
        ("send", kernels.KernelsUnavailable("the native kernels do not load"), 500),
        ("send", ChatbotError("empty message"), 400),
    ],
)
def test_the_server_answers_its_own_failures_with_5xx(
    tiny_model, tiny_tokenizer, monkeypatch, where, error, status
):
    """Native kernels that fail while a request runs are the server's fault (500, a
    server_error), not the client's (400); an error in the request stays a 400."""
    from chatbot.config import EngineConfig, SamplingConfig
    from chatbot.engine.generate import Engine
    from chatbot.server.pool import Conversation, PrefixCachePool
    from chatbot.server.worker import Job, Worker

    sampling = SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=4)
    pool = PrefixCachePool(Engine(tiny_model, tiny_tokenizer), EngineConfig(), sampling)
    checkout = pool.checkout

    def failing_checkout(conv):
        if where == "checkout":
            raise error
        entry = checkout(conv)

        def failing_send(*args, **kwargs):
            raise error

        monkeypatch.setattr(entry.session, "send", failing_send)
        return entry

    monkeypatch.setattr(pool, "checkout", failing_checkout)
    events: list[tuple[str, object]] = []
    done = threading.Event()
    worker = Worker(pool)
    try:
        worker.submit(
            Job(
                Conversation(None, [], "Hello"),
                sampling,
                lambda e: (events.append(e), e[0] != "text" and done.set()),
            )
        )
        assert done.wait(30)
    finally:
        worker.stop()
        worker.thread.join(10)
    kind, api_error = events[-1]
    assert kind == "error" and api_error.status == status, (kind, vars(api_error))
    assert api_error.type == ("server_error" if status == 500 else "invalid_request_error")
    assert str(error) in api_error.message
