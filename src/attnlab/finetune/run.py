"""`attnlab finetune`: base model + control tokens + peft (or every parameter), trained on prompt–completion data
with the same Trainer, checkpoints, telemetry, evaluation and strict resume as `attnlab train`; the result is an
adapter directory (or, for finetune.method=full, a whole model) in RUN/final."""

from __future__ import annotations

import functools
import json
import math
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import torch
import transformers
from rich.console import Console

import attnlab
from attnlab.config.presets import token_in
from attnlab.console import make_console, progress
from attnlab.errors import (
    AttnLabError,
    CheckpointError,
    ConfigError,
    DataError,
    RunInterrupted,
    TrainingDivergedError,
)
from attnlab.eval.callback import EvalDuringTraining
from attnlab.train.checkpoint import RESUME_FILES, CheckpointManager
from attnlab.train.loop import AttnLabTrainer, StopOnSignal, TelemetryCallback, _elapsed_at, training_arguments
from attnlab.train.telemetry import RunLogger
from attnlab.outputs import replace_file

from . import adapter  # its functions looked up when called (tests replace them)
from .config import (
    FinetuneConfig,
    finetune_config_to_yaml,
    resume_changes,
    save_finetune_config,
)
from .data import ExampleDataset, PadCollator, encode_rows, pack_examples, read_rows
from .model import add_control_tokens, load_base, quantization_config, trainable_parameters, wrap_with_peft
from .presets import metric_budget, style_separation

MIB = 1024 * 1024
CONTROL_FILE = "style_control.json"  # the style metric of the untuned base, measured once when the run starts


@dataclass
class FinetuneResult:
    run_dir: Path
    adapter_dir: Path
    report: dict[str, Any]


def _device(cfg: FinetuneConfig) -> str:
    d = cfg.train.device
    if d == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if d == "cuda" and not torch.cuda.is_available():
        raise DataError("train.device=cuda but no CUDA device is visible; use train.device=cpu or auto")
    return d


def _precision(cfg: FinetuneConfig, device: str) -> str:
    p = cfg.train.precision
    return ("bf16" if device == "cuda" else "fp32") if p == "auto" else p


def prepare(cfg: FinetuneConfig, console: Console | None = None):
    """Everything before training: base model, control tokens, data, peft wrapping. Fails early with one message."""
    console = console or Console(quiet=True)
    device = _device(cfg)
    quant = quantization_config(cfg.finetune, device) if cfg.finetune.method == "qlora" else None
    train_rows = read_rows(cfg.data.train)  # bad data fails before the model loads
    val_rows = read_rows(cfg.data.val) if cfg.data.val else None
    eval_rows = read_rows(cfg.finetune.eval_prompts) if cfg.finetune.eval_prompts else None
    model, tokenizer, where = load_base(cfg.base.path, device=device, dtype=cfg.base.dtype,
                                        trust_remote_code=cfg.base.trust_remote_code, quantization=quant)
    token_ids = add_control_tokens(model, tokenizer, cfg.finetune.control_tokens)
    train = encode_rows(tokenizer, train_rows, cfg.data.max_len, cfg.data.chat_template, cfg.data.add_eos)
    console.print(train.summary("train data"), highlight=False)
    if train.dropped:
        console.print(f"[yellow]dropped train rows (0-based): {train.dropped[:20]}{' ...' if len(train.dropped) > 20 else ''}[/yellow]")
    if not train.examples:
        raise DataError(f"no training example keeps a completion token within data.max_len={cfg.data.max_len}; raise it")
    examples = train.examples
    if cfg.data.packing:
        examples = pack_examples(train.examples, cfg.data.max_len)
        console.print(f"packing: {len(train.examples)} examples in {len(examples)} rows of at most {cfg.data.max_len} tokens", highlight=False)
    val = None
    if val_rows:
        val = encode_rows(tokenizer, val_rows, cfg.data.max_len, cfg.data.chat_template, cfg.data.add_eos)
        console.print(val.summary("val data"), highlight=False)
    if cfg.train.gradient_checkpointing:
        model.activation_checkpointing_enable()
        if hasattr(model, "enable_input_require_grads"):
            model.enable_input_require_grads()
    transformers.set_seed(cfg.train.seed)
    peft_model, targets = wrap_with_peft(model, cfg.finetune, list(token_ids.values()), cfg.train.gradient_checkpointing)
    return SimpleNamespace(device=device, precision=_precision(cfg, device), model=peft_model, tokenizer=tokenizer, where=where,
                           token_ids=token_ids, train=train, examples=examples, val=val, eval_rows=eval_rows, targets=targets)


