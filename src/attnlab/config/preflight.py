"""The preflight report, and the preflight rules that read a run config alone (with the devices and the
processes there are): checkpoint cadence, device and precision, process count, sharding strategy.
The checks that read the run directory, the tokenizer, the model and the data are attnlab.train.preflight's.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from attnlab.launch import world_size

from .schema import RunConfig

LONG_RUN_STEPS = 1000  # runs at least this long must checkpoint; long CUDA runs get precision/memory checks


@dataclass
class Problem:
    level: Literal["error", "warning"]
    key: str
    message: str


@dataclass
class PreflightReport:
    problems: list[Problem] = field(default_factory=list)
    device: str = "cpu"
    precision: str = "fp32"
    tokenizer: Any = None
    data: Any = None
    model_config: Any = None
    resume_from: Path | None = None
    init_from: tuple[str, str] | None = None  # (kind, model directory) of train.init_from: 'attnlab' or 'hf'
    notes: list[str] = field(default_factory=list)  # facts worth knowing that are not problems (e.g. the LR on resume)

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if p.level == "error"]

    def error(self, key: str, message: str) -> None:
        self.problems.append(Problem("error", key, message))

    def warn(self, key: str, message: str) -> None:
        self.problems.append(Problem("warning", key, message))


def resolve_device(cfg: RunConfig) -> tuple[str, str]:
    device = cfg.train.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    precision = cfg.train.precision
    if precision == "auto":
        precision = "bf16" if device == "cuda" else "fp32"
    return device, precision


def check_config(cfg: RunConfig, report: PreflightReport) -> None:
    """The rules that read the config alone, in this order: process count, checkpoint cadence, device and
    precision, sharding strategy."""
    _check_world_size(cfg, report)
    _check_cadence(cfg, report)
    _check_device(cfg, report)
    _check_strategy(cfg, report)


def _check_world_size(cfg: RunConfig, report: PreflightReport) -> None:
    world = world_size()
    if world > 1 and cfg.train.batch_size % world:
        report.error("train.batch_size", f"train.batch_size ({cfg.train.batch_size}) is the global batch and must divide evenly across the {world} processes")


def _check_cadence(cfg: RunConfig, report: PreflightReport) -> None:
    t = cfg.train
    if t.max_steps >= LONG_RUN_STEPS and (t.save_every == 0 or t.save_every > t.max_steps):
        report.error("train.save_every", f"a run of {t.max_steps} steps with no checkpoint before its end: a crash loses all of it. Set train.save_every (e.g. {max(t.max_steps // 10, 1)}).")
    elif cfg.train.profile == "production" and t.save_every == 0:
        report.error("train.save_every", "the production profile needs checkpoints: set train.save_every > 0")
    if t.eval_every > t.max_steps:
        report.warn("train.eval_every", f"eval_every ({t.eval_every}) > max_steps ({t.max_steps}): validation only at the end")


def _check_device(cfg: RunConfig, report: PreflightReport) -> None:
    t = cfg.train
    if t.wandb and importlib.util.find_spec("wandb") is None:
        report.error("train.wandb", "train.wandb is on but wandb is not installed: pip install 'attnlab[wandb]' (and set WANDB_API_KEY), or turn it off.")
    if report.device == "cuda" and not torch.cuda.is_available():
        report.error("train.device", "train.device is 'cuda' but no CUDA device is visible. Use train.device=auto or cpu.")
        return
    gpus = torch.cuda.device_count() if report.device == "cuda" else 0
    if gpus > 1 and world_size() == 1:
        report.warn("train.device", f"{gpus} GPUs are visible but one process trains on one of them (train.batch_size is "
                    f"not multiplied). To train on all {gpus}: torchrun --nproc_per_node {gpus} -m attnlab.cli train ...")
    if report.device == "cpu" and report.precision == "bf16":
        report.warn("train.precision", "bf16 on CPU is slow and gains nothing; use fp32 (train.precision=auto)")
    long_cuda = report.device == "cuda" and t.max_steps >= LONG_RUN_STEPS
    level = "error" if cfg.train.profile == "production" else "warning"
    if long_cuda and report.precision == "fp32":
        report.problems.append(Problem(level, "train.precision", f"a {t.max_steps}-step CUDA run in fp32: roughly half the speed and twice the memory of bf16. Set train.precision=bf16."))
    if long_cuda and not t.gradient_checkpointing:
        report.problems.append(Problem(level, "train.gradient_checkpointing", "a long CUDA run without gradient checkpointing: activations bound the batch and sequence length. Set train.gradient_checkpointing=true."))
    if cfg.train.profile == "production" and report.device != "cuda":
        report.error("train.profile", "the production profile is for CUDA runs, but this run would train on CPU")


def _check_strategy(cfg: RunConfig, report: PreflightReport) -> None:
    """FSDP runs as accelerate's FSDP2: on CUDA devices only (accelerate runs several CPU processes as DDP
    over gloo and drops an FSDP plugin without a word). Every torch attnlab supports (>= 2.11) has FSDP2."""
    if cfg.train.strategy != "fsdp":
        return
    world = world_size()
    if world == 1:
        report.warn("train.strategy", "train.strategy=fsdp with one process: nothing to shard, so it trains as one process. "
                    "Launch under torchrun --nproc_per_node N (N > 1) to shard.")
        return
    if report.device != "cuda":
        report.error("train.strategy", f"train.strategy=fsdp needs CUDA devices, but these {world} processes would train on CPU, where "
                     "accelerate runs DDP whatever the strategy. Use train.strategy=ddp on CPU, or train on GPUs.")
    if cfg.eval.tasks:
        report.error("eval.tasks", "evaluation tasks during training decode on rank 0 alone, which a model sharded by "
                     "train.strategy=fsdp cannot do. Use train.strategy=ddp, or evaluate the final model with attnlab eval.")
