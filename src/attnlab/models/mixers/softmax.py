"""Causal softmax attention with rotary position embeddings and grouped-query heads."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from attnlab.models import kernels
from attnlab.models.mixers.registry import Mixer, register_mixer
from attnlab.models.modules import FusedProjections
from attnlab.models.ops.common import apply_rotary, rotary_cos_sin, rotary_inv_freq
from attnlab.models.ops.softmax import decode_attention as reference_decode_attention


def interleaved_rope_permutation(head_dim: int) -> torch.Tensor:
    """The order of a head's channels that turns interleaved RoPE into attnlab's rotate-half RoPE.

    Interleaved RoPE (`rotary_embedding_torch`, the later 2Mamba study's softmax) rotates the pairs
    (2i, 2i + 1) by position * inv_freq_i; rotate-half rotates (i, i + D/2) by the same angle. So for
    x of one head, rotate_half_rope(x[perm]) = interleaved_rope(x)[perm] with perm = [0, 2, 4, ..., 1,
    3, 5, ...], and since q.k is unchanged when q and k are permuted alike, a model with interleaved
    RoPE computes the same function as attnlab's with the rows of each head of W_q and W_k in this
    order (`permute_heads_rows`). Returns perm [head_dim] (long)."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head dim, got {head_dim}")
    return torch.cat((torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)))


def permute_heads_rows(weight: torch.Tensor, head_dim: int, perm: torch.Tensor) -> torch.Tensor:
    """The rows of a projection's weight (or bias) [heads * head_dim, ...] in the order `perm` within each head."""
    heads = weight.shape[0] // head_dim
    rows = (torch.arange(heads)[:, None] * head_dim + perm[None, :]).flatten()
    return weight[rows.to(weight.device)]


def static_kv_state(state: dict, capacity: int) -> dict:
    """A dynamic KV cache ({"key", "value": [B, T, Hkv, D], "mask": [B, T] or None}) copied into
    buffers of `capacity` columns (see `SoftmaxAttention.static_state`)."""
    key, value, mask = state["key"], state["value"], state.get("mask")
    batch, length = key.shape[:2]
    if capacity < length:
        raise ValueError(f"a static cache of {capacity} columns cannot hold {length} tokens")

    def buffer(t: torch.Tensor) -> torch.Tensor:
        out = t.new_zeros(batch, capacity, *t.shape[2:])
        out[:, :length] = t
        return out

    valid = torch.zeros(batch, capacity, dtype=torch.bool, device=key.device)
    valid[:, :length] = True if mask is None else mask.bool()
    out = {"key": buffer(key), "value": buffer(value), "valid": valid,
           "length": torch.full((batch,), length, dtype=torch.long, device=key.device),
           "position": valid.sum(-1)}
    return out


def write_static_kv(cache: dict, k: torch.Tensor, v: torch.Tensor, is_token: torch.Tensor | None) -> torch.Tensor:
    """Write one step's k, v [B, 1, Hkv, D] at each row's next column of a static cache, in place;
    advance `length` (and `position` for real tokens). Returns the columns written [B]."""
    column = cache["length"]
    index = column.view(-1, 1, 1, 1).expand(-1, 1, *k.shape[2:])
    cache["key"].scatter_(1, index, k.to(cache["key"].dtype))
    cache["value"].scatter_(1, index, v.to(cache["value"].dtype))
    real = torch.ones_like(column, dtype=torch.bool) if is_token is None else is_token.bool()
    cache["valid"].scatter_(1, column[:, None], real[:, None])
    written = column.clone()
    column.add_(1)
    cache["position"].add_(real.long())
    return written


def decode_attention(choice: str, q, key, value, valid, length, scale: float) -> torch.Tensor:
    """One query per row over a static cache: attnlab's split-key Triton kernel on CUDA, SDPA elsewhere."""
    if kernels.use_triton(choice, q):
        from attnlab.models.kernels.softmax.decode import decode_attention as fused

        return fused(q, key, value, valid.view(torch.uint8), length, scale)
    return reference_decode_attention(q, key, value, valid, length, scale)


