"""One large file from the hub into huggingface_hub's cache, resumable across runs.

huggingface_hub (2.x) downloads into a temporary file unique to the process and deletes it
when the download fails, so an interrupted `chatbot pull` would start again from nothing.
Here the partial file is kept beside the cache's blobs (`blobs/<sha256>.partial`) and handed
back to huggingface_hub's own `http_get` with its size (`resume_size`: a byte range), with
huggingface_hub's headers (token, user agent), endpoint and retries. The finished file is
checked against the sha256 the hub names it by, then placed as huggingface_hub places its
downloads (the cache layout it documents: `blobs/`, a relative link in `snapshots/<commit>/`,
`refs/<revision>`), so that huggingface_hub, transformers and `HF_HUB_OFFLINE` find it.
"""

from __future__ import annotations

import os
from pathlib import Path

from chatbot.errors import ModelLoadError, first_line


def fetch_file(repo: str, path: str, revision: str | None, sha256: str | None, progress: bool = True) -> Path:
    """The local path (in the hub cache's snapshot) of `path` in `repo`, downloaded or
    resumed where it is not there yet.

    Raises:
        ModelLoadError: the hub cannot be reached or refuses; the download broke off (the
            partial file is kept: the next run resumes it); a checksum that does not match
            (the file is removed).
        KeyboardInterrupt: Ctrl-C (the partial file is kept).
    """
    from filelock import FileLock
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
    from huggingface_hub.file_download import http_get, repo_folder_name
    from huggingface_hub.utils import build_hf_headers

    from chatbot.models.hub import hub_error, verify

    url = hf_hub_url(repo, path, revision=revision)
    try:
        meta = get_hf_file_metadata(url)
    except Exception as exc:
        raise hub_error(exc, repo) from exc
    etag, commit = meta.etag or sha256, meta.commit_hash
    if not etag or not commit:
        raise ModelLoadError(f"the hub gave no checksum or commit for {path} in {repo}")
    storage = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo, repo_type="model")
    blob = storage / "blobs" / etag
    pointer = storage / "snapshots" / commit / path
    lock = Path(constants.HF_HUB_CACHE) / ".locks" / storage.name / f"{etag}.lock"  # as huggingface_hub
    blob.parent.mkdir(parents=True, exist_ok=True)
    lock.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(lock)):
        if not blob.is_file():
            partial = blob.with_name(etag + ".partial")
            done = partial.stat().st_size if partial.exists() else 0
            if meta.size is not None and done > meta.size:
                partial.unlink()
                done = 0
            try:
                with partial.open("ab") as f:
                    http_get(
                        meta.location,
                        f,
                        resume_size=done,
                        headers=build_hf_headers(),
                        expected_size=meta.size,
                        displayed_filename=Path(path).name,
                    )
            except Exception as exc:
                raise ModelLoadError(
                    f"downloading {path} from {repo} broke off ({type(exc).__name__}: {first_line(exc)}); "
                    "run it again to resume"
                ) from exc
            verify(partial, sha256 or etag, progress, name=Path(path).name)
            os.replace(partial, blob)
        _link(blob, pointer)
    refs = storage / "refs" / (revision or "main")
    if revision is None or revision != commit:
        refs.parent.mkdir(parents=True, exist_ok=True)
        refs.write_text(commit, encoding="utf-8")
    return pointer


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
