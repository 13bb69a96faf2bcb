"""Function calling: a request's `tools` rendered through the model's chat template, the calls
read back out of the answer, and a call forced by the grammar engine.

- *Rendering.* A template that takes `tools` (its Jinja text reads them: Qwen2.5, Hermes,
  Llama 3.1, Mistral) renders the whole message list, `tool` results and assistant
  `tool_calls` included. One that does not can still be made to call: with `tool_choice`
  "required" or a named function the tools are described in a system message and the answer
  is held to a call by the grammar; with "auto" it is a 400 naming `tools`.
- *Parsing* (`parse_calls`): Hermes / Qwen `<tool_call>{...}</tool_call>`, Mistral
  `[TOOL_CALLS] [{...}]`, Llama 3.1 (optionally after `<|python_tag|>`) a bare JSON object
  `{"name", "parameters" | "arguments"}`, and the forced call's own form, the same object.
  gpt-oss's harmony calls are no text: they are messages addressed to `functions.NAME` on the
  commentary channel, which the worker's `HarmonySplitter` keeps apart (`harmony_calls`).
- *Forcing* (`forced_call`): "required" or a named function holds the answer to one JSON
  object `{"name": ..., "arguments": {...}}` whose arguments satisfy that function's
  `parameters`, whatever the template's own format; but gpt-oss, held to one function, is
  given its call's header and writes the arguments as it was trained to.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from chatbot.config import OutputFormat
from chatbot.conversation.harmony import CHANNEL, MESSAGE, OPENED
from chatbot.models.templates import is_harmony

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_MARKERS = ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "{")
_ANY = {"type": "object"}  # the arguments of a function that gives no parameters


class ToolError(ValueError):
    """A request's tools or tool_choice that cannot be used; `param` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tools:
    """A request's functions and what it asks of them.

    Args:
        functions: each tool's `function` object (name, description, parameters).
        choice: "auto", "required", or the one function's name the answer must call.
    """

    functions: tuple[dict[str, Any], ...]
    choice: str = "auto"
    forced: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "forced", self.choice != "auto")

    @classmethod
    def of(cls, tools: list[Any] | None, tool_choice: Any) -> Tools | None:
        """The request's tools (None: none, or tool_choice "none").

        Raises:
            ToolError: a tool that is not a function with a name, a tool_choice that is not
                "none", "auto", "required" or one of the tools.
        """
        if not tools or tool_choice == "none":
            if tool_choice not in (None, "none", "auto"):
                raise ToolError("tool_choice: there are no tools to call", "tool_choice")
            return None
        functions = []
        for i, tool in enumerate(tools):
            fn = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
                raise ToolError(f"tools[{i}]: a tool is {{'type': 'function', 'function': {{...}}}}", "tools")
            if not isinstance(fn.get("name"), str) or not fn["name"]:
                raise ToolError(f"tools[{i}].function.name: a function needs a name", "tools")
            if not isinstance(fn.get("parameters", {}), dict):
                raise ToolError(f"tools[{i}].function.parameters: must be a JSON schema object", "tools")
            functions.append(fn)
        names = [fn["name"] for fn in functions]
        if tool_choice in (None, "auto", "required"):  # null: the default, as OpenAI reads it
            return cls(tuple(functions), tool_choice or "auto")
        name = _chosen_name(tool_choice)
        if name is None:
            raise ToolError(
                'tool_choice: must be "none", "auto", "required" or {"type": "function", "function": '
                f'{{"name": NAME}}}}, got {json.dumps(tool_choice)[:80]}',
                "tool_choice",
            )
        if name not in names:
            raise ToolError(
                f"tool_choice: names the function {name!r}, which is none of the tools ({', '.join(names)})",
                "tool_choice",
            )
        return cls(tuple(functions), name)

    def template_tools(self) -> list[dict[str, Any]]:
        """The tools as `apply_chat_template(tools=...)` takes them."""
        return [{"type": "function", "function": fn} for fn in self.functions]

    def call_format(self) -> OutputFormat:
        """The format a forced call is held to: one of the allowed functions, its arguments."""
        allowed = [fn for fn in self.functions if self.choice in ("required", fn["name"])]
        options = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": fn["name"]},
                    # on a base of its own: its `#` refs (`#/$defs/...`, `#`) mean the
                    # parameters schema as the client wrote it, not this wrapper
                    "arguments": {"$id": f"urn:chatbot:tool:{i}", **(fn.get("parameters") or _ANY)},
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for i, fn in enumerate(allowed)
        ]
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        return OutputFormat(json.dumps(schema), "tool_call")

    def forced_call(self, prompt: str) -> tuple[str, OutputFormat]:
        """The prompt and the format of a forced call. A harmony prompt (gpt-oss's, which ends
        in ``<|start|>assistant``) held to one function goes on with that call's header, and
        the answer is its arguments, held to its `parameters`; any other, `call_format`."""
        allowed = [fn for fn in self.functions if self.choice in ("required", fn["name"])]
        if len(allowed) != 1 or not prompt.endswith(OPENED):
            return prompt, self.call_format()
        fn = allowed[0]
        header = f"{CHANNEL}commentary to=functions.{fn['name']} <|constrain|>json{MESSAGE}"
        return prompt + header, OutputFormat(json.dumps(fn.get("parameters") or _ANY), "tool_call")

    def described(self) -> str:
        """The tools in words, for a template that cannot render them (a forced call only)."""
        lines = [
            'You can call these functions. Answer with one call, as JSON: {"name": ..., "arguments": {...}}.'
        ]
        lines += [json.dumps(fn, ensure_ascii=False) for fn in self.functions]
        return "\n".join(lines)


