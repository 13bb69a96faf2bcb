"""Chat templates render under a budget: a template is code from the model's files, and
transformers renders it in Jinja's sandbox, which bounds what it may touch but not how long
it runs. A template of nested loops (``{% for i in range(100000) %}{% for j in range(100000)
%}``) rendered forever, without a word, before the first prompt.

`install` wraps transformers' template compiler so that each compiled template renders with:
- a `range` that counts the items of every call against `MAX_RANGE_ITEMS` for the rendering;
- its output read piece by piece and stopped past `MAX_OUTPUT_CHARS`.
Either raises `TemplateBudgetExceeded`, which the callers' error handling turns into one line
naming the template ("the chat template of M does not render (...)").
"""

from __future__ import annotations

import threading
from typing import Any

MAX_RANGE_ITEMS = 1_000_000
"""The items all `range()` calls of one rendering may give (a chat's own loops run over its
messages, a few thousand at most)."""
MAX_OUTPUT_CHARS = 64 * 1024 * 1024
"""The longest text one rendering may make (a full 128k-token context is under 1 MB)."""


class TemplateBudgetExceeded(ValueError):
    """A chat template went past its rendering budget."""


_renders = threading.local()  # .left: range items left to the rendering in this thread


def _budgeted_range(*args: Any) -> range:
    from jinja2.sandbox import safe_range

    items = safe_range(*args)  # Jinja's own cap on one range (100,000 items)
    left = getattr(_renders, "left", None)
    if left is not None:
        left -= len(items)
        _renders.left = left
        if left < 0:
            raise TemplateBudgetExceeded(
                f"its loops run over more than {MAX_RANGE_ITEMS:,} items in one rendering"
            )
    return items


def budget(compiled: Any) -> Any:
    """`compiled` (a jinja2 Template) rendering under the budget; once per template."""
    if getattr(compiled, "chatbot_budget", False):
        return compiled
    compiled.globals["range"] = _budgeted_range
    generate = compiled.generate

    def render(*args: Any, **kwargs: Any) -> str:
        outer = getattr(_renders, "left", None)
        _renders.left = MAX_RANGE_ITEMS
        parts: list[str] = []
        size = 0
        try:
            for part in generate(*args, **kwargs):
                size += len(part)
                if size > MAX_OUTPUT_CHARS:
                    raise TemplateBudgetExceeded(
                        f"it writes more than {MAX_OUTPUT_CHARS // (1024 * 1024)} MB of text in one rendering"
                    )
                parts.append(part)
        finally:
            _renders.left = outer
        return "".join(parts)

    compiled.render = render
    compiled.chatbot_budget = True
    return compiled


def install() -> bool:
    """Make transformers' `apply_chat_template` compile every template under the budget
    (idempotent); False where this transformers has no such compiler to wrap."""
    try:
        from transformers.utils import chat_template_utils as templates
    except ImportError:
        return False
    original = getattr(templates, "_compile_jinja_template", None)
    if original is None:
        return False
    if getattr(original, "chatbot_budget", False):
        return True

    def compile_under_budget(chat_template: str) -> Any:
        return budget(original(chat_template))

    compile_under_budget.chatbot_budget = True  # type: ignore[attr-defined]
    templates._compile_jinja_template = compile_under_budget  # type: ignore[assignment]
    return True
