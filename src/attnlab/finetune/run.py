"""`attnlab finetune`: base model + control tokens + peft, trained on prompt–completion data with the
same Trainer, checkpoints and telemetry as `attnlab train`; the result is an adapter directory (RUN/final)."""

from __future__ import annotations

import json
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
from attnlab.errors import DataError, TrainingDivergedError

from .config import FinetuneConfig, finetune_config_to_yaml, save_finetune_config

MIB = 1024 * 1024


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
    from .data import encode_rows, read_rows
    from .model import add_control_tokens, load_base, quantization_config, wrap_with_peft

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
    val = None
    if val_rows:
        val = encode_rows(tokenizer, val_rows, cfg.data.max_len, cfg.data.chat_template, cfg.data.add_eos)
        console.print(val.summary("val data"), highlight=False)
    if cfg.train.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        if hasattr(model, "enable_input_require_grads"):
            model.enable_input_require_grads()
    transformers.set_seed(cfg.train.seed)
    peft_model, targets = wrap_with_peft(model, cfg.finetune, list(token_ids.values()), cfg.train.gradient_checkpointing)
    return SimpleNamespace(device=device, precision=_precision(cfg, device), model=peft_model, tokenizer=tokenizer, where=where,
                           token_ids=token_ids, train=train, val=val, eval_rows=eval_rows, targets=targets)


def eval_prompts(rows: list[dict]) -> list[str]:
    return [r["prompt"] if "prompt" in r else next(m["content"] for m in reversed(r["messages"]) if m["role"] == "user") for r in rows]


