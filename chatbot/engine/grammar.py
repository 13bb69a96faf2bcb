"""Constrained decoding: a JSON schema (or any JSON object) compiled by llguidance into a
token mask applied once per step, so that the answer is valid JSON of that schema.

Only imported when an answer asks for a format (`SamplingConfig.output_format`): plain
decoding never loads llguidance. A `JsonConstraint` is made per answer; the tokenizer's
llguidance form is made once per tokenizer and kept on it.

The JSON is written as OpenAI's models write it: `", "` between items, `": "` after a key, no
other whitespace (a small model given free whitespace may fill its answer with newlines).
"""

from __future__ import annotations

import copy
import json
import shlex
import sys
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from chatbot.config import OutputFormat
from chatbot.errors import ChatbotError

if TYPE_CHECKING:
    import torch


class GrammarError(ChatbotError):
    """A schema the grammar engine cannot enforce (or that is not a JSON schema at all)."""


# How the JSON is laid out (see the module's docstring).
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_TOKENIZER_ATTR = "_chatbot_llguidance"
_LOCK = threading.Lock()
# byte value -> the 8 tokens it stands for, lowest bit first: 0 where allowed, -inf where not
_BYTE_BIAS = np.where(
    np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little") == 1,
    np.float32(0),
    np.float32(-np.inf),
).astype(np.float32)


# A dependency of the package; an environment can still lack it (installed without
# dependencies). The command installs it into the interpreter that runs chatbot.
LLGUIDANCE_REQUIREMENT = "llguidance>=1.9,<2"


def install_command() -> str:
    """The command that installs the grammar engine where chatbot runs."""
    return f"{shlex.quote(sys.executable)} -m pip install {shlex.quote(LLGUIDANCE_REQUIREMENT)}"


def _llguidance() -> Any:
    # The package alone (10 ms): its `torch` helpers import torch's compiler (seconds) and
    # compile their mask kernel on first use, its `hf` helper imports transformers.
    try:
        import llguidance
    except ImportError:
        raise GrammarError(
            f"structured outputs need llguidance, which is not installed: {install_command()}"
        ) from None
    return llguidance


def check_format(fmt: OutputFormat) -> None:
    """Check that `fmt` can be enforced, without a model (milliseconds; torch not imported):
    the grammar engine is there and the schema is one it enforces. The tokenizer's own
    check comes with the model (`compiled`).

    Raises:
        GrammarError: no grammar engine, or a schema it refuses (the message says which).
    """
    ll = _llguidance()
    try:
        grammar = ll.LLMatcher.grammar_from_json_schema(schema_of(fmt), defaults=_JSON_OPTIONS)
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"not a JSON schema: {exc}") from None
    is_error, messages = ll.LLMatcher.validate_grammar_with_warnings(grammar, None)
    if is_error:
        raise GrammarError(f"the schema cannot be enforced: {'; '.join(messages)}")


def _ll_tokenizer(tokenizer: Any) -> Any:
    """The tokenizer as llguidance takes it, made once (~0.4 s for 49k tokens) and kept on it.

    Raises:
        GrammarError: a tokenizer llguidance cannot read (a slow, Python-only one).
    """
    made = getattr(tokenizer, _TOKENIZER_ATTR, None)
    if made is not None:
        return made
    ll = _llguidance()
    with _LOCK:
        made = getattr(tokenizer, _TOKENIZER_ATTR, None)
        if made is None:
            backend = getattr(tokenizer, "backend_tokenizer", None)
            if backend is None:
                raise GrammarError("this model's tokenizer cannot be constrained: it is not a fast tokenizer")
            backend = copy.copy(backend)  # its padding and truncation are not the grammar's
            backend.no_padding()
            backend.no_truncation()
            try:
                made = ll.LLTokenizer(
                    backend.to_str(), n_vocab=len(tokenizer), eos_token=tokenizer.eos_token_id
                )
            except (ValueError, TypeError, RuntimeError) as exc:
                raise GrammarError(f"this model's tokenizer cannot be constrained: {exc}") from None
            setattr(tokenizer, _TOKENIZER_ATTR, made)
    return made


def schema_of(fmt: OutputFormat) -> dict[str, Any]:
    """The JSON schema a format stands for: a `json_object` is any JSON object."""
    if fmt.schema is None:
        return {"type": "object"}
    return json.loads(fmt.schema)


