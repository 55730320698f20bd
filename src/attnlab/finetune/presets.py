"""Generation presets per control token, and the style-separation metric.

A prompt that carries a control token is decoded with that token's preset (for example
TERSE: max_new_tokens 20; VERBOSE: min_new_tokens 30, max_new_tokens 100), under any
settings the user gave explicitly. Both styles never share one set of decoding settings.
"""

from __future__ import annotations

from typing import Any

from attnlab.config import GenerateConfig


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


def generate_with_presets(model, tokenizer, prompts: list[str], presets: dict[str, dict[str, Any]],
                          explicit: dict[str, Any] | None = None, chat: bool = False):
    """Generate for each prompt with its own preset; results come back in prompt order."""
    from attnlab.generation import generate

    from .data import chat_prompt_ids

    groups: dict[str, list[int]] = {}
    configs: dict[str, GenerateConfig] = {}
    for i, p in enumerate(prompts):
        cfg = settings_for_prompt(p, presets, explicit)
        key = cfg.model_dump_json()
        configs[key] = cfg
        groups.setdefault(key, []).append(i)
    results: list = [None] * len(prompts)
    for key, idx in groups.items():
        batch = [chat_prompt_ids(tokenizer, prompts[i]) if chat else prompts[i] for i in idx]
        for i, r in zip(idx, generate(model, tokenizer, batch, configs[key])):
            results[i] = r
    return results


def style_separation(model, tokenizer, prompts: list[str], control_tokens: list[str], presets: dict[str, dict[str, Any]],
                     chat: bool = False) -> dict[str, Any]:
    """Mean generated length (tokens) per control token on held-out prompts, and the separation
    ratio: mean under the last control token over mean under the first (list the terse style first)."""
    results = generate_with_presets(model, tokenizer, prompts, presets, chat=chat)
    lengths: dict[str, list[int]] = {t: [] for t in control_tokens}
    samples: dict[str, str] = {}
    for p, r in zip(prompts, results):
        t = token_in(p, {t: {} for t in control_tokens})
        if t is not None:
            lengths[t].append(len(r.token_ids))
            samples.setdefault(t, r.text)
    means = {t: (sum(v) / len(v) if v else None) for t, v in lengths.items()}
    out: dict[str, Any] = {"mean_new_tokens": means, "prompts": {t: len(v) for t, v in lengths.items()}, "samples": samples}
    if len(control_tokens) >= 2 and means[control_tokens[0]] and means[control_tokens[-1]] is not None:
        out["style_separation"] = round(means[control_tokens[-1]] / means[control_tokens[0]], 3)
        out["style_separation_of"] = f"{control_tokens[-1]} / {control_tokens[0]}"
    return out