def run_finetune(cfg: FinetuneConfig, run_dir: Path, console: Console | None = None) -> FinetuneResult:
    from transformers import TrainerCallback

    from attnlab.train.checkpoint import CheckpointManager
    from attnlab.train.loop import AttnLabTrainer, TelemetryCallback, training_arguments
    from attnlab.train.telemetry import RunLogger

    from .adapter import merge_adapter, save_adapter
    from .data import ExampleDataset, PadCollator
    from .model import trainable_parameters
    from .presets import style_separation

    console = console or Console()
    transformers.utils.logging.disable_progress_bar()
    run_dir.mkdir(parents=True, exist_ok=True)
    save_finetune_config(cfg, run_dir / "config.yaml")
    _write_status(run_dir, {"status": "preparing"})
    t_start = time.perf_counter()
    p = prepare(cfg, console)
    trainable, total = trainable_parameters(p.model)
    report: dict[str, Any] = {
        "base_model": str(p.where), "method": cfg.finetune.method, "target_modules": p.targets,
        "control_tokens": p.token_ids, "trainable_params": trainable, "total_params": total,
        "trainable_pct": round(100.0 * trainable / total, 4),
        "train_examples": len(p.train.examples), "train_truncated": p.train.truncated, "train_dropped": len(p.train.dropped),
        "device": p.device, "precision": p.precision,
    }
    console.print(f"base {p.where.name}: {cfg.finetune.method} on {', '.join(p.targets)}; trainable {trainable:,} of {total:,} "
                  f"parameters ({report['trainable_pct']:.3f}%)", highlight=False)
    has_val = p.val is not None and len(p.val.examples) > 0
    checkpoints = CheckpointManager(run_dir, keep_last=cfg.train.keep_last)
    checkpoints.clear_staging()
    logger = RunLogger(run_dir)
    mean_len = sum(len(e["input_ids"]) for e in p.train.examples) / len(p.train.examples)
    tokens_per_step = int(cfg.train.batch_size * cfg.train.grad_accum * mean_len)
    bytes_per_token = (p.val.completion_bytes / max(p.val.completion_tokens, 1)) if has_val else None
    telemetry = TelemetryCallback(cfg, logger, p.tokenizer, bytes_per_token, console, tokens_per_step, 0.0, 0)
    args = training_arguments(cfg, SimpleNamespace(device=p.device, precision=p.precision), checkpoints.staging, has_val)
    args.dataloader_drop_last = len(p.train.examples) >= cfg.train.batch_size * 2
    trainer = AttnLabTrainer(
        model=p.model, args=args, train_dataset=ExampleDataset(p.train.examples),
        eval_dataset=ExampleDataset(p.val.examples[: cfg.train.eval_batches * cfg.train.batch_size]) if has_val else None,
        data_collator=PadCollator(p.tokenizer.pad_token_id), processing_class=p.tokenizer, callbacks=[telemetry],
        checkpoints=checkpoints, run_config_yaml=finetune_config_to_yaml(cfg),
    )
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
    _write_status(run_dir, {"status": "running", **report})
    peak_rss = _PeakRss()
    trainer.add_callback(peak_rss)
    t0 = time.perf_counter()
    status = "failed"
    adapter_dir = run_dir / "final"
    try:
        trainer.train()
        train_s = time.perf_counter() - t0
        history = [h for h in trainer.state.log_history if "loss" in h]
        report.update(
            steps=trainer.state.global_step, train_s=round(train_s, 2),
            final_loss=history[-1]["loss"] if history else None,
            val_loss=telemetry.val_loss,
            tokens_per_s=round(tokens_per_step * trainer.state.global_step / max(train_s, 1e-9), 1),
            peak_cpu_rss_mib=round(peak_rss.peak / MIB, 1),
        )
        if p.device == "cuda":
            report["peak_gpu_mem_gib"] = round(torch.cuda.max_memory_allocated() / MIB / 1024, 3)
        meta = {"base_model": cfg.base.path if cfg.base.path.startswith("pip:") else str(Path(cfg.base.path).expanduser().resolve()),
                "method": cfg.finetune.method, "control_tokens": p.token_ids, "generation_presets": cfg.finetune.generation,
                "chat_template": cfg.data.chat_template, "attnlab_version": attnlab.__version__}
        save_adapter(p.model, p.tokenizer, adapter_dir, meta, finetune_config_to_yaml(cfg))
        if p.eval_rows and len(cfg.finetune.control_tokens) >= 1:
            base = p.model.get_base_model()
            base.eval()
            prompts = eval_prompts(p.eval_rows)[: cfg.finetune.eval_max_prompts * max(1, len(cfg.finetune.control_tokens))]
            t_eval = time.perf_counter()
            sep = style_separation(base, p.tokenizer, prompts, cfg.finetune.control_tokens, cfg.finetune.generation, cfg.data.chat_template)
            report["style"] = {**sep, "eval_s": round(time.perf_counter() - t_eval, 2)}
            if "style_separation" in sep:
                report["style_separation"] = sep["style_separation"]
        if cfg.finetune.merge:
            report["merged_model"] = str(merge_adapter(adapter_dir, run_dir / "merged", cfg.base.trust_remote_code))
        status = "finished"
    except TrainingDivergedError:
        status = "diverged"
        raise
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    finally:
        telemetry.progress.stop()
        logger.close()
        checkpoints.clear_staging()
        report["wall_s"] = round(time.perf_counter() - t_start, 2)
        _write_status(run_dir, {"status": status, **report})
    return FinetuneResult(run_dir, adapter_dir, report)


class _PeakRss(transformers.TrainerCallback):
    def __init__(self):
        self.peak = psutil.Process().memory_info().rss

    def on_step_end(self, args, state, control, **kw):
        self.peak = max(self.peak, psutil.Process().memory_info().rss)


def _write_status(run_dir: Path, record: dict) -> None:
    record = {**record, "attnlab_version": attnlab.__version__, "torch_version": torch.__version__,
              "transformers_version": transformers.__version__, "python": platform.python_version(),
              "updated": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    tmp = run_dir / "run.json.tmp"
    tmp.write_text(json.dumps(record, indent=1, default=str))
    tmp.replace(run_dir / "run.json")
