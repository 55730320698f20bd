"""Checkpoints that are either complete or absent.

A checkpoint is written into `checkpoints/.staging/`, described by a manifest (size and
SHA-256 of every file), flushed to disk, and only then renamed to `checkpoints/step-NNNNNNN/`.
`checkpoints/latest` is a symlink swapped atomically to the newest one. A crash at any point
leaves the previous checkpoints untouched; a half-written staging directory is never resumed.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

from attnlab.errors import CheckpointError

MANIFEST = "attnlab_manifest.json"
STEP_DIR = re.compile(r"^step-(\d{7,})$")


def step_dir_name(step: int) -> str:
    return f"step-{step:07d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(path)


def _fsync_dir(path: Path) -> None:
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


def write_manifest(directory: Path, step: int) -> None:
    files = {
        str(p.relative_to(directory)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }
    tmp = directory / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"step": step, "files": files}, indent=1))
    tmp.replace(directory / MANIFEST)


def verify_checkpoint(directory: Path) -> int:
    """Check every file against the manifest; return the step. Raises CheckpointError naming the damage."""
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"checkpoint {directory} has no {MANIFEST}: it is incomplete. Delete it to resume from the previous checkpoint.")
    try:
        manifest = json.loads(manifest_path.read_text())
        files, step = manifest["files"], int(manifest["step"])
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(f"checkpoint {directory} has an unreadable manifest. Delete the directory to resume from the previous checkpoint.") from None
    for rel, meta in files.items():
        p = directory / rel
        problem = None
        if not p.is_file():
            problem = "is missing"
        elif p.stat().st_size != meta["bytes"]:
            problem = f"has {p.stat().st_size} bytes, expected {meta['bytes']} (truncated or overwritten)"
        elif _sha256(p) != meta["sha256"]:
            problem = "does not match its checksum (corrupted)"
        if problem:
            raise CheckpointError(
                f"checkpoint {directory} is damaged: {rel} {problem}. "
                f"Delete {directory} to resume from the previous checkpoint, or restore the file."
            )
    return step


class CheckpointManager:
    """Owns RUN/checkpoints: atomic publication, the `latest` pointer, rotation, discovery."""

    def __init__(self, run_dir: Path, keep_last: int = 3):
        self.root = Path(run_dir) / "checkpoints"
        self.staging = self.root / ".staging"
        self.keep_last = keep_last

    def checkpoints(self) -> list[tuple[int, Path]]:
        """Published checkpoints, oldest first (published = renamed out of staging)."""
        if not self.root.is_dir():
            return []
        found = []
        for p in self.root.iterdir():
            m = STEP_DIR.match(p.name)
            if m and p.is_dir() and not p.is_symlink():
                found.append((int(m.group(1)), p))
        return sorted(found)

    def newest(self) -> Path | None:
        found = self.checkpoints()
        return found[-1][1] if found else None

    def clear_staging(self) -> None:
        if self.staging.exists():
            shutil.rmtree(self.staging)

    def publish(self, staged: Path, step: int, extra_files: dict[str, str] | None = None) -> Path:
        """Turn a fully written staging directory into checkpoints/step-NNNNNNN, atomically."""
        for name, text in (extra_files or {}).items():
            (staged / name).write_text(text, encoding="utf-8")
        write_manifest(staged, step)
        _fsync_tree(staged)
        final = self.root / step_dir_name(step)
        if final.exists():  # a re-save of the same step (e.g. resumed at the end): replace it whole
            trash = self.root / f".trash-{final.name}"
            shutil.rmtree(trash, ignore_errors=True)
            final.replace(trash)
            staged.replace(final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            staged.replace(final)
        _fsync_dir(self.root)
        self._point_latest(final)
        self._rotate()
        return final

    def _point_latest(self, target: Path) -> None:
        link, tmp = self.root / "latest", self.root / "latest.tmp"
        if tmp.is_symlink() or tmp.exists():
            tmp.unlink()
        tmp.symlink_to(target.name)
        tmp.replace(link)
        _fsync_dir(self.root)

    def _rotate(self) -> None:
        best = self._best_checkpoint_name()
        for _, path in self.checkpoints()[: -self.keep_last]:
            if path.name != best:  # the best checkpoint by the eval metric (RUN/best.json) is kept
                shutil.rmtree(path, ignore_errors=True)

    def _best_checkpoint_name(self) -> str | None:
        best = self.root.parent / "best.json"
        try:
            return Path(json.loads(best.read_text()).get("checkpoint", "")).name or None
        except (OSError, ValueError, AttributeError):
            return None

    def resume_point(self) -> Path:
        """The newest complete checkpoint, verified; CheckpointError if there is none or it is damaged."""
        newest = self.newest()
        if newest is None:
            raise CheckpointError(
                f"nothing to resume: {self.root} holds no complete checkpoint. "
                "Start a new run without --resume (or point --run-dir at the run you meant)."
            )
        verify_checkpoint(newest)
        return newest
