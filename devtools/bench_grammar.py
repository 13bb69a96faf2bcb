"""Grammar engines for constrained decoding, measured on one tokenizer: the cost of a token
mask per step, of compiling a JSON schema, and which schema keywords each takes.

    python -m devtools.bench_grammar [--tokenizer DIR] [--rounds N]
    python -m devtools.bench_grammar --decode [--rounds N] [--threads T]

Each engine walks the same answer token by token (the tokenizer's encoding of a JSON
document that satisfies the schema): at every step it computes the mask of allowed tokens
and applies it to a logits row of the vocabulary's size, then accepts the token. Without
--tokenizer, the default model's tokenizer (SmolLM2, 49,152 tokens). Engines that do not
import are skipped with the reason.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from chatbot.config import OutputFormat

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "colour": {"enum": ["red", "green", "blue"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "colour", "age", "address"],
    "additionalProperties": False,
}
ANSWER = '{"name": "Ada Lovelace", "colour": "green", "age": 36, "address": {"city": "London", "zip": "W1"}}'

# Keywords a schema may use, each alone with an instance that breaks it: an engine that
# compiles the schema but lets every token of that instance through ignores the keyword.
COVERAGE: dict[str, tuple[dict[str, Any], str]] = {
    "enum": ({"enum": ["a", "b"]}, '"c"'),
    "const": ({"const": "x"}, '"y"'),
    "integer min/max": ({"type": "integer", "minimum": 0, "maximum": 120}, "150"),
    "exclusiveMinimum": ({"type": "integer", "exclusiveMinimum": 0}, "0"),
    "string min/maxLength": ({"type": "string", "minLength": 2, "maxLength": 5}, '"abcdefg"'),
    "pattern": ({"type": "string", "pattern": "^[a-z]+[0-9]$"}, '"abc"'),
    "format date-time": ({"type": "string", "format": "date-time"}, '"yesterday"'),
    "array maxItems": ({"type": "array", "items": {"type": "integer"}, "maxItems": 2}, "[1, 2, 3]"),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "string"}]}, "true"),
    "$ref/$defs": (
        {"$defs": {"p": {"type": "integer"}}, "type": "object", "properties": {"x": {"$ref": "#/$defs/p"}}},
        '{"x": "s"}',
    ),
    "recursive $ref": (
        {
            "$defs": {
                "n": {
                    "type": "object",
                    "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/n"}}},
                }
            },
            "$ref": "#/$defs/n",
        },
        '{"kids": [1]}',
    ),
    "additionalProperties schema": (
        {"type": "object", "additionalProperties": {"type": "integer"}},
        '{"a": "s"}',
    ),
    "multipleOf": ({"type": "integer", "multipleOf": 3}, "4"),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]"),
}


class Candidate:
    """One engine: `compile(schema)` returns a stepper whose `mask(logits)` masks in place
    and `accept(token)` advances."""

    name = ""

    def compile(self, schema: dict[str, Any]) -> Any:
        raise NotImplementedError


class LLGuidance(Candidate):
    """llguidance as chatbot runs it (`chatbot.engine.grammar.JsonConstraint`)."""

    name = "llguidance"

    def __init__(self, tok: Any) -> None:
        from chatbot.engine import grammar

        self.grammar, self.tok = grammar, tok
        grammar.JsonConstraint(tok, OutputFormat.json_object())  # the tokenizer's form, made once

    def compile(self, schema: dict[str, Any]) -> Any:
        constraint = self.grammar.JsonConstraint(self.tok, OutputFormat(json.dumps(schema)))

        class Step:
            def mask(self, logits: torch.Tensor) -> None:
                logits[0] = constraint.mask(logits[0])

            def accept(self, token: int) -> None:
                constraint.matcher.consume_token(token)

        return Step()


class XGrammar(Candidate):
    name = "xgrammar"

    def __init__(self, tok: Any) -> None:
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.n_vocab = len(tok)

    def compile(self, schema: dict[str, Any]) -> Any:
        xgr = self.xgr
        compiled = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        matcher = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, self.n_vocab)

        class Step:
            def mask(self, logits: torch.Tensor) -> None:
                matcher.fill_next_token_bitmask(bitmask)
                xgr.apply_token_bitmask_inplace(logits, bitmask)

            def accept(self, token: int) -> None:
                matcher.accept_token(token)

        return Step()


class OutlinesCore(Candidate):
    name = "outlines-core"

    def __init__(self, tok: Any) -> None:
        import outlines_core

        self.oc = outlines_core
        # The vocabulary as outlines-core wants it: each token's bytes (byte-level BPE: GPT-2's
        # byte-to-unicode characters mapped back to the bytes they stand for).
        printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
        chars = printable + [256 + n for n in range(256 - len(printable))]
        to_byte = {
            chr(c): b for c, b in zip(chars, printable + [b for b in range(256) if b not in printable])
        }
        tokens: dict[bytes, list[int]] = {}
        eos = tok.eos_token_id
        for token, i in tok.get_vocab().items():
            if i != eos and token not in tok.all_special_tokens:
                tokens.setdefault(bytes(to_byte[c] for c in token), []).append(i)
        self.vocab = outlines_core.Vocabulary(eos, tokens)
        self.n_vocab = len(tok)

    def compile(self, schema: dict[str, Any]) -> Any:
        oc = self.oc
        regex = oc.json_schema.build_regex_from_schema(json.dumps(schema))
        guide = oc.Guide(oc.Index(regex, self.vocab))
        n_vocab = self.n_vocab
        words = torch.zeros((n_vocab + 31) // 32, dtype=torch.int32)

        class Step:
            def mask(self, logits: torch.Tensor) -> None:
                guide.write_mask_into(words.data_ptr(), words.numel(), 4)
                bits = (words[:, None] >> torch.arange(32, dtype=torch.int32)) & 1
                allowed = bits.flatten()[:n_vocab].bool()
                logits.masked_fill_(~allowed, -float("inf"))

            def accept(self, token: int) -> None:
                guide.advance(token)

        return Step()


def walk(candidate: Candidate, ids: list[int], vocab: int, rounds: int) -> tuple[float, float]:
    """(compile ms, median mask + apply µs per token) over `rounds` walks of `ids`."""
    compile_s, step_s = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        stepper = candidate.compile(SCHEMA)
        compile_s.append(time.perf_counter() - t0)
        for token in ids:
            logits = torch.randn(1, vocab)
            t1 = time.perf_counter()
            stepper.mask(logits)
            step_s.append(time.perf_counter() - t1)
            assert logits[0, token] != -float("inf"), (
                f"{candidate.name} masked out the answer's token {token}"
            )
            stepper.accept(token)
    return statistics.median(compile_s) * 1e3, statistics.median(step_s) * 1e6


def coverage(candidate: Candidate, tok: Any) -> tuple[list[str], list[str]]:
    """(the COVERAGE keywords the engine refuses, those it compiles but does not enforce)."""
    refused, ignored = [], []
    for name, (schema, bad) in COVERAGE.items():
        try:
            stepper = candidate.compile(schema)
        except Exception:  # noqa: BLE001 - any refusal counts
            refused.append(name)
            continue
        # the instance, then the end of the answer: a prefix of a valid one must not end there
        for token in [*tok(bad, add_special_tokens=False)["input_ids"], tok.eos_token_id]:
            logits = torch.zeros(1, len(tok))
            stepper.mask(logits)
            if logits[0, token] == -float("inf"):
                break
            if token != tok.eos_token_id:
                stepper.accept(token)
        else:
            ignored.append(name)
    return refused, ignored


def decode_figures(rounds: int, threads: int | None) -> None:
    """Decode tok/s of the default model's answers, free and under SCHEMA, in turn."""
    from chatbot.cli.load import make_backend, set_threads
    from chatbot.config import ChatConfig, SamplingConfig
    from chatbot.conversation.session import ChatSession
    from chatbot.engine.generate import Engine
    from chatbot.models.loader import load_model

    set_threads(threads)
    loaded = load_model(None)
    backend, _ = make_backend(loaded.model, "auto")
    engine = Engine(loaded.model, loaded.tokenizer, backend=backend)
    question = "Describe a person as JSON: name, favourite colour, age and address."
    modes = {"free": None, "schema": OutputFormat(json.dumps(SCHEMA), "person")}
    tokens = dict.fromkeys(modes, 0)
    seconds = dict.fromkeys(modes, 0.0)
    for i in range(rounds):
        for mode, fmt in modes.items():
            sampling = SamplingConfig(temperature=0.8, max_new_tokens=128, seed=i, output_format=fmt)
            session = ChatSession(engine, ChatConfig(sampling=sampling), loaded.template)
            stats = list(session.send(question))[-1].stats
            assert stats is not None
            # the first token's time holds the prefill's last step; both modes drop it alike
            tokens[mode] += len(stats.token_latencies_s)
            seconds[mode] += sum(stats.token_latencies_s)
    rate = {mode: tokens[mode] / seconds[mode] for mode in modes}
    print(f"decode: {type(backend).__name__}, {rounds} answers each, temperature 0.8")
    for mode in modes:
        print(f"  {mode:<6} {rate[mode]:6.1f} tok/s ({tokens[mode]} tokens)")
    print(f"  schema / free: {rate['schema'] / rate['free']:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", help="a tokenizer folder (default: the default model's)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--decode", action="store_true", help="decode tok/s with and without a schema")
    parser.add_argument("--threads", type=int, help="with --decode: the kernels' threads")
    args = parser.parse_args()
    if args.decode:
        decode_figures(args.rounds, args.threads)
        return
    if args.tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.tokenizer)
    else:
        from chatbot.models.loader import load_model

        tok = load_model(None).tokenizer
    ids = tok(ANSWER, add_special_tokens=False)["input_ids"]
    torch.set_num_threads(1)
    print(f"vocabulary {len(tok):,} tokens; answer {len(ids)} tokens; torch threads 1")
    makers: list[Callable[[Any], Candidate]] = [LLGuidance, XGrammar, OutlinesCore]
    for make in makers:
        name = make.name  # type: ignore[attr-defined]
        try:
            t0 = time.perf_counter()
            candidate = make(tok)
            setup_ms = (time.perf_counter() - t0) * 1e3
        except Exception as exc:  # noqa: BLE001 - not installed or not working here
            print(f"{name}: skipped ({type(exc).__name__}: {exc})")
            continue
        compile_ms, step_us = walk(candidate, ids, len(tok), args.rounds)
        refused, ignored = coverage(candidate, tok)
        print(
            f"{name}: tokenizer setup {setup_ms:,.0f} ms · schema compile {compile_ms:,.1f} ms · "
            f"mask+apply {step_us:,.0f} µs/token (median)\n"
            f"  refuses: {', '.join(refused) or 'none'}; compiles but does not enforce: "
            f"{', '.join(ignored) or 'none'}"
        )


if __name__ == "__main__":
    main()
