"""`chatbot doctor --check-model M`: a GGUF file's metadata against its tensors, then every
tensor scanned for NaN and infinity, with a progress bar on a terminal."""

from __future__ import annotations

import sys
from pathlib import Path

from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

from chatbot.errors import ModelLoadError
from chatbot.models.tensor_scan import ScanResult, scan_model
from chatbot.terminal.tty import line_console


def check_model_files(path: Path) -> ScanResult:
    """Check `path` (a .gguf file or a transformers folder) and print one line of what was found.

    Raises:
        ModelLoadError: a damaged file, naming the first bad tensor (and block) or the first
            inconsistency of its metadata; or a path that is no model.
    """
    out, err = line_console(), line_console(stderr=True)
    path = path.expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        from chatbot.gguf.metadata import InconsistentMetadata, check_metadata

        try:
            check_metadata(path)
        except InconsistentMetadata as exc:
            raise ModelLoadError(f"{path}: {exc}") from None
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from None
    bar = Progress(
        TextColumn("checking tensors"),
        BarColumn(),
        DownloadColumn(),
        TimeRemainingColumn(),
        console=err,
        transient=True,
        disable=not err.is_terminal,
    )
    try:
        with bar:
            task = bar.add_task("scan", total=None)
            result = scan_model(path, lambda done, total: bar.update(task, completed=done, total=total))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot check {path}: {exc}") from None
    if result.bad is not None:
        raise ModelLoadError(f"{path}: {result.bad}; the file is damaged, download it again")
    skipped = f"; {len(result.unchecked)} of a type not scanned" if result.unchecked else ""
    out.print(
        f"{path}: {result.tensors} tensors, {result.checked_bytes / 2**20:,.1f} MiB: no NaN or infinity"
        + (", metadata consistent" if path.is_file() else "")
        + skipped,
        markup=False,
    )
    sys.stdout.flush()
    return result
