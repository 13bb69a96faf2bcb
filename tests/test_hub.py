"""GGUF repos on the hub by name (`chatbot pull`, `rm`, `models`, `run --model user/repo:QUANT`)
against a stand-in hub on loopback (tests/hub_standin.py), through huggingface_hub itself.

The stand-in's repo `stand/smol` holds two quants: the default model's file as `Q4_1`, and a
tiny synthetic llama as `Q8_0` split into two files.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hub_standin import StandInHub

from chatbot.errors import ModelLoadError
from chatbot.models.hub import HubRef, RepoFile, parse_ref, pick
from chatbot.models.source import default_gguf_path
from devtools.gguf_split import split_gguf
from devtools.gguf_synthetic import pick_shape, write_synthetic_gguf

Q4_1 = "SmolLM2-135M-Instruct-Q4_1.gguf"
Q8_0 = [f"tiny-llama-Q8_0-0000{n}-of-00002.gguf" for n in (1, 2)]


@pytest.fixture(scope="module")
def tiny_q8(tmp_path_factory):
    """(the whole synthetic Q8_0 file, its two split parts)."""
    folder = tmp_path_factory.mktemp("tiny-q8")
    whole = folder / "tiny-llama-Q8_0.gguf"
    write_synthetic_gguf(whole, "llama", pick_shape("llama", "tiny"), "Q8_0")
    parts = split_gguf(whole, folder / "split" / whole.name, 2)
    assert [p.name for p in parts] == Q8_0
    return whole, parts


@pytest.fixture(scope="module")
def hub(tiny_q8):
    _, parts = tiny_q8
    files: dict[str, bytes | Path] = {Q4_1: default_gguf_path(), "README.md": b"# smol\n"}
    files.update({p.name: p for p in parts})
    stand_in = StandInHub({"stand/smol": files, "stand/broken": {"broken-Q4_1.gguf": b"GGUF" + bytes(4096)}})
    stand_in.files["stand/broken"]["broken-Q4_1.gguf"].advertised = "0" * 64
    yield stand_in
    stand_in.close()


@pytest.fixture
def env(hub, tmp_path):
    """The environment of a chatbot process using the stand-in, with a hub cache of its own."""
    hub.rate = hub.cut_after = None
    return {**os.environ, **hub.env(tmp_path)}


def chatbot(env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "chatbot.cli", *args]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def blobs(env: dict[str, str]) -> list[Path]:
    return sorted(Path(env["HF_HUB_CACHE"]).glob("models--*/blobs/*"))


# --- names and picking, without a hub -------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "ref"),
    [
        ("user/repo:Q4_K_M", HubRef("user/repo", quant="Q4_K_M")),
        ("hf.co/user/repo:q8_0", HubRef("user/repo", quant="q8_0")),
        ("user/repo/sub/model-Q4_1.gguf", HubRef("user/repo", file="sub/model-Q4_1.gguf")),
        ("user/repo", None),  # a transformers repo
        ("./user/repo:Q4_1", None),
        ("model.gguf", None),
    ],
)
def test_names_of_hub_gguf_files(source, ref):
    assert parse_ref(source) == ref


LISTING = [
    RepoFile("m-Q4_K.gguf"),
    RepoFile("m-Q4_K_M.gguf"),
    RepoFile("mmproj-m-Q4_K_M.gguf"),
    RepoFile("big/m-Q8_0-00002-of-00002.gguf"),
    RepoFile("big/m-Q8_0-00001-of-00002.gguf"),
    RepoFile("README.md"),
]


def test_a_quant_is_matched_whole_and_case_insensitively():
    assert [f.path for f in pick(HubRef("u/r", quant="q4_k"), LISTING)] == ["m-Q4_K.gguf"]
    assert [f.path for f in pick(HubRef("u/r", quant="Q4_K_M"), LISTING)] == ["m-Q4_K_M.gguf"]  # not mmproj


def test_a_split_is_taken_in_order_and_refused_with_a_part_missing():
    parts = ["big/m-Q8_0-00001-of-00002.gguf", "big/m-Q8_0-00002-of-00002.gguf"]
    assert [f.path for f in pick(HubRef("u/r", quant="Q8_0"), LISTING)] == parts
    assert [f.path for f in pick(HubRef("u/r", file=parts[1]), LISTING)] == parts
    with pytest.raises(ModelLoadError, match="part 2 of it is not there"):
        pick(HubRef("u/r", quant="Q8_0"), [f for f in LISTING if f.path != parts[1]])


def test_an_absent_quant_lists_what_there_is():
    with pytest.raises(ModelLoadError, match=r"u/r has no Q5_K_M GGUF file; it has: Q4_K, Q4_K_M, Q8_0"):
        pick(HubRef("u/r", quant="Q5_K_M"), LISTING)


def test_a_quant_matching_two_files_asks_for_one():
    listing = [RepoFile("a-Q4_0.gguf"), RepoFile("b-Q4_0.gguf")]
    with pytest.raises(ModelLoadError, match=r"Q4_0 matches 2 files in u/r \(a-Q4_0.gguf, b-Q4_0.gguf\)"):
        pick(HubRef("u/r", quant="Q4_0"), listing)


# --- against the stand-in -------------------------------------------------------------------


@pytest.mark.slow
def test_pull_then_offline_run_then_rm(env, hub):
    pulled = chatbot(env, "pull", "stand/smol:Q4_1")
    assert pulled.returncode == 0, pulled.stderr
    assert "pulled stand/smol:Q4_1 (1 file, 98.4 MB, checked)" in pulled.stdout
    (blob,) = blobs(env)
    assert blob.name == hashlib.sha256(default_gguf_path().read_bytes()).hexdigest()

    listed = chatbot(env, "models")
    assert "stand/smol:Q4_1" in listed.stdout and "98.4 MB  hub cache" in listed.stdout

    hub.requests.clear()
    offline = {**env, "HF_HUB_OFFLINE": "1"}
    answer = chatbot(offline, "run", "--model", "stand/smol:q4_1", "--max-new-tokens", "16", "Say yes.")
    assert answer.returncode == 0, answer.stderr
    assert answer.stdout.strip()
    assert hub.requests == []  # from the cache alone

    removed = chatbot(env, "rm", "stand/smol:Q4_1")
    assert removed.returncode == 0, removed.stderr
    assert "removed stand/smol:Q4_1 (1 file, 98.4 MB freed)" in removed.stdout
    assert blobs(env) == []
    assert "stand/smol:Q4_1" not in chatbot(env, "models").stdout
    again = chatbot(env, "rm", "stand/smol:Q4_1")
    assert again.returncode == 2 and "not downloaded" in again.stderr


@pytest.mark.slow
def test_a_split_quant_is_fetched_whole_and_answers_as_the_unsplit_file(env, tiny_q8):
    whole, _ = tiny_q8
    args = ["--greedy", "--max-new-tokens", "12", "--no-stats", "Hello there"]
    from_hub = chatbot(env, "run", "--model", "stand/smol:Q8_0", *args)
    assert from_hub.returncode == 0, from_hub.stderr
    assert len(blobs(env)) == 2
    local = chatbot(env, "run", "--model", str(whole), *args)
    assert local.returncode == 0, local.stderr
    assert from_hub.stdout == local.stdout and from_hub.stdout.strip()


@pytest.mark.slow
def test_an_interrupted_pull_resumes(env, hub):
    hub.rate = 40e6  # bytes/s: the 98 MB file takes a few seconds
    proc = subprocess.Popen(
        [sys.executable, "-m", "chatbot.cli", "pull", "stand/smol:Q4_1"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    start_sent = hub.sent
    deadline = time.monotonic() + 60
    while hub.sent - start_sent < 30e6 and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert "interrupted: the part downloaded is kept; chatbot pull stand/smol:Q4_1 resumes it" in err
    assert blobs(env) and all(b.name.endswith((".partial", ".lock")) for b in blobs(env))

    hub.rate = None
    hub.requests.clear()
    again = chatbot(env, "pull", "stand/smol:Q4_1")
    assert again.returncode == 0, again.stderr
    ranges = [r for method, path, r in hub.requests if method == "GET" and path.endswith(Q4_1)]
    assert len(ranges) == 1 and ranges[0] is not None and int(ranges[0].split("=")[1].rstrip("-")) > 0
    (blob,) = [b for b in blobs(env) if not b.name.endswith(".lock")]
    assert hashlib.sha256(blob.read_bytes()).hexdigest() == blob.name


@pytest.mark.slow
def test_a_download_that_does_not_match_its_checksum_is_removed(env):
    bad = chatbot(env, "pull", "stand/broken:Q4_1")
    assert bad.returncode == 2
    assert "broken-Q4_1.gguf does not match the hub's checksum" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
    assert [b for b in blobs(env) if not b.name.endswith(".lock")] == []


def test_what_is_not_there_fails_in_one_line_without_retries(env, hub):
    """One line, and at once: huggingface_hub's retries back off for 1 + 2 + 4... s."""
    offline, closed = {**env, "HF_HUB_OFFLINE": "1"}, {**env, "HF_ENDPOINT": "http://127.0.0.1:9"}
    cases = [
        (offline, ["run", "--model", "stand/smol:Q4_1", "hi"], "is not downloaded and HF_HUB_OFFLINE is set"),
        (env, ["pull", "stand/smol:Q5_K_M"], "stand/smol has no Q5_K_M GGUF file; it has: Q4_1, Q8_0"),
        (env, ["pull", "nobody/nothing:Q4_1"], "no repo nobody/nothing on the hub"),
        (closed, ["pull", "stand/smol:Q4_1"], "cannot reach the hub at http://127.0.0.1:9"),
    ]
    for case_env, args, message in cases:
        start = time.monotonic()
        done = chatbot(case_env, *args)
        elapsed = time.monotonic() - start
        assert done.returncode == 2, (args, done.stderr)
        assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert elapsed < 5, (args, elapsed)


