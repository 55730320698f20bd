"""Data-to-text in the DART layout, scored by corpus BLEU over all references and chrF (sacrebleu).

Layout (as released): a JSON list of items with `tripleset` (a list of [subject, predicate,
object]) and `annotations` (a list of {"source", "text"}); each annotation's text is a reference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from attnlab.errors import DataError

from ..metrics import bleu_chrf, sentence_bleu_chrf
from .base import Example, Task, find_split_file, read_json_list, require_keys

LAYOUT = "a DART JSON file (items with 'tripleset' and 'annotations') or a directory holding e.g. dart-v1.1.1-full-dev.json"


def linearize(tripleset: list) -> str:
    return " ; ".join(" | ".join(str(x) for x in triple) for triple in tripleset)


class DartTask(Task):
    name = "dart"
    description = "data-to-text (DART layout): BLEU with all references, chrF"
    template = "Triples: {triples}\nText:"
    fields = ("triples",)
    generation_defaults = {"max_new_tokens": 64, "stop": ["\n"]}

    def load(self, data: Path, split: str = "dev", limit: int | None = None) -> list[Example]:
        path = find_split_file(Path(data), split, "dart", LAYOUT)
        items = read_json_list(path, "DART items")
        if limit is not None:
            items = items[:limit]
        examples = []
        for n, item in enumerate(items):
            require_keys(item, ("tripleset", "annotations"), f"{path.name}, item {n}", "DART")
            triples = item["tripleset"]
            if not isinstance(triples, list) or not all(isinstance(t, list) and len(t) == 3 for t in triples):
                raise DataError(f"{path.name}, item {n}: 'tripleset' must be a list of [subject, predicate, object]")
            refs = [a["text"] if isinstance(a, dict) else a for a in item["annotations"]]
            if not all(isinstance(r, str) for r in refs):
                raise DataError(f"{path.name}, item {n}: each annotation needs a 'text' string")
            examples.append(Example(str(item.get("id", n)), self.render(triples=linearize(triples)), refs))
        return examples

    def score(self, examples: Sequence[Example], predictions: Sequence[str]):
        per_example: list[dict[str, Any]] = []
        scored_preds, scored_refs = [], []
        empty_predictions = 0
        for ex, pred in zip(examples, predictions):
            refs = [r.strip() for r in ex.references if r.strip()]
            empty_predictions += not pred.strip()
            if not refs:
                per_example.append({"bleu": None, "chrf": None, "skipped": "no non-empty reference"})
                continue
            scored_preds.append(pred)
            scored_refs.append(refs)
            per_example.append(sentence_bleu_chrf(pred, refs))
        metrics: dict[str, Any] = bleu_chrf(scored_preds, scored_refs)
        metrics.update(examples=len(examples), scored=len(scored_preds),
                       empty_references=len(examples) - len(scored_preds), empty_predictions=empty_predictions)
        return metrics, per_example