def _chosen_name(tool_choice: Any) -> str | None:
    """The function a tool_choice object names; None where it is not one
    (`{"type": "function", "function": {"name": NAME}}`)."""
    if not isinstance(tool_choice, dict) or tool_choice.get("type", "function") != "function":
        return None
    function = tool_choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    return name if isinstance(name, str) else None


def template_takes_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template reads `tools` (renders function definitions)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default")
    return isinstance(template, str) and "tools" in template


def template_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """The request's messages as chat templates take them: text content, assistant calls with
    their arguments as objects (templates index them), tool results with their call ids."""
    out = []
    for m in messages:
        record: dict[str, Any] = {"role": m.role, "content": m.text()}
        calls = getattr(m, "tool_calls", None)
        if calls:
            record["tool_calls"] = [_template_call(call) for call in calls]
            thought = getattr(m, "reasoning_content", None)
            if thought and not record["content"]:  # the thinking that led to the calls (gpt-oss's
                record["thinking"] = thought  # template renders it until a final answer follows)
        if getattr(m, "tool_call_id", None):
            record["tool_call_id"] = m.tool_call_id
        if getattr(m, "name", None):
            record["name"] = m.name
        out.append(record)
    return out


def one_call_each(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with one call to an assistant message, each call's result after it (by
    `tool_call_id`, else in order): gpt-oss's template renders an assistant message's first
    call alone, and a result as addressed from the last call."""
    out: list[dict[str, Any]] = []
    i = 0
    while i < len(records):
        record, i = records[i], i + 1
        calls = record.get("tool_calls") or []
        if record["role"] != "assistant" or len(calls) < 2:
            out.append(record)
            continue
        results = []
        while i < len(records) and records[i]["role"] == "tool":
            results.append(records[i])
            i += 1
        call_ids = {call.get("id") for call in calls}
        for k, call in enumerate(calls):
            out.append(
                {**record, "tool_calls": [call]} if k == 0 else {"role": "assistant", "tool_calls": [call]}
            )
            ids = [r.get("tool_call_id") for r in results]
            if call.get("id") in ids:
                out.append(results.pop(ids.index(call.get("id"))))
            else:  # the next result that names none of the calls
                at = next((j for j, r in enumerate(results) if r.get("tool_call_id") not in call_ids), None)
                if at is not None:
                    out.append(results.pop(at))
        out += results  # results of no call here stay after the last, in order
    return out


def _template_call(call: Any) -> dict[str, Any]:
    fn = dict(call.get("function") or {}) if isinstance(call, dict) else {}
    arguments = fn.get("arguments")
    if isinstance(arguments, str):
        try:
            fn["arguments"] = json.loads(arguments)
        except ValueError:
            pass  # the template gets the text as it was sent
    return {"type": "function", "id": call.get("id") if isinstance(call, dict) else None, "function": fn}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def api(self, index: int | None = None) -> dict[str, Any]:
        """The call as OpenAI's `tool_calls[i]` (with `index`: a streamed delta's)."""
        call: dict[str, Any] = {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


def harmony_calls(messages: list[tuple[str, str]]) -> list[ToolCall]:
    """The calls among a harmony answer's messages addressed to a recipient (recipient,
    message): those to `functions.NAME`, their message the arguments (a builtin tool's,
    `python` or `browser.search`, is none of the request's functions)."""
    return [
        ToolCall(to.removeprefix("functions."), message.strip() or "{}")
        for to, message in messages
        if to.startswith("functions.") and len(to) > len("functions.")
    ]


def chat_message(
    text: str, thought: str, tools: Tools | None, made: list[ToolCall] | None = None
) -> tuple[dict[str, Any], bool]:
    """A chat answer as OpenAI's `message`, and whether it calls: its text, read for calls where
    the request has tools (`made`: the calls already read, harmony's), its thinking as
    `reasoning_content`."""
    content: str | None = text
    calls = list(made or [])
    if tools is not None and not calls:
        content, calls = parse_calls(text)
    elif calls:
        content = text.strip() or None
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if thought:
        message["reasoning_content"] = thought
    if calls:
        message["tool_calls"] = [call.api() for call in calls]
    return message, bool(calls)


def _call(obj: Any) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        return ToolCall(obj["name"], arguments)
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def _json_values(text: str) -> list[Any]:
    """The JSON values written one after another in `text` (stopping at the first that is not)."""
    decoder, at = json.JSONDecoder(), 0
    values: list[Any] = []
    while True:
        while at < len(text) and text[at] in " \t\r\n;,":
            at += 1
        if at >= len(text):
            return values
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return values
        values.append(value)


def parse_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """The answer's text before any call (None when there is none) and the calls it makes.
    An answer that is not a call in any of the known forms is all text, no calls."""
    if "<tool_call>" in text:
        head = text[: text.index("<tool_call>")].strip()
        calls = []
        for body in _HERMES.findall(text):
            calls += [c for c in map(_call, _json_values(body)) if c is not None]
        if calls:
            return head or None, calls
    if "[TOOL_CALLS]" in text:
        head, _, body = text.partition("[TOOL_CALLS]")
        values = _json_values(body.strip())
        items = values[0] if len(values) == 1 and isinstance(values[0], list) else values
        calls = [c for c in map(_call, items) if c is not None]
        if calls:
            return head.strip() or None, calls
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if body.startswith("{"):
        values = _json_values(body)
        calls = [c for c in map(_call, values) if c is not None]
        if calls and len(calls) == len(values):
            return None, calls
    return text, []


class CallStream:
    """A streamed answer that may be a call: text goes out while it cannot be the start of one;
    from the first sign of one it is held back, and read as calls when the answer ends."""

    def __init__(self) -> None:
        self.held = ""
        self.sent = ""

    def feed(self, piece: str) -> str:
        """The part of `piece` that can be shown now."""
        self.held += piece
        start = _marker_start(self.held, at_start=not self.sent.strip())
        if start is None:
            out, self.held = self.held, ""
        else:
            out, self.held = self.held[:start], self.held[start:]
        self.sent += out
        return out

    def finish(self, made: list[ToolCall] | None = None) -> tuple[str, list[ToolCall]]:
        """At the end: (text still to show, the calls), or the calls `made` already (harmony's)
        with the text held back."""
        if made:
            rest, self.held = self.held, ""
            return rest, list(made)
        content, calls = parse_calls(self.sent + self.held)
        if not calls:
            rest, self.held = self.held, ""
            return rest, []
        self.held = ""
        shown = len(self.sent.strip())
        return ((content or "")[shown:] if content else ""), calls


def _marker_start(text: str, at_start: bool) -> int | None:
    """Where in `text` a call may begin: a marker, or the start of one at its end; a bare JSON
    object only at the start of the answer."""
    best = None
    for marker in _MARKERS:
        if marker == "{" and not at_start:
            continue
        i = text.find(marker)
        if marker == "{" and i >= 0 and text[:i].strip():
            i = -1
        if i < 0:  # a marker's beginning at the end of the text
            for n in range(min(len(marker) - 1, len(text)), 0, -1):
                if text.endswith(marker[:n]):
                    i = len(text) - n
                    break
        if i >= 0 and (best is None or i < best):
            best = i
    return best


def tool_prompt(tokenizer: Any, messages: list[Any], tools: Tools | None) -> str:
    """The conversation rendered for an answer that may call `tools` (or that reads tool
    results back), through the chat template.

    Raises:
        ToolError: the template cannot render tools and the call is not forced ("tools"), it
            cannot render tool results ("messages"), or it refuses the messages.
    """
    takes = template_takes_tools(tokenizer)
    records = template_messages(messages)
    if not takes:
        if tools is not None and not tools.forced:
            raise ToolError(
                "tools: this model's chat template does not render tools; tool_choice 'required' or a "
                "named function still works (the call is then forced by the grammar)",
                "tools",
            )
        if any(r["role"] == "tool" or r.get("tool_calls") for r in records):
            raise ToolError(
                "messages: this model's chat template does not render tool calls or results", "messages"
            )
        if tools is not None:  # a forced call: the tools in words, after any system prompt
            if records and records[0]["role"] in ("system", "developer"):
                records[0] = {**records[0], "content": f"{records[0]['content']}\n\n{tools.described()}"}
            else:
                records.insert(0, {"role": "system", "content": tools.described()})
    extra = {"tools": tools.template_tools()} if takes and tools is not None else {}
    if is_harmony(getattr(tokenizer, "chat_template", None)):
        records = one_call_each(records)
        if extra:  # gpt-oss's template writes each description as a comment, and fails on none
            extra["tools"] = [{**t, "function": {"description": "", **t["function"]}} for t in extra["tools"]]
    try:
        return str(
            tokenizer.apply_chat_template(records, tokenize=False, add_generation_prompt=True, **extra)
        )
    except Exception as exc:  # noqa: BLE001 - a template's own refusal (jinja raise_exception)
        raise ToolError(f"messages: the chat template refused them: {exc}", "messages") from None
