"""A chat template renders under a budget (issue 38, case 4): one of nested loops, or one that
writes without end, is refused in one line instead of rendering for ever; a real template
renders as it did."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from chatbot.models.template_budget import TemplateBudgetExceeded, install

LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"
BOMB = "{% for m in messages %}{% for i in range(90000) %}{{ m['content'] * 1000 }}{% endfor %}{% endfor %}"
MESSAGES = [{"role": "user", "content": "Hello"}]


@pytest.mark.parametrize(("template", "says"), [(LOOPS, "more than 1,000,000 items"), (BOMB, "MB of text")])
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
    assert "template" in lines[-1] and "1,000,000" in lines[-1], lines
    assert run.stdout.strip() == ""
