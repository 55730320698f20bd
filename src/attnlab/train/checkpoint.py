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
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


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


# Sharded (FSDP) training state <-> the files one process writes. A checkpoint written under FSDP holds
# the whole model (model.safetensors) and the whole optimizer state (optimizer.pt) keyed by parameter
# position, as `torch.optim.Optimizer.state_dict()` keys it; so it resumes with either strategy, on any
# number of processes. The gathering and scattering is torch.distributed.checkpoint's (the API accelerate uses).

OPTIMIZER_FILE = "optimizer.pt"
MODEL_FILE = "model.safetensors"


def full_optimizer_state(model, optimizer) -> dict | None:
    """The optimizer state of a sharded model, gathered whole onto rank 0's CPU and keyed by parameter
    position. Every rank must call it; rank 0 gets the state, the others None."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    by_name = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() != 0:
        return None
    names = [name for group in by_name["param_groups"] for name in group["params"]]
    position = {name: i for i, name in enumerate(names)}
    return {
        "state": {position[name]: state for name, state in by_name["state"].items()},
        "param_groups": [{**group, "params": [position[n] for n in group["params"]]} for group in by_name["param_groups"]],
    }


def load_full_optimizer_state(model, optimizer, checkpoint: Path) -> None:
    """Load a checkpoint's optimizer.pt (written by one process, DDP or FSDP) into the optimizer of a
    sharded model: every rank reads the file and keeps its shard."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict

    path = Path(checkpoint) / OPTIMIZER_FILE
    if not path.is_file():
        raise CheckpointError(f"checkpoint {checkpoint} has no {OPTIMIZER_FILE}: its optimizer state cannot be resumed. "
                              "Resume from a checkpoint written by attnlab train.")
    saved = torch.load(path, map_location="cpu", weights_only=True)
    # The parameter names in the optimizer's own order: the order in which one process numbers them.
    names = [name for group in get_optimizer_state_dict(model, optimizer)["param_groups"] for name in group["params"]]
    positions = [i for group in saved["param_groups"] for i in group["params"]]
    if len(positions) != len(names) or len(saved["param_groups"]) != len(optimizer.param_groups):
        raise CheckpointError(
            f"{path} holds optimizer state for {len(positions)} parameters in {len(saved['param_groups'])} groups; "
            f"this run's optimizer has {len(names)} in {len(optimizer.param_groups)}. Resume with the run's saved config."
        )
    name_of = dict(zip(positions, names))
    by_name = {
        "state": {name_of[i]: state for i, state in saved["state"].items()},
        "param_groups": [{**group, "params": [name_of[i] for i in group["params"]]} for group in saved["param_groups"]],
    }
    set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))


def load_full_model_state(model, checkpoint: Path) -> None:
    """Load a checkpoint's model.safetensors into a sharded model: every rank reads the file and keeps its shard.
    Weights saved once for two names (tied embeddings) are given to both."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    path = Path(checkpoint) / MODEL_FILE
    if not path.is_file():
        raise CheckpointError(f"checkpoint {checkpoint} has no {MODEL_FILE}. Resume from a checkpoint written by attnlab train.")
    full = load_file(path)
    local = model.state_dict(keep_vars=True)
    for key, tensor in local.items():
        if key not in full:
            twin = next((k for k, t in local.items() if t is tensor and k in full), None)
            if twin is None:
                raise CheckpointError(f"{path} has no tensor '{key}': it was written for another model. Resume with the run's saved config.")
            full[key] = full[twin]
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True))