@pytest.mark.slow
def test_pull_shows_its_progress_on_a_terminal(env, hub, terminals):
    """On a terminal, huggingface_hub's bar: the file, the size done of the whole, the rate
    and the time left, within 80 columns."""
    from screen import Terminal

    hub.rate = 30e6
    term = Terminal([sys.executable, "-m", "chatbot.cli", "pull", "stand/smol:Q4_1"], columns=80, env=env)
    terminals.append(term)
    bar = re.compile(
        r"SmolLM2-135M-Instruct-Q4_1\.gguf: +\d+%.*\d+(\.\d)?M/98\.4M \[\d\d:\d\d<\d\d:\d\d, +[\d.]+MB/s\]"
    )
    term.wait_for(lambda: any(bar.search(line) for line in term.lines()), 60, "the download's bar")
    assert all(len(line) <= 80 for line in term.lines())
    term.wait_text("pulled stand/smol:Q4_1", 120)


@pytest.mark.slow
def test_pull_and_rm_of_a_transformers_repo(tmp_path):
    """`chatbot pull user/repo` on a safetensors repo: its weights and small files, checked;
    `chatbot rm user/repo` deletes the whole repo from the hub cache."""
    from helpers import make_model, make_tokenizer

    src = tmp_path / "src"
    tok = make_tokenizer()
    make_model(len(tok)).save_pretrained(src)
    tok.save_pretrained(src)
    (src / "notes.bin.unused").write_bytes(b"not downloaded")
    stand_in = StandInHub({"tiny-org/tiny": {p.name: p for p in src.iterdir()}})
    try:
        env = {**os.environ, **stand_in.env(tmp_path)}
        pulled = chatbot(env, "pull", "tiny-org/tiny")
        assert pulled.returncode == 0, pulled.stderr
        assert (
            pulled.stdout.startswith("pulled tiny-org/tiny (")
            and "run it: chatbot run --model tiny-org/tiny" in pulled.stdout
        )
        got = {
            path.rsplit("/", 1)[-1]
            for method, path, _ in stand_in.requests
            if method == "GET" and "/resolve/" in path
        }
        assert {"model.safetensors", "config.json", "tokenizer.json"} <= got and "notes.bin.unused" not in got
        listed = chatbot(env, "models")
        assert "tiny-org/tiny" in listed.stdout
        removed = chatbot(env, "rm", "tiny-org/tiny")
        assert removed.returncode == 0 and removed.stdout.startswith(
            "removed tiny-org/tiny (the whole repo, "
        )
        assert not (Path(env["HF_HUB_CACHE"]) / "models--tiny-org--tiny").exists()
    finally:
        stand_in.close()
