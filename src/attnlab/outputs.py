"""Where results go: output files and directories checked before any work, written whole or not at all.

A wrong output path (a file where a directory should be, a directory where a file should be, a
read-only or full disk) is an `OutputError` with one message, never a traceback; it is found before
a model loads wherever possible, so that no compute is spent on results that cannot be kept.

Every file attnlab writes goes through one writer, `replace_file` (or `writing`, its streaming form): a new
file under a fresh random name beside the target (created with O_CREAT|O_EXCL, so a file or symlink planted
there is never opened), renamed over the target. Logs that a child process writes while it runs are created
anew with `open_fresh_file`. Lock files and appended logs are opened with O_NOFOLLOW, staging directories
are created anew with `fresh_dir`, and paths read from data (`inside`) must stay under their root.

Every directory attnlab publishes (a checkpoint, a final model, an adapter, a converted model, a dequantised GGUF
copy) goes through one writer, `publishing` (or `publish_dir`, its second half): written into a new staging
directory beside its destination, described by a manifest (size and SHA-256 of every file), flushed to disk, and
only then renamed into place; a crash at any point leaves what was there before.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import secrets
import shutil
import stat
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
    return _write_atomic(Path(path), text.encode("utf-8"), what)


def write_bytes_atomic(path: str | Path, data: bytes, what: str = "--output") -> Path:
    """`write_text_atomic` for bytes."""
    return _write_atomic(Path(path), data, what)


def _write_atomic(path: Path, data: bytes, what: str) -> Path:
    try:
        replace_file(path, data)
    except OSError as e:
        raise OutputError(f"could not write {what} {path} ({_reason(e)}); nothing was written there. "
                          "Free some space or pass a path you can write to.") from None
    return path


# --- the one safe writer: nothing written through a link planted at a target or its temporary name -----------

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def replace_file(path: str | Path, data: str | bytes, fsync: bool = False) -> Path:
    """Write `data` (str: UTF-8) as the file `path`, whole or not at all, never through a planted link.

    The bytes go to a new file under a fresh random name in `path`'s directory, created with
    O_CREAT|O_EXCL (so neither an existing file nor a symlink there is ever opened), then `os.replace`
    renames it over `path` (a symlink at `path` is replaced, not followed). On any failure the temporary
    file is removed and the OSError raised; `path` is as it was. `fsync`: flush the bytes to disk first."""
    path = Path(path)
    if isinstance(data, str):
        data = data.encode("utf-8")
    fd, tmp = _new_temporary_file(path)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return _rename_into_place(tmp, path)


@contextlib.contextmanager
def writing(path: str | Path, text: bool = False, fsync: bool = False):
    """`replace_file` for writers that stream (matplotlib, torch.save, np.save, large copies): yields a file
    object (binary, or UTF-8 text with `text`) on a new file under a fresh random name beside `path`, renamed
    over `path` when the block ends without an exception; on any exception the temporary file is removed and
    `path` is as it was. Never opens a file or link planted at `path` or at a temporary name."""
    path = Path(path)
    fd, tmp = _new_temporary_file(path)
    try:
        with (os.fdopen(fd, "w", encoding="utf-8") if text else os.fdopen(fd, "wb")) as f:
            yield f
            if fsync:
                f.flush()
                os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _rename_into_place(tmp, path)


@contextlib.contextmanager
def staged_files(directory: str | Path):
    """For writers that save several files into a directory by name (a tokenizer's save_pretrained): yields a
    new empty staging directory inside `directory`; when the block ends without an exception each file saved
    there is renamed over its name in `directory` (a link planted at that name is replaced, never written
    through). The staging directory is removed in every case."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _, staging = _at_fresh_name(directory / ".staged", os.mkdir)
    try:
        yield staging
        for item in sorted(staging.iterdir()):
            if item.is_dir():
                remove_path(directory / item.name)
            os.replace(item, directory / item.name)
    finally:
        remove_path(staging)


def open_fresh_file(path: str | Path, text: bool = True):
    """A new, empty file at `path` opened for writing (a log another process writes into while it runs, so it
    cannot wait for a rename): what was at `path`, a file or a planted symlink, is unlinked first (a link is
    never followed), then the file is created with O_EXCL|O_NOFOLLOW. A directory there is an OutputError."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        raise OutputError(f"{path} is a directory; attnlab writes a file there. Remove or rename it and run again.")
    for _ in range(100):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o666)
            break
        except FileExistsError:  # something was planted again between the unlink and the open
            continue
    else:
        raise FileExistsError(errno.EEXIST, "cannot create a fresh file", str(path))
    return os.fdopen(fd, "w", encoding="utf-8") if text else os.fdopen(fd, "wb")


def _rename_into_place(tmp: Path, path: Path) -> Path:
    """`tmp` renamed over `path`; on failure `tmp` is removed, never left behind."""
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def temporary_name(path: str | Path) -> Path:
    """A fresh random name beside `path` for a file or directory that will be renamed over it
    (`.NAME.<random>.tmp`: hidden, and matched by `*.tmp` clean-ups)."""
    path = Path(path)
    return path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")


def _at_fresh_name(path: Path, create):
    """`create(tmp)` at fresh random names beside `path` until one does not exist yet (`create` must fail
    with FileExistsError on an existing path, never reuse it); returns (its result, tmp)."""
    for _ in range(100):
        tmp = temporary_name(path)
        try:
            return create(tmp), tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary name", str(path))


def _new_temporary_file(path: Path) -> tuple[int, Path]:
    return _at_fresh_name(path, lambda tmp: os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o666))


def open_for_append(path: str | Path, newline: str | None = None):
    """`open(path, "a", encoding="utf-8")` that never appends through a symlink planted at `path`
    (O_NOFOLLOW): such a link is an OutputError saying to remove it."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW | _CLOEXEC, 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP or path.is_symlink():
            raise OutputError(f"{path} is a symbolic link; attnlab never writes through a link planted among its files. "
                              f"Remove the link (rm {path}) and run again.") from None
        raise
    return os.fdopen(fd, "a", encoding="utf-8", newline=newline)


def replace_symlink(link: str | Path, target: str) -> Path:
    """Point the symlink `link` at `target` atomically: a new link under a fresh random name, renamed over `link`."""
    link = Path(link)
    _, tmp = _at_fresh_name(link, lambda tmp: os.symlink(target, tmp))  # fails on any existing path: never reuses a planted one
    return _rename_into_place(tmp, link)


def remove_path(path: str | Path) -> None:
    """Remove whatever is at `path`: a symlink or file is unlinked (never followed), a directory removed
    with its contents (rmtree never follows the links inside it). Nothing there is not an error."""
    path = Path(path)
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    elif path.is_dir():
        shutil.rmtree(path, ignore_errors=True)


def fresh_dir(path: str | Path) -> Path:
    """Create `path` as a new, empty directory to stage files in, removing what a crashed run left there
    first. `os.mkdir` fails on any existing path, so a symlink planted at `path` is never written through."""
    path = Path(path)
    remove_path(path)
    os.mkdir(path)
    return path


# --- directories published whole: stage, manifest, rename -------------------------------------------------

MANIFEST = "attnlab_manifest.json"


def file_sha256(path: str | Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_manifest(directory: str | Path, step: int | None = None) -> None:
    """`directory`/attnlab_manifest.json: the size and SHA-256 of every file under `directory` (the manifest
    itself excepted) and, for a checkpoint or a run's final model, the training step. Readers check a directory
    against it (attnlab.models.checkpoints.verify_checkpoint)."""
    directory = Path(directory)
    files = {
        str(p.relative_to(directory)): {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }
    manifest = {"step": step, "files": files} if step is not None else {"files": files}
    replace_file(directory / MANIFEST, json.dumps(manifest, indent=1))


@contextlib.contextmanager
def publishing(dest: str | Path, step: int | None = None, replace: bool = True):
    """Publish the directory `dest` whole or not at all: yields a new, empty staging directory beside `dest`
    (`.NAME.<random>.tmp`, created with mkdir, so nothing planted there is written through) for the caller to
    write into; when the block ends without an exception, `publish_dir` adds the manifest, flushes and renames
    it to `dest`. On any exception the staging directory is removed and `dest` is as it was.

    `replace`: a directory already at `dest` is replaced (kept until the new one is in place); without it, a
    `dest` that is there (not an empty directory) is an OSError and nothing changes. Staging directories that
    a killed process left beside `dest` are removed first; those of a process still writing are held by a lock
    (flock) and left alone, so that two processes may publish the same `dest` at once."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_staging(dest)
    held, staging = _at_fresh_name(dest, _new_held_dir)
    try:
        try:
            yield staging
            publish_dir(staging, dest, step, replace=replace)
        except BaseException:
            remove_path(staging)
            raise
    finally:
        os.close(held)


def publish_dir(staging: str | Path, dest: str | Path, step: int | None = None, replace: bool = True) -> Path:
    """The second half of `publishing`, for a staging directory another writer made (the Trainer's processes
    all write a checkpoint's staging directory): write its manifest, flush every file and the directory to disk,
    and rename it to `dest`. With `replace`, whatever is at `dest` (a directory, a file, a planted link: moved,
    never followed) is first renamed aside and removed once the new directory is in place; were that rename
    to fail, it is put back."""
    staging, dest = Path(staging), Path(dest)
    write_manifest(staging, step)
    _fsync_tree(staging)
    if replace and os.path.lexists(dest):
        old = temporary_name(dest)
        os.rename(dest, old)
        try:
            os.rename(staging, dest)
        except BaseException:
            with contextlib.suppress(OSError):
                os.rename(old, dest)
            raise
        remove_path(old)
    else:
        os.rename(staging, dest)  # never over anything but an empty directory: OSError otherwise
    fsync_dir(dest.parent)
    return dest


def fsync_dir(path: str | Path) -> None:
    """Flush a directory's entries (a rename into it) to disk, where the file system allows it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(path)


_DIRECTORY = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _NOFOLLOW | _CLOEXEC


def _new_held_dir(path: Path) -> int:
    """mkdir `path` (FileExistsError on anything there, a link included) and hold it: an open descriptor with an
    exclusive flock, released when the descriptor is closed or the process dies."""
    os.mkdir(path)
    try:
        fd = os.open(path, _DIRECTORY)
    except FileNotFoundError:  # another publisher's clean-up removed it before it was held: take another name
        raise FileExistsError(errno.EEXIST, "removed before it was held", str(path)) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # that clean-up holds it, to remove it: take another name
        os.close(fd)
        raise FileExistsError(errno.EEXIST, "held by another process's clean-up", str(path)) from None
    return fd


def _remove_abandoned_staging(dest: Path) -> None:
    """Remove the directories at `dest`'s temporary names (`.NAME.<random>.tmp`) that no live process holds:
    what a killed `publishing` left. Anything there that is not a directory (a planted link) is left alone."""
    name = re.compile(re.escape(f".{dest.name}.") + r"[0-9a-f]{12}\.tmp")
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(dest.parent):
            if not name.fullmatch(entry.name):
                continue
            try:
                fd = os.open(entry.path, _DIRECTORY)
            except OSError:  # gone, or not a directory (a link is never opened)
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # held: a process is writing it
                os.close(fd)
                continue
            try:
                remove_path(entry.path)
            finally:
                os.close(fd)


def open_lock_file(path: str | Path) -> int:
    """Open (creating if missing) the lock file `path` for reading and writing, without following a
    symlink at it; refuse a link or anything but a regular file with one link, which truncating or
    writing it would damage. Raises OutputError saying what is there; OSError for other failures."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | _NOFOLLOW | _CLOEXEC, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP or path.is_symlink():
            raise OutputError(f"{path} is a symbolic link; attnlab never writes through a link planted where it "
                              f"keeps its lock. Remove the link (rm {path}) and run again.") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        kind = "not a regular file" if not stat.S_ISREG(st.st_mode) else "a hard link to another file"
        raise OutputError(f"{path} is {kind}; attnlab keeps its lock in a file of its own. "
                          f"Remove it (rm {path}) and run again.")
    return fd


# --- paths that must stay under their roots ---------------------------------------------------------------


def inside(root: str | Path, path: str | Path) -> Path:
    """`path` (taken relative to `root` unless absolute) resolved, symlinks and '..' followed, if it stays
    under `root` resolved; ValueError otherwise. Callers turn that into their own error naming the field."""
    base = Path(root).resolve()
    resolved = (base / Path(path)).resolve()
    if not resolved.is_relative_to(base):
        raise ValueError(f"{path} resolves to {resolved}, outside {base}")
    return resolved
