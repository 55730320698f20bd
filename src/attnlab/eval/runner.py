"""Evaluate a loaded model on a task, or score predictions made elsewhere, with the same scorer.

    result = evaluate(model, tokenizer, "spider", "path/to/spider", limit=100)
    result.metrics        # {"execution_accuracy": 0.41, "exact_match": 0.2, ...}
    result.records        # one dict per example: prompt, prediction, references, scores, finish_reason

Generation goes through attnlab's engine (batched, left-padded by the engine), whose texts are
already without the prompt and special tokens; `clean_prediction` removes both once more, so
predictions from other systems are scored exactly as ours are.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from attnlab.config import GenerateConfig, load_config
from attnlab.config.presets import token_in
from attnlab.data.corpus import jsonl_records, text_lines
from attnlab.errors import DataError
from attnlab.outputs import prepare_output_dir, write_text_atomic

from .metrics import clean_prediction
from .tasks import BUNDLED, Example, Task, get_task, task_name


@dataclass
class EvalResult:
    task: str
    metrics: dict[str, Any]
    records: list[dict[str, Any]] = field(default_factory=list)
    data: str = ""

    def prefixed(self) -> dict[str, float]:
        """Numeric metrics as {"task/metric": value}, for loggers (missing values left out)."""
        return {f"{self.task}/{k}": float(v) for k, v in self.metrics.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool)}


def resolve_data(task: str, data: str | Path | None) -> Path:
    """The data path, or the task's bundled fixture when none is given."""
    return BUNDLED[task_name(task)] if data is None else Path(data)


def generation_config(task: Task, settings: GenerateConfig | dict[str, Any] | None) -> GenerateConfig:
    """The task's defaults (e.g. max_new_tokens, stop strings) overridden by the settings given explicitly."""
    from attnlab.generation.engine import resolve_config

    if isinstance(settings, GenerateConfig):
        explicit = {k: getattr(settings, k) for k in settings.model_fields_set}
    else:
        explicit = dict(settings or {})
    return resolve_config({**task.generation_defaults, **explicit})


def _generate_with_presets(model, tokenizer, task, examples, prompts, presets, generation, progress):
    """Prompts carrying a control token decode with that token's preset: task defaults, then the
    adapter's 'default' and token presets, then the settings given explicitly."""
    from attnlab.generation import generate

    explicit = ({k: getattr(generation, k) for k in generation.model_fields_set} if isinstance(generation, GenerateConfig)
                else dict(generation or {}))
    groups: dict[str | None, list[int]] = {}
    for i, ex in enumerate(examples):
        groups.setdefault(token_in(ex.prompt, presets), []).append(i)
    results: list = [None] * len(examples)
    for token, idx in groups.items():
        settings = {**presets.get("default", {}), **(presets.get(token, {}) if token else {}), **explicit}
        for i, r in zip(idx, generate(model, tokenizer, [prompts[i] for i in idx], generation_config(task, settings), progress=progress)):
            results[i] = r
    return results


def _special_tokens(tokenizer) -> list[str]:
    return [t for t in getattr(tokenizer, "all_special_tokens", []) if t]


