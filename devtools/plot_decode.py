"""`scripts/plot-decode JSON PNG`: the figures of `chatbot bench decode --json` as bar charts."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from chatbot.errors import ConfigError


def plot_decode(result: dict[str, Any], path: Path) -> None:
    """Bar charts of decode and prefill speed as a PNG (needs matplotlib).

    Args:
        result: what `run_decode_bench` returns (`chatbot bench decode --json` writes it).
        path: the PNG to write.

    Raises:
        ConfigError: matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError(f"plotting needs matplotlib: {sys.executable} -m pip install matplotlib") from None
    rows = [r for r in result["results"] if "error" not in r]
    names = [r["name"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax1.barh(names, [r["decode_tps"] for r in rows], color="tab:blue")
    ax1.set_xlabel("decode tokens/s (higher is better)")
    ax1.invert_yaxis()
    sizes = result["settings"]["prefill_sizes"]
    width = 0.8 / len(sizes)
    for i, n in enumerate(sizes):
        ax2.barh([j + i * width for j in range(len(rows))], [r["prefill_tps"][str(n)] for r in rows],
                 height=width, label=f"{n} tokens")  # fmt: skip
    ax2.set_yticks([j + width for j in range(len(rows))], names)
    ax2.invert_yaxis()
    ax2.set_xlabel("prefill tokens/s")
    ax2.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=len(sizes), fontsize=8, frameon=False)
    fig.suptitle(f"{result['settings']['model']}, {result['machine']['torch_threads']} threads")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    """`scripts/plot-decode BENCH.json OUT.png`."""
    import argparse

    p = argparse.ArgumentParser(prog="scripts/plot-decode", description=__doc__)
    p.add_argument("json", type=Path, help="what `chatbot bench decode --json` wrote")
    p.add_argument("png", type=Path, help="the PNG to write")
    a = p.parse_args(argv)
    try:
        result = json.loads(a.json.read_text())
        result["results"], result["settings"]["prefill_sizes"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{a.json}: not the JSON of chatbot bench decode ({exc})") from None
    plot_decode(result, a.png)
    print(f"plot: {a.png}")


if __name__ == "__main__":
    from devtools import run_tool

    sys.exit(run_tool("plot-decode", main))
