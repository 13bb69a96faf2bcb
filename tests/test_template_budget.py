"""A chat template renders under a budget (issue 38, case 4; issue 57, item 12): one of nested
loops (over anything), one that writes without end or builds a huge value, is refused in one
line instead of rendering for ever or taking gigabytes; a real template renders as it did."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import time

import pytest

from chatbot.models.template_budget import TemplateBudgetExceeded, install

LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"
BOMB = "{% for m in messages %}{% for i in range(90000) %}{{ m['content'] * 1000 }}{% endfor %}{% endfor %}"
MESSAGES = [{"role": "user", "content": "Hello"}]


MACROS = "{% macro f(n) %}{% if n %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}{% endmacro %}{{ f(60) }}"


@pytest.mark.parametrize(
    ("template", "says"),
    [(LOOPS, "more than 1,000,000 steps"), (MACROS, "more than 1,000,000 steps"), (BOMB, "MB of text")],
)
def test_a_runaway_template_is_stopped(tiny_tokenizer, template, says):
    install()
    tiny_tokenizer.chat_template = template
    start = time.perf_counter()
    with pytest.raises(TemplateBudgetExceeded, match=says):
        tiny_tokenizer.apply_chat_template(MESSAGES, tokenize=False)
    assert time.perf_counter() - start < 20


def test_a_real_template_renders_as_without_the_budget(tiny_tokenizer):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    install()
    template = (
        "{% for m in messages %}{% for i in range(3) %}[{{ i }}]{% endfor %}"
        "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tiny_tokenizer.chat_template = template
    messages = [*MESSAGES, {"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "Bye"}]
    ours = tiny_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    plain = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(template)
    assert ours == plain.render(messages=messages, add_generation_prompt=True)
    # the budget is per rendering: many renderings in a row are each within it
    for _ in range(50):
        tiny_tokenizer.apply_chat_template(messages, tokenize=False)


STEPS = "more than 1,000,000 steps|renders for more than"  # the time backstop where tracing slows it
TOO_BIG = "text or list of more than 32 M"
DOUBLING = (
    "{{% set ns = namespace(s={start}) %}}"
    "{{% for i in range(64) %}}{{% set ns.s = ns.s {op} ns.s %}}{{% endfor %}}"
)
# (template, what the refusal says): each hangs or takes gigabytes without the budget
HOSTILE = [
    ("{% for a in 'x'*100000 %}{% for b in 'y'*100000 %}z{% endfor %}{% endfor %}", STEPS),
    ("{% for a in ['x']*100000 %}{% for b in ['y']*100000 %}{% endfor %}{% endfor %}", STEPS),
    ("{% for a in 'x'*100000 if a %}{% for b in 'y'*100000 if not b %}{% endfor %}{% endfor %}", STEPS),
    (
        (
            "{% for a in ['x']*100000 recursive %}"
            "{% if a|length < 2 %}{{ loop(['xx']*100000) }}{% endif %}{% endfor %}"
        ),
        STEPS,
    ),
    ("{% macro f(n) %}{% if n %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}{% endmacro %}{{ f(60) }}", STEPS),
    ("{{ 'x'*1000000000 }}", TOO_BIG),
    ("{% set big = ['x']*1000000000 %}", TOO_BIG),
    ("{{ (['x'*1000000]*1000)|join }}", TOO_BIG),
    (
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
        TOO_BIG,
    ),
    (
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
        TOO_BIG,
    ),
    (
        "{% set ns = namespace(s=['x']) %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
        TOO_BIG,
    ),
    ("{{ 'x'.ljust(1000000000) }}", TOO_BIG),
    ("{{ 'x'|center(1000000000) }}", TOO_BIG),
    ("{{ '%1000000000d' % 1 }}", TOO_BIG),
    ("{{ '{:>1000000000}'.format(1) }}", TOO_BIG),
    ("{{ ('x'*10000000).replace('x', 'yyyyyyyyyy') }}", TOO_BIG),
    ("{{ 7 ** 1000000000 }}", "number of more than"),
    (
        (
            "{% set ns = namespace(l=[]) %}"
            "{% for i in range(100) %}{% set ns.l = ns.l + ['x'*10000000] %}{% endfor %}"
        ),
        TOO_BIG,
    ),
    ("".join(f"{{% set v{i} = 'x'*30000000 %}}" for i in range(40)), "M characters of text and lists"),
    ("{% for i in range(100000) %}{{ 'x' * 5000 }}{% endfor %}", "M characters of text|MB of text"),
]

# renders one template under the budget in a fresh process, its address space held to what
# it has plus 3 GB (so that a template the budget misses fails there, not on the machine)
RENDER_ONE = textwrap.dedent(
    """
    import json, resource, sys, tracemalloc
    from chatbot.models.template_budget import install
    from transformers.utils import chat_template_utils as templates
    install()
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[0])
    room = pages * resource.getpagesize() + 3 * 1024**3
    resource.setrlimit(resource.RLIMIT_AS, (room, room))
    tracemalloc.start()
    try:
        template = templates._compile_jinja_template(sys.argv[1])
        text = template.render(messages=[{"role": "user", "content": "Hi"}])
        out = {"error": None, "length": len(text)}
    except Exception as e:
        out = {"error": type(e).__name__, "message": str(e)}
    out["peak"] = tracemalloc.get_traced_memory()[1]
    print(json.dumps(out))
    """
)


@pytest.mark.parametrize(("template", "says"), HOSTILE, ids=range(len(HOSTILE)))
def test_a_hostile_template_is_refused_in_bounded_time_and_memory(template, says):
    run = subprocess.run(
        [sys.executable, "-c", RENDER_ONE, template], capture_output=True, text=True, timeout=300, check=False
    )
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.splitlines()[-1])
    assert out["error"] == "TemplateBudgetExceeded", out
    assert re.search(says, out["message"]), out
    assert "\n" not in out["message"]
    assert out["peak"] < 400 * 1024 * 1024, out  # the budget's caps; without it: gigabytes


def _messages() -> list[list[dict]]:
    turns = [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi! How can I help? \u00e9\u4e2d"},
        {"role": "user", "content": "x" * 100_000},
    ]
    return [turns[:1], turns, [{"role": "system", "content": "Be brief."}, *turns]]


# Qwen3's ways, cut down: a reversed scan with a namespace, string methods, filters, tools
QWEN_LIKE = (
    "{%- set ns = namespace(last_user=messages|length - 1) %}"
    "{%- for m in messages[::-1] %}{%- if m.role == 'user' and ns.last_user == messages|length - 1 %}"
    "{%- set ns.last_user = messages|length - 1 - loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- if tools %}<|im_start|>system\n{% for t in tools %}{{ t|tojson }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{%- for m in messages %}{%- set content = m.content.split('</think>')[-1].lstrip('\\n') %}"
    "<|im_start|>{{ m.role }}\n{{ content|trim }}{{ ' (last)' if loop.index0 == ns.last_user else '' }}"
    "{{ ' [%d chars]' % (content|length) }}{{ '{}/{}'.format(loop.index, loop.length) }}<|im_end|>\n"
    "{%- endfor %}{{ (messages|map(attribute='role')|unique|list|join(',')) ~ '\n' }}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _real_templates() -> list[str]:
    from helpers import CHATML
    from test_tool_calls import TEMPLATE as TOOLS

    from chatbot.gguf.metadata import read_metadata
    from chatbot.models.source import default_gguf_path
    from chatbot.models.templates import TEMPLATES

    default = read_metadata(default_gguf_path())["tokenizer.chat_template"]
    return [default, CHATML, TOOLS, QWEN_LIKE, *(t.jinja for t in TEMPLATES.values() if t.jinja)]


def test_real_templates_render_as_transformers_renders_them():
    from test_tool_calls import TOOLS
    from transformers.utils import chat_template_utils as templates

    install()
    for template in _real_templates():
        ours = templates._compile_jinja_template(template)
        plain = templates._cached_compile_jinja_template(template)  # transformers' own, no budget
        assert getattr(ours, "chatbot_budget", False) and not getattr(plain, "chatbot_budget", False)
        for messages in _messages():
            for prompt, tools in ((True, None), (False, None), (True, TOOLS)):
                kwargs = {"messages": messages, "add_generation_prompt": prompt, "tools": tools}
                try:
                    expected = plain.render(**kwargs)
                except Exception as e:  # noqa: BLE001  (a template refusing a system turn: refused the same way)
                    with pytest.raises(type(e)):
                        ours.render(**kwargs)
                    continue
                assert ours.render(**kwargs) == expected


@pytest.mark.slow
def test_chatbot_run_refuses_a_template_of_nested_loops(tmp_path):
    loops = tmp_path / "loops.jinja"
    loops.write_text(LOOPS)
    start = time.perf_counter()
    run = subprocess.run(
        [sys.executable, "-m", "chatbot.cli", "run", "--template", str(loops)],
        input="Hi\n",
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert time.perf_counter() - start < 60
    assert run.returncode != 0
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert 1 <= len(lines) <= 2 and "Traceback" not in run.stderr, run.stderr
    assert "template" in lines[-1] and "1,000,000 steps" in lines[-1], lines
    assert run.stdout.strip() == ""
