"""The name transformers gives the decoding cache: `cache` from 5.24, `past_key_values` before.

attnlab models take either name (`AttnLabForCausalLM.forward`); attnlab's own calls into any model,
and the outputs attnlab models return, use the installed version's name, so that no call of ours
goes through transformers' deprecation path.
"""

from __future__ import annotations

from typing import Any

from transformers.modeling_outputs import CausalLMOutputWithPast

CACHE_KEY = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def cache_of(output: Any) -> Any:
    """The cache an HF model output carries (None when it carries none)."""
    return getattr(output, CACHE_KEY, None)


def one_cache(cache: Any, past_key_values: Any) -> Any:
    """The cache a forward was given under either name; both at once is a mistake."""
    if cache is not None and past_key_values is not None:
        raise TypeError("pass the cache as `cache` or as `past_key_values`, not both")
    return cache if cache is not None else past_key_values
