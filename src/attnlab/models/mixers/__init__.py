"""Token mixers, looked up by name.

A mixer is an `nn.Module` built from `(config, layer_idx)` with
`forward(x, attention_mask=None, cache=None, use_cache=False) -> (y, cache_state)`:

* x: [batch, time, hidden]; attention_mask: [batch, past + time] or [batch, time], 1 = real token;
* cache: this layer's state from earlier calls (a dict of tensors) or None;
* cache_state: the state after these tokens when `use_cache`, else None.

Each mixer class declares `default_options` (its entries in `config.mixer_options`).
"""

from __future__ import annotations

from attnlab.models.mixers.registry import (
    MIXERS,
    Mixer,
    build_mixer,
    mixer_class,
    presets_markdown,
    register_mixer,
    register_preset,
    resolve_mixer,
    unknown_mixer_message,
)

# Importing the families registers them.
from attnlab.models.mixers import attention_family, gla, mamba2, nsa, softmax  # noqa: F401
from attnlab.models.mixers import attention_presets  # noqa: F401  (presets of attention_family)

__all__ = ["MIXERS", "Mixer", "build_mixer", "mixer_class", "presets_markdown", "register_mixer", "register_preset",
           "resolve_mixer", "unknown_mixer_message"]
