"""Developer tools kept beside the package, not in it: benchmarks of the kernels, builds, thread
counts, model sizes, start-up, the renderer and servers started side by side; the synthetic
GGUF writer; the fuzzer.

The wheel does not carry them. `scripts/` runs them from the checkout's root, and the tests
import them (pytest's `pythonpath` setting puts the root on `sys.path`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """A child process's environment in which `python -m devtools.X` imports this folder.

    Args:
        env: the environment to extend (default: this process's).

    Returns:
        A copy of `env` with the checkout's root first on PYTHONPATH.
    """
    out = dict(os.environ if env is None else env)
    out["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), out.get("PYTHONPATH", "")) if p)
    return out


def run_tool(prog: str, main: Callable[[list[str] | None], None], argv: list[str] | None = None) -> int:
    """Run a tool's `main(argv)`; a `ChatbotError` becomes one line on stderr, as in `chatbot`.

    Args:
        prog: the name the error line starts with (the script's).
        main: parses `argv` and runs the tool.
        argv: the arguments (default: `sys.argv[1:]`).

    Returns:
        The exit status: 0, or 2 after a user error (a bad file, a failed run).
    """
    from chatbot.errors import ChatbotError

    try:
        main(argv)
    except ChatbotError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    return 0
