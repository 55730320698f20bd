"""Causal softmax attention with grouped-query heads in plain PyTorch: the oracle of the softmax mixer's fast
paths (PyTorch's fused SDPA for training and prefill, attnlab's split-key decoding kernel,
`attnlab.models.kernels.softmax.decode`).

Layout: q [batch, time, heads, head_dim]; k, v [batch, time, kv_heads, head_dim], query head h reading kv head
h // (heads / kv_heads).
"""

from __future__ import annotations

import torch


def _per_query_head(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, T, Hkv, D] -> [B, T, H, D]: each kv head serves heads / kv_heads consecutive query heads."""
    return t.repeat_interleave(heads // t.shape[2], dim=2)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None = None,
                     scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scale) v of T queries over past + T keys, the queries being the last T positions.

    key_mask [B, past + T] (1: a real token) or None. A query sees the keys at or before its position that are
    real tokens, and always itself (so a padded query's softmax stays finite, as the mixer does). Returns
    [B, T, H, D] in fp32."""
    heads, seq_len, total_len = q.shape[2], q.shape[1], k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    k, v = _per_query_head(k.float(), heads), _per_query_head(v.float(), heads)
    scores = torch.einsum("bthd,bshd->bhts", q.float() * scale, k)  # [B, H, T, past + T]
    query_pos = torch.arange(total_len - seq_len, total_len, device=q.device)[:, None]
    key_pos = torch.arange(total_len, device=q.device)[None, :]
    allowed = (key_pos <= query_pos)[None, None]  # [1, 1, T, past + T]
    if key_mask is not None:
        allowed = (allowed & key_mask[:, None, None, :].bool()) | (key_pos == query_pos)[None, None]
    weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.einsum("bhts,bshd->bthd", weights, v)


def decode_attention(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, valid: torch.Tensor,
                     length: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per row over a static cache (the signature of `kernels.softmax.decode.decode_attention`): SDPA
    of q [B, H, D] over the whole buffer [B, capacity, Hkv, D], masked to the `valid` columns among the first
    `length` [B]. Returns [B, H, D]."""
    heads, kv_heads = q.shape[1], key.shape[2]
    columns = torch.arange(key.shape[1], device=key.device)
    allowed = (valid != 0) & (columns[None, :] < length[:, None])  # [B, capacity]
    k, v = key.transpose(1, 2), value.transpose(1, 2)  # [B, Hkv, capacity, D]
    if heads > kv_heads:
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    o = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=allowed[:, None, None, :], scale=scale)
    return o[:, :, 0]
