"""A run directory held by one process at a time, and checked to be usable before anything is written.

`RunLock(run_dir)` takes an exclusive `fcntl.flock` on `RUN/.lock` and keeps the file open for the
life of the run. The kernel drops the lock when the process ends however it ends (SIGKILL, OOM,
a lost node), so a dead run never leaves the directory stuck. The file holds the holder's pid and
host, so that a second `attnlab train` on the same directory can say who has it.
"""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

from attnlab.errors import OutputError, RunDirError
from attnlab.outputs import open_lock_file

LOCK_FILE = ".lock"


def _explain(err: OSError) -> str:
    if err.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    if err.errno == errno.EROFS:
        return "the file system is read-only"
    if err.errno == errno.ENOSPC:
        return "no space left on the device"
    return err.strerror or str(err)


def check_writable(run_dir: Path) -> None:
    """Write and remove a probe file: a read-only directory is refused before the run touches anything."""
    probe = run_dir / f".write-probe-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise RunDirError(f"cannot write in the run directory {run_dir}: {_explain(e)}. "
                          "Make it writable, or copy the run somewhere writable and pass that --run-dir.") from None


class RunLock:
    """An exclusive lock on a run directory, created if missing; `release()` (or the end of the process) frees it.

    A directory that the lock itself created and that nothing else was written to (the run failed in
    preflight) is removed again on release, so that a refused run leaves nothing behind."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.fd: int | None = None
        self.created = False

    def acquire(self) -> "RunLock":
        import fcntl

        d = self.run_dir
        if d.exists() and not d.is_dir():
            raise RunDirError(f"--run-dir {d} is a file, not a directory. Pass a directory (new or holding a run).")
        if not d.exists():
            try:
                d.mkdir(parents=True)
                self.created = True
            except FileExistsError:
                if not d.is_dir():
                    raise RunDirError(f"--run-dir {d}: a parent of it is a file, not a directory. Pass another --run-dir.") from None
            except NotADirectoryError:
                raise RunDirError(f"--run-dir {d}: a parent of it is a file, not a directory. Pass another --run-dir.") from None
            except OSError as e:
                raise RunDirError(f"cannot create the run directory {d}: {_explain(e)}. Choose a writable location for --run-dir.") from None
        check_writable(d)
        path = d / LOCK_FILE
        try:
            fd = open_lock_file(path)  # never through a symlink planted at RUN/.lock
        except OutputError as e:
            raise RunDirError(str(e)) from None
        except OSError as e:
            raise RunDirError(f"cannot open {path}: {_explain(e)}. Make the run directory writable.") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise RunDirError(
                f"{d} is in use by another attnlab process ({holder}). Wait for it to finish or stop it; "
                "two processes writing one run would mix their checkpoints and telemetry."
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is None:
            return
        import fcntl

        if self.created and {p.name for p in self.run_dir.iterdir()} <= {LOCK_FILE}:
            (self.run_dir / LOCK_FILE).unlink(missing_ok=True)  # a refused new run: leave nothing behind
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None
            try:
                self.run_dir.rmdir()
            except OSError:
                pass
            return
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _read_holder(fd: int) -> str:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        text = os.read(fd, 200).decode(errors="replace").strip()
    except OSError:
        text = ""
    return text or "pid unknown"
