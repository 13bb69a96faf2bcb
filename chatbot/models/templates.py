"""Chat templates: the tokenizer's own, or a named fallback for models that ship none.

A fallback is a Jinja template set as `tokenizer.chat_template`, so everything downstream
renders through `apply_chat_template` whatever the source. Each template knows the texts
that end an assistant turn (its stop strings); the ones that are a single token of the
model's vocabulary (and the tokenizer's EOS where the template closes turns with it) are
added to `model.generation_config.eos_token_id`, where the session looks for stop ids; the
session also ends an answer on any of them written as text (`stop_strings_of`,
`StopOnStrings`), e.g. Vicuna's "USER:", which is several tokens.

The fallbacks are written to be *prefix-stable*: rendering a conversation with the
generation prompt, then appending the answer exactly as the model produced it, gives the
same text as rendering the conversation with that answer. That is what lets the session
keep its cache from turn to turn. So assistant messages are not stripped, and a separating
space is written only when the answer does not already start with one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chatbot.engine.stops import StopStrings
from chatbot.errors import ChatbotError, ConfigError

# Pieces shared by the templates below (Jinja, whitespace-controlled to one line of output).
_SPLIT_SYSTEM = (
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set system = messages[0]['content'] -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set system = none -%}{%- set loop_messages = messages -%}{%- endif -%}"
)
_BOS = "{%- if bos_token -%}{{ bos_token }}{%- endif -%}"
_EOS = "{%- if eos_token -%}{{ eos_token }}{%- endif -%}"
# A space before an answer, unless the model's answer already starts with one.
_SP = "{%- if not message['content'].startswith(' ') -%}{{ ' ' }}{%- endif -%}"


@dataclass(frozen=True)
class ChatTemplate:
    """A named conversation layout.

    Attributes:
        name: what `--template` and presets call it.
        description: one line for `chatbot models` and the docs.
        jinja: the template, rendered by `tokenizer.apply_chat_template`.
        stop_strings: texts that end an assistant turn (the first is the turn's closing text).
        system: whether the layout has a place for a system prompt.
    """

    name: str
    description: str
    jinja: str
    stop_strings: tuple[str, ...]
    system: bool = True


CHATML = ChatTemplate(
    "chatml",
    "ChatML: <|im_start|>role ... <|im_end|> (Qwen, SmolLM, many fine-tunes)",
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}",
    ("<|im_end|>", "<|im_start|>"),
)

LLAMA2 = ChatTemplate(
    "llama2",
    "Llama-2-chat: <s>[INST] <<SYS>>...<</SYS>> user [/INST] answer </s>",
    _SPLIT_SYSTEM + "{%- for message in loop_messages -%}"
    "{%- if message['role'] == 'user' -%}" + _BOS + "{{ '[INST] ' }}"
    "{%- if loop.first and system is not none -%}{{ '<<SYS>>\n' + system + '\n<</SYS>>\n\n' }}{%- endif -%}"
    "{{ message['content'] + ' [/INST]' }}"
    "{%- elif message['role'] == 'assistant' -%}"
    + _SP
    + "{{ message['content'] + ' ' }}"
    + _EOS
    + "{%- endif -%}{%- endfor -%}",
    ("</s>", "[INST]"),
)

MISTRAL = ChatTemplate(
    "mistral",
    "Mistral-instruct: <s>[INST] user [/INST] answer</s> (system prompt joined to the first message)",
    _SPLIT_SYSTEM + _BOS + "{%- for message in loop_messages -%}"
    "{%- if message['role'] == 'user' -%}"
    "{{ '[INST] ' }}"
    "{%- if loop.first and system is not none -%}{{ system + '\n\n' }}{%- endif -%}"
    "{{ message['content'] + ' [/INST]' }}"
    "{%- elif message['role'] == 'assistant' -%}"
    + _SP
    + "{{ message['content'] }}"
    + _EOS
    + "{%- endif -%}{%- endfor -%}",
    ("</s>", "[INST]"),
)

LLAMA3 = ChatTemplate(
    "llama3",
    "Llama-3-instruct: <|start_header_id|>role<|end_header_id|> ... <|eot_id|>",
    _BOS + "{%- for message in messages -%}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content']"
    " + '<|eot_id|>' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif -%}",
    ("<|eot_id|>", "<|start_header_id|>"),
)

VICUNA_SYSTEM = (
    "A chat between a curious user and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the user's questions."
)

VICUNA = ChatTemplate(
    "vicuna",
    "Vicuna v1.1 (FastChat): SYSTEM USER: ... ASSISTANT: ...</s>",
    _SPLIT_SYSTEM
    + _BOS
    + "{{ (system if system is not none else '"
    + VICUNA_SYSTEM.replace("'", "\\'")
    + "') + ' ' }}"
    "{%- for message in loop_messages -%}"
    "{%- if message['role'] == 'user' -%}{{ 'USER: ' + message['content'] + ' ' }}"
    "{%- elif message['role'] == 'assistant' -%}{{ 'ASSISTANT:' }}"
    + _SP
    + "{{ message['content'] }}"
    + _EOS
    + "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'ASSISTANT:' }}{%- endif -%}",
    ("</s>", "USER:"),
)

# ColossalAI's Colossal-LLaMA `get_prompt_template` (roles "", "Human", "Assistant"): the
# system message as "<s>{system}\n\n", then "Human: <s>{msg}</s>Assistant: <s>{msg}</s>",
# ending with "Assistant: <s>". Its tokenizer call adds one more BOS in front.
COLOSSAL = ChatTemplate(
    "colossal",
    "Colossal-LLaMA: <s>SYSTEM\\n\\nHuman: <s>...</s>Assistant: <s>...</s>",
    _BOS + "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}" + _BOS + "{{ message['content'] + '\n\n' }}"
    "{%- elif message['role'] == 'user' -%}{{ 'Human: ' }}"
    + _BOS
    + "{{ message['content'] }}"
    + _EOS
    + "{%- elif message['role'] == 'assistant' -%}{{ 'Assistant: ' }}"
    + _BOS
    + "{{ message['content'] }}"
    + _EOS
    + "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'Assistant: ' }}" + _BOS + "{%- endif -%}",
    ("</s>", "Human:"),
)

PLAIN = ChatTemplate(
    "plain",
    "plain text for base (non-chat) models: User: ... / Assistant: ...",
    _BOS + "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{ message['content'] + '\n\n' }}"
    "{%- elif message['role'] == 'user' -%}{{ 'User: ' + message['content'] + '\n' }}"
    "{%- elif message['role'] == 'assistant' -%}{{ 'Assistant:' }}" + _SP + "{{ message['content'] + '\n' }}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'Assistant:' }}{%- endif -%}",
    ("\nUser:",),
)

# Gemma (2 and 3): "<start_of_turn>user\n...<end_of_turn>\n<start_of_turn>model\n"; the system
# prompt goes before the first user message, as Gemma 3's own template puts it. Unlike Gemma's
# template, messages are not trimmed (prefix stability).
GEMMA = ChatTemplate(
    "gemma",
    "Gemma: <start_of_turn>user ... <end_of_turn> <start_of_turn>model ... (system before the first message)",
    _SPLIT_SYSTEM + _BOS + "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' }}"
    "{%- if loop.first and system is not none -%}{{ system + '\n\n' }}{%- endif -%}"
    "{{ message['content'] + '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}",
    ("<end_of_turn>", "<start_of_turn>"),
)

PHI3 = ChatTemplate(
    "phi3",
    "Phi-3: <|system|> ... <|end|> <|user|> ... <|end|> <|assistant|> ... <|end|>",
    "{%- for message in messages -%}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>\n' }}{%- endif -%}",
    ("<|end|>", "<|user|>"),
)

TEMPLATES: dict[str, ChatTemplate] = {
    t.name: t for t in (CHATML, LLAMA2, LLAMA3, MISTRAL, GEMMA, PHI3, VICUNA, COLOSSAL, PLAIN)
}
"""Every named template: `--template`, `run --help` and the unknown-name error list these."""
TEMPLATE_CHOICES = ("auto", *TEMPLATES)


def choices_text() -> str:
    """The template names as `--help` and the unknown-name error list them."""
    return ", ".join(TEMPLATE_CHOICES) + ", or a .jinja file"


# Special tokens that give a template away when a tokenizer ships none (a GGUF without
# `tokenizer.chat_template`, a folder without one): all of a row's tokens must be in the
# vocabulary, the first row that matches wins.
_SIGNATURES = (
    (("<|im_start|>", "<|im_end|>"), CHATML),
    (("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"), LLAMA3),
    (("<start_of_turn>", "<end_of_turn>"), GEMMA),
    (("<|user|>", "<|assistant|>", "<|end|>"), PHI3),
    (("[INST]", "[/INST]"), MISTRAL),
)


@dataclass
class TemplateInfo:
    """Which template a loaded model chats with, and what ends its turns."""

    name: str  # "tokenizer" or a fallback's name, or a file's name
    source: str  # "tokenizer", "preset/flag", "guessed", "file", "base model"
    stop_strings: tuple[str, ...] = ()
    stop_ids: list[int] = field(default_factory=list)
    warning: str | None = None

    def label(self) -> str:
        return self.name if self.source in ("tokenizer", "preset/flag") else f"{self.name} ({self.source})"


def template_by_name(name: str) -> ChatTemplate:
    """Raises ConfigError for an unknown name."""
    if name not in TEMPLATES:
        raise ConfigError(f"unknown template {name!r}; templates: {choices_text()}")
    return TEMPLATES[name]


def check_template_choice(value: str | None) -> None:
    """Refuse an unknown template before anything slow happens.

    Raises:
        ConfigError: neither auto, a known name, nor an existing .jinja file.
    """
    if value in (None, "auto") or value in TEMPLATES:
        return
    path = Path(value).expanduser()
    if path.is_file():
        return
    if value.endswith((".jinja", ".j2")):
        raise ConfigError(f"template file {value} does not exist")
    template_by_name(value)


def _single_token_id(tokenizer: Any, text: str) -> int | None:
    try:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    except Exception:  # noqa: BLE001 - a tokenizer that cannot encode it: not a stop id
        return None
    return int(ids[0]) if len(ids) == 1 else None


def _vocab_has(tokenizer: Any, token: str) -> bool:
    try:
        return token in tokenizer.get_vocab()
    except Exception:  # noqa: BLE001 - tokenizers without a vocabulary dict
        return False


def apply_template(tokenizer: Any, model: Any | None = None, requested: str | None = "auto") -> TemplateInfo:
    """Give the tokenizer the template to chat with, and register the template's stop ids.

    Args:
        tokenizer: the model's tokenizer; its `chat_template` may be replaced.
        model: the model, whose `generation_config.eos_token_id` gains the stop ids.
        requested: "auto" (the tokenizer's own, else one guessed from its special tokens,
            else "plain" with a warning), a template name, or a path to a .jinja file.

    Raises:
        ConfigError: an unknown template name or an unreadable file.
    """
    requested = requested or "auto"
    own = getattr(tokenizer, "chat_template", None)
    template: ChatTemplate | None = None
    if requested == "auto":
        if own:
            info = TemplateInfo("tokenizer", "tokenizer")
        else:
            for tokens, candidate in _SIGNATURES:
                if all(_vocab_has(tokenizer, t) for t in tokens):
                    template = candidate
                    info = TemplateInfo(
                        candidate.name,
                        "guessed",
                        warning=f"the model has no chat template: using {candidate.name}, which its "
                        f"vocabulary names ({tokens[0]}); pick another with --template",
                    )
                    break
            else:
                template = PLAIN
                info = TemplateInfo(
                    "plain",
                    "base model",
                    warning="the model has no chat template (a base model?): using a plain "
                    "User:/Assistant: layout; pick one with --template",
                )
    elif requested in TEMPLATES:
        template = TEMPLATES[requested]
        info = TemplateInfo(template.name, "preset/flag")
    elif requested.endswith((".jinja", ".j2")) or Path(requested).expanduser().is_file():
        from chatbot.limits import MAX_CONFIG_BYTES, read_text

        path = Path(requested).expanduser()
        try:
            tokenizer.chat_template = read_text(path, MAX_CONFIG_BYTES, "template file")
        except ChatbotError as exc:
            raise ConfigError(str(exc)) from None
        info = TemplateInfo(path.name, "file")
    else:
        template_by_name(requested)  # raises with the list of names
        raise AssertionError("unreachable")
    if template is not None:
        tokenizer.chat_template = template.jinja
        info.stop_strings = template.stop_strings
    info.stop_ids = _stop_ids_for(tokenizer, info.stop_strings)
    if model is not None and info.stop_ids:
        _add_eos_ids(model, info.stop_ids)
    return info


def _as_written(tokenizer: Any, text: str) -> str:
    """A stop string as the rendered text has it: `</s>` is the tokenizer's EOS, whatever it is."""
    eos = getattr(tokenizer, "eos_token", None)
    return eos if text == "</s>" and eos and eos != "</s>" else text


def _stop_ids_for(tokenizer: Any, stop_strings: tuple[str, ...]) -> list[int]:
    ids: list[int] = []
    for text in stop_strings:
        text = _as_written(tokenizer, text)
        tid = _single_token_id(tokenizer, text)
        if tid is not None and tid not in ids:
            ids.append(tid)
    return ids


def _add_eos_ids(model: Any, ids: list[int]) -> None:
    gc = getattr(model, "generation_config", None)
    if gc is None:
        return
    current = gc.eos_token_id
    merged = [] if current is None else [current] if isinstance(current, int) else list(current)
    merged += [i for i in ids if i not in merged]
    gc.eos_token_id = merged


def check_template(tokenizer: Any, system: str | None, name: str = "this model") -> None:
    """Render a short conversation (with the system prompt, when there is one).

    Raises:
        ConfigError: the template fails to render, refuses a system prompt, or drops it.
    """
    msgs = [{"role": "user", "content": "Hello"}]
    if system:
        msgs.insert(0, {"role": "system", "content": system})
    try:
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - Jinja and raise_exception() raise anything
        reason = " ".join(str(exc).split())[:200] or type(exc).__name__
        if system:
            raise ConfigError(
                f"the chat template of {name} cannot render a system prompt ({reason}): "
                "drop --system, or pick a template with one, e.g. --template chatml"
            ) from None
        raise ConfigError(
            f"the chat template of {name} does not render ({reason}): pick one with --template"
        ) from None
    if system and system.strip() not in text:
        raise ConfigError(
            f"the chat template of {name} drops the system prompt: drop --system, or pick a "
            "template with one, e.g. --template chatml"
        )


def default_system_prompt(tokenizer: Any) -> str | None:
    """The system prompt the tokenizer's template writes when the conversation has none
    (SmolLM's "You are a helpful AI assistant named SmolLM..."), or None when it writes none.

    Found by rendering a user message alone and with a marker system prompt: what stands
    in the marker's place without it is the template's own.
    """
    marker, user = "\u2063system\u2063", "\u2063user\u2063"
    try:
        alone = tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False)
        with_system = tokenizer.apply_chat_template(
            [{"role": "system", "content": marker}, {"role": "user", "content": user}], tokenize=False
        )
    except Exception:  # noqa: BLE001 - a template (user code) that renders no system prompt
        return None
    if marker not in with_system or user not in alone:
        return None
    head, tail = with_system.split(user, 1)[0].split(marker, 1)
    before = alone.split(user, 1)[0]
    if not (before.startswith(head) and before.endswith(tail)) or len(before) < len(head) + len(tail):
        return None
    own = before[len(head) : len(before) - len(tail)].strip()
    return own or None


