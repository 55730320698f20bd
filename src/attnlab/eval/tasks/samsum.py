"""Dialogue summarisation in the SAMSum layout, scored by ROUGE-1/2/L F1 (rouge-score, stemmed).

Layout (as released): a JSON list of items with `id`, `dialogue` and `summary`
(train.json / val.json / test.json).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from attnlab.errors import DataError

from ..metrics import mean, rouge
from .base import Example, Task, find_split_file, read_json_list, require_keys

LAYOUT = "a SAMSum JSON file (items with 'dialogue' and 'summary') or a directory holding val.json / test.json / train.json"


class SamsumTask(Task):
    name = "samsum"
    description = "summarisation (SAMSum layout): ROUGE-1/2/L F1"
    template = "Dialogue:\n{dialogue}\nSummary:"
    fields = ("dialogue",)
    generation_defaults = {"max_new_tokens": 64, "stop": ["\n"]}

    def load(self, data: Path, split: str = "dev", limit: int | None = None) -> list[Example]:
        path = find_split_file(Path(data), split, "samsum", LAYOUT)
        items = read_json_list(path, "SAMSum dialogues")
        if limit is not None:
            items = items[:limit]
        examples = []
        for n, item in enumerate(items):
            require_keys(item, ("dialogue", "summary"), f"{path.name}, item {n}", "SAMSum")
            if not isinstance(item["dialogue"], str) or not isinstance(item["summary"], str):
                raise DataError(f"{path.name}, item {n}: 'dialogue' and 'summary' must be strings")
            dialogue = "\n".join(line.strip() for line in item["dialogue"].replace("\r\n", "\n").split("\n") if line.strip())
            examples.append(Example(str(item.get("id", n)), self.render(dialogue=dialogue), [item["summary"]]))
        return examples

    def score(self, examples: Sequence[Example], predictions: Sequence[str]):
        per_example: list[dict[str, Any]] = []
        totals: dict[str, list[float]] = {"rouge1": [], "rouge2": [], "rougeL": []}
        empty_predictions = 0
        for ex, pred in zip(examples, predictions):
            ref = ex.references[0].strip()
            empty_predictions += not pred.strip()
            if not ref:
                per_example.append({"rouge1": None, "rouge2": None, "rougeL": None, "skipped": "empty reference"})
                continue
            scores = rouge(pred, ref)  # an empty prediction scores 0
            for k, v in scores.items():
                totals[k].append(v)
            per_example.append(scores)
        metrics: dict[str, Any] = {k: mean(v) for k, v in totals.items()}
        scored = len(totals["rouge1"])
        metrics.update(examples=len(examples), scored=scored, empty_references=len(examples) - scored, empty_predictions=empty_predictions)
        return metrics, per_example
