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
from hub_standin import COMMIT, StandInHub

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


# --- a hostile hub --------------------------------------------------------------------------

SMALL = b"GGUF" + bytes(60_000)  # what the hostile stand-ins serve: small, so no slow mark


def hostile_env(stand_in: StandInHub, tmp_path: Path, **extra: str) -> dict[str, str]:
    """The environment of a chatbot process using `stand_in` with every cache under
    tmp_path/cache: what lies elsewhere under tmp_path is outside."""
    cache = tmp_path / "cache"
    return {**os.environ, **stand_in.env(cache), "XDG_CACHE_HOME": str(cache / "xdg"), **extra}


def outside(root: Path) -> dict[str, object]:
    """Every entry under `root` but outside root/cache: a link's target, a file's bytes."""
    seen: dict[str, object] = {}
    for folder, dirs, files in os.walk(root):
        here = Path(folder)
        dirs[:] = [d for d in dirs if here / d != root / "cache"]
        for name in dirs + files:
            p = here / name
            what = os.readlink(p) if p.is_symlink() else p.read_bytes() if p.is_file() else "folder"
            seen[str(p.relative_to(root))] = what
    return seen


# Each name leads out of the cache, to tmp_path/victim-Q4_1.gguf or tmp_path/victim/: the
# pointer is cache/hub/models--stand--evil/snapshots/COMMIT/NAME, the blob .../blobs/ETAG.
UP5 = "../" * 5
HOSTILE = {
    "an absolute file name": ({"name": "{tmp}/victim-Q4_1.gguf"}, "file name"),
    "a file name with ../": ({"name": UP5 + "victim-Q4_1.gguf"}, "file name"),
    "a file name with sub/../": ({"name": "sub/" + UP5 + "../victim-Q4_1.gguf"}, "file name"),
    "a file name with sub/../ inside": ({"name": "sub/../m-Q4_1.gguf"}, "file name"),
    "a commit with ../": ({"commit": "../../../../victim"}, "commit"),
    "an ETag with ../": ({"etag": "../../../../victim-Q4_1.gguf"}, "ETag"),
    "an ETag with /": ({"etag": "sub/victim"}, "ETag"),
    "an ETag ..": ({"etag": ".."}, "ETag"),
    "a revision with ../": ({"revision": "../../../../victim-Q4_1.gguf"}, "revision"),
    "a transformers repo's file name with ../": (
        {"name": UP5 + "victim.safetensors", "ref": "stand/evil"},
        "file name",
    ),
    "a transformers repo's ETag with ../": (
        {"name": "model.safetensors", "etag": "../../../../victim.safetensors", "ref": "stand/evil"},
        "ETag",
    ),
}


@pytest.mark.parametrize("case", HOSTILE)
def test_names_from_a_hostile_hub_are_refused_and_nothing_lands_outside_the_cache(case, tmp_path):
    how, what = HOSTILE[case]
    name = how.get("name", "m-Q4_1.gguf").format(tmp=tmp_path)
    stand_in = StandInHub({"stand/evil": {name: SMALL}})
    stand_in.commit = how.get("commit", COMMIT)
    stand_in.files["stand/evil"][name].etag = how.get("etag")
    (tmp_path / "victim").mkdir()
    for precious in (tmp_path / "victim-Q4_1.gguf", tmp_path / "victim" / "m-Q4_1.gguf"):
        precious.write_bytes(b"precious")
    before = outside(tmp_path)
    args = ["--revision", how["revision"]] if "revision" in how else []
    try:
        ref = how.get("ref", "stand/evil:Q4_1")
        done = chatbot(hostile_env(stand_in, tmp_path), "pull", ref, *args, timeout=60)
    finally:
        stand_in.close()
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert f"{what} " in done.stderr and "refused" in done.stderr, done.stderr
    assert outside(tmp_path) == before


def test_run_of_a_transformers_repo_refuses_a_hostile_etag_as_pull_does(tmp_path):
    """`run --model user/repo` downloads as `pull` does (huggingface_hub's snapshot_download
    names a blob by the ETag as given)."""
    stand_in = StandInHub({"stand/evil": {"model.safetensors": SMALL}})
    stand_in.files["stand/evil"]["model.safetensors"].etag = "../../../../victim.safetensors"
    before = outside(tmp_path)
    try:
        done = chatbot(hostile_env(stand_in, tmp_path), "run", "--model", "stand/evil", "hi", timeout=120)
    finally:
        stand_in.close()
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stderr.startswith("chatbot: error: the hub gives model.safetensors")
    assert "ETag that cannot name a file" in done.stderr
    assert outside(tmp_path) == before


