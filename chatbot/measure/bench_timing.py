"""What every set-up of `chatbot bench decode` measures the same way, in its worker process:
the tasks it decodes, its resident memory, and its figures from its own prefill and decode
(`timed`)."""

from __future__ import annotations

import re
import statistics
from collections.abc import Callable
from importlib import resources
from typing import Any

from chatbot.engine.seq import quantile

PREFILL_REPEATS = {50: 5, 500: 3, 2000: 2}  # per worker; the median is kept
DECODE_PROMPT = 50  # tokens before the decoded ones: a short chat message

TASKS = {
    "text": None,  # the bench's text, 50 tokens of it, continued
    "repeat": "Repeat this text word for word:\n\n{text}",  # grounded in its input
    "edit": "Please proofread and correct this text, returning the full corrected text:\n\n{text}",
    "write": "Write a long story about a lighthouse keeper who finds a message in a bottle.",
}
"""What `--task` decodes: a chat message (`{text}`: ~300 words of prose from
chatbot/data/long_text.txt), or None: a cut of the bench's text. Speculative decoding pays on
the grounded ones; "edit" is grounded to its end (the default model answers it with the whole
text, 383 tokens, where it paraphrases "repeat" after a sentence or two and ends it at 90)."""
TASK_WORDS = 300


def task_message(task: str) -> str | None:
    """The chat message of `task` (None for "text"): its words are the first `TASK_WORDS` of
    the shipped text's prose paragraphs (its headings, directives and code left out)."""
    message = TASKS[task]
    if message is None:
        return None
    text = resources.files("chatbot").joinpath("data/long_text.txt").read_text(encoding="utf-8")
    prose = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text) if _is_prose(p)]
    return message.format(text=" ".join(" ".join(prose).split()[:TASK_WORDS]))


def _is_prose(paragraph: str) -> bool:
    """A paragraph of sentences: not indented (code, directives), not a heading's underline,
    not a directive (`.. x::`), and long enough to be more than a title."""
    first = paragraph.lstrip("\n")
    return bool(first) and not first[0].isspace() and not first.startswith((".", ":", "=", "-")) \
        and len(paragraph.split()) >= 25  # fmt: skip


def rss_mb() -> float | None:
    """The resident set now (Linux), in MB; None elsewhere."""
    from chatbot.engine.stats import proc_status_kb

    kb = proc_status_kb("VmRSS")
    return None if kb is None else kb / 1024


Prefill = Callable[[list[int]], tuple[float, float]]
"""prefill(prompt) -> (seconds prefilling it, seconds to its first new token)."""
Decode = Callable[[list[int], int], tuple[list[float], list[int] | None]]
"""decode(prompt, n) -> (seconds of each decoded token, the tokens; None: not comparable)."""


def timed(prefill: Prefill, decode: Decode, ids: list[int], sizes: tuple[int, ...], n: int) -> dict[str, Any]:
    """The figures every set-up reports, from its own two timings: a warm-up (first-call
    allocations, thread pools), prefill at each of `sizes` (the median of a few runs), then
    `n` tokens decoded after a `DECODE_PROMPT`-token prompt."""
    decode(ids[:16], 4)
    runs = {str(size): [prefill(ids[:size]) for _ in range(PREFILL_REPEATS.get(size, 1))] for size in sizes}
    ttft = {size: statistics.median(t for _, t in r) for size, r in runs.items()}
    latencies, tokens = decode(ids[:DECODE_PROMPT], n)
    return {
        "decode_tps": len(latencies) / sum(latencies) if latencies else 0.0,
        "ms_per_token_p50": 1000 * quantile(latencies, 0.5),
        "ms_per_token_p90": 1000 * quantile(latencies, 0.9),
        "prefill_tps": {size: int(size) / statistics.median(p for p, _ in r) for size, r in runs.items()},
        "ttft_s": ttft[str(DECODE_PROMPT)],
        "ttft_s_by_prompt": ttft,
        **({} if tokens is None else {"tokens": tokens}),
    }
