"""A logged chat's KV cache kept on disk (issue 61): `--resume` takes the history from it and
continues token for token as the chat that never stopped; a file that does not match or is
damaged is refused with one line, and the chat re-encodes and answers the same."""

from __future__ import annotations

import json

import pytest
import torch
from test_repl import Chat
from test_session import assert_invariant

from chatbot.conversation import log as session_log
from chatbot.conversation.kvstore import kv_dir

pytestmark = pytest.mark.usefixtures("one_thread")

MESSAGES = ("Hello there!", "How are you today?", "Tell me more.")


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("CHATBOT_KV_DIR", raising=False)  # the store where a user's is
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def _first(model, tokenizer, logs):
    """A chat of two turns, its log, its cache file, and (apart) the same chat going on."""
    first = Chat(model, tokenizer, logs, system="Be brief.")
    first.lines(*MESSAGES[:2])
    first.session.kv_store.wait()
    path = session_log.find_session("last", logs)
    return first, path, kv_dir() / (path.name.removesuffix(".jsonl") + ".safetensors")


def _resumed(model, tokenizer, path):
    second = Chat(model, tokenizer, None)
    second.repl.start_log(resume=path)
    assert_invariant(second.session)
    return second


def _uninterrupted(model, tokenizer, logs):
    whole = Chat(model, tokenizer, logs, system="Be brief.")
    whole.lines(*MESSAGES)
    return [t.answer for t in whole.session.turns]


def test_resume_takes_the_history_from_the_disk_cache(tiny_model, tiny_tokenizer, tmp_path):
    first, path, kv_file = _first(tiny_model, tiny_tokenizer, tmp_path / "logs")
    assert kv_file.is_file()
    held = len(first.session.kv.ids)
    second = _resumed(tiny_model, tiny_tokenizer, path)
    note = second.err.getvalue()
    # only the ids after the file's are encoded (the closing text of the last answer)
    history = len(second.session.all_ids)
    assert 0 < history - held <= 3
    assert f"(reused {held:,} of {history:,} tokens from the disk cache, {history - held:,} encoded)" in note
    second.lines(MESSAGES[2])
    stats = second.session.turns[-1].stats
    assert (stats.reused_tokens, stats.reused_of) == (held, history)
    assert f"· reused {held:,} of {history:,} tok" in second.out.getvalue() + second.err.getvalue()
    # the same greedy answers as the chat that never stopped
    same = _uninterrupted(tiny_model, tiny_tokenizer, tmp_path / "w")
    assert [t.answer for t in second.session.turns] == same


def test_sessions_says_what_the_store_holds_and_prune_empties_it(
    tiny_model, tiny_tokenizer, tmp_path, capsys
):
    from helpers import cli

    _, path, kv_file = _first(tiny_model, tiny_tokenizer, tmp_path / "logs")
    size = kv_file.stat().st_size
    code, out, _ = cli(capsys, "sessions")
    assert code in (0, None)
    assert f"disk cache: 1 file, {size / 1e6:,.1f} MB (cap 4 GiB;" in out.replace("\n", " "), out
    code, out, _ = cli(capsys, "sessions", "--prune")
    assert code in (0, None) and f"removed 1 cache file ({size / 1e6:,.1f} MB)" in out, out
    assert not kv_file.exists() and path.exists()  # the log stays
    code, out, _ = cli(capsys, "doctor", "--no-load")
    assert "kv cache: 0 files, 0.0 MB" in out, out
    second = _resumed(tiny_model, tiny_tokenizer, path)  # re-encodes, with no line about a file
    assert "disk cache" not in second.err.getvalue()


