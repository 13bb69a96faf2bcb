"""`chatbot serve --cache-dir DIR` (issue 61): each conversation's KV cache is also written to
the folder, so a restarted server goes on with a conversation it had, prefilling only what is
new; what it answers is what a server without the folder answers. The official `openai`
client against real `chatbot serve` processes on 127.0.0.1."""

from __future__ import annotations

import httpx
from openai import OpenAI
from serve_helpers import running_server, save_tiny_model

from chatbot.conversation.kvstore import SUFFIX

HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello there! How are you today? " * 6},
]


def ask(url: str, messages: list[dict[str, str]], **extra: object):
    client = OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
    return client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, temperature=0, extra_body=extra or None
    )


def test_a_restarted_server_goes_on_from_its_cache_dir(tmp_path):
    folder = save_tiny_model(tmp_path / "tiny")
    cache = tmp_path / "kv"
    serve = ("--model", str(folder), "--served-model-name", "tiny", "--cache-dir", str(cache))
    with running_server(*serve, log=tmp_path / "first.log") as url:
        first = ask(url, HISTORY)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
    files = list(cache.glob("*" + SUFFIX))
    assert len(files) == 1 and files[0].stat().st_mode & 0o077 == 0  # the user's alone
    going_on = [
        *HISTORY,
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And what else?"},
    ]
    with running_server(*serve, log=tmp_path / "second.log") as url:
        again = ask(url, going_on)
        # the history came from the file: only the new message (and the answer's closing) was
        # prefilled
        cached = again.usage.prompt_tokens_details.cached_tokens
        assert first.usage.prompt_tokens <= cached < again.usage.prompt_tokens
        health = httpx.get(url.removesuffix("/v1") + "/health", timeout=30).json()
        disk = health["prefix_cache"]["disk"]
        assert disk["starts_taken"] == 1 and disk["tokens_taken"] == cached and disk["files"] >= 1
        # another cache_salt never takes another's file
        salted = ask(url, going_on, cache_salt="someone else")
        assert salted.usage.prompt_tokens_details.cached_tokens == 0
    with running_server(*serve[:4], log=tmp_path / "plain.log") as url:  # no --cache-dir
        plain = ask(url, going_on)
    assert again.choices[0].message.content == plain.choices[0].message.content


def test_a_cache_dir_that_is_a_file_is_one_line(tmp_path, capsys):
    from helpers import assert_one_line_error
    from serve_helpers import free_port

    taken = tmp_path / "taken"
    taken.write_text("x")
    port = str(free_port())
    assert_one_line_error(capsys, "serve", "--cache-dir", str(taken), "--port", port, match="is not a folder")


def test_slot_save_and_restore_as_llama_server_has_them(tmp_path):
    """`--slot-save-path`: POST /slots/0?action=save writes the last conversation's cache to a
    named file; after a restart, action=restore makes it a start, and the conversation goes
    on prefilling only what is new; bad names, actions and slots are one-line errors."""
    folder = save_tiny_model(tmp_path / "tiny")
    slots = tmp_path / "slots"
    serve = ("--model", str(folder), "--served-model-name", "tiny", "--slot-save-path", str(slots))
    with running_server(*serve, log=tmp_path / "first.log") as url:
        root = url.removesuffix("/v1")
        first = ask(url, HISTORY)
        (slot,) = httpx.get(f"{root}/slots", timeout=30).json()
        assert slot["id"] == 0 and slot["n_tokens"] >= first.usage.prompt_tokens
        saved = httpx.post(f"{root}/slots/0?action=save", json={"filename": "hello.bin"}, timeout=60).json()
        assert (
            saved["n_saved"] == slot["n_tokens"]
            and saved["n_written"] == (slots / "hello.bin").stat().st_size
        )
        for path, body, status in (
            ("/slots/0?action=save", {"filename": "../escape"}, 400),
            ("/slots/0?action=fly", {"filename": "x"}, 400),
            ("/slots/7?action=save", {"filename": "x"}, 404),
            ("/slots/0?action=restore", {"filename": "missing.bin"}, 404),
        ):
            r = httpx.post(root + path, json=body, timeout=30)
            assert r.status_code == status and r.json()["error"]["message"], (path, r.text)
        assert not (tmp_path / "escape").exists()
    going_on = [
        *HISTORY,
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And what else?"},
    ]
    with running_server(*serve, log=tmp_path / "second.log") as url:
        root = url.removesuffix("/v1")
        restored = httpx.post(f"{root}/slots/0?action=restore", json={"filename": "hello.bin"}, timeout=60)
        assert restored.json()["n_restored"] == saved["n_saved"], restored.text
        again = ask(url, going_on)
        assert first.usage.prompt_tokens <= again.usage.prompt_tokens_details.cached_tokens
    with running_server(*serve[:4], log=tmp_path / "plain.log") as url:
        assert ask(url, going_on).choices[0].message.content == again.choices[0].message.content
        r = httpx.post(url.removesuffix("/v1") + "/slots/0?action=save", json={"filename": "x"}, timeout=30)
        assert r.status_code == 501 and "--slot-save-path" in r.json()["error"]["message"]
