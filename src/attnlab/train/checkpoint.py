"""Checkpoints that are either complete or absent.

A checkpoint is written into `checkpoints/.staging/` (by every process of the run), then published by
attnlab.outputs.publish_dir: described by a manifest (size and SHA-256 of every file), flushed to disk, and
only then renamed to `checkpoints/step-NNNNNNN/`. `checkpoints/latest` is a symlink swapped atomically to the
newest one. A crash at any point leaves the previous checkpoints untouched; a half-written staging directory is
never resumed. The manifest's check and the discovery of a run's checkpoints are attnlab.models.checkpoints'.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from attnlab.errors import CheckpointError
from attnlab.models.checkpoints import RunCheckpoints, step_dir_name, verify_checkpoint
from attnlab.models.files import check_safetensors
from attnlab.outputs import fsync_dir, publish_dir, remove_path, replace_file, replace_symlink


class CheckpointManager(RunCheckpoints):
    """Owns RUN/checkpoints: atomic publication, the `latest` pointer, rotation, discovery (RunCheckpoints)."""

    def __init__(self, run_dir: Path, keep_last: int = 3):
        super().__init__(run_dir)
        self.staging = self.root / ".staging"
        self.keep_last = keep_last

    def clear_staging(self) -> None:
        if self.staging.exists() or self.staging.is_symlink():
            remove_path(self.staging)  # a link planted there is removed, never followed

    def publish(self, staged: Path, step: int, extra_files: dict[str, str] | None = None) -> Path:
        """Turn a fully written staging directory into checkpoints/step-NNNNNNN, atomically."""
        for name, text in (extra_files or {}).items():
            replace_file(staged / name, text)
        # a re-save of the same step (e.g. resumed at the end) replaces it whole
        final = publish_dir(staged, self.root / step_dir_name(step), step)
        self._point_latest(final)
        self._rotate()
        return final

    def _point_latest(self, target: Path) -> None:
        replace_symlink(self.root / "latest", target.name)
        fsync_dir(self.root)

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
