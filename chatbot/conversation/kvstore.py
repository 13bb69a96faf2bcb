"""A logged chat's KV cache kept on disk, so that `--resume` does not encode the history again.

One safetensors file per session in `$XDG_CACHE_HOME/chatbot/kv/<session id>.safetensors`:
the keys and values of every layer exactly as the engine holds them (``k.<i>`` / ``v.<i>``,
``[1, kv_heads, tokens, head_dim]``, the cache's own dtype), and in its metadata a JSON header:
the token ids the cache holds and what makes them valid (the model file's identity, the chat
template, the system prompt, the dtype, the backend, the format version), with a CRC-32 of the
header and every tensor byte. It is a cache: deleting it only costs a re-encode.

Written after each turn by a thread (the next forward pass waits for it: it may write over
the positions being copied), to a temporary file renamed over the old one: a crash leaves the old file or the
new one, never a torn one that loads. A file that does not match (another model, template,
system prompt, dtype or backend; ids the resumed history does not start with) or that is
damaged (truncated, a flipped byte) is not used; `load` says why in one line.

A bounded (attention-sink) cache is kept as it stands: the keys and values of its window
(re-rotated as the engine holds them), the ids it holds and every id it took in (evicted ones
too) and its pin, so a resumed `--enable-streaming` chat goes on from the same window, with
the same evictions to come, as the chat that never stopped. Its window (sinks and recent
size) is part of what must match.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import threading
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from chatbot.engine.cache.layers import is_plain_layer
from chatbot.engine.cache.queries import PassQueries
from chatbot.engine.cache.sinks import SinkLayer
from chatbot.engine.cache.tracked import TrackedCache
from chatbot.errors import ChatbotError

FORMAT_VERSION = 2  # 2: the ids taken in and those held apart, the pin (bounded caches)
SUFFIX = ".safetensors"
DEFAULT_CAP = 4 << 30
"""The most bytes the store keeps (`CHATBOT_KV_CACHE_BYTES` sets another): past it, the
files written longest ago are removed after each write, never the one just written."""
_STALE_TMP_S = 3600.0  # a temporary file this old was left by a killed write
_HEADER = "chatbot.kv"
_CHECKSUM = "chatbot.crc32"


def kv_dir() -> Path:
    """`$XDG_CACHE_HOME/chatbot/kv` (default `~/.cache/chatbot/kv`); `CHATBOT_KV_DIR` (an
    absolute path) puts the store elsewhere."""
    own = os.environ.get("CHATBOT_KV_DIR")
    if own and os.path.isabs(own):
        return Path(own)
    base = os.environ.get("XDG_CACHE_HOME")
    if not base or not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "chatbot" / "kv"


def store_cap() -> int:
    """The store's size cap in bytes: `CHATBOT_KV_CACHE_BYTES` where it is a whole number of
    bytes (0: keep nothing but the file just written), else `DEFAULT_CAP`."""
    raw = os.environ.get("CHATBOT_KV_CACHE_BYTES", "")
    return int(raw) if raw.isdigit() else DEFAULT_CAP


def store_usage(folder: Path | None = None) -> tuple[int, int]:
    """How many cache files the store (default `kv_dir()`) holds, and their bytes."""
    files = total = 0
    try:
        entries = list((folder or kv_dir()).iterdir())
    except OSError:
        return 0, 0
    for path in entries:
        with contextlib.suppress(OSError):
            st = path.lstat()
            if path.suffix == SUFFIX and stat.S_ISREG(st.st_mode):
                files, total = files + 1, total + st.st_size
    return files, total


def describe_store() -> str:
    """What the store holds, where, under which cap, and how to empty it."""
    files, size = store_usage()
    return (
        f"{files} file{'' if files == 1 else 's'}, {size / 1e6:,.1f} MB in {kv_dir()} "
        f"(cap {store_cap() / 2**30:g} GiB; chatbot sessions --prune empties it, the logs stay)"
    )


def prefix_path(identity: dict[str, str]) -> Path:
    """The file of the start that new chats made with `identity` share (the template's
    opening and the system prompt), in the store."""
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]
    return kv_dir() / f"prefix-{digest}{SUFFIX}"


def saved_path(data: dict[str, Any]) -> Path:
    """The file of a saved chat's cache (/save, /load), named by its conversation: the
    system prompt and the messages."""
    conversation = {"system": data.get("system"), "messages": data.get("messages")}
    text = json.dumps(conversation, sort_keys=True, ensure_ascii=False, default=str)
    digest = hashlib.sha256(text.encode("utf-8", errors="surrogatepass")).hexdigest()[:20]
    return kv_dir() / f"saved-{digest}{SUFFIX}"


def prune(folder: Path, keep: Path | None = None, cap: int | None = None) -> list[Path]:
    """Remove the files of `folder` written longest ago until the store holds at most `cap`
    bytes (default `store_cap()`), never `keep`; and temporary files a killed write left
    (older than an hour). Returns what was removed; a file that cannot be removed is passed."""
    import time

    cap = store_cap() if cap is None else cap
    removed: list[Path] = []
    files: list[tuple[float, int, Path]] = []
    try:
        entries = list(folder.iterdir())
    except OSError:
        return removed
    now = time.time()
    for path in entries:
        try:
            st = path.lstat()
        except OSError:
            continue
        if path.name.endswith(".tmp") and now - st.st_mtime > _STALE_TMP_S:
            with contextlib.suppress(OSError):
                path.unlink()
                removed.append(path)
        elif path.suffix == SUFFIX and path.is_file() and not path.is_symlink():
            files.append((st.st_mtime, st.st_size, path))
    total = sum(size for _, size, _ in files)
    for _, size, path in sorted(files):
        if total <= cap:
            break
        if keep is not None and path == keep:
            continue
        with contextlib.suppress(OSError):
            path.unlink()
            removed.append(path)
            total -= size
    return removed


def model_identity(model: Any) -> str:
    """What identifies the weights a cache was computed with, not where they lie: a GGUF
    file's size and a hash of its header and tensor table; a transformers model's config
    and its weight files' sizes with a hash of each one's first and last 64 KiB."""
    gguf = getattr(model, "chatbot_gguf", None)
    if gguf:
        from chatbot.models.gguf_model import metadata_key

        return "gguf:" + metadata_key(Path(gguf))
    h = hashlib.sha256()
    config = getattr(model, "config", None)
    h.update((config.to_json_string(use_diff=False) if config is not None else repr(model)).encode())
    folder = Path(str(getattr(config, "_name_or_path", "") or ""))
    with contextlib.suppress(OSError):
        for f in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")):
            size = f.stat().st_size
            h.update(f"{f.name}:{size}".encode())
            with f.open("rb") as fh:
                h.update(fh.read(1 << 16))
                fh.seek(max(0, size - (1 << 16)))
                h.update(fh.read(1 << 16))
    return "hf:" + h.hexdigest()[:32]


def _digest(text: str | None) -> str:
    return hashlib.sha256((text or "").encode("utf-8", errors="surrogatepass")).hexdigest()[:16]


def _layers(kv: TrackedCache) -> list[Any] | None:
    """The cache's layers where each holds every id it holds as one tensor (plain, buffer or
    sink layers); None for any other (sliding-window, static)."""
    layers = list(kv.cache.layers)
    if not layers:
        return None
    if not all(isinstance(layer, SinkLayer) or is_plain_layer(layer) for layer in layers):
        return None
    return layers


def _crc(header: str, tensors: dict[str, torch.Tensor]) -> str:
    crc = zlib.crc32(header.encode())
    for name in sorted(tensors):
        crc = zlib.crc32(tensors[name].contiguous().view(torch.uint8).numpy().data, crc)
    return f"{crc:08x}"


class KVStore:
    """One chat's cache file.

    Args:
        path: the file (`kv_dir() / (session_id + SUFFIX)`).
        identity: what must match for the file to be used (model, template, system prompt,
            dtype, backend), asked at each write and load; `ChatSession.kv_identity`.
    """

    def __init__(self, path: Path, identity: Callable[[], dict[str, str]], cap: int | None = None) -> None:
        self.path = path
        self.identity = identity
        self.cap = cap  # the folder's size cap after each write (None: `store_cap()`)
        self._writer: threading.Thread | None = None
        self.last_error: str | None = None  # why the last write failed (None: it did not)
        self.queries: list[torch.Tensor] = []  # a shared start's, as the last `load` took them

    def save(self, kv: TrackedCache, start: PassQueries | None = None, pass_length: int = 0) -> bool:
        """Write the cache in the background (after any earlier write): the layers' tensors
        are taken now as views, copied and written by a thread. The caller runs no forward
        pass on the cache (which may write over the positions viewed) before `wait`. With
        `start`, only its first `start.rows` ids (of a cache that evicted nothing) and their
        queries (``q.<i>``), kept by a first pass of `pass_length` positions (a shared start).

        Returns:
            False, writing nothing, for a cache that cannot be kept (see `_layers`).
        """
        layers = _layers(kv)
        if (
            layers is None
            or not kv.ids
            or (start is not None and (kv.evicted_total or start.rows > len(kv.ids)))
        ):
            return False
        n = len(kv.ids)
        views: dict[str, torch.Tensor] = {}
        for i, layer in enumerate(layers):
            if layer.keys is None or layer.values is None or layer.keys.shape[-2] != n:
                return False
            views[f"k.{i}"], views[f"v.{i}"] = layer.keys.detach(), layer.values.detach()
        extra: dict[str, Any] = {}
        if start is not None:
            n = start.rows
            views = {name: t[:, :, :n] for name, t in views.items()}
            views.update({f"q.{i}": q.detach() for i, q in enumerate(start.layers)})
            extra["pass"] = pass_length
        header = json.dumps(
            {
                **self.identity(),
                "version": FORMAT_VERSION,
                "dtype": str(views["k.0"].dtype),
                "ids": kv.seen if start is None else kv.seen[:n],  # what it took in, evicted ids too
                "held": kv.ids[:n],
                "pinned": kv.pinned if start is None else min(kv.pinned, n),
                **extra,
            }
        )
        self.wait()
        self._writer = threading.Thread(target=self._write, args=(header, views), name="kv-store")
        self._writer.start()  # not a daemon: the process waits for the file before it ends
        return True

    def wait(self) -> None:
        """Return once the write under way (if any) is done."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None

    def _write(self, header: str, tensors: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        try:
            tensors = {name: t.to("cpu", copy=True).contiguous() for name, t in tensors.items()}
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            save_file(tensors, str(tmp), metadata={_HEADER: header, _CHECKSUM: _crc(header, tensors)})
            os.replace(tmp, self.path)
            self.last_error = None
            prune(self.path.parent, keep=self.path, cap=self.cap)
        except Exception as exc:  # noqa: BLE001 - a cache that cannot be written is only not kept
            self.last_error = str(exc)
            with contextlib.suppress(OSError):
                tmp.unlink()

    def load(
        self,
        kv: TrackedCache,
        ids: Sequence[int],
        device: torch.device | str,
        limit: Callable[[int, dict[str, Any]], int] | None = None,
    ) -> tuple[int, str | None]:
        """Fill the empty cache `kv` with the longest start of `ids` the file holds (with
        `limit`, at most what it says of that length and the file's header; a shared start's
        queries are then in `queries`, cut to what was taken).

        Returns:
            (ids taken in, None) or (0, why the file was not used); a missing file is
            (0, None) and says nothing.
        """
        self.wait()
        try:
            st = self.path.lstat()
        except OSError:
            return 0, None
        # a FIFO would block the read, a link lead elsewhere, a huge file fill memory
        if not stat.S_ISREG(st.st_mode):
            return 0, f"the disk cache {self.path} is not a regular file"
        if st.st_size > store_cap():
            return 0, f"the disk cache {self.path} is larger than the store's cap ({st.st_size:,} bytes)"
        layers = _layers(kv) if not kv.seen else None
        if layers is None:
            return 0, "the disk cache is kept only for a cache of whole layers"
        try:
            header, tensors = self._read()
        except (OSError, ValueError, RuntimeError, KeyError) as exc:
            return 0, f"the disk cache {self.path} is damaged ({str(exc).splitlines()[0][:80]})"
        for key, want in self.identity().items():
            if header.get(key) != want:
                return 0, f"the disk cache was made with another {key}"
        seen, held = header.get("ids"), header.get("held")
        if header.get("version") != FORMAT_VERSION or not (isinstance(seen, list) and isinstance(held, list)):
            return 0, "the disk cache is of another format version"
        n = 0
        for a, b in zip(seen, ids):
            if a != b:
                break
            n += 1
        if n == 0:
            return 0, "the disk cache holds another conversation (the log was edited)"
        queries = [tensors.pop(f"q.{i}") for i in range(len(layers)) if f"q.{i}" in tensors]
        if len(tensors) != 2 * len(layers) or any(t.shape[-2] != len(held) for t in tensors.values()):
            return 0, "the disk cache does not fit this model's layers"
        if limit is not None:
            n = limit(n, header)
            if n <= 0 or queries and (len(queries) != len(layers) or queries[0].shape[-2] != len(held)):
                return 0, None
        if any(str(t.dtype) != header.get("dtype") for t in tensors.values()):
            return 0, "the disk cache was made with another dtype"
        # a growing cache takes only the ids the conversation shares; a bounded one takes its
        # window whole, then is cut back (where that cuts into evicted text, it is not used)
        take = n if len(held) == len(seen) else len(held)
        for i, layer in enumerate(layers):
            k, v = tensors[f"k.{i}"], tensors[f"v.{i}"]
            layer.update(k[:, :, :take].to(device), v[:, :, :take].to(device))
        try:
            kv.take_in(held[:take], seen[: take + len(seen) - len(held)], int(header.get("pinned", 0)))
        except (ValueError, AssertionError, ChatbotError):
            kv.reset()
            return 0, "the disk cache could not be taken in"
        if not kv.settle() or not kv.crop_to(n):
            kv.reset()
            return 0, "the disk cache's window cannot be cut back to where the conversation parts from it"
        self.queries = [q[:, :, :n].to(device) for q in queries]
        return n, None

    def held_ids(self) -> list[int]:
        """The ids the file's cache took in, from its header alone (no tensor is read); []
        where it cannot be read."""
        from safetensors import SafetensorError, safe_open

        try:
            if not stat.S_ISREG(self.path.lstat().st_mode):
                return []
            with safe_open(str(self.path), framework="pt") as f:
                ids = json.loads((f.metadata() or {}).get(_HEADER, "{}")).get("ids")
        except (OSError, ValueError, SafetensorError, AttributeError):
            return []
        return ids if isinstance(ids, list) and all(isinstance(i, int) for i in ids) else []

    def _read(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """The header and tensors, checked against the checksum.

        Raises:
            ValueError: the checksum or the header is wrong; safetensors' errors for a
                truncated or malformed file.
        """
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(self.path), framework="pt") as f:  # memory-mapped
                meta = f.metadata() or {}
                tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - not a dict
        except SafetensorError as exc:
            raise ValueError(str(exc)) from None
        header = meta.get(_HEADER)
        if header is None or meta.get(_CHECKSUM) != _crc(header, tensors):
            raise ValueError("checksum mismatch")
        data = json.loads(header)
        if not isinstance(data, dict):
            raise ValueError("no header")  # noqa: TRY004 - a damaged file, as the others
        return data, tensors
