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
output in q's dtype. The PyTorch reference is `attnlab.models.ops.softmax.decode_attention` (SDPA under the mask).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
BLOCK_N = 128  # keys per tile (swept on an H100: 128 keys, 4 warps, 2 stages)
TARGET_PROGRAMS = 1024  # enough ranges in flight to keep every SM reading
NUM_WARPS = 4
NUM_STAGES = 2  # key and value tiles in flight per program


@triton.jit
def _partial_kernel(q, k, v, valid, length, bias, step_bias, part_o, part_ml, scale, clamp,
                    sq_b, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, s_valid, sb_b, sb_h, ss_b,
                    H: tl.constexpr, GROUP: tl.constexpr, BM: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                    SPLIT: tl.constexpr, NS: tl.constexpr, BN: tl.constexpr, HAS_CLAMP: tl.constexpr,
                    HAS_BIAS: tl.constexpr, STEP_BIAS: tl.constexpr, IEEE: tl.constexpr):
    # one program per (row, kv head, range): the kv head's GROUP query heads are the rows of one
    # tile (padded to BM >= 16 for the tensor cores), so each key and value tile is read once and
    # the loop is pipelined like a matrix product's
    i_bk, i_s = tl.program_id(0), tl.program_id(1)
    i_b, i_hk = i_bk // (H // GROUP), i_bk % (H // GROUP)
    o_m = tl.arange(0, BM)
    m_m = o_m < GROUP
    heads = i_hk * GROUP + o_m
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    b_q = tl.load(q + i_b * sq_b + heads[:, None] * sq_h + o_d[None, :], mask=m_m[:, None] & m_d[None, :], other=0.0)
    b_q = b_q.to(k.dtype.element_ty)
    n = tl.load(length + i_b)
    start = i_s * SPLIT
    end = tl.minimum(start + SPLIT, n)
    b_m = tl.full([BM], -1.0e30, tl.float32)  # finite: a tile with no valid key leaves the sums at zero
    b_l = tl.zeros([BM], tl.float32)
    b_c = tl.zeros([BM], tl.float32)  # keys attended (the count denominators)
    b_acc = tl.zeros([BM, BD], tl.float32)
    k_b = k + i_b.to(tl.int64) * sk_b + i_hk * sk_h
    v_b = v + i_b.to(tl.int64) * sv_b + i_hk * sv_h
    p_bias = bias + i_b.to(tl.int64) * sb_b + heads[:, None] * sb_h
    if STEP_BIAS:  # this step's log-decay per head, added to every earlier key's (the newest key's is 0)
        b_step = tl.load(step_bias + i_b * ss_b + heads, mask=m_m, other=0.0)
    for c0 in range(start, end, BN):
        cols = c0 + tl.arange(0, BN)
        m_c = cols < end
        ok = m_c & (tl.load(valid + i_b * s_valid + cols, mask=m_c, other=0) != 0)
        m_t = m_c[:, None] & m_d[None, :]
        b_k = tl.load(k_b + cols[:, None].to(tl.int64) * sk_t + o_d[None, :], mask=m_t, other=0.0)
        if IEEE:
            s = tl.dot(b_q, tl.trans(b_k), input_precision="ieee") * scale  # [BM, BN]
        else:
            s = tl.dot(b_q, tl.trans(b_k)) * scale
        if HAS_CLAMP:
            s = tl.minimum(s, clamp)
        if HAS_BIAS:  # each key's log-decay through this query
            m_b = m_m[:, None] & m_c[None, :]
            b_b = tl.load(p_bias + cols[None, :], mask=m_b, other=0.0)
            if STEP_BIAS:
                b_b = tl.where(cols[None, :] == n - 1, 0.0, b_b + b_step[:, None])
                tl.store(p_bias + cols[None, :], b_b, mask=m_b)
            s += b_b
        s = tl.where(ok[None, :], s * 1.4426950408889634, float("-inf"))  # log2 units
        m_new = tl.maximum(b_m, tl.max(s, axis=1))
        alpha = tl.exp2(b_m - m_new)
        p = tl.exp2(s - m_new[:, None])  # 0 where masked
        b_v = tl.load(v_b + cols[:, None].to(tl.int64) * sv_t + o_d[None, :], mask=m_t, other=0.0)
        if IEEE:
            b_acc = b_acc * alpha[:, None] + tl.dot(p.to(b_v.dtype), b_v, input_precision="ieee")
        else:
            b_acc = b_acc * alpha[:, None] + tl.dot(p.to(b_v.dtype), b_v)
        b_l = b_l * alpha + tl.sum(p, axis=1)
        b_c += tl.sum(ok.to(tl.float32), axis=0)
        b_m = m_new
    base = (i_b * H + heads) * NS + i_s  # [BM]
    tl.store(part_o + base[:, None] * D + o_d[None, :], b_acc, mask=m_m[:, None] & m_d[None, :])
    o_3 = tl.arange(0, 4)
    stats = tl.where(o_3[None, :] == 0, b_m[:, None], tl.where(o_3[None, :] == 1, b_l[:, None], b_c[:, None]))
    tl.store(part_ml + base[:, None] * 3 + o_3[None, :], stats, mask=m_m[:, None] & (o_3[None, :] < 3))


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
                     out_dtype: torch.dtype | None = None, step_bias: torch.Tensor | None = None):
    """q [B, H, D]; key, value [B, capacity, Hkv, D] (last dim contiguous); valid [B, capacity]
    (nonzero: a real token); length [B] int64 (columns written). Scores are scale * q.k, clamped
    from above at `clamp`, plus `bias` [B, H, capacity] fp32 (each key's log-decay) when given.
    With `step_bias` [B, H] fp32 the bias is first advanced in place, as the step reads it: this
    step's value is added to every written column's and the newest column's (length - 1) set to 0.
    Returns o [B, H, D] (the softmax-weighted values) in `out_dtype` (q's dtype by default), and
    with `stats` also [B, H, 3] fp32: (log2 of the reference weight, sum of weights relative to it,
    keys attended): the raw sum of exp(scores) is stats[..., 1] * 2 ** stats[..., 0]."""
    batch, heads, head_dim = q.shape
    capacity, kv_heads = key.shape[1], key.shape[2]
    if heads % kv_heads or key.shape[-1] != head_dim or value.shape != key.shape:
        raise ValueError(f"q {tuple(q.shape)} does not match key {tuple(key.shape)} / value {tuple(value.shape)}")
    if q.stride(-1) != 1 or key.stride(-1) != 1 or value.stride(-1) != 1 or valid.stride(-1) != 1:
        raise ValueError("decode_attention needs q, key, value and valid contiguous in their last dim")
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (batch, heads, capacity) or bias.stride(2) != 1):
        raise ValueError(f"bias must be fp32 [{batch}, {heads}, {capacity}] with its columns contiguous")
    if step_bias is not None and (bias is None or step_bias.dtype != torch.float32 or step_bias.shape != (batch, heads)
                                  or step_bias.stride(1) != 1):
        raise ValueError(f"step_bias must be fp32 [{batch}, {heads}] with its heads contiguous, beside a bias")
    group = heads // kv_heads
    splits = splits_for(batch * kv_heads, capacity)
    split = triton.cdiv(triton.cdiv(capacity, splits), BLOCK_N) * BLOCK_N
    splits = triton.cdiv(capacity, split)
    part_o = torch.empty(batch * heads * splits, head_dim, dtype=torch.float32, device=q.device)
    part_ml = torch.empty(batch * heads * splits, 3, dtype=torch.float32, device=q.device)
    block_d = max(16, triton.next_power_of_2(head_dim))
    _partial_kernel[(batch * kv_heads, splits)](
        q, key, value, valid, length, bias if bias is not None else part_ml, step_bias if step_bias is not None else part_ml,
        part_o, part_ml, scale, clamp if clamp is not None else 0.0,
        q.stride(0), q.stride(1), key.stride(0), key.stride(1), key.stride(2), value.stride(0), value.stride(1), value.stride(2),
        valid.stride(0), bias.stride(0) if bias is not None else 0, bias.stride(1) if bias is not None else 0,
        step_bias.stride(0) if step_bias is not None else 0,
        H=heads, GROUP=group, BM=max(16, triton.next_power_of_2(group)), D=head_dim, BD=block_d, SPLIT=split, NS=splits,
        BN=BLOCK_N, HAS_CLAMP=clamp is not None, HAS_BIAS=bias is not None, STEP_BIAS=step_bias is not None,
        IEEE=key.dtype == torch.float32, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    o = torch.empty(batch, heads, head_dim, dtype=out_dtype or q.dtype, device=q.device)
    summary = torch.empty(batch, heads, 3, dtype=torch.float32, device=q.device) if stats else part_ml
    _combine_kernel[(batch * heads,)](part_o, part_ml, o, summary, o.stride(0), o.stride(1), H=heads, D=head_dim, BD=block_d,
                                      NS=splits, BS=triton.next_power_of_2(splits), STATS=stats, num_warps=4)
    return (o, summary) if stats else o


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
    "rotate half" convention of `ops.common.apply_rotary`)."""
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


@triton.jit
def _kv_write_kernel(k, v, length, position, key, value, valid, sk_b, sk_h, sv_b, sv_h,
                     skey_b, skey_t, skey_h, sval_b, sval_t, sval_h, s_valid,
                     HKV: tl.constexpr, D: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr):
    # one program per row: it alone reads and advances the row's counters, so no other program races it
    i_b = tl.program_id(0)
    o_h, o_d = tl.arange(0, BH), tl.arange(0, BD)
    m = (o_h[:, None] < HKV) & (o_d[None, :] < D)
    column = tl.load(length + i_b).to(tl.int64)
    b_k = tl.load(k + i_b * sk_b + o_h[:, None] * sk_h + o_d[None, :], mask=m, other=0.0)
    b_v = tl.load(v + i_b * sv_b + o_h[:, None] * sv_h + o_d[None, :], mask=m, other=0.0)
    tl.store(key + i_b.to(tl.int64) * skey_b + column * skey_t + o_h[:, None] * skey_h + o_d[None, :],
             b_k.to(key.dtype.element_ty), mask=m)
    tl.store(value + i_b.to(tl.int64) * sval_b + column * sval_t + o_h[:, None] * sval_h + o_d[None, :],
             b_v.to(value.dtype.element_ty), mask=m)
    o_1 = tl.arange(0, 2)
    first = o_1 < 1
    tl.store(valid + i_b * s_valid + column + o_1, tl.full([2], 1, tl.uint8), mask=first)
    tl.store(length + i_b + o_1, (column + 1 + o_1 * 0).to(length.dtype.element_ty), mask=first)
    p_pos = position + i_b + o_1
    tl.store(p_pos, tl.load(p_pos, mask=first, other=0) + 1, mask=first)


def kv_write_(k: torch.Tensor, v: torch.Tensor, length: torch.Tensor, position: torch.Tensor, key: torch.Tensor,
              value: torch.Tensor, valid: torch.Tensor) -> None:
    """One decode step's cache write in one launch (the eager form takes about seven): k, v
    [B, Hkv, D] (last dim contiguous) at each row's column `length` [B] of key, value
    [B, capacity, Hkv, D], valid [B, capacity] (uint8) set there, then `length` and `position` [B]
    advanced by one, in place: every row holds a real token (the static engine's steps)."""
    batch, kv_heads, head_dim = k.shape
    if k.stride(-1) != 1 or v.stride(-1) != 1 or v.shape != k.shape:
        raise ValueError("kv_write_ needs k and v of one shape, contiguous in their last dim")
    _kv_write_kernel[(batch,)](
        k, v, length, position, key, value, valid, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        key.stride(0), key.stride(1), key.stride(2), value.stride(0), value.stride(1), value.stride(2), valid.stride(0),
        HKV=kv_heads, D=head_dim, BH=triton.next_power_of_2(kv_heads), BD=triton.next_power_of_2(head_dim), num_warps=4,
    )
