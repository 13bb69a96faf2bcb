"""GGUF files on the hugging face hub, by name: `user/repo:QUANT` (the quant matched among the
repo's .gguf files, case-insensitively) or `user/repo/path/file.gguf`, split files
(`-00001-of-00003.gguf`) taken together. Everything goes through huggingface_hub: its cache,
token, `HF_ENDPOINT` and offline mode, with resumable downloads (`chatbot.models.hub_download`,
which checks each name the hub gives before it names a path); the files are then checked
against the sha256 the hub names them by. Nothing here imports torch.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path, PurePosixPath
from typing import Any

from chatbot.errors import ModelLoadError
from chatbot.gguf.table import SPLIT
from chatbot.models.hub_download import (
    HEX64,
    Fetched,
    check_revision,
    checked_before,
    fetch_file,
    hub_error,
    repo_path,
    verified_marker,
)

_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_REF = re.compile(
    rf"^(?:(?:https?://)?(?:hf\.co|huggingface\.co)/)?({_NAME}/{_NAME})(?::([A-Za-z0-9._-]+))?$"
)
_FILE_REF = re.compile(
    rf"^(?:(?:https?://)?(?:hf\.co|huggingface\.co)/)?({_NAME}/{_NAME})/(.+\.gguf)$", re.IGNORECASE
)
_QUANT = re.compile(r"(?<![A-Za-z0-9])(I?Q\d(?:_[A-Z0-9]+)*|BF16|F16|F32)(?![A-Za-z0-9])", re.IGNORECASE)


@dataclass(frozen=True)
class HubRef:
    """A GGUF model on the hub: a repo and either a quant (`user/repo:Q4_K_M`) or a file."""

    repo: str
    quant: str | None = None
    file: str | None = None

    def __str__(self) -> str:
        return f"{self.repo}/{self.file}" if self.file else f"{self.repo}:{self.quant}"


@dataclass(frozen=True)
class RepoFile:
    """A file of a repo revision: its path in the repo, size and sha256 (None when unknown)."""

    path: str
    size: int | None = None
    sha256: str | None = None


def parse_ref(source: str) -> HubRef | None:
    """The GGUF that `source` names on the hub, or None when it names none (a plain
    `user/repo` is a transformers repo: `chatbot.models.loader`)."""
    if source.startswith((".", "/", "~")):
        return None
    m = _FILE_REF.match(source)
    if m:
        return HubRef(m.group(1), file=m.group(2))
    m = _REF.match(source)
    if m and m.group(2):
        return HubRef(m.group(1), quant=m.group(2))
    return None


def offline() -> bool:
    """Whether huggingface_hub is told to stay off the network (`HF_HUB_OFFLINE`)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def quant_of(path: str) -> str | None:
    """The quant a GGUF file's name gives (the last one in it: `Q4_K_M`, `IQ2_XS`, `BF16`...)."""
    found = _QUANT.findall(Path(path).name)
    return found[-1].upper() if found else None


def _split_key(path: str) -> tuple[str, int, int] | None:
    m = SPLIT.match(path)
    return (m.group(1), int(m.group(2)), int(m.group(3))) if m else None


def _group(files: list[RepoFile], first: RepoFile) -> list[RepoFile]:
    """`first` with the other parts of its split, in order (refused when a part is missing)."""
    key = _split_key(first.path)
    if key is None:
        return [first]
    stem, _, count = key
    parts = {k[1]: f for f in files if (k := _split_key(f.path)) and k[0] == stem and k[2] == count}
    missing = [n for n in range(1, count + 1) if n not in parts]
    if missing:
        raise ModelLoadError(
            f"{Path(first.path).name} is part of a split of {count} files, and part "
            f"{missing[0]} of it is not there"
        )
    return [parts[n] for n in range(1, count + 1)]


def pick(ref: HubRef, files: list[RepoFile], where: str = "") -> list[RepoFile]:
    """The files of the GGUF `ref` names among `files` (a split's parts in order).

    Raises:
        ModelLoadError: none matches (with the quants there are), or several do.
    """
    ggufs = [f for f in files if f.path.lower().endswith(".gguf")]
    where = where or ref.repo
    if ref.file:
        exact = [f for f in ggufs if f.path == ref.file] or [
            f for f in ggufs if f.path.lower() == ref.file.lower()
        ]
        if not exact:
            raise ModelLoadError(f"{where} has no file {ref.file}{_offer(ggufs, ref.repo)}")
        return _group(ggufs, exact[0])
    assert ref.quant is not None
    token = re.compile(rf"(?<![A-Za-z0-9]){re.escape(ref.quant)}(?![A-Za-z0-9_])", re.IGNORECASE)
    models = [f for f in ggufs if not Path(f.path).name.lower().startswith("mmproj")]
    matches = [f for f in models if token.search(f.path)]
    firsts: dict[str, RepoFile] = {}
    for f in matches:
        key = _split_key(f.path)
        firsts.setdefault(key[0] if key else f.path, f)
    if not firsts:
        raise ModelLoadError(f"{where} has no {ref.quant} GGUF file{_offer(models, ref.repo)}")
    if len(firsts) > 1:
        names = ", ".join(sorted(firsts))
        raise ModelLoadError(
            f"{ref.quant} matches {len(firsts)} files in {where} ({names}): name one as {ref.repo}/FILE.gguf"
        )
    return _group(matches, next(iter(firsts.values())))


