"""The base of every config section (run, fine-tune, eval, generation settings).

Unknown keys are refused; a number field takes a finite number and nothing else: `true` is not 1 (YAML and
pydantic would read it so) and NaN or an infinity is refused where a finite number is meant (a NaN length
penalty would turn every beam score into NaN without a word).

This module imports nothing from attnlab, so that every schema can build on it without an import cycle.
"""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


def _takes_bool(annotation: Any) -> bool:
    """Whether a field of this type accepts a boolean as itself (bool, Any, a Literal of booleans, a union with one of them)."""
    if annotation is bool or annotation is Any:
        return True
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return any(isinstance(a, bool) for a in typing.get_args(annotation))
    if origin is typing.Union or origin is types.UnionType or origin is typing.Annotated:
        return any(_takes_bool(a) for a in typing.get_args(annotation))
    return False


def _takes_number(annotation: Any) -> bool:
    """Whether a field of this type is a number (int or float, alone or in a union)."""
    if annotation in (int, float):
        return True
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType or origin is typing.Annotated:
        return any(_takes_number(a) for a in typing.get_args(annotation))
    return False


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, bool) and info.field_name is not None:
            annotation = cls.model_fields[info.field_name].annotation
            if _takes_number(annotation) and not _takes_bool(annotation):
                raise ValueError("should be a number, not a boolean")
        return value
