"""Chat templates render under a budget: a template is code from the model's files, and
transformers renders it in Jinja's sandbox, which bounds what it may touch but not how long
it runs or how much it builds. A template of nested loops over strings or lists rendered for
ever; `{{ 'x' * 1000000000 }}` took 4.3 GB before Python gave up (at compile time: Jinja folds
constant expressions there).

`install` makes transformers compile every template in its own environment with:
- a step counted for every loop iteration (whatever the loop runs over, recursive loops
  included), every call (macros, methods) and every filter, plus one per KiB of data a call
  or filter is given: at most `MAX_STEPS` per rendering, and at most `MAX_SECONDS` of wall
  time as a backstop for steps that compare or search big values;
- `*`, `+`, `**`, `%` and `~` checked before they run: no text or list (counted deep, as
  the characters and items it would print) longer than `MAX_VALUE_ITEMS`, no integer past
  `MAX_INT_BITS`, no format width past the cap;
- every value a call, filter or operator makes counted against `MAX_MADE_ITEMS` for the
  rendering (this bounds its memory), and checked against `MAX_VALUE_ITEMS` before it is
  printed;
- its output (and each macro's or block's) stopped past `MAX_OUTPUT_CHARS`.
Each raises `TemplateBudgetExceeded`, which the callers' error handling turns into one line
naming the template ("the chat template of M does not render (...)").
"""

from __future__ import annotations

import functools
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

MAX_STEPS = 1_000_000
"""Loop iterations, calls and filters of one rendering (a chat's own loops run over its
messages, a few thousand, with tens of steps each)."""
MAX_OUTPUT_CHARS = 32 * 1024 * 1024
"""The longest text one rendering may make (a full 128k-token context is under 1 MB)."""
MAX_VALUE_ITEMS = MAX_OUTPUT_CHARS
"""The longest text, or list counted as the characters it holds, one step may make."""
MAX_MADE_ITEMS = 4 * MAX_OUTPUT_CHARS
"""All the text and items the steps of one rendering may make together."""
MAX_INT_BITS = 1 << 16
"""The largest integer an operator may make (a template counts messages, not atoms)."""
MACRO_STEPS = 10
"""The steps a macro call counts for (Jinja spends ten times a loop iteration's time on one)."""
MAX_SECONDS = 30.0
"""Wall time of one rendering, for what steps cannot weigh (a real one takes milliseconds)."""


class TemplateBudgetExceeded(ValueError):
    """A chat template went past its rendering budget."""


class _Rendering:
    """What one rendering has left."""

    def __init__(self) -> None:
        self.steps = MAX_STEPS
        self.made = MAX_MADE_ITEMS
        self.deadline = time.monotonic() + MAX_SECONDS


_renders = threading.local()  # .now: the _Rendering of this thread's rendering, or None


def _now() -> _Rendering | None:
    return getattr(_renders, "now", None)


def _step(cost: int = 1) -> bool:
    """Count `cost` steps of the rendering under way (none outside one)."""
    now = _now()
    if now is not None:
        now.steps -= cost
        if now.steps < 0:
            raise TemplateBudgetExceeded(
                f"its loops and calls take more than {MAX_STEPS:,} steps in one rendering"
            )
        if time.monotonic() > now.deadline:
            raise TemplateBudgetExceeded(f"it renders for more than {MAX_SECONDS:.0f} s")
    return True


def _too_big(items: int) -> TemplateBudgetExceeded:
    return TemplateBudgetExceeded(
        f"it builds a text or list of more than {MAX_VALUE_ITEMS // (1024 * 1024)} M characters"
    )


_CONTAINERS = (str, bytes, dict, list, tuple, set, frozenset)


def _size(value: Any, limit: int = MAX_VALUE_ITEMS) -> int:
    """The characters and items `value` holds, counted deep (a list of one text a million
    times holds a million texts); stops counting once past `limit`."""
    if isinstance(value, (str, bytes)):
        return len(value)
    total = 0
    todo = [value]
    while todo and total <= limit:
        item = todo.pop()
        if isinstance(item, (str, bytes)):
            total += len(item)
        elif isinstance(item, dict):
            total += 1 + len(item)
            todo.extend(item.keys())
            todo.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            total += 1 + len(item)
            kinds = set(map(type, item))  # a list of texts, or of numbers, counted at C speed
            if kinds <= {str}:
                total += sum(map(len, item))
            elif any(issubclass(kind, _CONTAINERS) for kind in kinds):
                todo.extend(item)
    return total


def _check_size(items: int) -> None:
    if items > MAX_VALUE_ITEMS:
        raise _too_big(items)