def planned_steps(cfg: FinetuneConfig, n_rows: int) -> int:
    """Optimizer steps: train.max_steps, or train.epochs passes over the `n_rows` training rows."""
    if cfg.train.epochs <= 0:
        return cfg.train.max_steps
    per_step = cfg.train.batch_size * cfg.train.grad_accum
    steps = max(1, math.ceil(cfg.train.epochs * n_rows / per_step))
    if cfg.train.warmup_steps > steps:
        raise ConfigError(f"train.epochs={cfg.train.epochs:g} over {n_rows} rows at {per_step} rows per step is {steps} steps, fewer "
                          f"than train.warmup_steps={cfg.train.warmup_steps}; lower train.warmup_steps or raise train.epochs")
    return steps


def eval_prompts(rows: list[dict]) -> list[str]:
    return [r["prompt"] if "prompt" in r else next(m["content"] for m in reversed(r["messages"]) if m["role"] == "user") for r in rows]


def metric_prompts(cfg: FinetuneConfig, rows: list[dict]) -> list[str]:
    """The held-out prompts of the style metric: the first finetune.eval_max_prompts of each control token."""
    tokens = cfg.finetune.control_tokens
    taken: dict[str, int] = {t: 0 for t in tokens}
    out = []
    for p in eval_prompts(rows):
        t = token_in(p, {t: {} for t in tokens})
        if t is not None and taken[t] < cfg.finetune.eval_max_prompts:
            taken[t] += 1
            out.append(p)
    return out


def measure_style(cfg: FinetuneConfig, p, model, console: Console | None = None, which: str = "") -> dict[str, Any] | None:
    """The style metric (presets.style_separation) of `model` on the held-out prompts, or None without them;
    `console`: a line saying how many prompts, and progress while they are generated."""
    if not p.eval_rows or len(cfg.finetune.control_tokens) < 2:
        return None
    budget = cfg.finetune.eval_max_new_tokens or metric_budget(p.tokenizer, p.eval_rows, cfg.data.chat_template)
    prompts = metric_prompts(cfg, p.eval_rows)
    console = console or make_console()
    console.print(f"style metric{f' of {which}' if which else ''}: {len(prompts)} held-out prompts "
                  f"(at most {cfg.finetune.eval_max_prompts} per control token), greedy, {budget} new tokens at most", highlight=False)
    was_training = model.training
    model.eval()
    t0 = time.perf_counter()
    try:
        with torch.no_grad(), progress(console, "style metric", len(prompts), "prompts") as advance:
            out = style_separation(model, p.tokenizer, prompts, cfg.finetune.control_tokens, budget, cfg.data.chat_template,
                                   progress=advance)
    finally:
        if was_training:
            model.train()
    return {**out, "eval_s": round(time.perf_counter() - t0, 2)}


