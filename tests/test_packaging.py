"""What a user gets from `pip wheel .` or `pip install .`: every module, the presets (kept in
the checkout's top-level configs/), the kernels' source and the licence travel in the wheel, no
developer tool does, and the installed copy (not this source tree) lists the presets and chats
with one; an editable install (scripts/setup's) lists them from configs/."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from email.parser import Parser
from importlib import metadata
from pathlib import Path

import pytest

from chatbot import DISTRIBUTION

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
    (found,) = out.glob(f"{DISTRIBUTION.replace('-', '_')}-*.whl")
    return found


SHIPPED = sorted(p.stem for p in (ROOT / "configs").glob("*.yaml"))


def test_the_wheel_holds_every_module_preset_the_kernels_and_the_licence(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "default" in SHIPPED and not (ROOT / "chatbot" / "configs").exists()
    assert {f"chatbot/configs/{name}.yaml" for name in SHIPPED} <= names
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "chatbot").rglob("*.py")}
    assert modules - names == set()  # a subpackage missing from pyproject's list fails here
    assert not [n for n in names if n.startswith(("devtools/", "configs/", "tests/"))]
    csrc = ROOT / "chatbot" / "engine" / "backends" / "native" / "csrc"
    parts = {p.relative_to(ROOT).as_posix() for p in csrc.rglob("*") if p.is_file()}
    assert (
        "chatbot/engine/backends/native/csrc/kernels.c" in parts
        and "chatbot/engine/backends/native/csrc/kernels.h" in parts
    )
    assert parts - names == set()  # every part the build includes (and its cache key hashes)
    (licence,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
    assert "MIT License" in zipfile.ZipFile(wheel).read(licence).decode()
    (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
    metadata = Parser().parsestr(zipfile.ZipFile(wheel).read(meta).decode())
    assert metadata["License-Expression"] == "MIT"
    # a name of our own: pip install chatbot gets PyPI's chatbot, a wiki chat tool of 2013
    assert metadata["Name"] == DISTRIBUTION == "chatbot-local"
    entry_points = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    assert "chatbot = chatbot.cli.app:main" in zipfile.ZipFile(wheel).read(entry_points[0]).decode()


def listed_presets(stdout: str) -> list[str]:
    """The preset names `chatbot models` prints, in its order (an entry's first line is
    indented two spaces; its description under it, six)."""
    section = stdout.split("presets (chatbot run --preset NAME):\n", 1)[1].split("\nmodels on", 1)[0]
    return [line.split()[0] for line in section.splitlines() if line.startswith("  ") and line[2] != " "]


def test_an_editable_install_lists_the_presets_of_configs(tmp_path):
    """scripts/setup installs the checkout editable: its `chatbot models`, run away from the
    checkout, lists configs/."""
    # (a chatbot.egg-info in the checkout, left by a build, carries no direct_url.json)
    urls = [
        json.loads(d.read_text("direct_url.json") or "{}") for d in metadata.distributions(name=DISTRIBUTION)
    ]
    if not any(u.get("dir_info", {}).get("editable") and u["url"] == ROOT.as_uri() for u in urls):
        pytest.skip("chatbot is not installed editable from this checkout (scripts/setup does that)")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CHATBOT_PRESETS")}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "config")
    code = "import sys, chatbot, chatbot.cli.app as app; print(chatbot.__file__, file=sys.stderr); app.main()"
    listed = subprocess.run([sys.executable, "-c", code, "models"], capture_output=True, text=True,
                            timeout=300, cwd=tmp_path, env=env, check=False)  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    assert listed.stderr.splitlines()[0] == str(ROOT / "chatbot" / "__init__.py")
    assert sorted(listed_presets(listed.stdout)) == SHIPPED


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """The wheel installed into a folder of its own (its dependencies: this environment's)."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=True,
        timeout=300,
        capture_output=True,
    )
    return target


def installed_chatbot(
    target: Path, cwd: Path, *args: str, stdin: str = ""
) -> subprocess.CompletedProcess[str]:
    """`chatbot ARGS` from the installed copy, first on the path; cwd is not the source tree."""
    env = {**os.environ, "PYTHONPATH": str(target), "XDG_CONFIG_HOME": str(cwd / "config")}
    env.pop("CHATBOT_PRESETS", None)
    code = "import sys, chatbot, chatbot.cli.app as app; print(chatbot.__file__, file=sys.stderr); app.main()"
    return subprocess.run([sys.executable, "-c", code, *args], input=stdin, capture_output=True, text=True,
                          timeout=300, cwd=cwd, env=env, check=False)  # fmt: skip


def test_the_installed_copy_lists_the_presets(installed, tmp_path):
    listed = installed_chatbot(installed, tmp_path, "models")
    assert listed.returncode == 0, listed.stderr
    assert str(installed) in listed.stderr.splitlines()[0]
    assert sorted(listed_presets(listed.stdout)) == SHIPPED
    assert not (installed / "configs").exists() and not (installed / "devtools").exists()


@pytest.mark.slow
def test_the_installed_copy_chats_with_a_preset(installed, tmp_path):
    chat = installed_chatbot(installed, tmp_path, "run", "--preset", "default", "--greedy",
                             "--max-new-tokens", "8", stdin="Hi\n")  # fmt: skip
    assert chat.returncode == 0, chat.stderr
    assert str(installed) in chat.stderr.splitlines()[0]
    assert chat.stdout.strip(), chat.stderr
    assert "tok/s" in chat.stderr
