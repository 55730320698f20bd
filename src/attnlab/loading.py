"""Load a model and its tokenizer from whatever a user points at.

MODEL may be an attnlab run directory (its final model, or else its newest complete
checkpoint), a checkpoint directory, a Hugging Face model directory, or a GGUF file.
Weights load through safetensors (or a GGUF file); remote code runs only when asked for.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from attnlab.errors import CheckpointError


def resolve_model_dir(path: str | Path) -> Path:
    """The directory (or GGUF file) that holds the weights `path` refers to, verified against its manifest
    when it has one (attnlab checkpoints and final models): damaged weights are refused, never loaded."""
    p = Path(path).expanduser()
    if not p.exists():
        raise CheckpointError(f"model not found: {p}. Pass a run directory, a checkpoint, an HF model directory or a .gguf file.")
    if p.is_file():
        if p.suffix == ".gguf":
            return p
        raise CheckpointError(f"{p} is a file but not a .gguf model; pass a model directory or a .gguf file")
    if (p / "config.json").is_file() or (p / "attnlab_adapter.json").is_file():  # a model, or an adapter directory
        return verified_model_dir(p)
    if (p / "config.yaml").is_file() or (p / "checkpoints").is_dir():  # a run directory
        if (p / "final" / "config.json").is_file() or (p / "final" / "attnlab_adapter.json").is_file():
            return verified_model_dir(p / "final")
        from attnlab.train.checkpoint import CheckpointManager

        newest = CheckpointManager(p).newest()
        if newest is None:
            raise CheckpointError(f"run {p} has neither a final model nor a complete checkpoint yet")
        return verified_model_dir(newest)
    raise CheckpointError(f"{p} holds no model: expected config.json (a model or checkpoint directory) or a run directory")


def verified_model_dir(directory: Path) -> Path:
    """`directory`, after checking every file its attnlab manifest lists (size and SHA-256). A directory
    without a manifest (an HF model, an adapter) is returned as it is. A damaged checkpoint of a run is
    refused naming the newest intact checkpoint of that run."""
    from attnlab.train.checkpoint import MANIFEST, STEP_DIR, CheckpointManager, verify_checkpoint

    if not (directory / MANIFEST).is_file():
        return directory
    try:
        verify_checkpoint(directory)
    except CheckpointError as e:
        hint = ""
        if STEP_DIR.match(directory.name) and directory.parent.name == "checkpoints":
            hint = " " + CheckpointManager(directory.parent.parent).last_good_note(directory)
        elif directory.name == "final":
            good = CheckpointManager(directory.parent).last_good()
            hint = f" The newest intact checkpoint of this run is {good}: load it instead." if good else ""
        raise CheckpointError(f"refusing to load damaged weights: {e}{hint}") from None
    return directory


def load(path: str | Path, device: str = "auto", dtype: str = "auto", trust_remote_code: bool = False):
    """(model, tokenizer) ready for generation, on `device` in eval mode."""
    import attnlab.models  # noqa: F401  (registers the attnlab Auto classes)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from attnlab.data import load_tokenizer
    from attnlab.data.tokenizer import _prepare_for_lm

    import transformers

    transformers.utils.logging.disable_progress_bar()
    where = resolve_model_dir(path)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if (where / "attnlab_adapter.json").is_file():  # fine-tuned: base + control-token resize + adapter, in one call
        from attnlab.finetune.adapter import load_adapter

        return load_adapter(where, device=device, dtype=dtype, trust_remote_code=trust_remote_code)
    torch_dtype = {"auto": torch.bfloat16 if device.startswith("cuda") else torch.float32,
                   "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    common = {"trust_remote_code": trust_remote_code, "local_files_only": True}
    try:
        if where.suffix == ".gguf":
            model = AutoModelForCausalLM.from_pretrained(where.parent, gguf_file=where.name, dtype=torch_dtype, **common)
            try:
                tokenizer = _prepare_for_lm(AutoTokenizer.from_pretrained(where.parent, gguf_file=where.name, **common), str(where))
            except Exception as e:  # a GGUF file without tokenizer metadata
                raise CheckpointError(f"{where} holds no usable tokenizer ({e}); use a GGUF file that embeds its tokenizer") from None
        else:
            _refuse_pickled_only(where)
            model = AutoModelForCausalLM.from_pretrained(where, dtype=torch_dtype, use_safetensors=True, **common)
            tokenizer = load_tokenizer(str(where))
    except CheckpointError:
        raise
    except ValueError as e:
        if "trust_remote_code" in str(e):
            raise CheckpointError(f"{where} needs custom code from the model repository; rerun with --trust-remote-code if you trust it") from None
        raise CheckpointError(f"cannot load a model from {where}: {e}") from None
    except OSError as e:
        raise CheckpointError(f"cannot load a model from {where}: {e}") from None
    return model.to(device).eval(), tokenizer


def _refuse_pickled_only(where: Path) -> None:
    if not list(where.glob("*.safetensors")) and list(where.glob("*.bin")):
        raise CheckpointError(f"{where} holds only pickled weights (*.bin), which attnlab does not load; convert them to safetensors")


def describe(path: str | Path) -> str:
    where = resolve_model_dir(path)
    if where.suffix == ".gguf":
        return f"GGUF {where.name}"
    if (where / "attnlab_adapter.json").is_file():
        base = json.loads((where / "attnlab_adapter.json").read_text()).get("base_model")
        return f"adapter {where} on {base}"
    cfg = json.loads((where / "config.json").read_text())
    return f"{cfg.get('model_type', '?')} model from {where}"
