"""GGUF files on the hugging face hub, by name: `user/repo:QUANT` (the quant matched among the
repo's .gguf files, case-insensitively) or `user/repo/path/file.gguf`, split files
(`-00001-of-00003.gguf`) taken together. Everything goes through huggingface_hub: its cache,
token, `HF_ENDPOINT`, offline mode and resumable downloads; the files are then checked against
the sha256 the hub names them by. Nothing here imports torch.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chatbot.engine.gguf_table import SPLIT
from chatbot.errors import ModelLoadError, first_line
from chatbot.models.manifest import cache_root, file_sha256

_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_REF = re.compile(
    rf"^(?:(?:https?://)?(?:hf\.co|huggingface\.co)/)?({_NAME}/{_NAME})(?::([A-Za-z0-9._-]+))?$"
)
_FILE_REF = re.compile(
    rf"^(?:(?:https?://)?(?:hf\.co|huggingface\.co)/)?({_NAME}/{_NAME})/(.+\.gguf)$", re.IGNORECASE
)
_QUANT = re.compile(r"(?<![A-Za-z0-9])(I?Q\d(?:_[A-Z0-9]+)*|BF16|F16|F32)(?![A-Za-z0-9])", re.IGNORECASE)
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


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


def remote_files(repo: str, revision: str | None) -> list[RepoFile]:
    """The files of `repo` at `revision` on the hub: one request, no retries.

    Raises:
        ModelLoadError: `hub_error`'s line.
    """
    from huggingface_hub import HfApi

    try:
        info = HfApi().model_info(repo, revision=revision, files_metadata=True)
    except Exception as exc:
        raise hub_error(exc, repo) from exc
    files = [RepoFile(s.rfilename, s.size, s.lfs.sha256 if s.lfs else None) for s in info.siblings or []]
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
                    p.relative_to(folder).as_posix(), p.stat().st_size, blob if _HEX64.match(blob) else None
                )
            )
    return out


def resolve(ref: HubRef, revision: str | None = None, progress: bool = True) -> Path:
    """The local path of the GGUF `ref` names (its first part, for a split), downloaded
    (resuming a partial download) and checked against the hub's sha256 when not there yet.
    Offline (`HF_HUB_OFFLINE`): from the cache only. Hub unreachable: from the cache, if there.

    Raises:
        ModelLoadError: one line (not found, not downloaded, unreachable, a bad checksum).
    """
    folder = cached_folder(ref.repo, revision)
    if offline():
        if folder is None:
            raise ModelLoadError(
                f"{ref.repo} is not downloaded and HF_HUB_OFFLINE is set: "
                f"chatbot pull {ref} where the hub is reachable"
            )
        parts = pick(ref, cached_files(folder), f"the downloaded copy of {ref.repo}")
        return folder / parts[0].path
    try:
        files = remote_files(ref.repo, revision)
    except ModelLoadError:
        if folder is not None:  # unreachable, but downloaded: use it
            try:
                parts = pick(ref, cached_files(folder))
                return folder / parts[0].path
            except ModelLoadError:
                pass
        raise
    parts = pick(ref, files)
    paths = [download(ref.repo, revision, part, progress) for part in parts]
    return paths[0]


def download(repo: str, revision: str | None, part: RepoFile, progress: bool = True) -> Path:
    """One file of `repo` at `revision` into the hub cache, checked against its sha256 once: a
    large (LFS) file resumably (`chatbot.models.hub_download`), a small one by huggingface_hub.

    Raises:
        ModelLoadError: the download failed (a partial large file stays, to resume), or the
            file does not match its checksum (then it is removed).
    """
    if part.sha256:
        from chatbot.models.hub_download import fetch_file

        return fetch_file(repo, part.path, revision, part.sha256, progress)
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(repo, part.path, revision=revision))
    except Exception as exc:
        raise ModelLoadError(
            f"downloading {part.path} from {repo} failed ({type(exc).__name__}: {first_line(exc)})"
        ) from exc


def _verified_marker(sha: str) -> Path:
    return cache_root() / "hub-verified" / sha


def verify(path: Path, sha256: str | None, progress: bool = True, name: str | None = None) -> None:
    """Check `path` against `sha256` (its blob's name when None), once per blob (`name`: the
    file's name on its progress bar).

    Raises:
        ModelLoadError: it does not match; the file is removed.
    """
    blob = path.resolve()
    want = sha256 or (blob.name if _HEX64.match(blob.name) else None)
    if want is None:  # a small git file: the hub names it by its git hash, not a sha256
        return
    marker = _verified_marker(want)
    stamp = _stamp(blob)
    if marker.is_file() and stamp in marker.read_text(encoding="utf-8").splitlines():
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


def pull_repo(repo: str, revision: str | None = None) -> Path:
    """Download a transformers repo's weights and small files (resuming, checked against the
    hub's sha256); its snapshot folder.

    Raises:
        ModelLoadError: one line.
    """
    from huggingface_hub import snapshot_download

    files = remote_files(repo, revision)
    pattern = weights_pattern(repo, files)
    try:
        folder = Path(snapshot_download(repo, revision=revision, allow_patterns=[*SMALL_FILES, pattern]))
    except KeyboardInterrupt:
        raise
    except Exception as exc:
        raise ModelLoadError(
            f"downloading {repo} failed ({type(exc).__name__}: {first_line(exc)}); run it again to resume"
        ) from exc
    for f in files:
        local = folder / f.path
        if f.sha256 and local.is_file():
            verify(local, f.sha256)
    return folder


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
                _verified_marker(sha).unlink(missing_ok=True)
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
