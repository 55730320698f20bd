"""Token mixers, looked up by name.

A mixer is an `nn.Module` built from `(config, layer_idx)` with
`forward(x, attention_mask=None, cache=None, use_cache=False) -> (y, cache_state)`:

* x: [batch, time, hidden]; attention_mask: [batch, past + time] or [batch, time], 1 = real token;
* cache: this layer's state from earlier calls (a dict of tensors) or None;
* cache_state: the state after these tokens when `use_cache`, else None.

Each mixer class declares `default_options` (its entries in `config.mixer_options`).
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

MIXERS: dict[str, type["Mixer"]] = {}


class Mixer(nn.Module):
    """Base class: option handling shared by all mixers."""

    default_options: dict[str, Any] = {}

    @classmethod
    def resolve_options(cls, options: dict[str, Any] | None) -> dict[str, Any]:
        options = dict(options or {})
        unknown = sorted(set(options) - set(cls.default_options))
        if unknown:
            raise ValueError(
                f"unknown option(s) {unknown} for mixer {cls.name!r}; valid options: {sorted(cls.default_options)}"
            )
        return {**cls.default_options, **options}


def register_mixer(name: str):
    """Class decorator adding a mixer to `MIXERS` under `name`."""

    def register(cls):
        if name in MIXERS:
            raise ValueError(f"mixer {name!r} is already registered")
        cls.name = name
        MIXERS[name] = cls
        return cls

    return register


def build_mixer(config, layer_idx: int) -> nn.Module:
    if config.mixer not in MIXERS:
        raise ValueError(f"unknown mixer {config.mixer!r}; registered mixers: {sorted(MIXERS)}")
    return MIXERS[config.mixer](config, layer_idx)


# Importing the families registers them.
from attnlab.models.mixers import gla, softmax  # noqa: E402,F401

__all__ = ["MIXERS", "Mixer", "build_mixer", "register_mixer"]
