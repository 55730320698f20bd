"""Evaluation tasks by name. Generation tasks load their official layout; perplexity scores text."""

from __future__ import annotations

from pathlib import Path

from attnlab.config.tasks import GENERATION_TASK_NAMES, TASK_NAMES, task_name  # noqa: F401  (the names configs use)
from attnlab.errors import ConfigError

from .base import Example, Task
from .dart import DartTask
from .samsum import SamsumTask
from .spider import SpiderTask

GENERATION_TASKS: dict[str, type[Task]] = {"spider": SpiderTask, "dart": DartTask, "samsum": SamsumTask}  # one per GENERATION_TASK_NAMES
FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
BUNDLED = {"spider": FIXTURES / "spider", "dart": FIXTURES / "dart", "samsum": FIXTURES / "samsum",
           "perplexity": FIXTURES / "perplexity.txt"}


def get_task(name: str, template: str | None = None) -> Task:
    key = task_name(name)
    if key == "perplexity":
        raise ConfigError("perplexity is not a generation task")
    if key == "mqar":
        raise ConfigError("mqar is evaluated during training on data.source=mqar (its accuracy is in the run's eval metrics), "
                          "not by attnlab eval; for recall of a trained model use --task niah")
    return GENERATION_TASKS[key](template=template)


__all__ = ["Example", "Task", "SpiderTask", "DartTask", "SamsumTask", "GENERATION_TASKS", "TASK_NAMES", "BUNDLED", "task_name", "get_task"]