def _chat_prompt(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def evaluate(
    model,
    tokenizer,
    task: str | Task,
    data: str | Path | None = None,
    split: str = "dev",
    limit: int | None = None,
    generation: GenerateConfig | dict[str, Any] | None = None,
    template: str | None = None,
    chat: bool = False,
    progress: Callable[[int], None] | None = None,
    examples: Sequence[Example] | None = None,
) -> EvalResult:
    """Generate for every example of `task` and score the predictions."""
    from attnlab.generation import generate

    task = task if isinstance(task, Task) else get_task(task, template)
    if examples is None:
        examples = task.load(resolve_data(task.name, data), split, limit)
    if not examples:
        raise DataError(f"no {task.name} examples to evaluate in {data}")
    cfg = generation_config(task, generation)
    if chat and not getattr(tokenizer, "chat_template", None):
        raise DataError("chat prompts need a tokenizer with a chat template; this one has none")
    prompts = [_chat_prompt(tokenizer, ex.prompt) if chat else ex.prompt for ex in examples]
    presets = getattr(model, "attnlab_generation_presets", None) or {}  # a fine-tuned adapter's per-token settings
    if presets:
        results = _generate_with_presets(model, tokenizer, task, examples, prompts, presets, generation, progress)
    else:
        results = generate(model, tokenizer, prompts, cfg, progress=progress)
    specials = _special_tokens(tokenizer)
    predictions = [task.postprocess(clean_prediction(r.text, ex.prompt, specials)) for r, ex in zip(results, examples)]
    return _scored(task, examples, predictions, [r.finish_reason for r in results], str(data or ""))


def _scored(task: Task, examples: Sequence[Example], predictions: list[str], finish: Sequence[str | None], data: str) -> EvalResult:
    metrics, per_example = task.score(examples, predictions)
    records = [
        {"id": ex.id, "prompt": ex.prompt, "prediction": pred, "references": ex.references, "scores": scores, "finish_reason": reason}
        for ex, pred, scores, reason in zip(examples, predictions, per_example, finish)
    ]
    return EvalResult(task.name, metrics, records, data)


def read_predictions(path: Path, examples: Sequence[Example]) -> list[str]:
    """Predictions aligned with `examples`: one per line in order, or JSONL objects with an "id"."""
    if not path.is_file():
        raise DataError(f"predictions file not found: {path}")
    try:
        lines = text_lines(path.read_text(encoding="utf-8-sig"))
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read predictions {path}: {e}") from None
    first = next((line for line in lines if line.strip()), "")
    as_jsonl = path.suffix == ".jsonl" or first.lstrip().startswith("{")
    if not as_jsonl:
        if lines and lines[-1] == "":
            lines = lines[:-1]
        if len(lines) != len(examples):
            raise DataError(f"{path} has {len(lines)} lines but there are {len(examples)} examples; "
                            "give one prediction per line, in the data's order (or JSONL with an \"id\")")
        return lines
    by_id: dict[str, str] = {}
    for n, row in jsonl_records("\n".join(lines), path):
        text = next((row[k] for k in ("prediction", "text", "sql") if isinstance(row, dict) and isinstance(row.get(k), str)), None)
        if not isinstance(row, dict) or "id" not in row or text is None:
            raise DataError(f'{path}, line {n}: expected an object with "id" and "prediction", e.g. {{"id": "0", "prediction": "..."}}')
        by_id[str(row["id"])] = text
    missing = [ex.id for ex in examples if ex.id not in by_id]
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise DataError(f"{path} has no prediction for {len(missing)} of {len(examples)} examples (ids {shown}); "
                        "ids are the data's \"id\" fields, or 0-based positions when the data has none")
    return [by_id[ex.id] for ex in examples]


def score(task: str | Task, predictions: Path | Sequence[str], data: str | Path | None = None, split: str = "dev",
          limit: int | None = None, template: str | None = None) -> EvalResult:
    """Score predictions made elsewhere with attnlab's scorer (the role of an official evaluator)."""
    task = task if isinstance(task, Task) else get_task(task, template)
    examples = task.load(resolve_data(task.name, data), split, limit)
    raw = read_predictions(Path(predictions), examples) if isinstance(predictions, (str, Path)) else list(predictions)
    if len(raw) != len(examples):
        raise DataError(f"{len(raw)} predictions for {len(examples)} examples")
    cleaned = []
    for ex, text in zip(examples, raw):
        db_id = ex.meta.get("db_id")
        if db_id and text.rstrip().endswith("\t" + db_id):  # Spider's "SQL<TAB>db_id" lines
            text = text.rstrip()[: -len(db_id) - 1]
        cleaned.append(task.postprocess(clean_prediction(text, ex.prompt)))
    return _scored(task, examples, cleaned, [None] * len(examples), str(data or ""))


def evaluate_perplexity(model, tokenizer, data: str | Path | None = None, split: str = "dev", limit: int | None = None,
                        seq_len: int | None = None, batch_size: int = 8, progress: Callable[[int], None] | None = None) -> EvalResult:
    from .tasks.perplexity import load_texts, perplexity

    path = resolve_data("perplexity", data)
    texts, described = load_texts(path, split)
    if seq_len is None:
        seq_len = _default_seq_len(model, path)
    metrics = perplexity(model, tokenizer, texts, seq_len=seq_len, batch_size=batch_size, limit=limit, progress=progress)
    metrics["seq_len"] = seq_len
    return EvalResult("perplexity", metrics, [], described)


def _default_seq_len(model, path: Path) -> int:
    if path.suffix in (".yaml", ".yml"):
        return load_config(path).data.seq_len
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None) or 1024
    return int(min(limit, 1024))


def write_outputs(result: EvalResult, out_dir: Path, extra: dict[str, Any] | None = None) -> tuple[Path, Path]:
    """metrics.json and predictions.jsonl in `out_dir`, each written to a temporary name and renamed."""
    out_dir = prepare_output_dir(out_dir)
    metrics_path, predictions_path = out_dir / "metrics.json", out_dir / "predictions.jsonl"
    payload = {"task": result.task, "data": result.data, "metrics": result.metrics, **(extra or {})}
    for path, text in ((predictions_path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in result.records)),
                       (metrics_path, json.dumps(payload, indent=1, ensure_ascii=False) + "\n")):
        write_text_atomic(path, text, what="the eval output")
    return metrics_path, predictions_path
