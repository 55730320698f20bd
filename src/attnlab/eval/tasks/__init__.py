"""Evaluation tasks by name. Generation tasks load their official layout; perplexity scores text."""

from __future__ import annotations

from pathlib import Path

from attnlab.errors import ConfigError

from .base import Example, Task
from .dart import DartTask
from .samsum import SamsumTask
from .spider import SpiderTask

GENERATION_TASKS: dict[str, type[Task]] = {"spider": SpiderTask, "dart": DartTask, "samsum": SamsumTask}
ALIASES = {"text-to-sql": "spider", "sql": "spider", "data-to-text": "dart", "summarization": "samsum",
           "summarisation": "samsum", "ppl": "perplexity", "bpb": "perplexity"}
TASK_NAMES = (*GENERATION_TASKS, "perplexity", "mqar")  # mqar: during training on data.source=mqar only
FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
BUNDLED = {"spider": FIXTURES / "spider", "dart": FIXTURES / "dart", "samsum": FIXTURES / "samsum",
           "perplexity": FIXTURES / "perplexity.txt"}


def task_name(name: str) -> str:
    """The canonical name of a task, or a ConfigError listing the valid ones."""
    key = ALIASES.get(name.strip().lower(), name.strip().lower())
    if key not in TASK_NAMES:
        raise ConfigError(f"unknown task {name!r}; choose one of {', '.join(TASK_NAMES)}")
    return key


def get_task(name: str, template: str | None = None) -> Task:
    key = task_name(name)
    if key == "perplexity":
        raise ConfigError("perplexity is not a generation task")
    if key == "mqar":
        raise ConfigError("mqar is evaluated during training on data.source=mqar (its accuracy is in the run's eval metrics), "
                          "not by attnlab eval; for recall of a trained model use --task niah")
    return GENERATION_TASKS[key](template=template)


__all__ = ["Example", "Task", "SpiderTask", "DartTask", "SamsumTask", "GENERATION_TASKS", "TASK_NAMES", "BUNDLED", "task_name", "get_task"]