@register_mixer("softmax")
class SoftmaxAttention(FusedProjections, Mixer):
    default_options = {"num_kv_heads": None}  # None: as many as num_heads
    train_graph_safe = True
    compiles_whole = True  # SDPA and PyTorch's rotary under torch.compile
    static_kv = True  # decodes over static buffers (`static_state`)
    static_columns = ("key", "value", "valid")  # the static cache's buffers whose prompt columns every beam of a prompt shares

    @classmethod
    def resolve_options(cls, options):
        options = super().resolve_options(options)
        kv = options["num_kv_heads"]
        if kv is not None and (isinstance(kv, bool) or not isinstance(kv, int) or kv < 1):
            raise ValueError(f"model.mixer_options.num_kv_heads must be a positive integer or null (mixer {cls.name!r}), got {kv!r}")
        return options

    def __init__(self, config, layer_idx: int):
        super().__init__()
        options = self.options_of(config)
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.num_kv_heads = options["num_kv_heads"] or config.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be divisible by num_kv_heads ({self.num_kv_heads})")
        self.head_dim = config.hidden_size // config.num_heads
        self.rope_theta = config.rope_theta
        self.kernels = config.kernels

        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: dict | None = None,
        use_cache: bool = False,
    ) -> tuple[torch.Tensor, dict | None]:
        batch, seq_len, _ = x.shape
        if cache is not None and "length" in cache:  # the decode engine's static cache (`static_state`)
            return self._static_step(x, attention_mask, cache), cache
        past_k = cache["key"] if cache is not None else None  # [B, past, Hkv, D]
        past_v = cache["value"] if cache is not None else None
        past_len = past_k.shape[1] if past_k is not None else 0
        mask = self._full_mask(attention_mask, cache, batch, past_len, seq_len, x.device)  # [B, past + T] or None

        # positions count real tokens only, so left padding does not shift them
        if mask is None:
            positions = torch.arange(past_len, past_len + seq_len, device=x.device).expand(batch, seq_len)
        else:
            positions = (mask.long().cumsum(-1) - 1).clamp(min=0)[:, -seq_len:]  # [B, T]

        q, k, v = self.project(x)
        q = q.view(batch, seq_len, self.num_heads, self.head_dim)
        k = k.view(batch, seq_len, self.num_kv_heads, self.head_dim)
        v = v.view(batch, seq_len, self.num_kv_heads, self.head_dim)
        q, k = kernels.rotate(self.kernels, x, q, k, positions, self.rope_theta)
        if past_k is not None:
            k = torch.cat((past_k, k), dim=1)  # [B, past + T, Hkv, D]
            v = torch.cat((past_v, v), dim=1)
        new_cache = {"key": k, "value": v, "mask": mask} if use_cache else None

        if seq_len == 1 and past_len > 0:
            o = self._step(q, k, v, mask)
        else:
            o = self._parallel(q, k, v, mask, past_len)
        y = self.o_proj(o.reshape(batch, seq_len, self.num_heads * self.head_dim))
        return y, new_cache

    def projection_group(self) -> list[nn.Module]:
        return [self.q_proj, self.k_proj, self.v_proj]

    def static_state(self, state: dict, capacity: int) -> dict:
        """The cache after a prefill as the decode engine keeps it: keys and values in buffers of
        `capacity` columns written in place one per step, `valid` [B, capacity] (1: a real token),
        `length` [B] (columns written) and `position` [B] (real tokens so far: the next rotary position)."""
        return static_kv_state(state, capacity)

    def _static_step(self, x: torch.Tensor, attention_mask: torch.Tensor | None, cache: dict) -> torch.Tensor:
        """One token per row over the static cache, written where it lies."""
        batch, seq_len, _ = x.shape
        if seq_len != 1:
            raise ValueError("a static decode cache takes one token per row; prefill with a dynamic cache")
        q, k, v = self.project(x)
        q = q.view(batch, self.num_heads, self.head_dim)
        k = k.view(batch, self.num_kv_heads, self.head_dim)
        v = v.view(batch, self.num_kv_heads, self.head_dim)
        if attention_mask is None and kernels.use_triton(self.kernels, x):  # rotary and the cache write in one kernel
            from attnlab.models.kernels.softmax.decode import rope_write_

            if getattr(self, "_inv_freq", None) is None or self._inv_freq.device != x.device:
                self._inv_freq = rotary_inv_freq(self.head_dim, self.rope_theta, x.device)
            q = rope_write_(q, k, v, self._inv_freq, cache["position"], cache["length"], cache["key"], cache["value"],
                            cache["valid"].view(torch.uint8))[:, None]
            cache["length"].add_(1)
            cache["position"].add_(1)
        else:
            cos, sin = rotary_cos_sin(cache["position"][:, None], self.head_dim, self.rope_theta)
            q, k = apply_rotary(q[:, None], cos, sin), apply_rotary(k[:, None], cos, sin)
            write_static_kv(cache, k, v[:, None], None if attention_mask is None else attention_mask[:, -1])
        o = decode_attention(self.kernels, q[:, 0], cache["key"], cache["value"], cache["valid"], cache["length"], self.head_dim**-0.5)
        return self.o_proj(o.reshape(batch, 1, self.num_heads * self.head_dim))

    def _parallel(self, q, k, v, mask, past_len) -> torch.Tensor:
        """Causal attention of T queries over past + T keys. Returns [B, T, H, D]."""
        seq_len, total_len = q.shape[1], k.shape[1]
        q, k, v = self._to_sdpa_layout(q, k, v)
        if mask is None and past_len == 0:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            query_pos = torch.arange(past_len, past_len + seq_len, device=q.device)[:, None]
            key_pos = torch.arange(total_len, device=q.device)[None, :]
            allowed = (key_pos <= query_pos)[None, None]  # [1, 1, T, past + T]
            if mask is not None:
                allowed = allowed & mask[:, None, None, :].bool()
                # a padded query would see no key at all; let it see itself to keep the softmax finite
                allowed = allowed | (key_pos == query_pos)[None, None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return o.transpose(1, 2)

    def _step(self, q, k, v, mask) -> torch.Tensor:
        """One new query over the whole KV cache. Returns [B, 1, H, D]."""
        q, k, v = self._to_sdpa_layout(q, k, v)
        allowed = None if mask is None else mask[:, None, None, :].bool()  # [B, 1, 1, past + 1]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return o.transpose(1, 2)

    def _to_sdpa_layout(self, q, k, v):
        """[B, T, H, D] -> [B, H, T, D], repeating each kv head for its group of query heads."""
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:
            k = k.repeat_interleave(groups, dim=2)
            v = v.repeat_interleave(groups, dim=2)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    @staticmethod
    def _full_mask(attention_mask, cache, batch, past_len, seq_len, device) -> torch.Tensor | None:
        """The padding mask over past + new tokens, or None when nothing has ever been padded.

        `attention_mask` may cover past + new tokens (the Hugging Face convention) or only the new ones.
        """
        past_mask = cache.get("mask") if cache is not None else None
        if attention_mask is None and past_mask is None:
            return None
        if attention_mask is not None and attention_mask.shape[1] == past_len + seq_len:
            return attention_mask
        if attention_mask is None:
            attention_mask = torch.ones(batch, seq_len, dtype=torch.long, device=device)
        if attention_mask.shape[1] != seq_len:
            raise ValueError(
                f"attention_mask has {attention_mask.shape[1]} columns; expected {seq_len} (new tokens) "
                f"or {past_len + seq_len} (past + new tokens)"
            )
        if past_mask is None:
            past_mask = torch.ones(batch, past_len, dtype=attention_mask.dtype, device=device)
        return torch.cat((past_mask.to(attention_mask.dtype), attention_mask), dim=1)
