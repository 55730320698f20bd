"""Text-to-SQL in the Spider layout, scored by execution accuracy and normalised exact match.

Layout (as released): `dev.json` / `train_spider.json` (items with `db_id`, `question`, `query`),
`tables.json` (one schema per database) and `database/<db_id>/<db_id>.sqlite`.

Execution accuracy runs the gold and the predicted query on the database (read-only, time- and
row-limited, see `attnlab.eval.sql`) and compares the results as multisets of rows, or as lists
when the gold query orders its rows. Gold queries that fail to run are reported and left out of
the denominator; a prediction that fails to run is wrong.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from attnlab.errors import DataError
from attnlab.outputs import inside

from ..metrics import normalize_sql, ratio, sql_orders_rows
from ..sql import results_match, run_query
from .base import Example, Task, read_json_list, require_keys

LAYOUT = "a Spider directory (dev.json or train_spider.json, tables.json, database/<db_id>/<db_id>.sqlite)"
SPLIT_FILES = {"dev": ("dev.json",), "validation": ("dev.json",), "val": ("dev.json",),
               "train": ("train_spider.json", "train.json"), "test": ("test.json",)}


def render_schema(schema: dict[str, Any]) -> str:
    """One line per table, `table(column, ...)`, then the foreign keys, from a tables.json entry."""
    tables = schema["table_names_original"]
    columns = schema["column_names_original"]
    lines = []
    for t, table in enumerate(tables):
        cols = [name for owner, name in columns if owner == t]
        lines.append(f"-- {table}({', '.join(cols)})")
    keys = []
    for a, b in schema.get("foreign_keys", []):
        (ta, ca), (tb, cb) = columns[a], columns[b]
        keys.append(f"{tables[ta]}.{ca} = {tables[tb]}.{cb}")
    if keys:
        lines.append(f"-- foreign keys: {'; '.join(keys)}")
    return "\n".join(lines)


def _plain_name(db_id) -> bool:
    """A db_id names one directory under `database/`: a path such as '../../outside/o' or '/tmp/o'
    would open a database outside the data directory."""
    return (isinstance(db_id, str) and db_id not in ("", ".", "..") and "/" not in db_id and "\\" not in db_id
            and "\0" not in db_id and not Path(db_id).is_absolute() and Path(db_id).name == db_id)


class SpiderTask(Task):
    name = "spider"
    description = "text-to-SQL (Spider layout): execution accuracy, exact match"
    template = "-- SQLite database {db_id}\n{schema}\n-- Question: {question}\n-- SQL:\n"
    fields = ("db_id", "schema", "question")
    generation_defaults = {"max_new_tokens": 128, "stop": [";", "\n\n"]}

    def __init__(self, template: str | None = None, timeout_s: float = 5.0, max_rows: int = 10_000):
        super().__init__(template)
        self.timeout_s, self.max_rows = timeout_s, max_rows

    def load(self, data: Path, split: str = "dev", limit: int | None = None) -> list[Example]:
        data = Path(data)
        if not data.is_dir():
            raise DataError(f"spider data must be a directory: {data} {'is a file' if data.exists() else 'not found'}. Pass {LAYOUT}.")
        split_path = next((data / n for n in SPLIT_FILES.get(split, (f"{split}.json",)) if (data / n).is_file()), None)
        if split_path is None:
            raise DataError(f"no {split} split in {data}: expected {' or '.join(SPLIT_FILES.get(split, (f'{split}.json',)))}. Pass {LAYOUT}.")
        if not (data / "tables.json").is_file():
            raise DataError(f"{data} has no tables.json. Pass {LAYOUT}.")
        schemas = {}
        for n, entry in enumerate(read_json_list(data / "tables.json", "Spider schemas (tables.json)")):
            require_keys(entry, ("db_id", "table_names_original", "column_names_original"), f"tables.json, entry {n}", "Spider")
            schemas[entry["db_id"]] = entry
        items = read_json_list(split_path, f"Spider {split} questions")
        if limit is not None:
            items = items[:limit]
        examples = []
        for n, item in enumerate(items):
            require_keys(item, ("db_id", "question", "query"), f"{split_path.name}, item {n}", "Spider")
            db_id = item["db_id"]
            if not _plain_name(db_id):
                raise DataError(f"{split_path.name}, item {n}: db_id {db_id!r} is not a database name: it must name a directory "
                                f"of {data / 'database'} (no path separators, no '..', not absolute). Fix that item's db_id.")
            if db_id not in schemas:
                raise DataError(f"{split_path.name}, item {n}: database {db_id!r} is not described in tables.json")
            db_path = data / "database" / db_id / f"{db_id}.sqlite"
            if not db_path.is_file():
                raise DataError(f"{split_path.name}, item {n}: database file {db_path} not found")
            try:
                inside(data, db_path)
            except ValueError:
                raise DataError(f"{split_path.name}, item {n}: the database file {db_path} of {db_id!r} leads outside the data "
                                f"directory {data} (to {db_path.resolve()}, through a symbolic link). Put the database itself "
                                "under database/<db_id>/.") from None
            prompt = self.render(db_id=db_id, schema=render_schema(schemas[db_id]), question=item["question"].strip())
            examples.append(Example(str(item.get("id", n)), prompt, [item["query"]], {"db_id": db_id, "db_path": str(db_path), "question": item["question"]}))
        return examples

    def postprocess(self, text: str) -> str:
        """The first statement of the prediction, without a trailing ';' or markdown fences."""
        text = text.strip()
        if text.startswith("```"):
            text = text.split("\n", 1)[1] if "\n" in text else ""
        text = text.split("```", 1)[0]
        text = text.split(";", 1)[0]
        text = text.split("\n\n", 1)[0]
        return " ".join(text.split())

    def score(self, examples: Sequence[Example], predictions: Sequence[str]):
        per_example: list[dict[str, Any]] = []
        counted = correct = exact = gold_failures = prediction_failures = 0
        for ex, pred in zip(examples, predictions):
            gold_sql = ex.references[0]
            gold = run_query(ex.meta["db_path"], gold_sql, self.timeout_s, self.max_rows)
            gold_norm, pred_norm = normalize_sql(gold_sql), normalize_sql(pred)
            is_exact = pred_norm is not None and pred_norm == gold_norm
            exact += is_exact
            row: dict[str, Any] = {"exact_match": is_exact, "execution_match": None}
            predicted = run_query(ex.meta["db_path"], pred, self.timeout_s, self.max_rows)
            if not predicted.ok:
                prediction_failures += 1
                row["prediction_error"] = predicted.error
            if not gold.ok:
                gold_failures += 1
                row["gold_error"] = gold.error
            else:
                counted += 1
                match = predicted.ok and results_match(gold.rows, predicted.rows, sql_orders_rows(gold_sql))
                correct += match
                row["execution_match"] = match
            per_example.append(row)
        metrics = {
            "execution_accuracy": ratio(correct, counted),
            "exact_match": ratio(exact, len(examples)),
            "examples": len(examples),
            "execution_counted": counted,
            "gold_failures": gold_failures,
            "prediction_failures": prediction_failures,
        }
        return metrics, per_example