def _made(value: Any) -> Any:
    """`value`, made by a step: checked and counted against the rendering's budget."""
    items = _size(value)
    _check_size(items)
    now = _now()
    if now is not None and items:
        now.made -= items
        if now.made < 0:
            raise TemplateBudgetExceeded(
                f"it builds more than {MAX_MADE_ITEMS // (1024 * 1024)} M characters of text "
                "and lists in one rendering"
            )
    return value


def _reads(values: Iterable[Any]) -> int:
    """The steps a call costs for the data it is given: one per KiB."""
    return sum(_size(value) for value in values) // 1024


_FORMAT_NUMBER = re.compile(r"\d+")


def _check_format(form: str, args: Iterable[Any]) -> None:
    """Refuse a format (``%``, ``str.format``, ``|format``) whose widths would make a text
    past the cap: written in the format, or taken from its arguments (``%*d``, ``{:{}}``)."""
    if any(int(digits) > MAX_VALUE_ITEMS for digits in _FORMAT_NUMBER.findall(form)):
        raise _too_big(MAX_VALUE_ITEMS + 1)
    if "*" in form or re.search(r"\{[^{}]*\{", form):
        for arg in args:
            values = (
                arg.values() if isinstance(arg, dict) else arg if isinstance(arg, (list, tuple)) else [arg]
            )
            if any(isinstance(v, int) and v > MAX_VALUE_ITEMS for v in values):
                raise _too_big(MAX_VALUE_ITEMS + 1)


def _int_bits(value: Any) -> int:
    return abs(value).bit_length() if isinstance(value, int) else 0


def _check_bits(bits: int) -> None:
    if bits > MAX_INT_BITS:
        raise TemplateBudgetExceeded(f"it builds a number of more than {MAX_INT_BITS:,} bits")


def _check_binop(operator: str, left: Any, right: Any) -> None:
    """Refuse an operation whose result would be past the caps, before it is made."""
    if operator == "*":
        for seq, times in ((left, right), (right, left)):
            if isinstance(times, int) and not isinstance(seq, int) and times > 0:
                _check_size(_size(seq) * times)
        if (
            isinstance(left, int)
            and isinstance(right, int)
            and _int_bits(left) + _int_bits(right) > MAX_INT_BITS
        ):
            raise TemplateBudgetExceeded(f"it builds a number of more than {MAX_INT_BITS:,} bits")
    elif operator == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0 and _int_bits(left) > 1:
            _check_bits((_int_bits(left) - 1) * right)
    elif operator == "+":
        if not isinstance(left, (int, float)):
            _check_size(_size(left) + _size(right))
    elif operator == "%" and isinstance(left, str):
        _check_format(left, [right])


_WIDTH_METHODS = frozenset({"ljust", "rjust", "center", "zfill", "expandtabs"})
_WIDTH_FILTERS = frozenset({"center", "indent", "batch", "tojson", "wordwrap"})


