"""Checkpoints that are either complete or absent.

A checkpoint is written into `checkpoints/.staging/`, described by a manifest (size and
SHA-256 of every file), flushed to disk, and only then renamed to `checkpoints/step-NNNNNNN/`.
`checkpoints/latest` is a symlink swapped atomically to the newest one. A crash at any point
leaves the previous checkpoints untouched; a half-written staging directory is never resumed.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re
import shutil
from pathlib import Path

from attnlab.errors import CheckpointError
from attnlab.outputs import remove_path, replace_file, replace_symlink

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
    replace_file(directory / MANIFEST, json.dumps({"step": step, "files": files}, indent=1))


def verify_checkpoint(directory: Path, require: tuple[str, ...] = ()) -> int:
    """Check every file against the manifest; return the step. Raises CheckpointError naming the damage.

    `require`: file names (glob patterns) the manifest must list, e.g. what a resume restores. A checkpoint
    whose manifest was rewritten without one of them is refused rather than resumed without it."""
    directory = Path(directory)
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"checkpoint {directory} has no {MANIFEST}: it is incomplete. Delete it to resume from the previous checkpoint.")
    try:
        manifest = json.loads(manifest_path.read_text())
        files, step = manifest["files"], int(manifest["step"])
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
        elif _sha256(p) != sums[rel]:
            problem = "does not match its checksum (corrupted)"
        if problem:
            raise CheckpointError(
                f"checkpoint {directory} is damaged: {rel} {problem}. "
                f"Delete {directory} to resume from the previous checkpoint, or restore the file."
            )
    return step


_WHAT_IT_HOLDS = {"optimizer.pt": "the optimizer (AdamW moments)", "scheduler.pt": "the learning-rate schedule",
                  "rng_state*.pth": "the random number generators", "trainer_state.json": "the step counter",
                  "model.safetensors": "the weights"}


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
        if self.staging.exists() or self.staging.is_symlink():
            remove_path(self.staging)  # a link planted there is removed, never followed

    def publish(self, staged: Path, step: int, extra_files: dict[str, str] | None = None) -> Path:
        """Turn a fully written staging directory into checkpoints/step-NNNNNNN, atomically."""
        for name, text in (extra_files or {}).items():
            (staged / name).write_text(text, encoding="utf-8")
        write_manifest(staged, step)
        _fsync_tree(staged)
        final = self.root / step_dir_name(step)
        if final.exists():  # a re-save of the same step (e.g. resumed at the end): replace it whole
            trash = self.root / f".trash-{final.name}"
            remove_path(trash)
            final.replace(trash)
            staged.replace(final)
            remove_path(trash)
        else:
            staged.replace(final)
        _fsync_dir(self.root)
        self._point_latest(final)
        self._rotate()
        return final

    def _point_latest(self, target: Path) -> None:
        replace_symlink(self.root / "latest", target.name)
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

    def resume_point(self, require: tuple[str, ...] | None = None) -> Path:
        """The newest complete checkpoint, verified against its manifest and holding everything a resume restores;
        CheckpointError (naming the newest intact one, if any) when there is none or it is damaged."""
        newest = self.newest()
        if newest is None:
            raise CheckpointError(
                f"nothing to resume: {self.root} holds no complete checkpoint. "
                "Start a new run without --resume (or point --run-dir at the run you meant)."
            )
        try:
            verify_checkpoint(newest, require=RESUME_FILES if require is None else require)
        except CheckpointError as e:
            raise CheckpointError(f"{e} {self.last_good_note(newest)}") from None
        return newest

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


# What a resume restores, beyond the manifest's own check: without these a run would continue with a fresh
# optimizer or schedule, or another random stream, and leave the trajectory without a word.
RESUME_FILES = ("model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json", "rng_state*.pth")
UNSAFE_PICKLE = "the file is not a plain tensor file (its pickle asks to run code, or it is damaged)"


def torch_load_checked(path: Path, **kwargs):
    """torch.load with weights_only; a file that is not plain tensors (a malicious or damaged pickle) is a CheckpointError."""
    import pickle

    import torch
    from transformers.trainer_pt_utils import safe_globals  # the numpy types an RNG state holds, and nothing else

    try:
        with safe_globals():
            return torch.load(path, weights_only=True, **kwargs)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, AttributeError, TypeError) as e:
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path} was refused: {UNSAFE_PICKLE} ({first}). attnlab loads only tensors; "
                              "restore the file from the run that wrote it, or resume from an older checkpoint.") from None


def load_model_state(model, checkpoint: Path) -> None:
    """Load a checkpoint's model.safetensors into a model of one process, strictly: every tensor the model has
    must be in the file (a tied LM head is given the embedding it shares), and of the same shape.
    A checkpoint of another model is a CheckpointError listing what differs, never a raw load_state_dict error."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(checkpoint) / MODEL_FILE
    if not path.is_file():
        raise CheckpointError(f"checkpoint {checkpoint} has no {MODEL_FILE}. Resume from a checkpoint written by attnlab train.")
    from attnlab.models.files import check_safetensors

    check_safetensors(path)  # the header fits the file, before safetensors maps or allocates anything
    try:
        saved = load_file(path, device="cpu")
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path} cannot be read ({e}). Resume from an older checkpoint.") from None
    local = model.state_dict(keep_vars=True)
    for key, tensor in local.items():
        if key not in saved:
            twin = next((k for k, t in local.items() if t is tensor and k in saved), None)
            if twin is not None:
                saved[key] = saved[twin]
    missing = [k for k in local if k not in saved]
    unexpected = [k for k in saved if k not in local]
    shapes = [f"{k} {tuple(saved[k].shape)} in the checkpoint, {tuple(local[k].shape)} in this model"
              for k in local if k in saved and tuple(saved[k].shape) != tuple(local[k].shape)]
    if missing or unexpected or shapes:
        parts = ([f"differently shaped: {'; '.join(shapes[:4])}" + (" ..." if len(shapes) > 4 else "")] if shapes else []) + \
                ([f"missing: {', '.join(missing[:6])}" + (" ..." if len(missing) > 6 else "")] if missing else []) + \
                ([f"not in this model: {', '.join(unexpected[:6])}" + (" ..." if len(unexpected) > 6 else "")] if unexpected else [])
        raise CheckpointError(f"{path} was written for another model ({'; '.join(parts)}). "
                              "Resume with the config the run was trained with (its checkpoint's run_config.yaml).")
    model.load_state_dict(saved, strict=True)


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
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict

    path = Path(checkpoint) / OPTIMIZER_FILE
    if not path.is_file():
        raise CheckpointError(f"checkpoint {checkpoint} has no {OPTIMIZER_FILE}: its optimizer state cannot be resumed. "
                              "Resume from a checkpoint written by attnlab train.")
    saved = torch_load_checked(path, map_location="cpu")
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
    from attnlab.models.files import check_safetensors

    check_safetensors(path)  # the header fits the file, before safetensors maps or allocates anything
    full = load_file(path)
    local = model.state_dict(keep_vars=True)
    for key, tensor in local.items():
        if key not in full:
            twin = next((k for k, t in local.items() if t is tensor and k in full), None)
            if twin is None:
                raise CheckpointError(f"{path} has no tensor '{key}': it was written for another model. Resume with the run's saved config.")
            full[key] = full[twin]
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True))
