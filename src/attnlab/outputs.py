"""Where results go: output files and directories checked before any work, written whole or not at all.

A wrong output path (a file where a directory should be, a directory where a file should be, a
read-only or full disk) is an `OutputError` with one message, never a traceback; it is found before
a model loads wherever possible, so that no compute is spent on results that cannot be kept.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from attnlab.errors import OutputError


def _reason(e: OSError) -> str:
    return e.strerror or str(e)


def prepare_output_dir(path: str | Path, what: str = "--output-dir") -> Path:
    """Create `path` (and its parents) as a directory that can be written to."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputError(f"{what} {path} is a file; pass a directory (it is created if missing)")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise OutputError(f"{what} {path}: a file is in the way of the directory; pass another path") from None
    except OSError as e:
        raise OutputError(f"{what} {path} cannot be created ({_reason(e)}); pass a directory you can write to") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise OutputError(f"{what} {path} is not writable; pass a directory you can write to")
    return path


def prepare_output_file(path: str | Path, what: str = "--output") -> Path:
    """Check that `path` can be written as a file: its parent directories are created, it is not a directory."""
    path = Path(path)
    if path.is_dir():
        raise OutputError(f"{what} {path} is a directory; pass a file name, e.g. {path / 'results.jsonl'}")
    prepare_output_dir(path.parent if str(path.parent) else Path("."), what=f"the directory of {what}")
    return path


def write_text_atomic(path: str | Path, text: str, what: str = "--output") -> Path:
    """Write `text` to a temporary name beside `path`, then rename it over `path`: a reader sees the
    old file or the new one, never half of it. A failed write leaves no temporary file behind."""
    return _write_atomic(Path(path), lambda tmp: tmp.write_text(text, encoding="utf-8"), what)


def write_bytes_atomic(path: str | Path, data: bytes, what: str = "--output") -> Path:
    """`write_text_atomic` for bytes."""
    return _write_atomic(Path(path), lambda tmp: tmp.write_bytes(data), what)


def _write_atomic(path: Path, write, what: str) -> Path:
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
        tmp.replace(path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise OutputError(f"could not write {what} {path} ({_reason(e)}); nothing was written there. "
                          "Free some space or pass a path you can write to.") from None
    return path
