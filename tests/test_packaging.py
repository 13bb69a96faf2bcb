"""What a user gets from `pip wheel .` or `pip install .`: the presets, the kernels' source
and the licence travel in the wheel, and the installed copy (not this source tree) chats with
a preset."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    args = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "--disable-pip-version-check"]
    try:  # the venv's setuptools when it can build (no download); else pip's isolated build
        import setuptools

        if int(setuptools.__version__.split(".")[0]) >= 77:
            args.append("--no-build-isolation")
    except ImportError:
        pass
    subprocess.run([*args, "-w", str(out), str(ROOT)], check=True, timeout=600, capture_output=True)
    (found,) = out.glob("chatbot-*.whl")
    return found


def test_the_wheel_holds_every_preset_the_kernels_and_the_licence(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = sorted(p.name for p in (ROOT / "chatbot" / "configs").glob("*.yaml"))
    assert "default.yaml" in shipped
    assert {f"chatbot/configs/{name}" for name in shipped} <= names
    assert "chatbot/engine/kernels.c" in names
    (licence,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
    assert "MIT License" in zipfile.ZipFile(wheel).read(licence).decode()
    (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
    metadata = Parser().parsestr(zipfile.ZipFile(wheel).read(meta).decode())
    assert metadata["License-Expression"] == "MIT"


@pytest.mark.slow
def test_the_installed_copy_lists_the_presets_and_chats_with_one(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=True,
        timeout=300,
        capture_output=True,
    )
    # The installed copy comes first on the path; cwd is not the source tree.
    env = {**os.environ, "PYTHONPATH": str(target), "XDG_CONFIG_HOME": str(tmp_path / "config")}
    env.pop("CHATBOT_PRESETS", None)

    def chatbot(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
        code = (
            "import sys, chatbot, chatbot.cli; print(chatbot.__file__, file=sys.stderr); chatbot.cli.main()"
        )
        return subprocess.run(
            [sys.executable, "-c", code, *args],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp_path,
            env=env,
            check=False,
        )

    listed = chatbot("models")
    assert listed.returncode == 0, listed.stderr
    assert str(target) in listed.stderr.splitlines()[0]
    for name in ("default", "qwen2.5-instruct", "llama-3-instruct"):
        assert f"\n  {name} " in listed.stdout, listed.stdout
    chat = chatbot("run", "--preset", "default", "--greedy", "--max-new-tokens", "8", stdin="Hi\n")
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout.strip(), chat.stderr
    assert "tok/s" in chat.stderr
