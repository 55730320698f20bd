"""Softmax attention of one new query per row over a static KV cache (decoding), split over the keys.

The cache is preallocated at its full capacity ([B, capacity, Hkv, D], written in place one column
per step); `valid` [B, capacity] marks the columns that hold a real token (left padding and the
columns not yet written are 0) and `length` [B] says how many columns are written. Both live on
the device, so a step reads only the written part of the cache and is still one fixed sequence of
launches (a CUDA graph replays it as the cache fills).

A decode step is bound by reading the cache. One program per (row, query head) would leave most of
an H100 idle at batch 8, so the keys are split in `splits` ranges (flash-decoding):

    1. `_partial_kernel`  one program per (row * head, range): an online softmax over its range's
                          keys (exp2 of log2e-scaled scores; optionally clamped from above and with a
                          per-key bias, the attention family's log-decay), giving its unnormalised
                          output, its running maximum, its sum of weights and its count of keys;
    2. `_combine_kernel`  one program per (row * head): the ranges' outputs rescaled to the common
                          maximum and divided by the total weight.

Grouped-query heads read their key/value head (head // (H / Hkv)). Scores and sums in fp32; the
output in q's dtype. The PyTorch reference is `decode_attention_reference` (SDPA under the mask).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
BLOCK_N = 64  # keys per tile
TARGET_PROGRAMS = 1024  # enough ranges in flight to keep every SM reading
NUM_WARPS = 4


@triton.jit
def _partial_kernel(q, k, v, valid, length, bias, part_o, part_ml, scale, clamp,
                    sq_b, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, s_valid, sb_b, sb_h,
                    H: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                    SPLIT: tl.constexpr, NS: tl.constexpr, BN: tl.constexpr, HAS_CLAMP: tl.constexpr,
                    HAS_BIAS: tl.constexpr):
    i_bh, i_s = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    i_hk = i_h // GROUP
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    b_q = tl.load(q + i_b * sq_b + i_h * sq_h + o_d, mask=m_d, other=0.0).to(tl.float32)
    n = tl.load(length + i_b)
    start = i_s * SPLIT
    end = tl.minimum(start + SPLIT, n)
    b_m = tl.full([1], -1.0e30, tl.float32)  # finite: a tile with no valid key leaves the sums at zero
    b_l = tl.zeros([1], tl.float32)
    b_c = tl.zeros([1], tl.float32)  # keys attended (the count denominators)
    b_acc = tl.zeros([BD], tl.float32)
    k_b = k + i_b.to(tl.int64) * sk_b + i_hk * sk_h
    v_b = v + i_b.to(tl.int64) * sv_b + i_hk * sv_h
    for c0 in range(start, end, BN):
        cols = c0 + tl.arange(0, BN)
        m_c = cols < end
        ok = m_c & (tl.load(valid + i_b * s_valid + cols, mask=m_c, other=0) != 0)
        m_t = m_c[:, None] & m_d[None, :]
        b_k = tl.load(k_b + cols[:, None].to(tl.int64) * sk_t + o_d[None, :], mask=m_t, other=0.0).to(tl.float32)
        s = tl.sum(b_k * b_q[None, :], axis=1) * scale  # [BN]
        if HAS_CLAMP:
            s = tl.minimum(s, clamp)
        if HAS_BIAS:  # each key's log-decay through this query
            s += tl.load(bias + i_b.to(tl.int64) * sb_b + i_h * sb_h + cols, mask=m_c, other=0.0)
        s = tl.where(ok, s * 1.4426950408889634, float("-inf"))  # log2 units
        m_new = tl.maximum(b_m, tl.max(s, axis=0))
        alpha = tl.exp2(b_m - m_new)
        p = tl.exp2(s - m_new)  # 0 where masked
        b_v = tl.load(v_b + cols[:, None].to(tl.int64) * sv_t + o_d[None, :], mask=m_t, other=0.0).to(tl.float32)
        b_acc = b_acc * alpha + tl.sum(p[:, None] * b_v, axis=0)
        b_l = b_l * alpha + tl.sum(p, axis=0)
        b_c += tl.sum(ok.to(tl.float32), axis=0)
        b_m = m_new
    base = i_bh * NS + i_s
    tl.store(part_o + base * D + o_d, b_acc, mask=m_d)
    o_3 = tl.arange(0, 4)
    stats = tl.where(o_3 == 0, tl.sum(b_m, axis=0), tl.where(o_3 == 1, tl.sum(b_l, axis=0), tl.sum(b_c, axis=0)))
    tl.store(part_ml + base * 3 + o_3, stats, mask=o_3 < 3)


@triton.jit
def _combine_kernel(part_o, part_ml, o, stats, so_b, so_h, H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                    NS: tl.constexpr, BS: tl.constexpr, STATS: tl.constexpr):
    i_bh = tl.program_id(0)
    i_b, i_h = i_bh // H, i_bh % H
    o_s = tl.arange(0, BS)
    m_s = o_s < NS
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    b_m = tl.load(part_ml + (i_bh * NS + o_s) * 3, mask=m_s, other=-1.0e30)
    b_l = tl.load(part_ml + (i_bh * NS + o_s) * 3 + 1, mask=m_s, other=0.0)
    top = tl.max(b_m, axis=0)
    w = tl.exp2(b_m - top)  # [BS]
    b_o = tl.load(part_o + (i_bh * NS + o_s)[:, None] * D + o_d[None, :], mask=m_s[:, None] & m_d[None, :], other=0.0)
    num = tl.sum(w[:, None] * b_o, axis=0)
    den = tl.sum(w * b_l, axis=0)
    if STATS:  # the raw sum of weights is den * 2^top; the count of keys attended
        count = tl.sum(tl.load(part_ml + (i_bh * NS + o_s) * 3 + 2, mask=m_s, other=0.0), axis=0)
        o_3 = tl.arange(0, 4)
        tl.store(stats + i_bh * 3 + o_3, tl.where(o_3 == 0, top, tl.where(o_3 == 1, den, count)), mask=o_3 < 3)
    den = tl.where(den > 0, den, 1.0)
    tl.store(o + i_b * so_b + i_h * so_h + o_d, (num / den).to(o.dtype.element_ty), mask=m_d)


def splits_for(rows: int, capacity: int) -> int:
    """How many key ranges one (row, head) is split into: about TARGET_PROGRAMS programs in all, each
    range at least one tile."""
    return max(1, min(triton.cdiv(TARGET_PROGRAMS, rows), triton.cdiv(capacity, BLOCK_N)))


def decode_attention(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, valid: torch.Tensor, length: torch.Tensor,
                     scale: float, clamp: float | None = None, bias: torch.Tensor | None = None, stats: bool = False,
                     out_dtype: torch.dtype | None = None):
    """q [B, H, D]; key, value [B, capacity, Hkv, D] (last dim contiguous); valid [B, capacity]
    (nonzero: a real token); length [B] int64 (columns written). Scores are scale * q.k, clamped
    from above at `clamp`, plus `bias` [B, H, capacity] fp32 (each key's log-decay) when given.
    Returns o [B, H, D] (the softmax-weighted values) in `out_dtype` (q's dtype by default), and
    with `stats` also [B, H, 3] fp32: (log2 of the reference weight, sum of weights relative to it,
    keys attended): the raw sum of exp(scores) is stats[..., 1] * 2 ** stats[..., 0]."""
    batch, heads, head_dim = q.shape
    capacity, kv_heads = key.shape[1], key.shape[2]
    if heads % kv_heads or key.shape[-1] != head_dim or value.shape != key.shape:
        raise ValueError(f"q {tuple(q.shape)} does not match key {tuple(key.shape)} / value {tuple(value.shape)}")
    if q.stride(-1) != 1 or key.stride(-1) != 1 or value.stride(-1) != 1 or valid.stride(-1) != 1:
        raise ValueError("decode_attention needs q, key, value and valid contiguous in their last dim")
    splits = splits_for(batch * heads, capacity)
    split = triton.cdiv(triton.cdiv(capacity, splits), BLOCK_N) * BLOCK_N
    splits = triton.cdiv(capacity, split)
    part_o = torch.empty(batch * heads * splits, head_dim, dtype=torch.float32, device=q.device)
    part_ml = torch.empty(batch * heads * splits, 3, dtype=torch.float32, device=q.device)
    block_d = triton.next_power_of_2(head_dim)
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (batch, heads, capacity) or bias.stride(2) != 1):
        raise ValueError(f"bias must be fp32 [{batch}, {heads}, {capacity}] with its columns contiguous")
    _partial_kernel[(batch * heads, splits)](
        q, key, value, valid, length, bias if bias is not None else part_ml, part_o, part_ml, scale,
        clamp if clamp is not None else 0.0,
        q.stride(0), q.stride(1), key.stride(0), key.stride(1), key.stride(2), value.stride(0), value.stride(1), value.stride(2),
        valid.stride(0), bias.stride(0) if bias is not None else 0, bias.stride(1) if bias is not None else 0,
        H=heads, GROUP=heads // kv_heads, D=head_dim, BD=block_d, SPLIT=split, NS=splits, BN=BLOCK_N,
        HAS_CLAMP=clamp is not None, HAS_BIAS=bias is not None, num_warps=NUM_WARPS,
    )
    o = torch.empty(batch, heads, head_dim, dtype=out_dtype or q.dtype, device=q.device)
    summary = torch.empty(batch, heads, 3, dtype=torch.float32, device=q.device) if stats else part_ml
    _combine_kernel[(batch * heads,)](part_o, part_ml, o, summary, o.stride(0), o.stride(1), H=heads, D=head_dim, BD=block_d,
                                      NS=splits, BS=triton.next_power_of_2(splits), STATS=stats, num_warps=4)
    return (o, summary) if stats else o


def decode_attention_reference(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, valid: torch.Tensor,
                               length: torch.Tensor, scale: float) -> torch.Tensor:
    """`decode_attention` in PyTorch: SDPA of the one query over the whole buffer, masked to the
    valid columns among the first `length`."""
    heads, kv_heads = q.shape[1], key.shape[2]
    columns = torch.arange(key.shape[1], device=key.device)
    allowed = (valid != 0) & (columns[None, :] < length[:, None])  # [B, capacity]
    k, v = key.transpose(1, 2), value.transpose(1, 2)  # [B, Hkv, capacity, D]
    if heads > kv_heads:
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    o = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=allowed[:, None, None, :], scale=scale)
    return o[:, :, 0]


@triton.jit
def _rope_write_kernel(q, k, v, inv_freq, position, length, key, value, valid, q_out,
                       sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, skey_b, skey_t, skey_h, sval_b, sval_t, sval_h, s_valid,
                       KV_HEADS: tl.constexpr, HALF: tl.constexpr, BH: tl.constexpr, WRITE: tl.constexpr):
    i_b, i_h = tl.program_id(0), tl.program_id(1)
    o_d = tl.arange(0, BH)
    m_d = o_d < HALF
    angle = tl.load(position + i_b).to(tl.float32) * tl.load(inv_freq + o_d, mask=m_d, other=0.0)
    cos, sin = tl.cos(angle), tl.sin(angle)
    p_q = q + i_b * sq_b + i_h * sq_h + o_d
    x1 = tl.load(p_q, mask=m_d, other=0.0).to(tl.float32)
    x2 = tl.load(p_q + HALF, mask=m_d, other=0.0).to(tl.float32)
    p_o = q_out + (i_b * tl.num_programs(1) + i_h) * (2 * HALF) + o_d
    tl.store(p_o, (x1 * cos - x2 * sin).to(q_out.dtype.element_ty), mask=m_d)
    tl.store(p_o + HALF, (x2 * cos + x1 * sin).to(q_out.dtype.element_ty), mask=m_d)
    if not WRITE:  # rotate k only, into `key` [B, Hkv, D]
        if i_h < KV_HEADS:
            p_k = k + i_b * sk_b + i_h * sk_h + o_d
            y1 = tl.load(p_k, mask=m_d, other=0.0).to(tl.float32)
            y2 = tl.load(p_k + HALF, mask=m_d, other=0.0).to(tl.float32)
            p_key = key + (i_b * KV_HEADS + i_h) * (2 * HALF) + o_d
            tl.store(p_key, (y1 * cos - y2 * sin).to(key.dtype.element_ty), mask=m_d)
            tl.store(p_key + HALF, (y2 * cos + y1 * sin).to(key.dtype.element_ty), mask=m_d)
    elif i_h < KV_HEADS:  # this head's key (rotated) and value go to the row's next column
        column = tl.load(length + i_b).to(tl.int64)
        p_k = k + i_b * sk_b + i_h * sk_h + o_d
        y1 = tl.load(p_k, mask=m_d, other=0.0).to(tl.float32)
        y2 = tl.load(p_k + HALF, mask=m_d, other=0.0).to(tl.float32)
        p_key = key + i_b.to(tl.int64) * skey_b + column * skey_t + i_h * skey_h + o_d
        tl.store(p_key, (y1 * cos - y2 * sin).to(key.dtype.element_ty), mask=m_d)
        tl.store(p_key + HALF, (y2 * cos + y1 * sin).to(key.dtype.element_ty), mask=m_d)
        p_v = v + i_b * sv_b + i_h * sv_h + o_d
        p_val = value + i_b.to(tl.int64) * sval_b + column * sval_t + i_h * sval_h + o_d
        tl.store(p_val, tl.load(p_v, mask=m_d, other=0.0).to(value.dtype.element_ty), mask=m_d)
        tl.store(p_val + HALF, tl.load(p_v + HALF, mask=m_d, other=0.0).to(value.dtype.element_ty), mask=m_d)
        if i_h == 0:
            o_1 = tl.arange(0, 2)
            tl.store(valid + i_b * s_valid + column + o_1, tl.full([2], 1, tl.uint8), mask=o_1 < 1)


def rope_write_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inv_freq: torch.Tensor, position: torch.Tensor,
                length: torch.Tensor, key: torch.Tensor, value: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """One decode step's rotary embedding and cache write in one launch: q [B, H, D], k, v [B, Hkv, D]
    (last dim contiguous); inv_freq [D / 2] fp32 (the rotary frequencies); position [B] (each row's
    rotary position); length [B] (the column to write). k rotated and v are written at each row's
    column of key, value [B, capacity, Hkv, D], and valid [B, capacity] (uint8) set there; the
    counters are left to the caller. Returns q rotated [B, H, D] in q's dtype (the non-interleaved
    "rotate half" convention of `mixers.softmax.apply_rotary`)."""
    batch, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    if head_dim % 2 or q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("rope_write_ needs an even head dim and q, k, v contiguous in their last dim")
    out = torch.empty(batch, heads, head_dim, dtype=q.dtype, device=q.device)
    _rope_write_kernel[(batch, heads)](
        q, k, v, inv_freq, position, length, key, value, valid, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        key.stride(0), key.stride(1), key.stride(2), value.stride(0), value.stride(1), value.stride(2), valid.stride(0),
        KV_HEADS=kv_heads, HALF=head_dim // 2, BH=triton.next_power_of_2(head_dim // 2), WRITE=True, num_warps=1,
    )
    return out


def rope_(q: torch.Tensor, k: torch.Tensor, inv_freq: torch.Tensor, position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step's rotary embedding of q [B, H, D] and k [B, Hkv, D] (last dim contiguous) at
    each row's `position` [B], in one launch (the eager form takes about twenty). Returns new
    contiguous tensors in the inputs' dtypes."""
    batch, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    if head_dim % 2 or q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("rope_ needs an even head dim and q, k contiguous in their last dim")
    q_out = torch.empty(batch, heads, head_dim, dtype=q.dtype, device=q.device)
    k_out = torch.empty(batch, kv_heads, head_dim, dtype=k.dtype, device=k.device)
    _rope_write_kernel[(batch, max(heads, kv_heads))](
        q, k, k, inv_freq, position, position, k_out, k_out, position, q_out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), 0, 0, 0, 0, 0, 0, 0, 0, 0,
        KV_HEADS=kv_heads, HALF=head_dim // 2, BH=triton.next_power_of_2(head_dim // 2), WRITE=False, num_warps=1,
    )
    return q_out, k_out
