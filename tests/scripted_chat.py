"""A chat on the tiny test model whose answers are scripted: the real engine, session,
REPL and renderer, with a model that replays given Markdown token by token.

Run as a program (the screen tests start it in a pseudo-terminal):
    python tests/scripted_chat.py ANSWER.md [ANSWER2.md ...] [--delay SECONDS]
The n-th message gets the n-th answer (the last one repeats). Each decode step sleeps
`--delay` seconds, so a test can act in the middle of an answer; `--chunk-delay` holds the
second pass of the first message read in several chunks, once the first is in the cache.
With `--prompt TEXT` it answers once and exits, as `chatbot run "TEXT"`. With `--load-when PATH`,
the REPL starts as `chatbot run` does, with its model still loading: the load ends when the
test creates PATH (with `--load-fails`, it ends with an error). `--max-context` makes room
for a long paste (the tiny tokenizer spends about one token per two characters).
`--thinking show|hide` is --show-thinking / --hide-thinking (default: folded). `--harmony` chats
in gpt-oss's format: its control tokens and its real chat template (answers are written in
channels, `<|channel|>analysis<|message|>...`).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from helpers import make_harmony_tokenizer, make_model, make_tokenizer


class ScriptedModel:
    """Wraps a real (tiny, random) causal LM: its forward pass runs and fills the cache as
    usual, then the logits of the last position are replaced so that the next token is the
    script's. A prompt (more than one new token) starts the next answer of the script."""

    def __init__(
        self,
        model,
        answers: list[list[int]],
        eos: int,
        delay: float = 0.0,
        prefill_delay: float = 0.0,
        chunk_delay: float = 0.0,
    ) -> None:
        self.model = model
        self.answers = answers
        self.eos = eos
        self.delay = delay
        self.prefill_delay = prefill_delay
        self.chunk_delay = chunk_delay
        self.turn = -1
        self.pos = 0
        self.prompt_passes = 0  # prompt passes in a row: the chunks of one message

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, *args, **kwargs):
        out = self.model(*args, **kwargs)
        ids = kwargs.get("input_ids")
        if ids is None:
            ids = args[0]
        if ids.shape[-1] > 1:  # a prompt: the next answer begins
            self.prompt_passes += 1
            if self.prompt_passes == 2 and self.chunk_delay:
                delay, self.chunk_delay = self.chunk_delay, 0.0  # once: the first chunk is in
                time.sleep(delay)
            self.turn += 1
            self.pos = 0
            if self.prefill_delay:
                delay, self.prefill_delay = self.prefill_delay, 0.0  # the first prompt's pass only
                time.sleep(delay)
        else:
            self.prompt_passes = 0
            self.pos += 1
            if self.delay:
                time.sleep(self.delay)
        script = self.answers[min(self.turn, len(self.answers) - 1)]
        target = script[self.pos] if self.pos < len(script) else self.eos
        logits = torch.full_like(out.logits[:, -1:, :], -1e4)
        logits[..., target] = 1e4
        out.logits = torch.cat([out.logits[:, :-1, :], logits], dim=1)
        return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("answers", nargs="+", type=Path)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--load-when", type=Path)
    parser.add_argument("--load-fails", action="store_true")
    parser.add_argument("--load-waits-on", help="words of a wait (chatbot.progress) the load is in")
    parser.add_argument("--resume", type=Path, help="a session log to resume once loaded")
    parser.add_argument("--name", default="scripted", help="the model's name (the toolbar shows it)")
    parser.add_argument(
        "--prefill-delay", type=float, default=0.0, help="seconds the first prompt's pass sleeps"
    )
    parser.add_argument(
        "--chunk-delay", type=float, default=0.0, help="seconds the second chunk of a long message sleeps"
    )
    parser.add_argument("--prompt", help="answer this message once and exit (chatbot run PROMPT)")
    parser.add_argument("--source", default="test", help="where the model came from (/model shows it)")
    parser.add_argument("--decode", help="how the model decodes, as /model says it")
    parser.add_argument("--max-context", type=int, default=4096, help="the engine's context, in tokens")
    parser.add_argument("--thinking", default="fold", help="fold, show or hide (--show/--hide-thinking)")
    parser.add_argument(
        "--harmony", action="store_true", help="gpt-oss's control tokens and chat template (harmony)"
    )
    args = parser.parse_args()

    torch.set_num_threads(1)
    from chatbot.config import ChatConfig, SamplingConfig
    from chatbot.conversation.session import ChatSession
    from chatbot.engine.generate import Engine
    from chatbot.errors import ModelLoadError
    from chatbot.models.loader import LoadedModel
    from chatbot.terminal.repl import ChatStart, Repl
    from chatbot.terminal.repl import run as run_repl
    from chatbot.terminal.tty import make_consoles

    tokenizer = make_harmony_tokenizer() if args.harmony else make_tokenizer()
    answers = [
        tokenizer.encode(p.read_text(encoding="utf-8"), add_special_tokens=False) for p in args.answers
    ]
    model = ScriptedModel(
        make_model(len(tokenizer)),
        answers,
        tokenizer.convert_tokens_to_ids("<|return|>") if args.harmony else tokenizer.eos_token_id,
        args.delay,
        args.prefill_delay,
        args.chunk_delay,
    )
    engine = Engine(model, tokenizer, max_context=args.max_context)
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=max(len(a) for a in answers) + 8)
    session = ChatSession(engine, ChatConfig(sampling=sampling))
    if args.decode is not None:
        engine.backend.describe = lambda: args.decode
    loaded = LoadedModel(
        model=model.model, tokenizer=tokenizer, name=args.name, source=args.source, kind="folder"
    )
    interactive = sys.stdin.isatty() and args.prompt is None
    out, info = make_consoles(interactive)
    if args.prompt is not None:
        from chatbot.terminal.oneshot import answer_once

        repl = Repl(session, loaded, out, plain=not sys.stdout.isatty(), info=info)
        repl.start_log()
        sys.exit(answer_once(repl, args.prompt))
    if args.load_when is None:
        repl = Repl(session, loaded, out, plain=not sys.stdout.isatty(), info=info)
        repl.thinking_view = args.thinking
        repl.start_log()
        run_repl(repl, interactive)
        return
    pending: Future[ChatStart] = Future()

    def load() -> None:
        from contextlib import nullcontext

        from chatbot.progress import waiting

        with waiting(args.load_waits_on) if args.load_waits_on else nullcontext():
            while not args.load_when.exists():
                time.sleep(0.02)
        if args.load_fails:
            pending.set_exception(ModelLoadError("cannot read GGUF file scripted.gguf: it is truncated"))
        else:
            pending.set_result(ChatStart(session, loaded, ["scripted · ready in 0.0 s (load 0.0 s)"]))

    threading.Thread(target=load, daemon=True).start()
    repl = Repl.loading(
        pending,
        args.name,
        out,
        plain=not sys.stdout.isatty(),
        info=info,
        on_ready=lambda: repl.start_log(args.resume),
    )
    run_repl(repl, interactive)
    if repl.load_error is not None:  # as `chatbot run`'s main: one line, status 2
        print(f"chatbot: error: {repl.load_error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