def _damage(kv_file, how):
    data = bytearray(kv_file.read_bytes())
    if how == "truncated":
        kv_file.write_bytes(bytes(data[: len(data) // 2]))
    elif how == "flipped":
        data[-7] ^= 0x40  # a byte of the last tensor
        kv_file.write_bytes(bytes(data))
    elif how == "another model":
        n = int.from_bytes(data[:8], "little")
        head = json.loads(data[8 : 8 + n])
        inner = json.loads(head["__metadata__"]["chatbot.kv"])
        inner["model"] = "gguf:0123456789abcdef"
        head["__metadata__"]["chatbot.kv"] = json.dumps(inner)
        # the checksum is recomputed, as a cache written by another model's chat would have it
        import zlib

        crc = zlib.crc32(head["__metadata__"]["chatbot.kv"].encode())
        new = json.dumps(head).encode()
        new += b" " * ((8 - len(new) % 8) % 8)
        body = bytes(data[8 + n :])
        from safetensors.torch import load

        tensors = load(bytes(len(new).to_bytes(8, "little") + new + body))
        for name in sorted(tensors):
            crc = zlib.crc32(tensors[name].contiguous().view(__import__("torch").uint8).numpy(), crc)
        head["__metadata__"]["chatbot.crc32"] = f"{crc:08x}"
        new = json.dumps(head).encode()
        new += b" " * ((8 - len(new) % 8) % 8)
        kv_file.write_bytes(len(new).to_bytes(8, "little") + new + body)


@pytest.mark.parametrize(
    ("how", "said"),
    [
        ("truncated", "is damaged"),
        ("flipped", "is damaged (checksum mismatch)"),
        ("another model", "was made with another model"),
    ],
)
def test_a_cache_that_does_not_match_is_refused_and_the_chat_re_encodes(
    tiny_model, tiny_tokenizer, tmp_path, how, said
):
    _, path, kv_file = _first(tiny_model, tiny_tokenizer, tmp_path / "logs")
    _damage(kv_file, how)
    second = _resumed(tiny_model, tiny_tokenizer, path)
    note = second.err.getvalue()
    assert said in note and "re-encoded" in note and "reused" not in note, note
    assert "Traceback" not in note
    second.lines(MESSAGES[2])
    same = _uninterrupted(tiny_model, tiny_tokenizer, tmp_path / "w")
    assert [t.answer for t in second.session.turns] == same
    # the turn wrote a sound file again
    second.session.kv_store.wait()
    third = _resumed(tiny_model, tiny_tokenizer, path)
    assert "tokens from the disk cache" in third.err.getvalue()


def test_an_edited_log_is_not_given_the_old_cache(tiny_model, tiny_tokenizer, tmp_path):
    _, path, _ = _first(tiny_model, tiny_tokenizer, tmp_path / "logs")
    lines = path.read_text().splitlines()
    edited = [
        line.replace('"user": "Hello there!"', '"user": "Goodbye there!"') if '"turn"' in line else line
        for line in lines
    ]
    path.write_text("\n".join(edited) + "\n")
    second = _resumed(tiny_model, tiny_tokenizer, path)
    # the system prompt still matches: its tokens are reused, the edited turn on is encoded
    note = second.err.getvalue()
    assert "Goodbye there!" in second.session.rendered
    assert "reused" in note and "tokens from the disk cache" in note, note
    reused = second.session.kv.ids
    assert second.session.turns[0].user == "Goodbye there!" and len(reused) == len(second.session.kv.seen)


STREAMING = {"enable_streaming": True, "start_size": 4, "recent_size": 24}


@pytest.fixture
def _evicting(monkeypatch):
    """The chats' checks after each line, less the logits against a recompute of the ids
    held: a window that evicted was encoded with the text it no longer holds."""
    import test_repl

    monkeypatch.setattr(test_repl, "assert_invariant", lambda s: assert_invariant(s, check_logits=False))


@pytest.mark.usefixtures("_evicting")
def test_a_streaming_chat_resumes_its_window_after_evictions(tiny_model, tiny_tokenizer, tmp_path):
    """Under --enable-streaming the file keeps the window as it stands after evictions: the
    resumed chat encodes only what the file lacks, holds the same window (keys and values
    bit for bit), and answers the same greedy text as the chat that never stopped."""
    logs = tmp_path / "logs"
    first = Chat(tiny_model, tiny_tokenizer, logs, system="Be brief.", **STREAMING)
    first.lines(*MESSAGES[:2])
    first.session.kv_store.wait()
    kv = first.session.kv
    assert kv.evicted_total > 0  # the window has moved
    path = session_log.find_session("last", logs)
    second = Chat(tiny_model, tiny_tokenizer, None, **STREAMING)
    second.repl.start_log(resume=path)
    assert_invariant(second.session, check_logits=False)
    resumed = second.session.kv
    assert "from the disk cache" in second.err.getvalue(), second.err.getvalue()
    # the window the chat left, evictions and all; the closing text after it goes with the
    # next message, in one pass, as in the chat that never stopped
    assert (resumed.seen, resumed.ids, resumed.pinned) == (kv.seen, kv.ids, kv.pinned)
    assert resumed.evicted_total == kv.evicted_total
    for mine, theirs in zip(resumed.layers, kv.layers):
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)
    pending = len(second.session.all_ids) - len(kv.seen)
    assert f"from the disk cache, {pending} with the next message)" in second.err.getvalue()
    second.lines(MESSAGES[2])
    whole = Chat(tiny_model, tiny_tokenizer, tmp_path / "w", system="Be brief.", **STREAMING)
    whole.lines(*MESSAGES)
    assert [t.answer for t in second.session.turns] == [t.answer for t in whole.session.turns]
    assert second.session.kv.ids == whole.session.kv.ids


@pytest.mark.usefixtures("_evicting")
def test_a_file_of_another_window_is_refused(tiny_model, tiny_tokenizer, tmp_path):
    logs = tmp_path / "logs"
    first = Chat(tiny_model, tiny_tokenizer, logs, system="Be brief.", **STREAMING)
    first.lines(*MESSAGES[:2])
    first.session.kv_store.wait()
    path = session_log.find_session("last", logs)
    second = Chat(tiny_model, tiny_tokenizer, None, **{**STREAMING, "recent_size": 28})
    second.repl.start_log(resume=path)
    assert "the disk cache was made with another window" in second.err.getvalue()
    second.lines(MESSAGES[2])  # re-encoded, and the chat goes on
    assert len(second.session.turns) == 3


def test_the_default_model_resumes_from_disk_token_for_token(default_model, tmp_path):
    """On the real model and the native kernels (as `chatbot run` decodes): the resumed chat
    answers its next message with the same greedy tokens as the chat that never stopped; a
    truncated file is refused and the chat re-encodes, answering as one that had no file."""
    import shutil

    from chatbot.config import ChatConfig, SamplingConfig
    from chatbot.conversation.kvstore import KVStore
    from chatbot.conversation.session import ChatSession
    from chatbot.engine.backends.choose import backend_for
    from chatbot.engine.generate import Engine

    backend, _ = backend_for(default_model.model, "auto")
    engine = Engine(default_model.model, default_model.tokenizer, backend=backend)
    config = ChatConfig(sampling=SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=16))

    def answer(session, text):
        return "".join(chunk.text for chunk in session.send(text))

    def session(file=None):
        s = ChatSession(engine, config)
        if file is not None:
            s.keep_cache_in(KVStore(file, s.kv_identity), resuming=True)
        return s

    whole = session(tmp_path / "whole.safetensors")
    whole.keep_cache_in(whole.kv_store)  # writing, not resuming
    for text in ("What is bread made of?", "And how long does it bake?"):
        answer(whole, text)
    whole.kv_store.wait()
    saved, kept = whole.to_dict("default"), tmp_path / "kept.safetensors"
    shutil.copy(whole.kv_store.path, kept)
    if type(engine.backend).__name__ == "NativeBackend":
        assert type(whole.kv.cache.layers[0]).__name__ == "BufferLayer"
    going_on = answer(whole, "Thank you!")

    resumed = session(kept)
    encoded = resumed.restore(saved)  # the closing text of the last answer, at most a few more
    assert encoded <= 4 and f"from the disk cache, {encoded} encoded" in resumed.encoded_note(encoded, False)
    assert answer(resumed, "Thank you!") == going_on
    stats = resumed.turns[-1].stats
    assert stats.reused_of - stats.reused_tokens == encoded and stats.reused_tokens > 50

    resumed.kv_store.wait()  # (it wrote the file again after its turn)
    kept.write_bytes(kept.read_bytes()[:-1000])
    refused, plain = session(kept), session()
    n = refused.restore(saved)
    assert n == plain.restore(saved) > 50
    assert "is damaged" in refused.encoded_note(n, False)
    assert answer(refused, "Thank you!") == answer(plain, "Thank you!")


def test_the_default_model_resumes_a_streaming_window_token_for_token(default_model, tmp_path):
    """--enable-streaming on the real model and the native kernels (buffer layers that evict
    in place): the window a chat left after evictions, resumed from its file, answers the
    next message with the same greedy tokens as the chat that never stopped."""
    import shutil

    from chatbot.config import ChatConfig, EngineConfig, SamplingConfig
    from chatbot.conversation.kvstore import KVStore
    from chatbot.conversation.session import ChatSession
    from chatbot.engine.backends.choose import backend_for
    from chatbot.engine.generate import Engine

    backend, _ = backend_for(default_model.model, "auto")
    engine = Engine(default_model.model, default_model.tokenizer, backend=backend)
    config = ChatConfig(
        sampling=SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=24),
        engine=EngineConfig(enable_streaming=True, start_size=4, recent_size=48),
    )

    def answer(session, text):
        return "".join(chunk.text for chunk in session.send(text))

    whole = ChatSession(engine, config)
    whole.keep_cache_in(KVStore(tmp_path / "whole.safetensors", whole.kv_identity))
    for text in ("What is bread made of?", "And how long does it bake?"):
        answer(whole, text)
    assert whole.kv.evicted_total > 0
    whole.kv_store.wait()
    saved, kept = whole.to_dict("default"), tmp_path / "kept.safetensors"
    shutil.copy(whole.kv_store.path, kept)
    going_on = answer(whole, "Thank you!")

    resumed = ChatSession(engine, config)
    resumed.keep_cache_in(KVStore(kept, resumed.kv_identity), resuming=True)
    assert resumed.restore(saved) == 0  # nothing encoded: the closing text goes with the message
    assert "with the next message" in resumed.encoded_note(0, False)
    assert answer(resumed, "Thank you!") == going_on