def compiled(tokenizer: Any, fmt: OutputFormat) -> str:
    """The llguidance grammar of `fmt`, checked against the tokenizer.

    Raises:
        GrammarError: the schema uses what the engine does not enforce (e.g. `uniqueItems`),
            contradicts itself, or is not a JSON schema; the message says which.
    """
    ll = _llguidance()
    tok = _ll_tokenizer(tokenizer)
    try:
        grammar = ll.LLMatcher.grammar_from_json_schema(schema_of(fmt), defaults=_JSON_OPTIONS)
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"not a JSON schema: {exc}") from None
    is_error, messages = ll.LLMatcher.validate_grammar_with_warnings(grammar, tok)
    if is_error:
        raise GrammarError(f"the schema cannot be enforced: {'; '.join(messages)}")
    # The first steps, as decoding starts: the text every answer begins with (forced), then
    # the choice after it. A schema no JSON value satisfies (a `$ref` cycle a -> b -> a,
    # `{"$ref": "#"}`) or one the engine cannot even start on passes the validation and only
    # fails here, where unchecked it would end the answer at once, as if it were complete.
    first = ll.LLMatcher(tok, grammar, log_level=0)
    first.consume_tokens(first.compute_ff_tokens())
    first.compute_bitmask()
    if first.is_error():
        raise GrammarError(f"the schema cannot be enforced: {_reason(first, started=False)}")
    return grammar


def _reason(matcher: Any, started: bool) -> str:
    """The matcher's error in one line (llguidance adds a dump of its state after it)."""
    lines = str(matcher.get_error()).strip().splitlines()
    reason = lines[0] if lines else f"it stopped ({matcher.stop_reason()})"
    if reason.startswith("NoExtension"):  # no token can start (or go on with) the answer
        what = "no token can go on with the answer" if started else "no JSON value satisfies it"
        return f"{what} (a $ref cycle, or a schema that only refers to itself?)"
    return reason


class JsonConstraint:
    """One answer's grammar state: `mask` leaves only the tokens that keep the answer a
    valid prefix of the format (the end-of-answer token only once it is complete), `accept`
    moves on past the chosen token, and `complete` says that no token may follow.

    The grammar engine can give up part way (a lexer or parser over its limits, e.g. a
    pattern like `^(.{1,1000}){1,1000}$` after some tokens): it then allows the end of the
    answer alone, which would pass for a complete answer. Each step checks for that and
    raises instead.

    Args:
        tokenizer: the model's tokenizer.
        fmt: the format to hold the answer to.

    Raises:
        GrammarError: as `compiled`.
    """

    def __init__(self, tokenizer: Any, fmt: OutputFormat) -> None:
        ll = _llguidance()
        self.tokens = 0  # accepted so far
        self.matcher = ll.LLMatcher(_ll_tokenizer(tokenizer), compiled(tokenizer, fmt), log_level=0)
        self._check()
        self.vocab = len(tokenizer)
        self.words = np.zeros((self.vocab + 31) // 32, dtype=np.int32)  # one bit a token

    def _check(self) -> None:
        if self.matcher.is_error():
            where = f"after {self.tokens} tokens" if self.tokens else "at the start"
            reason = _reason(self.matcher, started=self.tokens > 0)
            raise GrammarError(f"the grammar engine gave up on the schema {where}: {reason}")

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` (``[vocab]``) with the tokens the grammar forbids at -inf (a copy).

        Raises:
            GrammarError: the grammar engine gave up (see the class).
        """
        import torch  # loaded by then (the model runs on it); kept off `check_format`'s path

        self.matcher.unsafe_compute_mask_ptr(self.words.ctypes.data, self.words.nbytes)
        self._check()
        # each byte of the mask looked up as its 8 tokens' 0 or -inf, then added: no branch
        # per token (a masked_fill over a mixed mask costs ~10x more)
        bias = torch.from_numpy(np.take(_BYTE_BIAS, self.words.view(np.uint8), axis=0).reshape(-1))
        out = logits.detach().to(torch.float32, copy=True)
        n = min(self.vocab, out.shape[0])
        out[n:] = -float("inf")  # a head wider than the tokenizer: those ids are never allowed
        out[:n] += bias[:n].to(out.device)
        return out

    def accept(self, token: int) -> None:
        """The chosen token joins the answer.

        Raises:
            GrammarError: the token breaks the grammar, or the grammar engine gave up on it.
        """
        if not self.matcher.consume_token(token):
            self._check()
            raise GrammarError(f"the grammar refused token {token}")  # a bug: the mask allowed it
        self.tokens += 1

    @property
    def complete(self) -> bool:
        """The answer is whole: nothing may follow it.

        Raises:
            GrammarError: the grammar engine stopped with the answer incomplete.
        """
        if not self.matcher.is_stopped():
            return False
        self._check()
        if not self.matcher.is_accepting():
            raise GrammarError(
                f"the grammar engine stopped after {self.tokens} tokens with the answer incomplete "
                f"({self.matcher.stop_reason()})"
            )
        return True
