"""Generation presets per control token: the decoding settings a prompt gets.

A fine-tuned adapter records decoding settings per control token (for example TERSE: max_new_tokens
20; VERBOSE: min_new_tokens 30, max_new_tokens 100) and a 'default'. A prompt that carries a control
token is decoded with that token's preset, under any settings the user gave explicitly.
"""

from __future__ import annotations

from typing import Any

from .schema import GenerateConfig


def token_in(prompt: str, presets: dict[str, dict[str, Any]]) -> str | None:
    """The control token (with a preset) that occurs first in `prompt`, or None."""
    hits = [(prompt.find(t), t) for t in presets if t != "default" and t in prompt]
    return min(hits)[1] if hits else None


def settings_for_prompt(prompt: str, presets: dict[str, dict[str, Any]], explicit: dict[str, Any] | None = None) -> GenerateConfig:
    """Decoding settings for `prompt`: the 'default' preset, then its control token's preset, then `explicit`."""
    merged: dict[str, Any] = dict(presets.get("default", {}))
    token = token_in(prompt, presets)
    if token is not None:
        merged.update(presets[token])
    merged.update(explicit or {})
    return GenerateConfig.model_validate(merged)