def test_the_store_keeps_under_its_cap_dropping_the_oldest(tmp_path, monkeypatch):
    """Past the cap, the files written longest ago go first, never the one just written; a
    temporary file a killed write left an hour ago goes too; other files stay."""
    import os
    import time

    from chatbot.conversation.kvstore import prune

    folder = tmp_path / "kv"
    folder.mkdir()
    now = time.time()
    paths = []
    for i in range(4):
        p = folder / f"chat{i}.safetensors"
        p.write_bytes(b"x" * 1000)
        os.utime(p, (now - 100 + i, now - 100 + i))  # chat0 oldest
        paths.append(p)
    stale, fresh = folder / "chat9.safetensors.1.tmp", folder / "chat8.safetensors.2.tmp"
    stale.write_bytes(b"t")
    os.utime(stale, (now - 7200, now - 7200))
    fresh.write_bytes(b"t")
    other = folder / "notes.txt"
    other.write_bytes(b"y" * 5000)
    removed = prune(folder, keep=paths[0], cap=2500)
    assert set(removed) == {paths[1], paths[2], stale}
    assert paths[0].exists() and paths[3].exists() and fresh.exists() and other.exists()
    monkeypatch.setenv("CHATBOT_KV_CACHE_BYTES", "0")
    assert set(prune(folder, keep=paths[3])) == {paths[0]}