def _plain(model):
    """The model with the base model's forward signature (peft's wrapper removed; the adapter layers stay inside)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def check_resume(cfg: FinetuneConfig, run_dir: Path) -> Path:
    """The checkpoint a strict resume continues from; CheckpointError / ConfigError when there is none or the config changed."""
    import yaml

    # the newest complete, verified checkpoint, or a refusal; an adapter's checkpoint holds the adapter's weights
    weights = "model*.safetensors" if cfg.finetune.method == "full" else "adapter_model.safetensors"
    resume_from = CheckpointManager(run_dir).resume_point(require=(weights, *(f for f in RESUME_FILES if f != "model.safetensors")))
    own = resume_from / "run_config.yaml"
    try:
        saved = FinetuneConfig.model_validate(yaml.safe_load(own.read_text(encoding="utf-8")))
    except FileNotFoundError:
        raise CheckpointError(f"{resume_from} records no run_config.yaml: it was not written by attnlab finetune. "
                              "Start a new run in another --run-dir.") from None
    except (OSError, ValueError, yaml.YAMLError) as e:  # pydantic's ValidationError is a ValueError
        raise CheckpointError(f"the config recorded in {own} cannot be read ({str(e).splitlines()[0]}); "
                              "start a new run in another --run-dir") from None
    changed = resume_changes(saved, cfg)
    if changed:
        raise ConfigError(f"the config differs from the one {resume_from.name} was trained with: " + "; ".join(changed)
                          + ". Resume with the run's own config (attnlab finetune --resume --run-dir RUN, plus only "
                            "train.max_steps / cadence changes), or start a new run in another --run-dir.")
    return resume_from


def run_finetune(cfg: FinetuneConfig, run_dir: Path, console: Console | None = None, resume: bool = False) -> FinetuneResult:
    """Fine-tune as `cfg` says into `run_dir`; with `resume`, continue from the run's newest checkpoint (strict:
    the config must match the checkpoint's own, and a run without a checkpoint is refused, never started afresh).

    run.json says "preparing", then "running", then finished / failed (with the error) / diverged / interrupted:
    whatever goes wrong after the run directory exists, run.json never stays at "preparing" or "running"."""
    console = console or make_console()
    transformers.utils.logging.disable_progress_bar()
    resume_from = check_resume(cfg, run_dir) if resume else None
    run_dir.mkdir(parents=True, exist_ok=True)
    previous = _read_status(run_dir) if resume else {}
    save_finetune_config(cfg, run_dir / "config.yaml")
    _write_status(run_dir, {"status": "preparing", **_carried(previous)})
    report: dict[str, Any] = {}
    state = {"status": "failed"}
    t_start = time.perf_counter()
    try:
        result = _run(cfg, run_dir, console, resume_from, report, state)
        return result
    except TrainingDivergedError:
        state["status"] = "diverged"
        raise
    except KeyboardInterrupt:
        state["status"] = "interrupted"
        raise
    except RunInterrupted:  # saved at a step boundary: run.json says "interrupted"
        raise
    except AttnLabError as e:
        report["error"] = str(e)
        raise
    except Exception as e:  # recorded, then passed on as it is
        report["error"] = f"{type(e).__name__}: {e}"
        raise
    finally:
        report["wall_s"] = round(time.perf_counter() - t_start + previous.get("wall_s", 0.0), 2)
        _write_status(run_dir, {**_carried(previous), "status": state["status"], **report})


def _carried(previous: dict) -> dict:
    """What a resumed run keeps from the run.json of its earlier segments."""
    return {k: previous[k] for k in ("style_control",) if k in previous}


def _run(cfg: FinetuneConfig, run_dir: Path, console: Console, resume_from: Path | None, report: dict, state: dict) -> FinetuneResult:
    p = prepare(cfg, console)
    steps = planned_steps(cfg, len(p.examples))
    run_cfg = cfg.model_copy(deep=True)
    run_cfg.train.max_steps = steps
    trainable, total = trainable_parameters(p.model)
    report.update({
        "base_model": str(p.where), "method": cfg.finetune.method, "target_modules": p.targets,
        "control_tokens": p.token_ids, "trainable_params": trainable, "total_params": total,
        "trainable_pct": round(100.0 * trainable / total, 4),
        "train_examples": len(p.train.examples), "train_truncated": p.train.truncated, "train_dropped": len(p.train.dropped),
        "train_rows": len(p.examples), "packing": cfg.data.packing, "max_steps": steps,
        "device": p.device, "precision": p.precision,
    })
    console.print(f"base {p.where.name}: {cfg.finetune.method} on {', '.join(p.targets)}; trainable {trainable:,} of {total:,} "
                  f"parameters ({report['trainable_pct']:.3f}%)", highlight=False)
    start_step = int(resume_from.name.split("-")[1]) if resume_from else 0
    # A run stopped at its last step (after the checkpoint, before its final adapter) resumes to finish: no steps,
    # the final adapter and the summary. One that finished, or that is past the steps asked for, is refused.
    if start_step > steps or (start_step == steps and (run_dir / "final").exists()):
        raise ConfigError(f"the run already reached step {start_step} (train.max_steps={steps}); to train further, resume with "
                          f"--set train.max_steps=N, N > {start_step}")

    # The control: the same style measurement on the untuned base (the adapter at its initial, identity
    # state; the control tokens at their initial rows), once, when the run starts.
    control_path = run_dir / CONTROL_FILE
    if resume_from is None:
        control_path.unlink(missing_ok=True)
        control = measure_style(cfg, p, _plain(p.model), console, "the untuned base")
        if control is not None:
            replace_file(control_path, json.dumps(control, indent=1) + "\n")
    else:
        control = json.loads(control_path.read_text()) if control_path.is_file() else None
    if control is not None:
        report["style_control"] = control
        if "style_separation" in control:
            console.print(f"style separation of the untuned base: {control['style_separation']:.2f}x "
                          f"(greedy, {control['max_new_tokens']} new tokens at most for every style)", highlight=False)

    has_val = p.val is not None and len(p.val.examples) > 0
    checkpoints = CheckpointManager(run_dir, keep_last=cfg.train.keep_last)
    checkpoints.clear_staging()
    logger = RunLogger(run_dir, resume_step=start_step)
    mean_len = sum(len(e["input_ids"]) for e in p.examples) / len(p.examples)
    tokens_per_step = int(cfg.train.batch_size * cfg.train.grad_accum * mean_len)
    bytes_per_token = (p.val.completion_bytes / max(p.val.completion_tokens, 1)) if has_val else None
    telemetry = TelemetryCallback(run_cfg, logger, p.tokenizer, bytes_per_token, console, tokens_per_step,
                                  _elapsed_at(run_dir, start_step), start_step)
    stopper = StopOnSignal()  # SIGINT / SIGTERM: save at the next step boundary, then stop
    callbacks: list[transformers.TrainerCallback] = [telemetry, _PeakRss(), stopper]
    evaluator = None
    if cfg.eval.tasks:
        evaluator = EvalDuringTraining(cfg.eval, p.tokenizer, logger, run_dir=run_dir, console=console)
        callbacks.append(_PlainModelEval(evaluator))
    args = training_arguments(run_cfg, SimpleNamespace(device=p.device, precision=p.precision), checkpoints.staging, has_val)
    args.dataloader_drop_last = len(p.examples) >= cfg.train.batch_size * 2
    trainer = FinetuneTrainer(
        model=p.model, args=args, train_dataset=ExampleDataset(p.examples),
        eval_dataset=ExampleDataset(p.val.examples[: cfg.train.eval_batches * cfg.train.batch_size]) if has_val else None,
        data_collator=PadCollator(p.tokenizer.pad_token_id), processing_class=p.tokenizer, callbacks=callbacks,
        checkpoints=checkpoints, run_config_yaml=finetune_config_to_yaml(cfg),
    )
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
    if resume_from is not None:
        console.print(f"resuming from [bold]{resume_from}[/bold]")
    state["status"] = "running"
    _write_status(run_dir, {"status": "running", **report})
    t0 = time.perf_counter()
    adapter_dir = run_dir / "final"
    stopper.install()
    try:
        trainer.train_or_finish(resume_from)
    finally:
        stopper.restore()
        telemetry.progress.stop()
        logger.close()
        checkpoints.clear_staging()
        state["status"] = "failed"
    if stopper.stopped_at is not None and trainer.state.global_step < trainer.state.max_steps:  # at the end: just finish
        state["status"] = "interrupted"
        raise RunInterrupted(
            f"stopped by {stopper.name} at step {stopper.stopped_at}; its checkpoint {checkpoints.newest()} is saved. "
            f"Continue with: attnlab finetune --resume --run-dir {run_dir}", exit_code=128 + int(stopper.signum))
    train_s = time.perf_counter() - t0
    history = [h for h in trainer.state.log_history if "loss" in h]
    peak_rss = next(c for c in callbacks if isinstance(c, _PeakRss)).peak
    report.update(
        steps=trainer.state.global_step, train_s=round(train_s, 2),
        final_loss=history[-1]["loss"] if history else None,
        final_loss_step=history[-1].get("step") if history else None,  # the last logged step (train.log_every)
        val_loss=telemetry.val_loss,
        tokens_per_s=round(tokens_per_step * (trainer.state.global_step - start_step) / max(train_s, 1e-9), 1),
        peak_cpu_rss_mib=round(peak_rss / MIB, 1),
    )
    if evaluator is not None and evaluator.latest:
        report["eval"] = evaluator.latest
        if evaluator.best is not None:
            report["best"] = {k: evaluator.best[k] for k in ("metric", "step", "value", "checkpoint")}
    if p.device == "cuda":
        report["peak_gpu_mem_gib"] = round(torch.cuda.max_memory_allocated() / MIB / 1024, 3)
    meta = {"base_model": cfg.base.path if cfg.base.path.startswith("pip:") else str(Path(cfg.base.path).expanduser().resolve()),
            "base_model_dir": str(Path(p.where).resolve()),
            "method": cfg.finetune.method, "control_tokens": p.token_ids, "generation_presets": cfg.finetune.generation,
            "chat_template": cfg.data.chat_template, "attnlab_version": attnlab.__version__}
    if cfg.finetune.method == "full":
        adapter.save_full_model(p.model, p.tokenizer, adapter_dir, meta, finetune_config_to_yaml(cfg))
    else:
        adapter.save_adapter(p.model, p.tokenizer, adapter_dir, meta, finetune_config_to_yaml(cfg))
    style = measure_style(cfg, p, _plain(p.model), console, "the tuned model")
    if style is not None:
        report["style"] = style
        if "style_separation" in style:
            report["style_separation"] = style["style_separation"]
    if control is not None and "style_separation" in control:
        report["style_separation_untuned"] = control["style_separation"]
    if cfg.finetune.merge and cfg.finetune.method != "full":
        report["merged_model"] = str(adapter.merge_adapter(adapter_dir, run_dir / "merged", cfg.base.trust_remote_code))
    state["status"] = "finished"
    return FinetuneResult(run_dir, adapter_dir, report)


class FinetuneTrainer(AttnLabTrainer):
    """AttnLabTrainer whose checkpoints of a peft model never hold the whole embedding matrices: the control
    tokens' rows travel in the adapter itself (peft trainable tokens), so peft's guess at whether the vocabulary
    changed (and its warning when it cannot tell) does not apply."""

    def _save(self, output_dir=None, state_dict=None):
        model = self.model
        if not hasattr(model, "peft_config"):
            return super()._save(output_dir, state_dict)
        model.save_pretrained = functools.partial(type(model).save_pretrained, model, save_embedding_layers=False)
        try:
            return super()._save(output_dir, state_dict)
        finally:
            del model.save_pretrained

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        """An adapter's checkpoint holds the adapter: Trainer's own loading (peft's) restores it."""
        if hasattr(model if model is not None else self.model, "peft_config"):
            return transformers.Trainer._load_from_checkpoint(self, resume_from_checkpoint, model)
        return super()._load_from_checkpoint(resume_from_checkpoint, model)


class _PeakRss(transformers.TrainerCallback):
    def __init__(self):
        self.peak = psutil.Process().memory_info().rss

    def on_step_end(self, args, state, control, **kw):
        self.peak = max(self.peak, psutil.Process().memory_info().rss)


class _PlainModelEval(transformers.TrainerCallback):
    """The eval section's tasks on the model being fine-tuned, with the base model's forward (peft's wrapper off)."""

    def __init__(self, evaluator):
        self.evaluator = evaluator

    def on_step_end(self, args, state, control, model=None, **kw):
        return self.evaluator.on_step_end(args, state, control, model=_plain(model) if model is not None else None, **kw)


def _read_status(run_dir: Path) -> dict:
    try:
        record = json.loads((run_dir / "run.json").read_text())
        return record if isinstance(record, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_status(run_dir: Path, record: dict) -> None:
    record = {**record, "attnlab_version": attnlab.__version__, "torch_version": torch.__version__,
              "transformers_version": transformers.__version__, "python": platform.python_version(),
              "updated": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    replace_file(run_dir / "run.json", json.dumps(record, indent=1, default=str))
