"""What a model reference names: the directory (or GGUF file) holding the weights that a run directory, a
checkpoint, a model directory, a .gguf file or a packaged model's name (`smollm2`) points at, verified against
its manifest when it has one. Loading, conversion, `train.init_from` and fine-tuning's base all resolve their
references here.
"""

from __future__ import annotations

from pathlib import Path

from attnlab.errors import CheckpointError

from .checkpoints import MANIFEST, STEP_DIR, RunCheckpoints, verify_checkpoint
from .smollm2 import packaged_model


def resolve_model_dir(path: str | Path) -> Path:
    """The directory (or GGUF file) that holds the weights `path` refers to, verified against its manifest
    when it has one (attnlab checkpoints and final models): damaged weights are refused, never loaded."""
    p = Path(path).expanduser()
    if not p.exists():
        packaged = packaged_model(str(path))
        if packaged is not None:
            return packaged
        raise CheckpointError(f"model not found: {p}. Pass a run directory, a checkpoint, an HF model directory, a .gguf file "
                              "or smollm2 (the packaged SmolLM2-135M-Instruct).")
    if p.is_file():
        if p.suffix == ".gguf":
            return p
        raise CheckpointError(f"{p} is a file but not a .gguf model; pass a model directory or a .gguf file")
    if (p / "config.json").is_file() or (p / "attnlab_adapter.json").is_file():  # a model, or an adapter directory
        return verified_model_dir(p)
    if (p / "config.yaml").is_file() or (p / "checkpoints").is_dir():  # a run directory
        if (p / "final" / "config.json").is_file() or (p / "final" / "attnlab_adapter.json").is_file():
            return verified_model_dir(p / "final")
        newest = RunCheckpoints(p).newest()
        if newest is None:
            raise CheckpointError(f"run {p} has neither a final model nor a complete checkpoint yet")
        return verified_model_dir(newest)
    raise CheckpointError(f"{p} holds no model: expected config.json (a model or checkpoint directory) or a run directory")


def verified_model_dir(directory: Path) -> Path:
    """`directory`, after checking every file its attnlab manifest lists (size and SHA-256; every directory
    attnlab publishes has one). A directory without a manifest (an HF model, an adapter or converted model
    written by an older attnlab) is returned as it is. A damaged checkpoint of a run is refused naming the
    newest intact checkpoint of that run."""
    if not (directory / MANIFEST).is_file():
        return directory
    try:
        verify_checkpoint(directory)
    except CheckpointError as e:
        hint = ""
        if STEP_DIR.match(directory.name) and directory.parent.name == "checkpoints":
            hint = " " + RunCheckpoints(directory.parent.parent).last_good_note(directory)
        elif directory.name == "final":
            good = RunCheckpoints(directory.parent).last_good()
            hint = f" The newest intact checkpoint of this run is {good}: load it instead." if good else ""
        raise CheckpointError(f"refusing to load damaged weights: {e}{hint}") from None
    return directory


def refuse_pickled_only(where: Path) -> None:
    if not list(where.glob("*.safetensors")) and list(where.glob("*.bin")):
        raise CheckpointError(f"{where} holds only pickled weights (*.bin), which attnlab does not load; convert them to safetensors")