def test_a_cache_path_that_is_no_regular_file_is_refused_without_reading_it(tmp_path, tiny_engine):
    """A FIFO (whose read would block), a link and a directory where the cache file should be
    are refused with their line, at once; nothing is taken into the cache."""
    import os

    from chatbot.conversation.kvstore import KVStore

    target = tmp_path / "elsewhere.safetensors"
    target.write_bytes(b"x" * 100)
    for name, make in (("fifo", os.mkfifo), ("link", lambda p: os.symlink(target, p)), ("dir", os.mkdir)):
        path = tmp_path / f"{name}.safetensors"
        make(path)
        kv = tiny_engine.new_cache()
        why = f"the disk cache {path} is not a regular file"
        assert KVStore(path, dict).load(kv, [1, 2, 3], "cpu") == (0, why)
        assert not kv.ids


@pytest.mark.parametrize("streaming", [False, True], ids=["growing", "streaming"])
def test_bench_resume_times_the_disk_cache_against_re_encoding(
    tmp_path, capsys, tiny_model, tiny_tokenizer, streaming
):
    """`chatbot bench resume`: a chat played to the asked length, restored from its file (a few
    tokens encoded) and re-encoded (all of them), both timed; the file's size per token."""
    from helpers import CORPUS, cli, make_model

    folder = tmp_path / "tiny"
    make_model(len(tiny_tokenizer), max_position_embeddings=4096).save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    text = tmp_path / "long.txt"
    text.write_text("\n\n".join(CORPUS * 30))
    out = tmp_path / "resume.json"
    flags = ["--enable-streaming", "--recent-size", "64"] if streaming else []
    args = ["--model", str(folder), "--text", str(text), "--history-tokens", "1500", "--repeats", "2"]
    code, stdout, err = cli(capsys, "bench", "resume", *args, *flags, "--json", str(out))
    assert code == 0, err
    result = json.loads(out.read_text())
    history = result["history_tokens"]
    assert history >= 1500 and result["streaming"] is streaming
    disk, again = result["disk"], result["reencode"]
    # the history and the next message (streaming: the window, refilled)
    assert again["encoded_tokens"] > (64 if streaming else history)
    assert 0 < disk["encoded_tokens"] < 40  # the next message (and a closing text)
    assert len(disk["runs_s"]) == len(again["runs_s"]) == 2
    assert result["bytes_per_1k_tokens"] * history // 1000 <= result["file_bytes"]
    assert f"--resume of a chat of {history:,} tokens" in stdout and "sooner from the disk cache" in stdout


