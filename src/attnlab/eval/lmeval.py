"""lm-evaluation-harness on an already loaded model, offline (the optional `lmeval` extra).

The model object and its tokenizer are handed to lm-eval's `HFLM` wrapper, so lm-eval never
loads anything itself; tasks come from lm-eval's registry or from local YAML task files
(`include_path`) whose data are local files.
"""

from __future__ import annotations

import os
from typing import Any

from attnlab.errors import ConfigError

MISSING = ("--lm-eval needs lm-evaluation-harness, which is not installed. "
           "Install the optional extra: pip install 'attnlab[lmeval]'")


def require_lm_eval() -> None:
    """Fail with one message naming the extra when lm-eval is missing (checked before a model loads)."""
    import importlib.util

    if importlib.util.find_spec("lm_eval") is None:
        raise ConfigError(MISSING)


def run_lm_eval(model, tokenizer, tasks: list[str], limit: int | None = None, include_path: str | None = None,
                batch_size: int = 8) -> dict[str, float]:
    """{"lmeval/<task>/<metric>": value} from `lm_eval.simple_evaluate` on `model`."""
    for knob in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(knob, "1")
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise ConfigError(MISSING) from None
    wrapped = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=str(next(model.parameters()).device))
    manager = TaskManager(include_path=include_path) if include_path else TaskManager()
    try:
        out: dict[str, Any] = lm_eval.simple_evaluate(model=wrapped, tasks=tasks, limit=limit, task_manager=manager)
    except (KeyError, ValueError, FileNotFoundError, ConnectionError) as e:
        raise ConfigError(f"lm-eval could not run {', '.join(tasks)} offline: {e}. "
                          "Use tasks whose data are local files (--lm-eval-include DIR with task YAMLs).") from None
    metrics = {}
    for task, values in (out or {}).get("results", {}).items():
        for key, value in values.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                metrics[f"lmeval/{task}/{key.replace(',none', '')}"] = float(value)
    return metrics
