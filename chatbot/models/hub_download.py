"""One file from the hub into huggingface_hub's cache, resumable across runs, and what is
trusted of what the hub says on the way.

huggingface_hub (2.x) downloads into a temporary file unique to the process and deletes it
when the download fails, so an interrupted `chatbot pull` would start again from nothing.
Here the partial file is kept beside the cache's blobs (`blobs/<etag>.partial`) and handed
back to huggingface_hub's own `http_get` with its size (`resume_size`: a byte range), with
huggingface_hub's headers (token, user agent), endpoint and retries. The finished file is
checked against the sha256 the hub names it by, then placed as huggingface_hub places its
downloads (the cache layout it documents: `blobs/`, a relative link in `snapshots/<commit>/`,
`refs/<revision>`), so that huggingface_hub, transformers and `HF_HUB_OFFLINE` find it.

The hub is not trusted with paths: every name it gives (a file's name, the commit, the ETag)
and the revision asked for are checked before they name one, and refused unless they stay in
their folder. The token goes to the hub's own origin only, never across a redirect to another;
a body is read up to the size the hub announced, and one that goes on is cut off and removed.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, cast
from urllib.parse import urljoin, urlsplit

from chatbot.errors import ModelLoadError, first_line
from chatbot.models.manifest import cache_root, file_sha256

HEX64 = re.compile(r"^[0-9a-f]{64}$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")  # a git commit, as the hub names its revisions
_ETAG = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,254}$")  # a blob's file name
_DRIVE = re.compile(r"^[A-Za-z]:")


@dataclass(frozen=True)
class Fetched:
    """A file in the hub cache: its path in the snapshot folder, and the sha256 it was
    checked against (None: not checked, the hub named none)."""

    path: Path
    sha256: str | None


def _shown(value: object) -> str:
    """A name from a server, quoted, escaped and cut for a one-line message."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def repo_path(name: object, repo: str) -> str:
    """`name`, a file's name in `repo` as the hub lists it, when it is a plain relative path
    that stays in the repo's folder.

    Raises:
        ModelLoadError: it is absolute, holds a `.`, `..` or empty part, a backslash, a drive
            or a control character.
    """
    if not (
        isinstance(name, str)
        and 0 < len(name) <= 1024
        and "\\" not in name
        and not _DRIVE.match(name)
        and all(c >= " " and c != "\x7f" for c in name)
        and all(part not in ("", ".", "..") for part in name.split("/"))
    ):
        raise ModelLoadError(
            f"the hub lists a file name in {repo} that is not a path inside it ({_shown(name)}): refused"
        )
    return name


def check_revision(revision: str | None) -> None:
    """Refuse a revision that would lead out of the cache's `refs/` folder (a branch may hold
    `/`: `refs/pr/1`)."""
    if revision is None:
        return
    try:
        repo_path(revision, "")
    except ModelLoadError:
        raise ModelLoadError(
            f"the revision {_shown(revision)} is not a branch, tag or commit name: refused"
        ) from None


def _check_headers(repo: str, path: str, commit: str, etag: str) -> None:
    """Refuse a commit that is not a git hash, an ETag that cannot be a file's name."""
    if not _COMMIT.match(commit):
        raise ModelLoadError(
            f"the hub names a commit for {path} in {repo} that is not a git hash ({_shown(commit)}): refused"
        )
    if not _ETAG.match(etag) or ".." in etag:
        raise ModelLoadError(
            f"the hub gives {path} in {repo} an ETag that cannot name a file ({_shown(etag)}): refused"
        )


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    try:
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme.lower())
    except ValueError:  # no port a server can have: an origin of its own
        port = -1
    return parts.scheme.lower(), (parts.hostname or "").lower(), port


class _TooLong(Exception):
    """The hub sent more than it announced."""


class _Bounded:
    """A file that takes `limit` bytes at most (where its position is): `http_get` writes a
    body through it, and a body longer than announced stops at the first write too many."""

    def __init__(self, file: BinaryIO, limit: int) -> None:
        self._file, self._limit = file, limit

    def write(self, data: bytes) -> int:
        if self._file.tell() + len(data) > self._limit:
            raise _TooLong
        return self._file.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)