def stop_strings_of(tokenizer: Any) -> tuple[str, ...]:
    """The stop strings of the fallback template the tokenizer renders with (`apply_template`
    set it), as the rendered text has them (`</s>` is the tokenizer's EOS); none for the
    tokenizer's own template or a file's."""
    current = getattr(tokenizer, "chat_template", None)
    for template in TEMPLATES.values():
        if current == template.jinja:
            return tuple(dict.fromkeys(_as_written(tokenizer, s) for s in template.stop_strings))
    return ()


def end_of_turn_ids(tokenizer: Any) -> list[int]:
    """The special token the template puts right after an assistant message (e.g.
    ``<|im_end|>``), as a one-element list; empty when there is none."""
    marker = "\u2063answer\u2063"
    msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": marker}]
    try:
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    except Exception:  # noqa: BLE001 - a template (user code) that cannot render this
        return []
    if marker not in text:
        return []
    suffix = text.split(marker, 1)[1]
    if not suffix:
        return []
    special = set(tokenizer.all_special_ids)
    special |= {i for i, tok in tokenizer.added_tokens_decoder.items() if tok.special}
    ids = tokenizer(suffix, add_special_tokens=False)["input_ids"]
    return [int(i) for i in ids if i in special][:1]


def answer_stops(
    tokenizer: Any, model: Any | None = None, info: TemplateInfo | None = None
) -> tuple[list[int], StopStrings]:
    """The ids and the texts that end an answer.

    Ids: the tokenizer's EOS, the model's `generation_config` EOS ids, the special token the
    template writes after an answer, and with `info` the template's single-token stop
    strings.
    Texts: the template's stop strings as the rendered text has them. With `info` (what
    `apply_template` set up) they come from it; without it (a tokenizer set up elsewhere),
    a fallback template is recognised by its Jinja text.
    """
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(gen_eos, int):
        ids.add(gen_eos)
    elif isinstance(gen_eos, (list, tuple)):
        ids.update(int(i) for i in gen_eos)
    if info is not None:
        strings = tuple(dict.fromkeys(_as_written(tokenizer, s) for s in info.stop_strings))
        ids.update(info.stop_ids)
    else:
        strings = stop_strings_of(tokenizer)
    ids.update(end_of_turn_ids(tokenizer))
    if is_harmony(getattr(tokenizer, "chat_template", None)):
        # gpt-oss: <|return|> and <|call|> end an answer; <|end|> ends only one of its
        # messages (the analysis), after which the final one follows
        ids.update(i for t in HARMONY_STOPS if (i := _single_token_id(tokenizer, t)) is not None)
        end = _single_token_id(tokenizer, "<|end|>")
        if end is not None:
            ids.discard(end)
    return sorted(ids), StopStrings(strings)


HARMONY_STOPS = ("<|return|>", "<|call|>")


def is_harmony(jinja: str | None) -> bool:
    """Whether a chat template writes gpt-oss's harmony format: channels in its assistant
    turns, a generation prompt that stops at ``<|start|>assistant``."""
    return isinstance(jinja, str) and "<|channel|>" in jinja and "<|start|>assistant" in jinja


def thinking_switch(jinja: str | None) -> str | None:
    """How a chat template turns a model's thinking on or off: "enable_thinking" (Qwen3,
    SmolLM3: a boolean), "reasoning_effort" (gpt-oss's harmony format: low, medium, high),
    or None (it has no switch)."""
    if not jinja:
        return None
    for name in ("enable_thinking", "reasoning_effort"):
        if name in jinja:
            return name
    return None


def thinking_kwargs(think: str | None, switch: str | None) -> dict[str, Any]:
    """What the template is given for `--think` (on, off, low, medium, high; None: nothing,
    the model's own default) where it has a `switch` (`thinking_switch`)."""
    if think is None or switch is None:
        return {}
    if switch == "enable_thinking":
        return {"enable_thinking": think != "off"}
    return {"reasoning_effort": {"on": "medium", "off": "low"}.get(think, think)}
