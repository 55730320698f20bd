"""The config reference table in docs/config.md, generated from the schema.

scripts/generate_docs.py writes it there; tests/test_docs.py keeps the two equal.
"""

from __future__ import annotations

import json

from pydantic import BaseModel

from .schema import RunConfig


def reference_markdown() -> str:
    lines = ["| key | default | meaning |", "|---|---|---|"]
    defaults = RunConfig().model_dump(mode="json")
    for section_name, section_field in RunConfig.model_fields.items():
        lines += _rows(section_field.annotation, section_name, defaults[section_name])
    return "\n".join(lines)


def _rows(section: type[BaseModel], prefix: str, defaults: dict) -> list[str]:
    """One row per field; a nested section (data.mqar) as one row per field of its own."""
    rows = []
    for name, field in section.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            rows += _rows(field.annotation, f"{prefix}.{name}", defaults[name])
            continue
        rows.append(f"| `{prefix}.{name}` | `{json.dumps(defaults[name])}` | {field.description or ''} |")
    return rows


if __name__ == "__main__":
    print(reference_markdown())