def test_load_of_a_saved_chat_takes_its_history_from_the_cache_save_kept(
    tiny_model, tiny_tokenizer, tmp_path
):
    """/save keeps the chat's cache under the saved conversation's name; /load of that file
    (in another chat) takes the history from it and answers as the chat that never stopped;
    a file edited since is not given the old cache."""
    saved = tmp_path / "chat.json"
    first = Chat(tiny_model, tiny_tokenizer, tmp_path / "a", system="Be brief.")
    first.lines(*MESSAGES[:2], f"/save {saved}")
    first.session._before_forward()  # the saved cache written
    held = len(first.session.kv.seen)
    other = Chat(tiny_model, tiny_tokenizer, tmp_path / "b")
    other.lines("Something else entirely.", f"/load {saved}")
    note = other.err.getvalue()
    assert f"(reused {held:,} of " in note and "from the disk cache" in note, note
    other.lines(MESSAGES[2])
    first.lines(MESSAGES[2])
    assert other.session.turns[-1].answer == first.session.turns[-1].answer
    edited = json.loads(saved.read_text())
    edited["messages"][1]["content"] = "Hello there, edited!"
    saved.write_text(json.dumps(edited))
    third = Chat(tiny_model, tiny_tokenizer, tmp_path / "c")
    third.lines(f"/load {saved}")
    assert "from the disk cache" not in third.err.getvalue()


QUESTIONS = (
    "What is the capital of France?",
    "Tell me a long story about a dragon who lived in a cave near the sea and ate fish.",
    "Explain quicksort in detail please, with an example of sorting eight numbers step by step.",
    "Summarize the plot of Hamlet in three sentences.",
    "Hi",
)


def _forward(engine, kv, ids, queries=None):
    """One forward pass of `ids` (never the batched rows), the last position's logits."""
    from chatbot.engine.backends.base import HFBackend

    engine.backend.reserve(kv.cache, kv.length + len(ids))
    logits = HFBackend.prefill(engine.backend, kv.cache, ids, queries)
    kv.feed(ids)
    return logits


@pytest.mark.slow
@pytest.mark.parametrize("opt", ["auto", "exact", "f32", "off"])
def test_a_stored_start_continues_the_whole_prompts_pass_bit_for_bit(default_model, opt):
    """--opt auto on the default model: a prompt that takes its start's keys, values and
    queries from another prompt's first pass and encodes the rest after them gets the logits
    of encoding it whole, bit for bit, wherever `exact_rows` lets it take the start. Encoding
    the rest alone (no queries) does not: how sdpa cuts a pass into blocks of queries decides
    the last bits (and the rows of a short rest took int8 inputs where the whole prompt's
    pass takes int16 ones: the L'Etoile answer of the first attempt)."""
    from chatbot.engine.backends.choose import backend_for
    from chatbot.engine.cache.queries import REST_ROWS, PassQueries, exact_rows
    from chatbot.engine.generate import Engine

    tok = default_model.tokenizer
    backend, _ = backend_for(default_model.model, opt)
    engine = Engine(default_model.model, tok, backend=backend)
    assert engine.backend.keeps_queries
    prompts = []
    for q in QUESTIONS:
        text = tok.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        prompts.append(tok(text, add_special_tokens=False)["input_ids"])
    start = next(i for i in range(min(map(len, prompts))) if len({p[i] for p in prompts}) > 1)
    with torch.inference_mode():
        whole, kept = [], []
        for p in prompts:
            kv = engine.new_cache()
            queries = PassQueries(start)
            whole.append(_forward(engine, kv, p, queries))
            kept.append((kv, queries))
        checked = 0
        for (kv, queries), written in zip(kept, prompts):
            for p, want in zip(prompts, whole):
                take = min(exact_rows(start, len(written), len(p)), len(p) - REST_ROWS)
                if take <= 0:
                    continue
                other = engine.new_cache()
                _forward(engine, other, p[:take])
                for layer, source in zip(other.cache.layers, kv.cache.layers):
                    layer.keys.copy_(source.keys[..., :take, :])
                    layer.values.copy_(source.values[..., :take, :])
                given = PassQueries(take, [q[:, :, :take] for q in queries.layers], continuing=True)
                assert torch.equal(_forward(engine, other, p[take:], given), want), (len(written), len(p))
                checked += 1
        assert checked >= 9
        # the rest encoded alone after the same start: other bits where the native kernels run
        # (their attention); torch's own (`off`) gave other bits on an AVX-512 Zen 5 and the
        # same on an AVX2 Zen 3: its blocking of a pass depends on the CPU, so not asserted there
        if opt != "off":
            kv = engine.new_cache()
            engine.prefill(kv, prompts[0][:start])
            assert not torch.equal(engine.prefill(kv, prompts[0][start:]), whole[0])