def fetch_file(
    repo: str,
    path: str,
    revision: str | None,
    sha256: str | None,
    size: int | None = None,
    progress: bool = True,
) -> Fetched:
    """`path` in `repo` in the hub cache's snapshot, downloaded or resumed where it is not
    there yet, and checked against `sha256` (the listing's), else against an ETag that is a
    sha256 (the hub names an LFS file by its sha256); unchecked where the hub names neither.

    Args:
        size: the size the listing gives, for a download whose headers announce none.

    Raises:
        ModelLoadError: a name from the hub that would lead out of the cache; the hub cannot
            be reached or refuses; the download broke off (the partial file is kept: the next
            run resumes it); the body went on past the announced size, or the file does not
            match its checksum (the file is removed).
        KeyboardInterrupt: Ctrl-C (the partial file is kept).
    """
    from filelock import FileLock
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
    from huggingface_hub.file_download import http_get, repo_folder_name
    from huggingface_hub.utils import build_hf_headers

    repo_path(path, repo)
    check_revision(revision)
    url = hf_hub_url(repo, path, revision=revision)
    try:
        meta = get_hf_file_metadata(url)
    except Exception as exc:
        raise hub_error(exc, repo) from exc
    etag, commit = meta.etag or sha256, meta.commit_hash
    if not etag or not commit:
        raise ModelLoadError(f"the hub gave no checksum or commit for {path} in {repo}")
    _check_headers(repo, path, commit, etag)
    want = sha256 or (etag if HEX64.match(etag) else None)
    announced = meta.size if meta.size is not None else size
    name = Path(path).name
    storage = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo, repo_type="model")
    blob = storage / "blobs" / etag
    pointer = storage / "snapshots" / commit / path
    lock = Path(constants.HF_HUB_CACHE) / ".locks" / storage.name / f"{etag}.lock"  # as huggingface_hub
    blob.parent.mkdir(parents=True, exist_ok=True)
    lock.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(lock)):
        if not blob.is_file():
            if announced is None:
                raise ModelLoadError(f"the hub announces no size for {path} in {repo}: refused")
            partial = blob.with_name(etag + ".partial")
            done = partial.stat().st_size if partial.exists() else 0
            if done > announced:
                partial.unlink()
                done = 0
            location = urljoin(url, meta.location)
            headers = build_hf_headers()
            if _origin(location) != _origin(url):  # a redirect off the hub: no token there
                headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
            try:
                with partial.open("ab") as f:
                    http_get(
                        location,
                        cast(BinaryIO, _Bounded(f, announced)),
                        resume_size=done,
                        headers=headers,
                        expected_size=announced,
                        displayed_filename=name,
                    )
            except _TooLong:
                partial.unlink(missing_ok=True)
                raise ModelLoadError(
                    f"the hub sent more than the {announced} bytes it announced for {name}: "
                    "the download was removed"
                ) from None
            except Exception as exc:
                raise ModelLoadError(
                    f"downloading {path} from {repo} broke off ({type(exc).__name__}: {first_line(exc)}); "
                    "run it again to resume"
                ) from exc
            if want:
                verify(partial, want, progress, name=name)
            os.replace(partial, blob)
        elif want:
            verify(blob, want, progress, name=name)
        _link(blob, pointer)
    refs = storage / "refs" / (revision or "main")
    if revision is None or revision != commit:
        refs.parent.mkdir(parents=True, exist_ok=True)
        refs.write_text(commit, encoding="utf-8")
    return Fetched(pointer, want)


def _link(blob: Path, pointer: Path) -> None:
    """`pointer` as a relative link to `blob` (a copy where links cannot be made)."""
    pointer.parent.mkdir(parents=True, exist_ok=True)
    if pointer.is_file() and pointer.resolve() == blob.resolve():
        return
    pointer.unlink(missing_ok=True)
    try:
        pointer.symlink_to(os.path.relpath(blob, pointer.parent))
    except OSError:
        import shutil

        shutil.copyfile(blob, pointer)


def hub_error(exc: BaseException, repo: str) -> ModelLoadError:
    """One line for a failed hub request about `repo` (not found, gated, unreachable...)."""
    from huggingface_hub import constants
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    if isinstance(exc, GatedRepoError):
        return ModelLoadError(
            f"{repo} is gated: accept its terms at {constants.ENDPOINT}/{repo} and log in (hf auth login)"
        )
    if isinstance(exc, RepositoryNotFoundError):
        return ModelLoadError(f"no repo {repo} on the hub (a private one needs a login: hf auth login)")
    if isinstance(exc, RevisionNotFoundError):
        return ModelLoadError(f"{repo} has no such revision ({first_line(exc)})")
    return ModelLoadError(
        f"cannot reach the hub at {constants.ENDPOINT} ({type(exc).__name__}: {first_line(exc)}); "
        "check the network, or set HF_HUB_OFFLINE=1 to use what is downloaded"
    )


def verified_marker(sha: str) -> Path:
    """Where the blobs found to match `sha` are remembered."""
    return cache_root() / "hub-verified" / sha


def verify(path: Path, sha256: str | None, progress: bool = True, name: str | None = None) -> None:
    """Check `path` against `sha256` (its blob's name when None), once per blob (`name`: the
    file's name on its progress bar).

    Raises:
        ModelLoadError: it does not match; the file is removed.
    """
    blob = path.resolve()
    want = sha256 or (blob.name if HEX64.match(blob.name) else None)
    if want is None:  # a small git file: the hub names it by its git hash, not a sha256
        return
    marker = verified_marker(want)
    if checked_before(blob, want):
        return
    got = file_sha256(blob, _hash_bar(name or path.name, blob.stat().st_size) if progress else None)
    if got != want:
        blob.unlink(missing_ok=True)
        path.unlink(missing_ok=True)
        raise ModelLoadError(
            f"{name or path.name} does not match the hub's checksum (sha256 {got[:12]}…, expected "
            f"{want[:12]}…): it was removed; download it again"
        )
    marker.parent.mkdir(parents=True, exist_ok=True)
    with marker.open("a", encoding="utf-8") as f:
        f.write(_stamp(blob, final=True) + "\n")


def checked_before(path: Path, sha256: str | None) -> bool:
    """Whether the blob at `path` was found to match `sha256` and is unchanged since."""
    if sha256 is None:
        return False
    blob = path.resolve()
    marker = verified_marker(sha256)
    return marker.is_file() and _stamp(blob) in marker.read_text(encoding="utf-8").splitlines()


def _stamp(blob: Path, final: bool = False) -> str:
    """What a checked blob is remembered by: where it will lie (a partial file is checked
    before it is moved to its blob's name), its size and modification time."""
    st = blob.stat()
    where = blob.with_name(blob.name.removesuffix(".partial")) if final else blob
    return f"{where} {st.st_size} {st.st_mtime_ns}"


def _hash_bar(name: str, size: int) -> Callable[[int], Any] | None:
    """A progress bar for checking a large file (huggingface_hub's tqdm, so that it is turned
    off where its download bars are)."""
    if size < 256 << 20:
        return None
    from huggingface_hub.utils import tqdm

    bar = tqdm(total=size, unit="B", unit_scale=True, desc=f"checking {name}", leave=False)
    return bar.update