def _check_call(obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse a string method call whose result would be past the cap, before it runs."""
    method = getattr(obj, "__wrapped__", obj)  # the sandbox wraps str.format
    text = getattr(method, "__self__", None)
    if not isinstance(text, str):
        return
    name = getattr(method, "__name__", "")
    given = [*args, *kwargs.values()]
    if name in _WIDTH_METHODS:
        if any(isinstance(v, int) and v > MAX_VALUE_ITEMS for v in given):
            raise _too_big(MAX_VALUE_ITEMS + 1)
        if name == "expandtabs" and given and isinstance(given[0], int):
            _check_size(len(text) + text.count("\t") * given[0])
    elif name == "join" and args and isinstance(args[0], (list, tuple)):
        _check_size(_size(args[0]) + len(text) * len(args[0]))
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        _check_size(len(text) + (text.count(args[0]) + (1 if not args[0] else 0)) * len(args[1]))
    elif name in ("format", "format_map"):
        _check_format(text, given)


def _check_filter(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """The same for filters (``args[0]`` is the value filtered)."""
    given = [*args[1:], *kwargs.values()]
    if name in _WIDTH_FILTERS and any(isinstance(v, int) and v > MAX_VALUE_ITEMS for v in given):
        raise _too_big(MAX_VALUE_ITEMS + 1)
    if name == "format" and args and isinstance(args[0], str):
        _check_format(args[0], given)
    elif name == "join" and args and isinstance(args[0], (list, tuple)):
        glue = args[1] if len(args) > 1 and isinstance(args[1], str) else ""
        _check_size(_size(args[0]) + len(glue) * len(args[0]))
    elif name == "replace" and len(args) >= 3 and all(isinstance(a, str) for a in args[:3]):
        text, old, new = args[:3]
        _check_size(len(text) + (text.count(old) + (1 if not old else 0)) * len(new))


def _budgeted_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(func)  # keeps `jinja_pass_arg`: how Jinja calls the filter
    def budgeted(*args: Any, **kwargs: Any) -> Any:
        _check_filter(name, _filter_args(func, args), kwargs)
        _step(1 + _reads(args))
        return _made(func(*args, **kwargs))

    return budgeted


def _filter_args(func: Callable[..., Any], args: tuple[Any, ...]) -> tuple[Any, ...]:
    """A filter's arguments from its value on (without the context some are passed first)."""
    return args[1:] if getattr(func, "jinja_pass_arg", None) is not None else args


def _concat(parts: Iterable[str]) -> str:
    """Jinja's `concat` (the output, a macro's, a `{% set %}` block's) under the cap."""
    pieces: list[str] = []
    size = 0
    for part in parts:
        size += len(part)
        if size > MAX_OUTPUT_CHARS:
            raise TemplateBudgetExceeded(
                f"it writes more than {MAX_OUTPUT_CHARS // (1024 * 1024)} MB of text in one rendering"
            )
        pieces.append(part)
    return _made("".join(pieces))


def _join_checked(values: tuple[Any, ...]) -> tuple[Any, ...]:
    """The operands of `~`, checked before they are turned to text and joined."""
    _check_size(sum(_size(value) for value in values))
    return values


def _finalize(value: Any) -> Any:
    """Each printed value (``{{ x }}``), checked before it is turned to text."""
    _check_size(_size(value))
    return value


def _budgeted_environment(env: Any) -> Any:
    """`env` (transformers' sandbox) made to compile templates under the budget; once."""
    if getattr(env, "chatbot_budget", False):
        return env
    from jinja2 import nodes
    from jinja2.compiler import CodeGenerator
    from jinja2.runtime import Macro

    def counted_step() -> nodes.Call:
        return nodes.Call(nodes.EnvironmentAttribute("chatbot_step"), [], [], None, None)

    class BudgetedCodeGenerator(CodeGenerator):
        def visit_For(self, node: nodes.For, frame: Any) -> None:
            # a step at the top of the body (recursive calls run it too) and in the filter
            node.body = [nodes.ExprStmt(counted_step()), *node.body]
            if node.test is not None:
                node.test = nodes.And(counted_step(), node.test)
            super().visit_For(node, frame)

        def visit_Concat(self, node: nodes.Concat, frame: Any) -> None:
            # Jinja's own, with the operands checked before they are turned to text
            if frame.eval_ctx.volatile:
                join = "(markup_join if context.eval_ctx.volatile else str_join)"
            elif frame.eval_ctx.autoescape:
                join = "markup_join"
            else:
                join = "str_join"
            self.write(f"environment.chatbot_made({join}(environment.chatbot_join_checked((")
            for operand in node.nodes:
                self.visit(operand, frame)
                self.write(", ")
            self.write("))))")

    sandbox_call = env.call
    binop_table = env.binop_table

    def call(__context: Any, __obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        if __obj is _step:
            return _step()
        _check_call(__obj, args, kwargs)
        weight = MACRO_STEPS if isinstance(__obj, Macro) else 1
        _step(weight + _reads(args) + _reads(kwargs.values()))
        return _made(sandbox_call(__context, __obj, *args, **kwargs))

    def call_binop(context: Any, operator: str, left: Any, right: Any) -> Any:
        _check_binop(operator, left, right)
        return _made(binop_table[operator](left, right))

    env.code_generator_class = BudgetedCodeGenerator
    env.intercepted_binops = frozenset({"*", "+", "**", "%"})
    env.call = call
    env.call_binop = call_binop
    env.concat = _concat
    env.finalize = _finalize
    env.chatbot_step = _step
    env.chatbot_join_checked = _join_checked
    env.chatbot_made = _made
    env.filters = {name: _budgeted_filter(name, func) for name, func in env.filters.items()}
    env.chatbot_budget = True
    return env


def budget(compiled: Any) -> Any:
    """`compiled` (a jinja2 Template from a budgeted environment) rendering under the
    budget: each `render` or `generate` call gets its own; once per template."""
    if getattr(compiled, "chatbot_budget", False):
        return compiled
    render = compiled.render
    generate = compiled.generate

    def budgeted_render(*args: Any, **kwargs: Any) -> str:
        outer = _now()
        _renders.now = _Rendering()
        try:
            return str(render(*args, **kwargs))
        finally:
            _renders.now = outer

    def budgeted_generate(*args: Any, **kwargs: Any) -> Any:
        outer = _now()
        rendering = _Rendering()
        size = 0
        parts = generate(*args, **kwargs)
        while True:
            _renders.now = rendering
            try:
                part = next(parts, None)
            finally:
                _renders.now = outer
            if part is None:
                return
            size += len(part)
            if size > MAX_OUTPUT_CHARS:
                raise TemplateBudgetExceeded(
                    f"it writes more than {MAX_OUTPUT_CHARS // (1024 * 1024)} MB of text in one rendering"
                )
            yield part

    compiled.render = budgeted_render
    compiled.generate = budgeted_generate
    compiled.chatbot_budget = True
    return compiled


def install() -> bool:
    """Make transformers' `apply_chat_template` compile every template under the budget
    (idempotent); False where this transformers has no such compiler to wrap, or where
    transformers is not imported: then no tokenizer of its exists to render with (ours,
    `chatbot.gguf.tokenizer`, renders under the budget itself), and the loader and the chat
    call this again once their tokenizer is made."""
    if "transformers" not in sys.modules:
        return False
    try:
        from transformers.utils import chat_template_utils as templates
    except ImportError:
        return False
    original = getattr(templates, "_compile_jinja_template", None)
    if original is None:
        return False
    if getattr(original, "chatbot_budget", False):
        return True

    @functools.lru_cache(maxsize=64)
    def compile_under_budget(chat_template: str) -> Any:
        # transformers' environment (its filters, globals and extensions), from an empty
        # template: compiling the template itself there would fold its constants unchecked
        env = _budgeted_environment(original("").environment)
        return budget(env.from_string(chat_template))

    compile_under_budget.chatbot_budget = True  # type: ignore[attr-defined]
    templates._compile_jinja_template = compile_under_budget
    return True


def sandbox() -> Any:
    """A Jinja sandbox as transformers' (5.x) `apply_chat_template` builds one, without
    importing transformers: immutable, blocks trimmed, loop controls, the `generation` tag
    (rendered as its body: no assistant mask is asked for here), `tojson` without HTML
    escaping, `raise_exception`, `strftime_now`, a `dict` that is only a constructor and a
    `namespace` that refuses underscore names; then budgeted (`_budgeted_environment`)."""
    import datetime
    import json

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        tags = {"generation"}  # noqa: RUF012 - Jinja's own attribute

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:  # fmt: skip
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(form: str) -> str:
        return datetime.datetime.now().strftime(form)

    class TemplateDict:  # `dict(...)` in a template, without the type's attributes
        def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict.fromkeys(*args, **kwargs)

    def check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot store {name!r} on a namespace")

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:  # (Jinja's signature: `self` may be a key)
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    env.globals.update(dict=TemplateDict(), namespace=TemplateNamespace)
    return _budgeted_environment(env)


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def plain_data(value: Any) -> Any:
    """`value` rebuilt from plain JSON types (str, int, float, bool, None, dict, list, tuple),
    anything else as a placeholder naming its type, as transformers gives a template its
    data: the sandbox does not know which methods of other objects are unsafe."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for kind in (str, int, float):
        if isinstance(value, kind):
            return kind(value)  # a subclass's extra methods dropped
    if isinstance(value, dict):
        return {plain_data(k): plain_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_data(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain_data(v) for v in value)
    return f"<{type(value).__name__}>"


@functools.lru_cache(maxsize=64)
def compiled_template(chat_template: str) -> Any:
    """`chat_template` compiled in `sandbox()`, rendering under the budget."""
    return budget(sandbox().from_string(chat_template))


def render_chat(
    chat_template: str,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    **kwargs: Any,
) -> str:
    """The text `chat_template` makes of `messages` (dicts), as transformers'
    `apply_chat_template(..., tokenize=False)` renders one conversation: the data made
    plain, a message's reasoning also under the other names templates read it by, the
    tools and `kwargs` (the special tokens, `enable_thinking`...) given to the template.

    Raises:
        TypeError: a message that is not a dict.
        jinja2.TemplateError: the template fails (or raises).
        TemplateBudgetExceeded: it runs past the budget.
    """
    chat = plain_data(messages)
    aliased = []
    for message in chat:
        if not isinstance(message, dict):
            raise TypeError(f"chat messages must be dicts, got {message!r}")
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        aliased.append(message)
    template = compiled_template(chat_template)
    data = {"tools": plain_data(tools), "documents": None, "add_generation_prompt": add_generation_prompt}
    return str(template.render(messages=aliased, **data, **plain_data(kwargs)))
