"""llama-server's slot save and restore (`--slot-save-path DIR`, `GET /slots`,
`POST /slots/{id}?action=save|restore|erase` with `{"filename": NAME}`), over the prefix cache.

A slot here is a conversation the pool keeps, numbered from the most recently used (0). `save`
writes its KV cache to `DIR/NAME` (the format of the chats' disk caches: safetensors, the ids,
what made it, a checksum); `restore` makes `DIR/NAME` a start that new conversations take
(the one holding the longest start of a request's tokens, if it was made by this model,
template, system prompt and salt: the same check as `--cache-dir`'s files); `erase` drops the
conversation. Names are plain file names: no folder, no leading dot.
"""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path
from typing import Any

from fastapi import Request

from chatbot.conversation.kvstore import KVStore
from chatbot.server.pool import PrefixCachePool, conversation_identity
from chatbot.server.protocol import APIError
from chatbot.server.worker import Worker

_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")


class Slots:
    """The handlers of /slots.

    Args:
        pool: the prefix cache (its conversations are the slots).
        worker: whose lock guards the pool.
        folder: `--slot-save-path` (None: save and restore are refused).
    """

    def __init__(self, pool: PrefixCachePool, worker: Worker, folder: Path | None) -> None:
        self.pool, self.worker, self.folder = pool, worker, folder

    async def listing(self) -> list[dict[str, Any]]:
        """`GET /slots`: each kept conversation, the most recently used first."""
        return await asyncio.to_thread(self._locked, self._listing)

    async def action(self, slot_id: int, request: Request) -> dict[str, Any]:
        """`POST /slots/{id}?action=save|restore|erase`."""
        action = request.query_params.get("action", "")
        if action not in ("save", "restore", "erase"):
            raise APIError(400, f"action must be save, restore or erase, got {action!r}", param="action")
        if action == "erase":
            return await asyncio.to_thread(self._locked, lambda: self._erase(slot_id))
        if self.folder is None:
            raise APIError(501, "slot save and restore need the server started with --slot-save-path DIR")
        try:
            body = await request.json()
        except ValueError:
            body = None
        name = body.get("filename") if isinstance(body, dict) else None
        if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name:
            raise APIError(
                400, "filename: a plain file name (letters, digits, . _ -), no folder", param="filename"
            )
        path = self.folder / name
        if action == "save":
            return await asyncio.to_thread(self._locked, lambda: self._save(slot_id, path))
        return await asyncio.to_thread(self._locked, lambda: self._restore(slot_id, path))

    def _locked(self, call: Any) -> Any:
        with self.worker.lock:
            return call()

    def _listing(self) -> list[dict[str, Any]]:
        entries = list(reversed(self.pool.entries.values()))
        return [
            {"id": i, "n_tokens": len(e.session.kv.seen), "turns": len(e.session.turns)}
            for i, e in enumerate(entries)
        ]

    def _entry(self, slot_id: int) -> Any:
        entries = list(reversed(self.pool.entries.values()))
        if not 0 <= slot_id < len(entries):
            raise APIError(404, f"no slot {slot_id}: the server keeps {len(entries)} conversations now")
        return entries[slot_id]

    def _save(self, slot_id: int, path: Path) -> dict[str, Any]:
        entry = self._entry(slot_id)
        start = time.perf_counter()
        session = entry.session
        store = KVStore(path, conversation_identity(session, entry.salt))
        if not store.save(session.kv):
            raise APIError(
                400, f"slot {slot_id}'s cache cannot be saved (it holds nothing, or it is not whole)"
            )
        store.wait()
        if store.last_error is not None:
            raise APIError(500, f"cannot write {path.name}: {store.last_error}", "server_error")
        return {
            "id_slot": slot_id,
            "filename": path.name,
            "n_saved": len(session.kv.seen),
            "n_written": path.stat().st_size,
            "timings": {"save_ms": (time.perf_counter() - start) * 1000},
        }

    def _restore(self, slot_id: int, path: Path) -> dict[str, Any]:
        start = time.perf_counter()
        if not path.is_file():
            raise APIError(404, f"no file {path.name} in the slot save path")
        ids = KVStore(path, dict).held_ids()
        if not ids:
            raise APIError(400, f"{path.name} is not a KV cache this server wrote")
        self.pool.add_start(path, ids)
        return {
            "id_slot": slot_id,
            "filename": path.name,
            "n_restored": len(ids),
            "n_read": path.stat().st_size,
            "timings": {"restore_ms": (time.perf_counter() - start) * 1000},
        }

    def _erase(self, slot_id: int) -> dict[str, Any]:
        entry = self._entry(slot_id)
        n = len(entry.session.kv.seen)
        self.pool.drop(entry)
        return {"id_slot": slot_id, "n_erased": n}