def test_the_token_goes_to_the_hub_but_not_across_a_redirect_to_another_origin(tmp_path):
    files = {"stand/t": {"m-Q4_1.gguf": SMALL}}
    cdn = StandInHub(files)  # another port: another origin
    hub = StandInHub(files, redirect=cdn.url)
    same = StandInHub(files)
    same.redirect = same.url  # a redirect that stays on the hub
    try:
        for stand_in, folder in ((hub, "other"), (same, "same")):
            env = hostile_env(stand_in, tmp_path / folder, HF_TOKEN="hf_secret")
            done = chatbot(env, "pull", "stand/t:Q4_1", timeout=60)
            assert done.returncode == 0, done.stderr
            assert "(1 file, 60.0 KB, checked)" in done.stdout
    finally:
        for s in (cdn, hub, same):
            s.close()
    assert "Bearer hf_secret" in hub.auth
    assert [m for m, path, _ in cdn.requests] == ["GET"] and cdn.auth == [None]
    at_cdn = [a for (_, path, _), a in zip(same.requests, same.auth, strict=True) if path.startswith("/cdn/")]
    assert at_cdn and all(a == "Bearer hf_secret" for a in at_cdn)


@pytest.mark.parametrize(
    ("listed", "etag", "said"),
    [
        (True, "not-a-sha256", "(1 file, 60.0 KB, checked)"),  # against the listing's sha256
        (False, None, "(1 file, 60.0 KB, checked)"),  # against the ETag, a sha256
        (False, "0" * 40, "(1 file, 60.0 KB, not checked: the hub named no sha256 for m-Q4_1.gguf)"),
        (False, "not-a-sha256", "(1 file, 60.0 KB, not checked: the hub named no sha256 for m-Q4_1.gguf)"),
    ],
)
def test_pull_says_checked_only_of_what_it_checked(listed, etag, said, tmp_path):
    stand_in = StandInHub({"stand/u": {"m-Q4_1.gguf": SMALL}})
    stand_in.files["stand/u"]["m-Q4_1.gguf"].listed = listed
    stand_in.files["stand/u"]["m-Q4_1.gguf"].etag = etag
    try:
        done = chatbot(hostile_env(stand_in, tmp_path), "pull", "stand/u:Q4_1", timeout=60)
    finally:
        stand_in.close()
    assert done.returncode == 0, done.stderr
    assert said in done.stdout


def test_an_etag_sha256_the_file_does_not_match_is_refused(tmp_path):
    """With no sha256 in the listing, a sha256 ETag is what the file is checked against."""
    stand_in = StandInHub({"stand/u": {"m-Q4_1.gguf": SMALL}})
    stand_in.files["stand/u"]["m-Q4_1.gguf"].listed = False
    stand_in.files["stand/u"]["m-Q4_1.gguf"].etag = "0" * 64
    try:
        env = hostile_env(stand_in, tmp_path)
        done = chatbot(env, "pull", "stand/u:Q4_1", timeout=60)
    finally:
        stand_in.close()
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "m-Q4_1.gguf does not match the hub's checksum" in done.stderr
    assert [b for b in blobs(env) if not b.name.endswith(".lock")] == []


def test_a_body_longer_than_announced_is_cut_off_and_removed(tmp_path):
    stand_in = StandInHub({"stand/e": {"m-Q4_1.gguf": SMALL}}, overflow=64 << 20)
    try:
        done = chatbot(hostile_env(stand_in, tmp_path), "pull", "stand/e:Q4_1", timeout=120)
    finally:
        stand_in.close()
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert f"the hub sent more than the {len(SMALL)} bytes it announced for m-Q4_1.gguf" in done.stderr
    written = [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]
    assert not [p for p in written if p.stat().st_size > len(SMALL) or p.name.endswith(".partial")]
    assert stand_in.sent < 32 << 20  # it hung up (what the sockets' buffers took is less)
