"""The evaluation tasks by name, as configs and `attnlab eval --task` name them (attnlab.eval.tasks implements
each; the eval tests hold the two lists together)."""

from __future__ import annotations

from attnlab.errors import ConfigError

GENERATION_TASK_NAMES = ("spider", "dart", "samsum")
ALIASES = {"text-to-sql": "spider", "sql": "spider", "data-to-text": "dart", "summarization": "samsum",
           "summarisation": "samsum", "ppl": "perplexity", "bpb": "perplexity"}
TASK_NAMES = (*GENERATION_TASK_NAMES, "perplexity", "mqar")  # mqar: during training on data.source=mqar only


def task_name(name: str) -> str:
    """The canonical name of a task, or a ConfigError listing the valid ones."""
    key = ALIASES.get(name.strip().lower(), name.strip().lower())
    if key not in TASK_NAMES:
        raise ConfigError(f"unknown task {name!r}; choose one of {', '.join(TASK_NAMES)}")
    return key
