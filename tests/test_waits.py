"""Every wait over about a second says what it is waiting for, on a terminal (pyte behind a
pseudo-terminal), and is gone from the screen once over; a pipe gets none of it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from screen import Terminal

pytest.importorskip("pyte")

SCRIPT = Path(__file__).parent / "scripted_chat.py"
LONG = " ".join(["zq"] * 400)  # several hundred tokens of the test tokenizer


@pytest.mark.parametrize("columns", [50, 80])
def test_a_long_message_shows_its_encoding_then_the_answer(tmp_path, terminals, columns):
    """A long message's prefill (held 4 s by the scripted model) is shown as a bar of tokens
    encoded out of the message's; the bar is gone when the answer is drawn. A short one shows
    none."""
    answer = tmp_path / "answer.md"
    answer.write_text("The answer is here.", encoding="utf-8")
    argv = [sys.executable, str(SCRIPT), str(answer), "--prefill-delay", "4"]
    term = Terminal(argv, columns=columns, lines=24, cwd=str(tmp_path))
    terminals.append(term)
    term.wait_prompt(120)
    term.type(LONG + "\r")
    term.wait_text("reading the message", 30)
    shown = "\n".join(term.lines())
    assert "0/" in shown and "tokens" in shown, shown
    term.wait_text("The answer is here.", 60)
    term.wait_prompt(60)
    term.pump(0.5)
    lines = term.lines()
    assert not [line for line in lines if "reading the message" in line], lines
    assert [line for line in lines if "The answer is here." in line], lines
    drawn = term.raw.count("reading the message")
    term.type("hi\r")
    term.wait_prompt(60)
    term.pump(0.5)
    assert term.raw.count("reading the message") == drawn  # a short message: no bar


def test_a_pipe_gets_no_encoding_bar(tmp_path):
    answer = tmp_path / "answer.md"
    answer.write_text("The answer is here.", encoding="utf-8")
    run = subprocess.run(
        [sys.executable, str(SCRIPT), str(answer)],
        input=LONG + "\n",
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert "The answer is here." in run.stdout
    assert "reading the message" not in run.stdout + run.stderr


def test_waits_nest_and_reach_every_listener_from_any_thread():
    import threading

    from chatbot import progress

    heard: list[str | None] = []
    assert progress.current() is None
    with progress.listen(heard.append):
        with progress.waiting("outer"):
            assert progress.current() == "outer"
            seen_in_thread: list[str | None] = []

            def inner() -> None:
                with progress.waiting("inner"):
                    seen_in_thread.append(progress.current())

            worker = threading.Thread(target=inner)
            worker.start()
            worker.join()
            assert seen_in_thread == ["inner"]
            late: list[str | None] = []
            with progress.listen(late.append):  # a listener that joins during a wait hears it
                pass
            assert late == ["outer"]
        assert progress.current() is None
    assert heard == ["outer", "inner", "outer", None]
    with progress.waiting("unheard"):
        pass
    assert heard[-1] is None and "unheard" not in heard


def test_the_kernels_build_is_a_wait_that_names_its_simd_level(tmp_path, monkeypatch):
    """A first build of the kernels (about 20 s) runs inside a wait that names the SIMD level
    the compiler targets here, as `chatbot doctor` names it."""
    from chatbot import doctor, progress
    from chatbot.engine.backends.native import build as kernel_build

    cc = kernel_build.find_compiler()
    if cc is None:
        pytest.skip("no C compiler")
    during: list[str | None] = []

    def build(cc_: str, target: Path, openmp: bool = True) -> None:
        during.append(progress.current())
        raise kernel_build.KernelsUnavailable("stopped here by the test")

    monkeypatch.setattr(kernel_build, "build", build)
    with pytest.raises(kernel_build.KernelsUnavailable):
        kernel_build.load_cached(cc, tmp_path / "k.so", tmp_path / "k-pool.so")
    level = doctor.compiler().simd
    assert len(during) == 2  # with OpenMP, then without
    assert during[0] is not None and "building the kernels" in during[0]
    assert f"for {level} " in during[0] and "once" in during[0]
    assert during[1] is not None and "no OpenMP" in during[1]
    assert progress.current() is None


def test_the_loading_toolbar_and_status_name_the_wait(tmp_path, terminals):
    """While the model loads behind the prompt, the toolbar names what the load waits on; a
    message sent meanwhile waits under a status line that names it too; both go when it is
    loaded."""
    answer = tmp_path / "answer.md"
    answer.write_text("The answer is here.", encoding="utf-8")
    flag = tmp_path / "loaded"
    words = "building the kernels for AVX2 (once, ~20 s)"
    argv = [sys.executable, str(SCRIPT), str(answer), "--load-when", str(flag), "--load-waits-on", words]
    term = Terminal(argv, columns=80, lines=24, cwd=str(tmp_path), env={"XDG_DATA_HOME": str(tmp_path)})
    terminals.append(term)
    term.wait_prompt(120)
    toolbar = lambda: next((line for line in reversed(term.screen_lines()) if line.strip()), "")
    term.wait_for(lambda: f"loading scripted: {words}… · /help" in toolbar(), 30, "the wait in the toolbar")
    term.type("hello\r")
    term.wait_text(f"{words}…", 30)  # what fits in 80 columns beside the spinner
    assert not [line for line in term.screen_lines() if line.startswith("to the prompt")]  # one row
    flag.touch()
    term.wait_text("The answer is here.", 60)
    term.wait_prompt(60)
    term.pump(0.5)
    assert not [line for line in term.lines() if "building the kernels" in line], term.lines()
