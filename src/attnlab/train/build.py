"""Turn the run config into the model config and the model (random, or continued from `train.init_from`)."""

from __future__ import annotations

from pathlib import Path

from attnlab.config import RunConfig
from attnlab.errors import AttnLabError, CheckpointError
from attnlab.models import AttnLabConfig, AttnLabForCausalLM
from attnlab.models.files import check_model_files
from attnlab.models.references import refuse_pickled_only, resolve_model_dir


def default_vocab_size(cfg: RunConfig, tokenizer) -> int:
    """The model's vocabulary when model.vocab_size is null: the tokenizer's size, or on data.source=mqar the task's
    ids (data.mqar.vocab_size). An MQAR run reads no text; output classes that no example uses (227 of a byte
    tokenizer's 259 beside a task of 32 ids) delay its learning several times over."""
    return cfg.data.mqar.vocab_size if cfg.data.source == "mqar" else len(tokenizer)


def model_config_from(cfg: RunConfig, tokenizer):
    """The model config of the run: the `model` section as it is (AttnLabConfig's architecture fields are its
    fields), the vocabulary and special tokens from the tokenizer."""
    vocab = cfg.model.vocab_size or default_vocab_size(cfg, tokenizer)
    within = lambda token: token if token is not None and token < vocab else None  # noqa: E731  (an MQAR model has no text specials)
    return AttnLabConfig(**{
        **cfg.model.model_dump(),
        "vocab_size": vocab,
        "bos_token_id": within(tokenizer.bos_token_id),
        "eos_token_id": within(tokenizer.eos_token_id),
        "pad_token_id": within(tokenizer.pad_token_id),
    })


# model.* fields and where an HF config keeps the same quantity
_HF_NAMES = {"hidden_size": "hidden_size", "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
             "intermediate_size": "intermediate_size", "vocab_size": "vocab_size",
             "max_position_embeddings": "max_position_embeddings", "norm_eps": "rms_norm_eps",
             "tie_word_embeddings": "tie_word_embeddings"}
_IGNORED = ("kernels", "initializer_range")  # a runtime choice, and an init that a checkpoint makes moot


def _hf_value(config, field: str):
    if field == "rope_theta":
        rope = getattr(config, "rope_parameters", None) or {}
        return rope.get("rope_theta", getattr(config, "rope_theta", None))
    name = _HF_NAMES.get(field)
    return getattr(config, name, None) if name else None


def init_from_config(cfg: RunConfig, tokenizer, resume_from: Path | None = None
                     ) -> tuple[str, str, object, list[tuple[str, str]], list[tuple[str, str]]]:
    """What `train.init_from` points at, checked against the run config without reading weights.

    Returns (kind, model directory, model config, errors, warnings): kind 'attnlab' (an attnlab model, or a
    checkpoint converted into one: `attnlab.models.convert`) or 'hf' (any other causal LM, trained as it is);
    errors and warnings as (config key, message). model.* fields left at their defaults are taken from the
    checkpoint; any other value must agree with it. A resumed run (`resume_from`, its checkpoint) builds the
    model from that checkpoint, which holds the same architecture: `train.init_from` need not exist any more."""
    from attnlab.models.convert import converted_config

    errors: list[tuple[str, str]] = []
    warnings: list[tuple[str, str]] = []
    try:
        where = resume_from or resolve_model_dir(cfg.train.init_from)
        if where.suffix == ".gguf":
            raise AttnLabError(f"train.init_from takes a model directory, not a GGUF file ({where})")
        kind, config = converted_config(where)
    except AttnLabError as e:
        return "", "", None, [("train.init_from", str(e))], []
    kind = "hf" if kind == "hf" else "attnlab"
    if kind == "hf":
        from transformers import AutoModelForCausalLM

        if type(config) not in AutoModelForCausalLM._model_mapping:
            why = (f"{where} holds an HF {config.model_type} model, which is not a causal language model transformers "
                   "knows: attnlab continues pretraining causal LMs only")
            return "", "", None, [("train.init_from", why)], []
    if kind == "attnlab":
        config.kernels = cfg.model.kernels
    m = cfg.model
    for field, info in type(m).model_fields.items():
        value = getattr(m, field)
        default = info.default_factory() if info.default_factory is not None else info.default
        if field in _IGNORED or value == default:
            continue
        if kind == "hf":
            if field in ("mixer", "mixer_options"):
                errors.append((f"model.{field}", (f"model.{field}={value!r}, but train.init_from is an HF "
                                                   f"{config.model_type} model, which trains as it is: remove model.{field}")))
                continue
            have = _hf_value(config, field)
        elif field == "mixer_options":
            have = {k: config.mixer_options.get(k) for k in value}
        else:
            have = getattr(config, field, None)
        if have is not None and have != value:
            errors.append((f"model.{field}", (f"model.{field}={value!r}, but the model in {where} has {have!r}: remove "
                                               f"model.{field} from the config (it is taken from the checkpoint) or point "
                                               "train.init_from elsewhere")))
    vocab = config.vocab_size
    if vocab is not None and len(tokenizer) > vocab:
        errors.append(("data.tokenizer", (f"the tokenizer ({cfg.data.tokenizer}) has {len(tokenizer)} tokens but the model in "
                                          f"{where} has {vocab} embeddings: train with the tokenizer the model was trained "
                                          "with (data.tokenizer)")))
    if cfg.data.tokenizer == "byte" and any((where / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        warnings.append(("data.tokenizer", (f"{where} holds its own tokenizer but data.tokenizer is 'byte': set "
                                            f"data.tokenizer={where} to train with it")))
    return kind, str(where), config, errors, warnings


def build_model(cfg: RunConfig, report):
    """The model a run trains: random weights from the model config, or the model `train.init_from` points at."""
    import torch

    if report.init_from is None:
        return AttnLabForCausalLM(report.model_config)
    kind, where = report.init_from
    if kind == "attnlab":
        from attnlab.models.convert import load_converted

        return load_converted(where, torch.float32, kernels=cfg.model.kernels)
    from transformers import AutoModelForCausalLM

    refuse_pickled_only(Path(where))
    check_model_files(Path(where))  # sizes and safetensors headers, before transformers builds anything from them
    try:
        return AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, use_safetensors=True, local_files_only=True)
    except (ValueError, OSError) as e:
        raise CheckpointError(f"cannot load the causal LM in {where} (train.init_from): {e}") from None
