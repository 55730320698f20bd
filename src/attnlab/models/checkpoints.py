"""Reading attnlab checkpoints: the manifest that vouches for every file of a checkpoint (or any directory attnlab
published: a final model, an adapter, a converted model), and the checkpoints a run directory has published
(RUN/checkpoints/step-NNNNNNN). attnlab.outputs.publishing writes the manifest, attnlab.train.checkpoint the
checkpoints; loading a model, resuming a run and converting one read them through this module.
"""

from __future__ import annotations

import fnmatch
import json
import re
from pathlib import Path

from attnlab.errors import CheckpointError
from attnlab.outputs import MANIFEST, file_sha256

STEP_DIR = re.compile(r"^step-(\d{7,})$")


def step_dir_name(step: int) -> str:
    return f"step-{step:07d}"


def verify_checkpoint(directory: Path, require: tuple[str, ...] = ()) -> int:
    """Check every file against the manifest; return the step (0 for a directory published without one, such as
    an adapter or a converted model). Raises CheckpointError naming the damage.

    `require`: file names (glob patterns) the manifest must list, e.g. what a resume restores. A checkpoint
    whose manifest was rewritten without one of them is refused rather than resumed without it."""
    directory = Path(directory)
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"checkpoint {directory} has no {MANIFEST}: it is incomplete. Delete it to resume from the previous checkpoint.")
    try:
        manifest = json.loads(manifest_path.read_text())
        files, step = manifest["files"], int(manifest.get("step", 0))
        sizes = {rel: int(meta["bytes"]) for rel, meta in files.items()}
        sums = {rel: str(meta["sha256"]) for rel, meta in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise CheckpointError(f"checkpoint {directory} has an unreadable manifest. Delete the directory to resume from the previous checkpoint.") from None
    for pattern in require:
        if not any(fnmatch.fnmatch(rel, pattern) for rel in files):
            raise CheckpointError(
                f"checkpoint {directory} holds no {pattern}: resuming from it would restart "
                f"{_WHAT_IT_HOLDS.get(pattern, 'part of the training state')} from scratch and silently leave the run's trajectory. "
                f"Delete {directory} to resume from the previous checkpoint, or restore the file."
            )
    for rel in files:
        p = directory / rel
        problem = None
        if not p.is_file():
            problem = "is missing"
        elif p.stat().st_size != sizes[rel]:
            problem = f"has {p.stat().st_size} bytes, expected {sizes[rel]} (truncated or overwritten)"
        elif file_sha256(p) != sums[rel]:
            problem = "does not match its checksum (corrupted)"
        if problem:
            if "step" in manifest:  # a training checkpoint: the run has earlier ones
                advice = f"Delete {directory} to resume from the previous checkpoint, or restore the file."
            else:  # a directory published once (an adapter, a merged or converted model)
                advice = "Restore the file, or write the directory again with the command that made it."
            raise CheckpointError(f"{'checkpoint' if 'step' in manifest else 'directory'} {directory} is damaged: {rel} {problem}. {advice}")
    return step


_WHAT_IT_HOLDS = {"optimizer.pt": "the optimizer (AdamW moments)", "scheduler.pt": "the learning-rate schedule",
                  "rng_state*.pth": "the random number generators", "trainer_state.json": "the step counter",
                  "model.safetensors": "the weights"}


class RunCheckpoints:
    """The published checkpoints of a run directory (RUN/checkpoints/step-NNNNNNN): which there are, the newest,
    the newest intact one."""

    def __init__(self, run_dir: Path):
        self.root = Path(run_dir) / "checkpoints"

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

    def last_good(self, before: Path | None = None) -> Path | None:
        """The newest checkpoint older than `before` (all of them without it) that passes its manifest."""
        for _, path in reversed(self.checkpoints()):
            if before is not None and path.name >= before.name:
                continue
            try:
                verify_checkpoint(path)
                return path
            except CheckpointError:
                continue
        return None

    def last_good_note(self, damaged: Path) -> str:
        good = self.last_good(before=damaged)
        if good is None:
            return "No older intact checkpoint remains in this run."
        return f"The newest intact checkpoint is {good}: delete {damaged} to resume (or load) from it."
