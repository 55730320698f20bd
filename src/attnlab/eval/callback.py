"""Evaluation during training: a `TrainerCallback` that runs the `eval` section's tasks every N steps
(generation tasks, perplexity, and the accuracy of a run on data.source=mqar on its evaluation stream).

Metrics go to `logger.validation_metrics(step, {"task/metric": value})`, predictions to
`run_dir/eval/step-NNNNNNN/<task>.jsonl`, every evaluation's metrics to `run_dir/eval/metrics.jsonl`,
and the best step by `best_metric` to `run_dir/best.json`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from attnlab.config.schema import EvalSection
from attnlab.data.mqar import EVAL, MqarDataset, mqar_accuracy
from attnlab.errors import ConfigError
from attnlab.generation import release_graphs
from attnlab.outputs import open_for_append, replace_file

from .runner import EvalResult, evaluate, evaluate_perplexity, resolve_data
from .tasks import get_task
from .tasks.perplexity import load_texts


MQAR_EXAMPLES = 256  # held-out examples of the mqar task when its limit is not given


class EvalDuringTraining(TrainerCallback):
    def __init__(self, section: EvalSection, tokenizer, logger, run_dir: str | Path | None = None, console=None, data=None):
        """`data`: the run's data section, which the mqar task takes its options from."""
        self.section, self.tokenizer, self.logger, self.console = section, tokenizer, logger, console
        self.run_dir = Path(run_dir if run_dir is not None else logger.run_dir)
        self.last_step: int | None = None
        self.latest: dict[str, float] = {}
        # Load every task's data now, so that bad paths fail before training starts.
        self.jobs: list[tuple[Any, Any, Any]] = []
        for spec in section.tasks:
            if spec.task == "mqar":
                if data is None or data.source != "mqar":
                    raise ConfigError("eval task mqar needs a run on data.source=mqar (its options are data.mqar)")
                # kept: the same held-out examples are read at every evaluation
                self.jobs.append((spec, "mqar", MqarDataset(data.mqar, data.seq_len, spec.limit or MQAR_EXAMPLES, EVAL, keep=True)))
            elif spec.task == "perplexity":
                load_texts(resolve_data("perplexity", spec.data), spec.split)
                self.jobs.append((spec, None, None))
            else:
                task = get_task(spec.task, spec.template)
                self.jobs.append((spec, task, task.load(resolve_data(spec.task, spec.data), spec.split, spec.limit)))
        self.best = self._read_best()

    @property
    def best_path(self) -> Path:
        return self.run_dir / "best.json"

    def _read_best(self) -> dict[str, Any] | None:
        if self.best_path.is_file():
            best = json.loads(self.best_path.read_text())
            if best.get("metric") == self.section.best_metric and best.get("mode") == self.section.best_mode:
                return best
        return None

    def on_step_end(self, args, state, control, model=None, **kwargs):
        step = state.global_step
        every = self.section.every
        due = (every > 0 and step % every == 0) or step >= state.max_steps
        if not self.jobs or not due or step == self.last_step or not state.is_world_process_zero:
            return
        self.run(model, step)

    def run(self, model, step: int) -> dict[str, float]:
        """Evaluate every task on `model` (in eval mode, without gradients), log, and update best.json."""
        model = getattr(model, "module", model)  # DDP / DataParallel wrappers
        was_training = model.training
        model.eval()
        metrics: dict[str, float] = {}
        out_dir = self.run_dir / "eval" / f"step-{step:07d}"
        try:
            with torch.no_grad():
                for spec, task, examples in self.jobs:
                    if task == "mqar":
                        result = EvalResult("mqar", mqar_accuracy(model, examples, self.section.generation.get("batch_size", 32)))
                    elif task is None:
                        result = evaluate_perplexity(model, self.tokenizer, resolve_data("perplexity", spec.data), spec.split, spec.limit,
                                                     batch_size=self.section.generation.get("batch_size", 8))
                    else:
                        result = evaluate(model, self.tokenizer, task, examples=examples, generation=self.section.generation)
                        out_dir.mkdir(parents=True, exist_ok=True)
                        replace_file(out_dir / f"{spec.task}.jsonl",
                                     "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in result.records))
                    metrics.update(result.prefixed())
        finally:
            if was_training:
                model.train()
            release_graphs(model)  # the decode graphs and buffers would otherwise sit in memory through training
        self.last_step, self.latest = step, metrics
        self.logger.validation_metrics(step, metrics)
        (self.run_dir / "eval").mkdir(parents=True, exist_ok=True)
        with open_for_append(self.run_dir / "eval" / "metrics.jsonl") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        self._update_best(step, metrics)
        if self.console is not None:
            shown = ", ".join(f"{k} {v:.4g}" for k, v in metrics.items() if not k.endswith(("/examples", "/scored", "/tokens", "/bytes")))
            self.console.print(f"step {step}: {shown}", highlight=False)
        return metrics

    def _update_best(self, step: int, metrics: dict[str, float]) -> None:
        name = self.section.best_metric
        if name is None or name not in metrics or math.isnan(metrics[name]):
            return
        value = metrics[name]
        if self.best is not None:
            better = value > self.best["value"] if self.section.best_mode == "max" else value < self.best["value"]
            if not better:
                return
        self.best = {"metric": name, "mode": self.section.best_mode, "step": step, "value": value,
                     "checkpoint": f"checkpoints/step-{step:07d}", "metrics": metrics}
        replace_file(self.best_path, json.dumps(self.best, indent=1) + "\n")