def _offer(ggufs: list[RepoFile], repo: str) -> str:
    """'; it has: Q4_K_M, Q8_0 (e.g. repo:Q8_0)': what there is to choose from."""
    quants = sorted({q for f in ggufs if (q := quant_of(f.path))})
    if quants:
        return f"; it has: {', '.join(quants)} (e.g. {repo}:{quants[-1]})"
    if ggufs:
        return f"; its GGUF files: {', '.join(f.path for f in ggufs[:8])}"
    return "; it has no GGUF files"


def remote_files(repo: str, revision: str | None) -> list[RepoFile]:
    """The files of `repo` at `revision` on the hub: one request, no retries. Their names and
    checksums are checked: each a path inside the repo, each sha256 one.

    Raises:
        ModelLoadError: `hub_error`'s line; a name, size or checksum that is refused.
    """
    from huggingface_hub import HfApi

    check_revision(revision)
    try:
        info = HfApi().model_info(repo, revision=revision, files_metadata=True)
    except Exception as exc:
        raise hub_error(exc, repo) from exc
    files = []
    for s in info.siblings or []:
        path = repo_path(s.rfilename, repo)
        sha = s.lfs.sha256 if s.lfs else None
        if sha is not None and not (isinstance(sha, str) and HEX64.match(sha)):
            raise ModelLoadError(f"the hub lists a sha256 for {path} in {repo} that is not one: refused")
        if s.size is not None and not (isinstance(s.size, int) and s.size >= 0):
            raise ModelLoadError(f"the hub lists a size for {path} in {repo} that is not one: refused")
        files.append(RepoFile(path, s.size, sha))
    return files


def cached_folder(repo: str, revision: str | None) -> Path | None:
    """The snapshot folder of `repo` in the local hub cache, or None when it has none."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo, revision=revision, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached (or a cache it cannot read): none
        return None


def cached_files(folder: Path) -> list[RepoFile]:
    """The files downloaded into a snapshot folder, with the sha256 their blobs are named by."""
    out = []
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            blob = p.resolve().name
            out.append(
                RepoFile(
                    p.relative_to(folder).as_posix(), p.stat().st_size, blob if HEX64.match(blob) else None
                )
            )
    return out


def resolve(ref: HubRef, revision: str | None = None, progress: bool = True) -> Path:
    """The local path of the GGUF `ref` names (its first part, for a split): `fetch`'s.

    Raises:
        ModelLoadError: one line (not found, not downloaded, unreachable, a bad checksum).
    """
    return fetch(ref, revision, progress)[0].path


def fetch(ref: HubRef, revision: str | None = None, progress: bool = True) -> list[Fetched]:
    """The files of the GGUF `ref` names (a split's parts in order), downloaded (resuming a
    partial download) and checked against the hub's sha256 when not there yet, with the
    sha256 each was checked against (None where the hub names none). Offline
    (`HF_HUB_OFFLINE`): from the cache only. Hub unreachable: from the cache, if there.

    Raises:
        ModelLoadError: one line (not found, not downloaded, unreachable, a name from the hub
            that is refused, a bad checksum).
    """
    folder = cached_folder(ref.repo, revision)
    if offline():
        if folder is None:
            raise ModelLoadError(
                f"{ref.repo} is not downloaded and HF_HUB_OFFLINE is set: "
                f"chatbot pull {ref} where the hub is reachable"
            )
        return _cached(folder, pick(ref, cached_files(folder), f"the downloaded copy of {ref.repo}"))
    try:
        files = remote_files(ref.repo, revision)
    except ModelLoadError:
        if folder is not None:  # unreachable, but downloaded: use it
            try:
                return _cached(folder, pick(ref, cached_files(folder)))
            except ModelLoadError:
                pass
        raise
    return [download(ref.repo, revision, part, progress) for part in pick(ref, files)]


def _cached(folder: Path, parts: list[RepoFile]) -> list[Fetched]:
    """Downloaded files, with the sha256 each was checked against when it was downloaded."""
    out = []
    for part in parts:
        path = folder / part.path
        out.append(Fetched(path, part.sha256 if checked_before(path, part.sha256) else None))
    return out


def download(repo: str, revision: str | None, part: RepoFile, progress: bool = True) -> Fetched:
    """One file of `repo` at `revision` into the hub cache, resumably, checked against its
    sha256 once (`chatbot.models.hub_download.fetch_file`).

    Raises:
        ModelLoadError: the download failed (a partial file stays, to resume), or the file
            does not match its checksum (then it is removed).
    """
    return fetch_file(repo, part.path, revision, part.sha256, part.size, progress)


SMALL_FILES = ["*.json", "*.model", "*.txt", "*.jinja", "*.py", "*.tiktoken"]
"""What a transformers repo needs beside its weights (configs, tokenizers, templates)."""


def weights_pattern(repo: str, files: list[RepoFile]) -> str:
    """The pattern of a transformers repo's weights: safetensors, else PyTorch pickles.

    Raises:
        ModelLoadError: it has neither (with its GGUF quants, when it holds those).
    """
    names = [f.path.lower() for f in files]
    if any(n.endswith(".safetensors") for n in names):
        return "*.safetensors"
    if any(n.endswith(".bin") for n in names):
        return "*.bin"
    if any(n.endswith(".gguf") for n in names):
        raise ModelLoadError(f"{repo} holds GGUF files: name one{_offer(files, repo)}")
    raise ModelLoadError(f"{repo} has no model weights (no .safetensors, .bin or .gguf files)")


def pull_repo(repo: str, revision: str | None = None) -> tuple[Path, list[Fetched]]:
    """Download a transformers repo's weights and small files (resuming, checked against the
    hub's sha256 where it names one); its snapshot folder and the files.

    Raises:
        ModelLoadError: one line.
    """
    files = remote_files(repo, revision)
    patterns = [*SMALL_FILES, weights_pattern(repo, files)]
    wanted = [f for f in files if any(fnmatch(f.path, p) for p in patterns)]
    fetched = [download(repo, revision, f) for f in wanted]
    folder = fetched[0].path.parents[len(PurePosixPath(wanted[0].path).parts) - 1]
    return folder, fetched


def cached_repo(repo: str) -> Any:
    """huggingface_hub's record of `repo` in its cache (`CachedRepoInfo`), or None."""
    from huggingface_hub import scan_cache_dir

    try:
        info = scan_cache_dir()
    except Exception:  # noqa: BLE001 - no cache yet
        return None
    return next((r for r in info.repos if r.repo_type == "model" and r.repo_id.lower() == repo.lower()), None)


