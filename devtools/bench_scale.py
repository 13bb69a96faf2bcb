"""Ours against llama.cpp as models grow: `chatbot bench decode` on synthetic GGUF files.

For each (architecture, size, file type) the file is written once under a scratch folder
(`scripts/make-synthetic-gguf`: random weights in the real layout; never in git), then
`chatbot bench decode --model FILE --setups chatbot-auto,llama.cpp` runs on it, so both sides
read the very same file, each in its own process, at the same thread count. The rows (decode
and prefill tok/s, time to load, peak RSS, the CPU and load average) go into
docs/benchmarks.md between two markers, beside an SVG plot drawn here (no plotting library).

A row that would not fit is skipped with one line saying why: the memory it needs (our peak
RSS per parameter in the previous row, scaled) against what the machine has available, or
the time left before `--minutes` runs out.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from devtools import child_env

START = "<!-- bench-scale:start -->"
END = "<!-- bench-scale:end -->"
ARCH_MARKERS = ("<!-- bench-archs:start -->", "<!-- bench-archs:end -->")
"""Where `--archs` writes its table (the other architectures, at one size each)."""
OURS = "chatbot-auto"
KEEP_FREE_MB = 3072  # the machine is shared: never push the others into swap or the OOM killer
PEER = "llama.cpp"
FIGURES = (
    ("decode_tps", "decode tok/s", True),
    ("prefill_tps", "prefill tok/s @500", True),
    ("load_s", "time to load, s", False),
    ("peak_mem_mb", "peak RSS, MB", False),
)
"""(key, label, higher is better) of each plotted figure."""


@dataclass(frozen=True)
class Case:
    """One synthetic model file to measure."""

    arch: str
    params: str
    type: str

    @property
    def label(self) -> str:
        return f"{self.arch} {self.params} {self.type}"

    def path(self, folder: Path) -> Path:
        if self.arch == DEFAULT_ARCH:
            from chatbot.models.loader import default_gguf_path

            return Path(default_gguf_path())
        return folder / f"synthetic-{self.arch}-{self.params}-{self.type}.gguf"


DEFAULT_ARCH = "default"
"""The arch name of the row that measures the default model's own GGUF file (real weights)."""
DEFAULT_CASES = (Case(DEFAULT_ARCH, "135M", "Q4_1"),) + tuple(
    Case(arch, params, kind)
    for arch, params, kinds in (
        ("llama", "135M", ("Q4_K_M", "Q8_0")),
        ("qwen2", "0.5B", ("Q4_K_M", "Q8_0")),
        ("qwen2", "1.5B", ("Q4_K_M", "Q8_0")),
        ("qwen2", "3B", ("Q4_K_M", "Q8_0")),
        ("llama", "8B", ("Q4_K_M",)),
    )
    for kind in kinds
)
ARCH_CASES = tuple(
    Case(arch, params, kind)
    for arch, params in (("gemma3", "1B"), ("gemma2", "2B"))
    for kind in ("Q4_K_M", "Q8_0")
)
"""`--archs`: the architectures with more to them than Llama's layer (Gemma's four norms per
layer, GeGLU, soft-capping, sliding windows, a 256k vocabulary), at their published sizes."""


def params_count(params: str) -> float:
    """'135M' -> 1.35e8, '1.5B' -> 1.5e9."""
    m = re.fullmatch(r"([0-9.]+)([MB])", params.strip(), re.IGNORECASE)
    if not m:
        raise ValueError(f"not a size like 0.5B or 135M: {params!r}")
    return float(m.group(1)) * (1e6 if m.group(2).upper() == "M" else 1e9)


