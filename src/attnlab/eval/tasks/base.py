"""What every evaluation task provides: examples from the official file layout, prompts, scoring."""

from __future__ import annotations

import json
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from attnlab.errors import DataError

SPLIT_NAMES = {"dev": ("dev", "val", "validation"), "validation": ("dev", "val", "validation"), "val": ("dev", "val", "validation"),
               "train": ("train",), "test": ("test",)}


@dataclass
class Example:
    """One item: the prompt shown to the model and the references it is scored against.

    References are read from the raw data files, never reconstructed from token ids.
    """

    id: str
    prompt: str
    references: list[str]
    meta: dict[str, Any] = field(default_factory=dict)


class Task:
    """A generation task. Subclasses set `name`, `template`, `fields`, `generation_defaults`."""

    name = ""
    template = ""
    fields: tuple[str, ...] = ()  # the names a prompt template may use (never a reference)
    generation_defaults: dict[str, Any] = {}
    description = ""

    def __init__(self, template: str | None = None):
        if template is not None:
            self.template = template
        self._check_template()

    def _check_template(self) -> None:
        try:
            used = {name for _, name, _, _ in string.Formatter().parse(self.template) if name is not None}
        except ValueError as e:
            raise DataError(f"prompt template for {self.name} is malformed: {e}") from None
        unknown = sorted(n for n in used if n not in self.fields)
        if unknown:
            raise DataError(f"prompt template for {self.name} uses {', '.join('{' + n + '}' for n in unknown)}; "
                            f"it may use only {', '.join('{' + n + '}' for n in self.fields)}")

    def render(self, **values: str) -> str:
        return self.template.format(**{k: values[k] for k in self.fields})

    def load(self, data: Path, split: str = "dev", limit: int | None = None) -> list[Example]:
        raise NotImplementedError

    def postprocess(self, text: str) -> str:
        """The part of a cleaned prediction that is scored."""
        return text.strip()

    def score(self, examples: Sequence[Example], predictions: Sequence[str]) -> tuple[dict[str, float | int | None], list[dict[str, Any]]]:
        """(corpus metrics, one dict of scores per example)."""
        raise NotImplementedError


def read_json_list(path: Path, what: str) -> list:
    try:
        data = json.loads(path.read_text(encoding="utf-8-sig"))
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read {what} {path}: {e}") from None
    except ValueError as e:
        raise DataError(f"{path} is not valid JSON ({e}); expected the {what}") from None
    if not isinstance(data, list):
        raise DataError(f"{path} should hold a JSON list ({what}), found {type(data).__name__}")
    return data


def find_split_file(data: Path, split: str, task: str, layout: str) -> Path:
    """`data` itself if it is a file, else the JSON file in it whose name ends with the split's name."""
    if not data.exists():
        raise DataError(f"{task} data not found: {data}. Pass {layout}.")
    if data.is_file():
        return data
    names = SPLIT_NAMES.get(split, (split,))
    for path in sorted(data.glob("*.json")):
        stem = path.stem.lower()
        if any(stem == n or stem.endswith(("-" + n, "_" + n)) for n in names):
            return path
    found = ", ".join(p.name for p in sorted(data.glob("*.json"))) or "no JSON files"
    raise DataError(f"no {split} split in {data} (found {found}); pass {layout}, or the file itself")


def require_keys(item: Any, keys: Sequence[str], where: str, layout: str) -> None:
    if not isinstance(item, dict) or any(k not in item for k in keys):
        missing = [k for k in keys if not isinstance(item, dict) or k not in item]
        raise DataError(f"{where}: missing {', '.join(repr(k) for k in missing)}; this does not look like the {layout} layout")