@pytest.mark.slow
def test_a_new_chat_takes_its_system_prompt_from_the_chat_before(default_model, tmp_path):
    """The start new chats of a model, template, system prompt and --opt share is kept once:
    the next chat's first answer prefills only its message and answers as a chat that encoded
    it all (greedy, --opt auto, the native kernels); a short prompt takes nothing (its whole
    pass would cut the start's block of queries otherwise); a damaged file is refused and
    another system prompt has a file of its own."""
    from chatbot.config import ChatConfig, SamplingConfig
    from chatbot.conversation.session import ChatSession
    from chatbot.engine.backends.choose import backend_for
    from chatbot.engine.generate import Engine

    backend, _ = backend_for(default_model.model, "auto")
    engine = Engine(default_model.model, default_model.tokenizer, backend=backend)
    config = ChatConfig(sampling=SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=12))

    def chat(text, keep=True, system=None):
        session = ChatSession(engine, ChatConfig(system=system, sampling=config.sampling))
        if keep:
            session.keep_start()
        answer = "".join(chunk.text for chunk in session.send(text))
        session._before_forward()  # the start's file written
        return session, answer

    plain = {q: chat(q, keep=False)[1] for q in QUESTIONS[:2]}
    first, answer = chat(QUESTIONS[0])
    (start,) = kv_dir().glob("prefix-*.safetensors")
    assert answer == plain[QUESTIONS[0]] and first.turns[0].stats.reused_of == 0
    second, answer = chat(QUESTIONS[1])
    stats = second.turns[0].stats
    assert answer == plain[QUESTIONS[1]]
    assert stats.reused_tokens >= 16 and stats.context_tokens == stats.reused_of - stats.reused_tokens
    assert "tokens of the start chats share" in second.describe_cache()[1]["from the disk cache"]
    again, answer = chat(QUESTIONS[0])
    assert answer == plain[QUESTIONS[0]] and again.turns[0].stats.reused_tokens > 0
    short, _ = chat("Hi")
    assert short.turns[0].stats.reused_tokens == 0  # 31 tokens: the start's block is not whole
    start.write_bytes(start.read_bytes()[:-100])
    damaged, answer = chat(QUESTIONS[1])
    assert answer == plain[QUESTIONS[1]] and damaged.turns[0].stats.reused_tokens == 0
    mended, answer = chat(QUESTIONS[0])  # the refused file was written again
    assert answer == plain[QUESTIONS[0]] and mended.turns[0].stats.reused_tokens > 0
    chat(QUESTIONS[1], system="Answer in French.")
    assert len(list(kv_dir().glob("prefix-*"))) == 2  # its own start


@pytest.mark.slow
def test_run_answers_the_same_twice_with_the_start_from_the_store(tmp_path):
    """`chatbot run --greedy` (the default model, --opt auto) answers the same text the first
    time (which writes the start's file) and the next (which takes it), and says so."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path / "data"), "CHATBOT_KV_DIR": str(tmp_path / "kv")}

    def run():
        args = ("run", "--greedy", "What is the capital of France?")
        proc = subprocess.run(
            [sys.executable, "-m", "chatbot.cli", *args], stdin=subprocess.DEVNULL, capture_output=True,
            text=True, env=env, timeout=300, check=False,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        return proc.stdout, proc.stderr

    (out1, err1), (out2, err2) = run(), run()
    assert "Paris" in out1 and out1 == out2
    assert "reused" not in err1 and "· reused 24 of 37 tok" in err2, err2
    assert len(list((tmp_path / "kv").glob("prefix-*.safetensors"))) == 1