def mem_available_mb(meminfo: Path = Path("/proc/meminfo")) -> float | None:
    """MemAvailable in MB, or None where there is no /proc/meminfo."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def memory_needed_mb(case: Case, measured: list[dict[str, Any]], file_mb: float) -> float:
    """Our peak RSS at `case`, guessed from the largest row measured so far (MB per
    parameter, the worse of ours and llama.cpp's), and never below the file's size plus 10%
    for llama.cpp, which maps all of it."""
    # The largest size only: at small sizes the fixed part (Python, torch: ~0.5 GB) dominates
    # and would scale to absurd figures.
    largest = max((params_count(r["params"]) for r in measured), default=0.0)
    per_param = [
        row[side]["peak_mem_mb"] / params_count(row["params"])
        for row in measured
        for side in (OURS, PEER)
        if params_count(row["params"]) == largest
        and isinstance(row.get(side), dict)
        and "peak_mem_mb" in row[side]
    ]
    guess = max(per_param) * params_count(case.params) if per_param else 0.0
    return max(guess, 1.1 * file_mb)


def skip_reason(
    case: Case,
    measured: list[dict[str, Any]],
    file_mb: float,
    available_mb: float | None,
    seconds_left: float,
) -> str | None:
    """Why `case` cannot run now (one line), or None when it can."""
    need = memory_needed_mb(case, measured, file_mb)
    if available_mb is not None and need > available_mb - KEEP_FREE_MB:
        return (
            f"needs ~{need / 1024:.1f} GB (scaled from the last row), {available_mb / 1024:.1f} GB available "
            f"({KEEP_FREE_MB / 1024:.0f} GB kept free for the other processes)"
        )
    last = next((r for r in reversed(measured) if r.get("wall_s")), None)
    if last is not None:
        # Bench time grows about with the parameter count (every token reads every weight).
        expect = last["wall_s"] * params_count(case.params) / params_count(last["params"])
        if expect > seconds_left:
            return (
                f"would take ~{expect / 60:.0f} min (scaled from the last row), "
                f"{seconds_left / 60:.0f} min left"
            )
    return None


def ensure_file(case: Case, folder: Path, python: str = sys.executable) -> Path:
    """The synthetic GGUF of `case` under `folder`, written first when missing."""
    path = case.path(folder)
    if not path.is_file() and case.arch != DEFAULT_ARCH:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".part")
        cmd = [python, "-m", "devtools.gguf_synthetic", "--arch", case.arch, "--params", case.params,
               "--type", case.type, "-o", str(tmp)]  # fmt: skip
        subprocess.run(cmd, check=True, capture_output=True, text=True, env=child_env())
        tmp.rename(path)
    return path


def bench_json_path(path: Path) -> Path:
    """Where `bench_one` keeps the JSON of `path`'s bench (under the temporary folder)."""
    return Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-scale-{path.stem}.json"


def bench_one(
    path: Path, *, threads: int, rounds: int, decode_tokens: int, prefill: str, python: str = sys.executable
) -> dict[str, Any]:
    """`chatbot bench decode` on one file, ours against llama.cpp; its JSON."""
    out = bench_json_path(path)
    out.unlink(missing_ok=True)
    first_load_s = warm_up(path, python)
    cmd = [python, "-m", "chatbot.cli", "bench", "decode", "--model", str(path), "--setups", f"{OURS},{PEER}",
           "--threads", str(threads), "--rounds", str(rounds), "--decode-tokens", str(decode_tokens),
           "--prefill", prefill, "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0 or not out.is_file():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"bench decode failed ({proc.returncode}): {tail[0]}")
    data: dict[str, Any] = json.loads(out.read_text())
    data["first_load_s"] = first_load_s
    data["startup"] = startup_one(path, threads=threads, rounds=rounds, python=python)
    out.write_text(json.dumps(data, indent=1))
    return data


def startup_one(path: Path, *, threads: int, rounds: int, python: str = sys.executable) -> dict[str, Any]:
    """`scripts/bench-startup` on one file (`chatbot run` to its prompt and to the model
    ready, against llama.cpp's load): its JSON, or ``{"error": ...}``."""
    out = bench_json_path(path).with_suffix(".startup.json")
    out.unlink(missing_ok=True)
    cmd = [python, "-m", "devtools.bench_startup", "--model", str(path), "--threads", str(threads),
           "--rounds", str(max(rounds, 3)), "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=child_env())
    if proc.returncode != 0 or not out.is_file():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"error": f"bench startup failed ({proc.returncode}): {tail[0]}"}
    result: dict[str, Any] = json.loads(out.read_text())
    return result


WARM_UP = """
import sys
from chatbot.engine.backends.native.decoder import make_decoder
from chatbot.models.loader import load_model
loaded = load_model(sys.argv[1], device="cpu", dtype="float32")
make_decoder(loaded.model, "auto")
"""


def warm_up(path: Path, python: str = sys.executable) -> float | None:
    """Load `path` once as ours would, untimed by the bench: the first load of a file writes
    its metadata cache (and of a changed csrc/, builds the library), which later starts
    skip. Returns that first load's seconds (None when it failed: the bench will say why)."""
    start = time.monotonic()
    proc = subprocess.run([python, "-c", WARM_UP, str(path)], capture_output=True, text=True, check=False)
    return time.monotonic() - start if proc.returncode == 0 else None


def row_from_bench(case: Case, path: Path, data: dict[str, Any], wall_s: float) -> dict[str, Any]:
    """The figures of one file, ours and llama.cpp's, from `bench decode`'s JSON."""
    row: dict[str, Any] = {
        "arch": case.arch,
        "params": case.params,
        "type": case.type,
        "file_mb": path.stat().st_size / 2**20,
        "wall_s": wall_s,
        "cpu": data["machine"].get("cpu_model", data["machine"].get("processor")),
        "threads": data["machine"].get("torch_threads"),
        "rounds": data.get("settings", {}).get("rounds"),
        "loadavg": [
            data["machine"].get("loadavg_start", [None])[0],
            data["machine"].get("loadavg_end", [None])[0],
        ],
    }
    for r in data["results"]:
        if r["name"] not in (OURS, PEER):
            continue
        if "error" in r:
            row[r["name"]] = {"error": r["error"]}
            continue
        sizes = r["prefill_tps"]
        size = "500" if "500" in sizes else max(sizes, key=int)
        row[r["name"]] = {
            "decode_tps": r["decode_tps"], "prefill_tps": sizes[size], "prefill_at": int(size),
            "load_s": r.get("load_s"), "peak_mem_mb": r["peak_mem_mb"], "runtime_mb": r.get("runtime_mb"),
            "loadavg": r.get("loadavg"), "weights": r.get("weights"),
        }  # fmt: skip
    if isinstance(row.get(OURS), dict):
        row[OURS]["first_load_s"] = data.get("first_load_s")
    startup = data.get("startup") or {}
    if "error" in startup:
        row["startup_error"] = startup["error"]
    elif startup:
        for name, side, key in (
            (OURS, "ours", "prompt_s"),
            (OURS, "ours", "ready_s"),
            (PEER, "llama_cpp", "load_s"),
        ):
            if isinstance(row.get(name), dict) and (startup.get(side) or {}).get(key) is not None:
                row[name]["prompt_s" if name == PEER else key] = startup[side][key]
    return row


def run_scale(
    cases: list[Case],
    folder: Path,
    *,
    threads: int,
    rounds: int = 2,
    decode_tokens: int = 64,
    prefill: str = "50,500",
    minutes: float = 60.0,
    reuse: bool = False,
    progress: Callable[[str], None] = lambda line: None,
) -> list[dict[str, Any]]:
    """Measure each case in order (smallest first, so memory and time can be guessed for the
    next); a case that cannot run is a row with its one-line reason. `reuse`: take a file's
    figures from the JSON an earlier run left (`bench_json_path`) instead of measuring again."""
    deadline = time.monotonic() + 60 * minutes
    rows: list[dict[str, Any]] = []
    for case in cases:
        measured = [r for r in rows if "skipped" not in r]
        path = case.path(folder)
        if reuse and path.is_file() and bench_json_path(path).is_file():
            data = json.loads(bench_json_path(path).read_text())
            progress(f"{case.label}: figures of the earlier run ({bench_json_path(path)})")
            rows.append(row_from_bench(case, path, data, data["settings"].get("wall_s", 0.0)))
            continue
        est_mb = params_count(case.params) * (1.1 if case.type == "Q8_0" else 0.6) / 2**20
        reason = skip_reason(case, measured, est_mb, mem_available_mb(), deadline - time.monotonic())
        if reason is None:
            try:
                progress(f"{case.label}: writing the file" if not case.path(folder).is_file() else case.label)
                path = ensure_file(case, folder)
                reason = skip_reason(case, measured, path.stat().st_size / 2**20, mem_available_mb(),
                                     deadline - time.monotonic())  # fmt: skip
                if reason is None:
                    progress(f"{case.label}: bench decode ({path.stat().st_size / 2**20:,.0f} MB)")
                    start = time.monotonic()
                    data = bench_one(path, threads=threads, rounds=rounds, decode_tokens=decode_tokens,
                                     prefill=prefill)  # fmt: skip
                    rows.append(row_from_bench(case, path, data, time.monotonic() - start))
                    continue
            except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
                reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        progress(f"{case.label}: skipped: {reason}")
        rows.append({"arch": case.arch, "params": case.params, "type": case.type, "skipped": reason})
    return rows


# --- output ----------------------------------------------------------------------------------


def _fmt(value: Any, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _ratio(row: dict[str, Any], key: str) -> str:
    a, b = row.get(OURS, {}), row.get(PEER, {})
    x, y = a.get(key), b.get(key)
    return f"{x / y:.2f}x" if x is not None and y else "-"


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table, ours / llama.cpp per figure, with the ratio."""
    lines = [
        (
            "| model | file MB | decode tok/s ours / llama.cpp | prefill tok/s @500 ours / llama.cpp "
            "| load s ours / llama.cpp | `chatbot run` to the prompt s / llama.cpp's load "
            "| peak RSS MB ours / llama.cpp | load avg start / end |"
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        name = f"{row['arch']} {row['params']} {row['type']}"
        if "skipped" in row:
            lines.append(f"| {name} | | skipped: {row['skipped']} | | | | | |")
            continue
        cells = []
        keys = (("decode_tps", 1), ("prefill_tps", 0), ("load_s", 1), ("prompt_s", 2), ("peak_mem_mb", 0))
        for key, digits in keys:
            a, b = row.get(OURS, {}), row.get(PEER, {})
            if key == "prompt_s" and "startup_error" in row:
                cells.append(row["startup_error"])
                continue
            if "error" in a or "error" in b:
                cells.append(f"ours: {a.get('error', 'ok')}; llama.cpp: {b.get('error', 'ok')}")
                continue
            at = f" @{a['prefill_at']}" if key == "prefill_tps" and a.get("prefill_at", 500) != 500 else ""
            cells.append(f"{_fmt(a.get(key), digits)} / {_fmt(b.get(key), digits)} ({_ratio(row, key)}){at}")
        load = " / ".join(_fmt(x, 2) for x in row["loadavg"])
        if row.get("rounds"):
            name += f" ({row['rounds']} round{'s' if row['rounds'] > 1 else ''})"
        lines.append(f"| {name} | {row['file_mb']:,.0f} | {' | '.join(cells)} | {load} |")
    return "\n".join(lines)


def svg_plot(rows: list[dict[str, Any]], title: str) -> str:
    """Four small line charts (decode, prefill, load time, peak RSS against model size; log
    scale), ours and llama.cpp, solid for Q4_K_M and dashed for Q8_0, as an SVG document."""
    measured = [r for r in rows if "skipped" not in r]
    sizes = sorted({r["params"] for r in measured}, key=params_count)
    types = sorted({r["type"] for r in measured})
    colors = {OURS: "#1f77b4", PEER: "#d62728"}
    dashes = ["", "6,4", "2,3"]
    pw, ph, left, top = 300, 190, 60, 40  # panel size and margins
    width, height = 2 * (pw + left + 20), 2 * (ph + top + 40) + 50
    out = [
        (
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'font-family="sans-serif" font-size="11">'
        ),
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{width / 2}" y="18" text-anchor="middle" font-size="13">{_esc(title)}</text>',
    ]
    for i, (key, label, better_up) in enumerate(FIGURES):
        x0 = left + (i % 2) * (pw + left + 20)
        y0 = top + (i // 2) * (ph + top + 40)
        values = [r[s][key] for r in measured for s in (OURS, PEER)
                  if isinstance(r.get(s), dict) and r[s].get(key)]  # fmt: skip
        out.append(f'<text x="{x0 + pw / 2}" y="{y0 - 8}" text-anchor="middle">{_esc(label)} '
                   f'({"higher" if better_up else "lower"} is better)</text>')  # fmt: skip
        out.append(f'<rect x="{x0}" y="{y0}" width="{pw}" height="{ph}" fill="none" stroke="#888"/>')
        if not values:
            continue
        lo, hi = math.log10(min(values)) - 0.05, math.log10(max(values)) + 0.05

        def y_of(v: float, lo: float = lo, hi: float = hi, y0: float = y0) -> float:
            return y0 + ph - (math.log10(v) - lo) / (hi - lo) * ph

        def x_of(params: str, x0: float = x0) -> float:
            return x0 + pw * (sizes.index(params) + 0.5) / len(sizes)

        for tick in _ticks(10**lo, 10**hi):
            y = y_of(tick)
            out.append(f'<line x1="{x0}" x2="{x0 + pw}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eee"/>')
            out.append(f'<text x="{x0 - 4}" y="{y + 4:.1f}" text-anchor="end">{tick:g}</text>')
        for params in sizes:
            out.append(
                f'<text x="{x_of(params):.1f}" y="{y0 + ph + 14}" text-anchor="middle">{params}</text>'
            )
        for side in (OURS, PEER):
            for t, kind in enumerate(types):
                pts = [
                    (x_of(r["params"]), y_of(r[side][key]))
                    for r in measured
                    if r["type"] == kind and isinstance(r.get(side), dict) and r[side].get(key)
                ]
                if not pts:
                    continue
                path = " ".join(f"{x:.1f},{y:.1f}" for x, y in pts)
                dash = f' stroke-dasharray="{dashes[t % len(dashes)]}"' if dashes[t % len(dashes)] else ""
                out.append(
                    f'<polyline points="{path}" fill="none" stroke="{colors[side]}" stroke-width="2"{dash}/>'
                )
                out.extend(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{colors[side]}"/>' for x, y in pts)
    ly = height - 22
    legend = [(f"ours ({OURS})", colors[OURS], ""), ("llama.cpp", colors[PEER], "")]
    legend += [(kind, "#444", dashes[t % len(dashes)]) for t, kind in enumerate(types)]
    for j, (name, color, dash) in enumerate(legend):
        lx = left + j * 150
        extra = f' stroke-dasharray="{dash}"' if dash else ""
        out.append(
            f'<line x1="{lx}" x2="{lx + 30}" y1="{ly}" y2="{ly}" stroke="{color}" stroke-width="2"{extra}/>'
        )
        out.append(f'<text x="{lx + 36}" y="{ly + 4}">{_esc(name)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _esc(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _ticks(lo: float, hi: float) -> list[float]:
    """1-2-5 ticks between lo and hi."""
    ticks = []
    for exp in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1):
        for m in (1, 2, 5):
            v = m * 10.0**exp
            if lo <= v <= hi:
                ticks.append(v)
    return ticks


def update_markdown(doc: Path, section: str, markers: tuple[str, str] = (START, END)) -> None:
    """Put `section` between the (start, end) `markers` of `doc` (appended with them when the
    markers are not there yet)."""
    start, end = markers
    text = doc.read_text(encoding="utf-8") if doc.is_file() else ""
    block = f"{start}\n{section.rstrip()}\n{end}"
    if start in text and end in text:
        head, rest = text.split(start, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    doc.write_text(text, encoding="utf-8")


def section(rows: list[dict[str, Any]], command: str, code: str, svg_name: str | None) -> str:
    """The Markdown written into docs/benchmarks.md (`svg_name`: the plot below the table)."""
    measured = [r for r in rows if "skipped" not in r]
    cpu = measured[0]["cpu"] if measured else "?"
    threads = measured[0]["threads"] if measured else "?"
    return "\n".join([
        f"Written by `{command}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; code: {code}).",
        (f"CPU: {cpu}, {os.cpu_count()} CPUs, {threads} threads on both sides. Each cell: ours / llama.cpp "
        "(ratio, ours over llama.cpp), the median of the bench's rounds; load s: from starting the process "
        "to the model ready, after one untimed first load of the file (it writes our small metadata cache; "
        "its time is `first_load_s` in the JSON); to the prompt: `scripts/bench-startup`, from starting "
        "`chatbot run --model FILE` in a pseudo-terminal to its prompt drawn (the model then loads behind "
        "it; `ready_s` in the JSON is to its banner), against llama.cpp's process to `Llama(...)` built, "
        "medians of at least 3 rounds; the load average (1 minute) as each file's bench started and ended."),
        "",
        markdown_table(rows),
        *(["", f"![ours against llama.cpp by model size]({svg_name})"] if svg_name else []),
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """`scripts/bench-scale`: measure, then write docs/benchmarks.md's section, the SVG and
    the JSON."""
    import argparse
    import importlib.util

    p = argparse.ArgumentParser(prog="scripts/bench-scale", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="threads for both sides (default 1: a small machine shared with other jobs)",
    )
    p.add_argument("--rounds", type=int, default=2, help="bench decode rounds per file (medians)")
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--prefill", default="50,500", help="prompt lengths prefill is timed at")
    p.add_argument("--minutes", type=float, default=60.0, help="stop starting new files after this long")
    p.add_argument(
        "--only", help="comma-separated sizes, types or size:type to keep, e.g. 0.5B,Q8_0,135M:Q4_K_M"
    )
    p.add_argument(
        "--folder",
        type=Path,
        default=Path(os.environ.get("TMPDIR", "/tmp")) / "chatbot-scale",
        help="where the synthetic files are written (default /tmp/chatbot-scale)",
    )
    p.add_argument("--doc", type=Path, default=Path("docs/benchmarks.md"))
    p.add_argument("--code", default="", help="which code was measured, for the doc (default: git describe)")
    p.add_argument(
        "--reuse",
        action="store_true",
        help="take the figures of files an earlier run measured (their JSON under the temporary folder)",
    )
    p.add_argument(
        "--archs",
        action="store_true",
        help="the other architectures (gemma3 1B, gemma2 2B) instead of the sizes; their own table",
    )
    p.add_argument("--dry-run", action="store_true", help="list the files and exit")
    a = p.parse_args(argv)
    cases = list(ARCH_CASES if a.archs else DEFAULT_CASES)
    if a.only:
        keep = {k.strip().lower() for k in a.only.split(",")}
        cases = [c for c in cases if keep & {c.params.lower(), c.type.lower(), c.arch,
                                             f"{c.params}:{c.type}".lower()}]  # fmt: skip
    if a.dry_run:
        for c in cases:
            print(f"{c.label}: {c.path(a.folder)}")
        return 0
    if importlib.util.find_spec("llama_cpp") is None:
        print(
            "bench-scale: llama-cpp-python is not installed; the llama.cpp column stays empty",
            file=sys.stderr,
        )
    # The code measured: HEAD as the run starts (a long run may outlive later commits).
    code = a.code or subprocess.run(["git", "log", "-1", "--format=%h %s"], capture_output=True, text=True,
                                    check=False).stdout.strip()[:90]  # fmt: skip
    rows = run_scale(
        cases,
        a.folder,
        threads=a.threads,
        rounds=a.rounds,
        decode_tokens=a.decode_tokens,
        prefill=a.prefill,
        minutes=a.minutes,
        reuse=a.reuse,
        progress=lambda line: print(f"bench-scale: {line}", file=sys.stderr, flush=True),
    )
    command = "scripts/bench-scale " + " ".join(argv if argv is not None else sys.argv[1:])
    out_json = a.doc.parent / ("bench_archs.json" if a.archs else "bench_scale.json")
    out_json.write_text(json.dumps(rows, indent=1), encoding="utf-8")
    if a.archs:
        update_markdown(a.doc, section(rows, command.strip(), code, None), ARCH_MARKERS)
        written = f"{a.doc}, {out_json}"
    else:
        svg = a.doc.parent / "bench_scale.svg"
        title = f"ours vs llama.cpp, same GGUF files, {a.threads} thread(s) each"
        svg.write_text(svg_plot(rows, title), encoding="utf-8")
        update_markdown(a.doc, section(rows, command.strip(), code, svg.name))
        written = f"{a.doc}, {svg}, {out_json}"
    print(markdown_table(rows))
    print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
