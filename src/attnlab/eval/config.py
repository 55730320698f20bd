"""The `eval` section of train and finetune configs: which tasks to run during training, how often,
with which decoding settings, and which metric picks the best checkpoint.

    eval:
      every: 200                       # steps; 0 = only at the end
      tasks:
        - {task: spider, data: data/spider, limit: 100}
        - {task: perplexity, data: data/heldout.txt, limit: 16}
      generation: {max_new_tokens: 128, batch_size: 16}
      best_metric: spider/execution_accuracy
      best_mode: max
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

# This module imports nothing from attnlab.config at import time, so that the run config schema can
# import EvalSection without an import cycle.
from attnlab.sections import Section


class EvalTaskSpec(Section):
    """One task evaluated during training."""

    task: str = Field(..., description="spider, dart, samsum, perplexity, or mqar (runs on data.source=mqar)")
    data: str | None = Field(None, description="the task's data in its official layout; null = the bundled fixture")
    split: str = Field("dev", description="split to evaluate (dev, test, train)")
    limit: int | None = Field(None, gt=0, description="first N examples (perplexity: windows; mqar: held-out examples, null = 256); null = all")
    template: str | None = Field(None, description="prompt template; null = the task's default")

    @field_validator("task")
    @classmethod
    def _known(cls, value: str) -> str:
        from .tasks import TASK_NAMES, task_name
        from attnlab.errors import ConfigError

        try:
            return task_name(value)
        except ConfigError:
            raise ValueError(f"unknown task {value!r}; choose one of {', '.join(TASK_NAMES)}") from None


class EvalSection(Section):
    """Evaluation on generation tasks and perplexity during training."""

    tasks: list[EvalTaskSpec] = Field(default_factory=list, description="tasks to evaluate; empty = none")
    every: int = Field(0, ge=0, description="evaluate every N optimizer steps (and at the end); 0 = only at the end")
    generation: dict[str, Any] = Field(default_factory=dict, description="decoding settings as for attnlab generate, e.g. {max_new_tokens: 128}; the task's defaults fill the rest")
    best_metric: str | None = Field(None, description="'task/metric' that picks the best step, e.g. spider/execution_accuracy")
    best_mode: Literal["max", "min"] = Field("max", description="whether a larger or a smaller best_metric is better")

    @field_validator("generation")
    @classmethod
    def _valid_generation(cls, value: dict[str, Any]) -> dict[str, Any]:
        from attnlab.config.schema import GenerateConfig

        GenerateConfig(**value)  # unknown keys and impossible settings fail here, with GenerateConfig's messages
        return value

    @model_validator(mode="after")
    def _best_metric_is_evaluated(self) -> "EvalSection":
        if self.best_metric is not None:
            task, sep, metric = self.best_metric.partition("/")
            names = [t.task for t in self.tasks]
            if not sep or not metric:
                raise ValueError(f"best_metric must look like 'task/metric', e.g. 'spider/execution_accuracy', not {self.best_metric!r}")
            if task not in names:
                raise ValueError(f"best_metric {self.best_metric!r} names task {task!r}, which is not in eval.tasks ({', '.join(names) or 'none'})")
        return self