def remove(name: str) -> tuple[str, int]:
    """Remove from the hub cache one GGUF (`user/repo:QUANT`, `user/repo/file.gguf`: its
    files and blobs) or a whole repo (`user/repo`); (what was removed, bytes freed).

    Raises:
        ModelLoadError: it is not downloaded.
    """
    from huggingface_hub import scan_cache_dir

    ref = parse_ref(name)
    repo = ref.repo if ref else name
    cached = cached_repo(repo)
    if cached is None:
        raise ModelLoadError(f"{repo} is not downloaded (chatbot models lists what is)")
    if ref is None:
        strategy = scan_cache_dir().delete_revisions(*(r.commit_hash for r in cached.revisions))
        strategy.execute()
        return "the whole repo", int(strategy.expected_freed_size)
    links, blobs = [], {}
    for rev in cached.revisions:
        try:
            parts = pick(ref, cached_files(Path(rev.snapshot_path)))
        except ModelLoadError:
            continue
        for part in parts:
            local = Path(rev.snapshot_path) / part.path
            links.append(local)
            blobs[local.resolve()] = part.sha256
    if not links:
        raise ModelLoadError(f"{ref} is not downloaded (chatbot models lists what is)")
    freed = sum(b.stat().st_size for b in blobs if b.exists())
    for link in links:
        link.unlink(missing_ok=True)
    still = {
        p.resolve() for rev in cached.revisions for p in Path(rev.snapshot_path).rglob("*") if p.is_file()
    }
    for blob, sha in blobs.items():
        if blob not in still:
            blob.unlink(missing_ok=True)
            if sha:
                verified_marker(sha).unlink(missing_ok=True)
    return f"{len(links)} file{'s' if len(links) > 1 else ''}", freed


def gguf_names(repo: str, files: list[RepoFile]) -> dict[str, list[RepoFile]]:
    """The GGUF models among a repo's `files`, each by the name that runs it: `repo:QUANT`
    where the quant picks it alone, else `repo/path.gguf`; split parts taken together (only
    complete splits)."""
    out: dict[str, list[RepoFile]] = {}
    for f in files:
        key = SPLIT.match(f.path)
        if not f.path.lower().endswith(".gguf") or (key and int(key.group(2)) != 1):
            continue
        if Path(f.path).name.lower().startswith("mmproj"):
            continue
        try:
            parts = _group(files, f)
        except ModelLoadError:
            continue
        quant = quant_of(f.path)
        name = f"{repo}/{f.path}"
        if quant:
            try:
                if pick(HubRef(repo, quant=quant), files)[0].path == f.path:
                    name = f"{repo}:{quant}"
            except ModelLoadError:
                pass
        out[name] = parts
    return out
