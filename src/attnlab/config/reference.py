"""The config reference table in README.md, generated from the schema (a test keeps them equal)."""

from __future__ import annotations

import json

from pydantic import BaseModel

from .schema import RunConfig


def reference_markdown() -> str:
    lines = ["| key | default | meaning |", "|---|---|---|"]
    defaults = RunConfig().model_dump(mode="json")
    for section_name, section_field in RunConfig.model_fields.items():
        section: type[BaseModel] = section_field.annotation  # type: ignore[assignment]
        for name, field in section.model_fields.items():
            default = json.dumps(defaults[section_name][name])
            lines.append(f"| `{section_name}.{name}` | `{default}` | {field.description or ''} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(reference_markdown())
