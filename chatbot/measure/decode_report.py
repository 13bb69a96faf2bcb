"""`chatbot bench decode`'s figures as tables (`print_decode`), and its comparison with
llama.cpp in words (`versus_llama_cpp`)."""

from __future__ import annotations

from typing import Any

from chatbot.wording import counted

LLAMA_CPP = "llama.cpp"
"""The set-up name of llama.cpp in `chatbot bench decode`."""


def print_decode(console: Any, result: dict[str, Any]) -> None:
    """Rich tables of the medians, one row per set-up: decode, then prefill (two narrow
    tables rather than one that an 80-column terminal would squeeze to ellipses)."""
    from rich.table import Table

    s = result["settings"]
    sizes = [str(n) for n in s["prefill_sizes"]]
    title = (f"{s['model']}, {counted(result['machine']['torch_threads'], 'thread')}, "
             f"medians of {s['rounds']} interleaved rounds")  # fmt: skip
    decode = Table(title=f"decode: {title}")
    prefill = Table(title="prefill and time to first token")
    columns = ["tok/s", "p50\nms", "p90\nms", "peak\nMB", "B/\nweight", "same\ntok"]
    columns.append("load\navg")
    prefill_cols = [*[f"tok/s @{n}" for n in sizes], "TTFT s", "load s", "load avg"]
    for table, cols in ((decode, columns), (prefill, prefill_cols)):
        table.add_column("set-up", no_wrap=True)
        for col in cols:
            table.add_column(col, justify="right", no_wrap=True)
    for r in result["results"]:
        if "error" in r:
            decode.add_row(r["name"], f"[dim]{r['error']}[/dim]", *[""] * (len(columns) - 1))
            continue
        row = [
            r["name"],
            f"{r['decode_tps']:.1f}",
            f"{r['ms_per_token_p50']:.1f}",
            f"{r['ms_per_token_p90']:.1f}",
            f"{r['peak_mem_mb']:.0f}",
            f"{r['bytes_per_weight']:.3f}" if r.get("bytes_per_weight") else "",
            str(r.get("same_tokens_as_baseline", "")),
        ]
        load_avg = f"{r['loadavg']:.2f}" if r.get("loadavg") is not None else ""
        decode.add_row(*row, load_avg)
        load_s = f"{r['load_s']:.1f}" if "load_s" in r else ""
        prefill.add_row(r["name"], *[f"{r['prefill_tps'][n]:.0f}" for n in sizes], f"{r['ttft_s']:.3f}",
                        load_s, load_avg)  # fmt: skip
    console.print(decode)
    console.print(prefill)
    if s.get("ppl_tokens"):
        console.print(quality_table(result))
    for line in versus_llama_cpp(result):
        console.print(line, markup=False)
    for r in result["results"]:
        if "compiles" in r:  # the compiled step: its compile time is not in the figures above
            failed = f"; failed, eager steps: {r['compile_failure']}" if r.get("compile_failure") else ""
            console.print(f"{r['name']}: {r['compiles']} compiles, {r.get('compile_s', 0):.1f} s compiling, "
                          f"{r['graph_breaks']} graph breaks{failed}", markup=False)  # fmt: skip
    m = result["machine"]
    load = f"; load average {m['loadavg_start'][0]} -> {m['loadavg_end'][0]}" if "loadavg_start" in m else ""
    cpu = m.get("cpu_model", m["processor"])
    console.print(
        f"[dim]{cpu}, {m['cpu_count']} CPUs, torch {m['torch']}{load}. load avg: the 1-minute load "
        "average as the set-up's runs ended (median); load s: from starting its process to the model "
        "ready to run (imports, reading the file, packing). prefill: tokens/s "
        f"at that prompt length; TTFT: time to first token after a {s['decode_prompt_tokens']}-token "
        "prompt; p50/p90 ms: per decoded token; same tok: greedy tokens equal to transformers' "
        "before the first difference; B/weight: bytes per weight of the matrices the native "
        "kernels read[/dim]"
    )


def versus_llama_cpp(result: dict[str, Any], ours: str = "chatbot-auto") -> list[str]:
    """One line per figure: `ours` against llama.cpp from the same run (none when either
    is missing or failed)."""
    rows = {r["name"]: r for r in result["results"] if "error" not in r}
    a, b = rows.get(ours), rows.get(LLAMA_CPP)
    if a is None or b is None:
        return []
    size = "500" if "500" in a["prefill_tps"] else next(iter(a["prefill_tps"]))
    pairs = [
        ("decode tok/s", a["decode_tps"], b["decode_tps"], "x faster"),
        (f"prefill tok/s @{size}", a["prefill_tps"][size], b["prefill_tps"][size], "x faster"),
        ("load s", a.get("load_s"), b.get("load_s"), "x the time"),
        ("peak RSS MB", a["peak_mem_mb"], b["peak_mem_mb"], "x the memory"),
    ]
    if a.get("runtime_mb") and b.get("runtime_mb"):
        # What the model costs each side, apart from the runtime loaded before it (torch and
        # transformers against numpy and libllama): the part a smaller model shrinks.
        pairs += [
            ("RSS before the model (runtime) MB", a["runtime_mb"], b["runtime_mb"], "x the memory"),
            ("peak RSS above it MB", a["peak_mem_mb"] - a["runtime_mb"], b["peak_mem_mb"] - b["runtime_mb"],
             "x the memory"),
        ]  # fmt: skip
    load = f" (load average {a.get('loadavg', '?')} / {b.get('loadavg', '?')})"
    lines = [f"{ours} vs llama.cpp, same file, same run{load}:"]
    for label, x, y, unit in pairs:
        if x is None or y is None or not y:
            continue
        lines.append(f"  {label}: {x:,.1f} vs {y:,.1f} = {x / y:.2f}{unit}")
    return lines


def quality_table(result: dict[str, Any]) -> Any:
    """A rich table of each set-up's distributions against float32's on the same tokens
    (`chatbot.measure.quality`): perplexity, its distance from float32's with the standard
    error chance alone gives that distance on this text, mean KL divergence, top-1 agreement."""
    from rich.table import Table

    n = result["settings"]["ppl_tokens"]
    table = Table(title=f"quality over {n} tokens, against float32 (--opt off's forward pass)")
    table.add_column("set-up", no_wrap=True)
    for col in ("perplexity", "vs float32 ± se", "KL nats", "same top-1"):
        table.add_column(col, justify="right", no_wrap=True)
    scored = [r for r in result["results"] if "error" not in r and "ppl" in r]
    for r in scored:
        kl = f"{r['kl']:.5f}" if r["kl"] >= 1e-4 else f"{r['kl']:.1e}"
        gap = (
            f"{100 * (r['ppl'] / r['ref_ppl'] - 1):+.2f}% ± {100 * r.get('ppl_se', 0.0):.2f}"
            if r.get("ref_ppl")
            else "-"
        )
        table.add_row(r["name"], f"{r['ppl']:.4f}", gap, kl, f"{100 * r['top1']:.1f}%")
    return table
