"""Generation with the presets per control token (attnlab.config.presets), and the style-separation metric.

A prompt that carries a control token is decoded with that token's preset (for example
TERSE: max_new_tokens 20; VERBOSE: min_new_tokens 30, max_new_tokens 100), under any
settings the user gave explicitly: presets are for generation.

The style-separation metric never uses them: a preset that caps one style at 20 tokens and
forces the other past 30 separates the styles of an untrained model. The metric decodes every
style under one greedy setting with one budget and measures where the model itself stops.
"""

from __future__ import annotations

from typing import Any

from attnlab.config import GenerateConfig
from attnlab.config.presets import settings_for_prompt, token_in


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


def style_separation(model, tokenizer, prompts: list[str], control_tokens: list[str], max_new_tokens: int,
                     chat: bool = False, batch_size: int = 32, progress=None) -> dict[str, Any]:
    """Mean generated length (tokens) per control token on held-out prompts, every prompt decoded under the
    same settings: greedy, one `max_new_tokens` budget (well above the longest answer expected), stopping
    at EOS. The separation is the mean under the last control token over the mean under the first (list the
    terse style first). Per-style presets play no part: what differs between the styles is the model's own
    choice of when to stop. `hit_budget` counts the outputs that ran into the budget instead of stopping.
    `progress`: called with the number of prompts finished after each batch."""
    from attnlab.generation import generate

    from .data import chat_prompt_ids

    settings = GenerateConfig(max_new_tokens=max_new_tokens, do_sample=False, batch_size=batch_size)
    batch = [chat_prompt_ids(tokenizer, p) if chat else p for p in prompts]
    results = generate(model, tokenizer, batch, settings, progress=progress)
    lengths: dict[str, list[int]] = {t: [] for t in control_tokens}
    capped: dict[str, int] = {t: 0 for t in control_tokens}
    samples: dict[str, str] = {}
    for p, r in zip(prompts, results):
        t = token_in(p, {t: {} for t in control_tokens})
        if t is not None:
            lengths[t].append(len(r.token_ids))
            capped[t] += r.finish_reason == "length"
            samples.setdefault(t, r.text)
    means = {t: (round(sum(v) / len(v), 2) if v else None) for t, v in lengths.items()}
    out: dict[str, Any] = {"mean_new_tokens": means, "prompts": {t: len(v) for t, v in lengths.items()}, "hit_budget": capped,
                           "max_new_tokens": max_new_tokens, "decoding": "greedy, the same budget for every style, EOS-terminated",
                           "samples": samples}
    if len(control_tokens) >= 2 and means[control_tokens[0]] and means[control_tokens[-1]] is not None:
        out["style_separation"] = round(means[control_tokens[-1]] / means[control_tokens[0]], 3)
        out["style_separation_of"] = f"{control_tokens[-1]} / {control_tokens[0]}"
    return out


def metric_budget(tokenizer, rows: list[dict], chat: bool = False, factor: float = 2.0, floor: int = 16) -> int:
    """The shared decoding budget of the style metric: `factor` x the longest reference completion in
    `rows` (tokens), so that no style's expected answer comes near it."""
    from .data import split_example

    longest = 0
    for row in rows:
        if "completion" in row or "messages" in row:
            longest = max(longest, len(split_example(tokenizer, row, chat, True)[1]))
    return max(floor, int(factor * longest))
