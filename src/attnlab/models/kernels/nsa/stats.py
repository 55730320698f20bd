"""NSA's training-health statistics of one forward in two Triton launches (`ops.nsa.stats_values`
computes the same values in PyTorch: the reference, and the CPU path of `mixers/nsa.py` `_record_stats`).

On every training forward that records them, the statistics are ~30 small PyTorch kernels per layer:
measured on an H100 (12 layers, 2 x 2048, step captured as CUDA graphs) they took 4.4 % of the step.
Here one kernel reads the gates [B, T, H, 3], the token positions [B, T] and the selected blocks
[B, T, Hkv, S] once and writes each program's partial sums; a one-program kernel adds them and writes
the finished values into the layer's statistics buffer in place (keeping the previous values when
the forward had no real tokens), so the statistics cost two launches and no host synchronisation.

Partial sums per program (fp32 columns): real tokens, gate entropy, largest gate, selected blocks,
pairs at the cap, the 3 branch shares, then each head's 3 gate sums.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_R = 64  # tokens per program
_HEAD_COLS = 5 + 3  # the scalar columns before the per-head gate sums


@triton.jit
def _partials_kernel(G, POS, IDX, PART, R, sg_r, sidx_r, sidx_h,
                     H: tl.constexpr, HKV: tl.constexpr, S: tl.constexpr, K_MAX: tl.constexpr, COLS: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr):
    pid = tl.program_id(0)
    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < R
    pos = tl.load(POS + r, mask=r_ok, other=-1)
    real = tl.where(r_ok & (pos >= 0), 1.0, 0.0)  # [BLOCK_R]
    h = tl.arange(0, BLOCK_H)
    h_ok = h < H
    m = r_ok[:, None] & h_ok[None, :]
    g_ptr = G + r.to(tl.int64)[:, None] * sg_r + h[None, :] * 3
    g0 = tl.load(g_ptr, mask=m, other=1.0).to(tl.float32)
    g1 = tl.load(g_ptr + 1, mask=m, other=1.0).to(tl.float32)
    g2 = tl.load(g_ptr + 2, mask=m, other=1.0).to(tl.float32)
    total = g0 + g1 + g2
    s0, s1, s2 = g0 / total, g1 / total, g2 / total
    entropy = -(s0 * tl.log(tl.maximum(s0, 1e-12)) + s1 * tl.log(tl.maximum(s1, 1e-12)) + s2 * tl.log(tl.maximum(s2, 1e-12)))
    w = tl.where(m, real[:, None], 0.0)  # [BLOCK_R, BLOCK_H]: real tokens, real heads
    out = PART + pid.to(tl.int64) * COLS
    tl.store(out, tl.sum(real, axis=0))
    tl.store(out + 1, tl.sum(tl.sum(entropy * w, axis=1), axis=0))
    tl.store(out + 2, tl.sum(tl.sum(tl.maximum(tl.maximum(g0, g1), g2) * w, axis=1), axis=0))
    # selected blocks per (token, kv head): the valid slots of its row
    s = tl.arange(0, BLOCK_S)
    selected = tl.zeros([BLOCK_R], dtype=tl.float32)
    at_cap = tl.zeros([BLOCK_R], dtype=tl.float32)
    for kh in tl.static_range(HKV):
        idx = tl.load(IDX + r.to(tl.int64)[:, None] * sidx_r + kh * sidx_h + s[None, :],
                      mask=r_ok[:, None] & (s < S)[None, :], other=-1)
        k = tl.sum(tl.where(idx >= 0, 1.0, 0.0), axis=1)
        selected += k
        at_cap += tl.where(k == K_MAX, 1.0, 0.0)
    tl.store(out + 3, tl.sum(selected * real, axis=0))
    tl.store(out + 4, tl.sum(at_cap * real, axis=0))
    tl.store(out + 5, tl.sum(tl.sum(s0 * w, axis=1), axis=0))
    tl.store(out + 6, tl.sum(tl.sum(s1 * w, axis=1), axis=0))
    tl.store(out + 7, tl.sum(tl.sum(s2 * w, axis=1), axis=0))
    heads = out + 8 + h * 3
    tl.store(heads, tl.sum(g0 * w, axis=0), mask=h_ok)
    tl.store(heads + 1, tl.sum(g1 * w, axis=0), mask=h_ok)
    tl.store(heads + 2, tl.sum(g2 * w, axis=0), mask=h_ok)


@triton.jit
def _finish_kernel(PART, OUT, programs, H: tl.constexpr, HKV: tl.constexpr, COLS: tl.constexpr,
                   BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    c = tl.arange(0, BLOCK_C)
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for start in range(0, programs, BLOCK_P):
        p = start + tl.arange(0, BLOCK_P)
        part = tl.load(PART + p.to(tl.int64)[:, None] * COLS + c[None, :], mask=(p < programs)[:, None] & (c < COLS)[None, :], other=0.0)
        acc += tl.sum(part, axis=0)
    tokens = tl.sum(tl.where(c == 0, acc, 0.0), axis=0)
    count = tl.maximum(tokens, 1.0)
    per_head = count * H
    per_kv = count * HKV
    # collapse: the share of heads whose mean gate on some branch exceeds 0.99
    head_col = c - 8
    is_head = (head_col >= 0) & (c < COLS)
    hot = tl.where(is_head & (acc / count > 0.99), 1.0, 0.0)  # [BLOCK_C]: per (head, branch)
    collapsed = tl.zeros([BLOCK_C], dtype=tl.float32)
    for hh in tl.static_range(H):  # a head is collapsed if any of its 3 columns is hot
        any_hot = tl.max(tl.where((head_col >= hh * 3) & (head_col < hh * 3 + 3), hot, 0.0), axis=0)
        collapsed += tl.where(c == 0, any_hot, 0.0)
    collapse = tl.sum(collapsed, axis=0) / H

    entropy = tl.sum(tl.where(c == 1, acc, 0.0), axis=0) / per_head
    max_gate = tl.sum(tl.where(c == 2, acc, 0.0), axis=0) / per_head
    k_mean = tl.sum(tl.where(c == 3, acc, 0.0), axis=0) / per_kv
    at_cap = tl.sum(tl.where(c == 4, acc, 0.0), axis=0) / per_kv * 100.0
    o = tl.arange(0, 8)
    values = tl.where(o == 0, entropy, 0.0)
    values = tl.where(o == 1, max_gate, values)
    values = tl.where(o == 2, collapse, values)
    for b in tl.static_range(3):  # the branch shares: columns 5, 6, 7 -> values 3, 4, 5
        values = tl.where(o == 3 + b, tl.sum(tl.where(c == 5 + b, acc, 0.0), axis=0) / per_head, values)
    values = tl.where(o == 6, k_mean, values)
    values = tl.where(o == 7, at_cap, values)
    keep = tl.load(OUT + o)
    tl.store(OUT + o, tl.where(tokens > 0, values, keep))


def record_stats(out: torch.Tensor, g: torch.Tensor, pos: torch.Tensor, block_indices: torch.Tensor, block_counts: int) -> None:
    """Write NSA's statistics of one forward into `out` ([8] fp32, in the order of
    `ops.nsa.STAT_NAMES`), in place; `out` keeps its values when no token is real (pos < 0 everywhere).
    g [B, T, H, 3] gates; pos [B, T] (negative: padding); block_indices [B, T, Hkv, S] (negative: no block)."""
    batch, seq_len, heads, _ = g.shape
    kv_heads, slots = block_indices.shape[2], block_indices.shape[3]
    rows = batch * seq_len
    g = g.reshape(rows, heads * 3)
    if g.stride(-1) != 1:
        g = g.contiguous()
    idx = block_indices.reshape(rows, kv_heads, slots)
    if idx.stride(-1) != 1:
        idx = idx.contiguous()
    pos = pos.reshape(rows).contiguous()
    cols = _HEAD_COLS + heads * 3
    programs = triton.cdiv(rows, _BLOCK_R)
    partials = torch.empty(programs, cols, dtype=torch.float32, device=g.device)
    if programs:
        _partials_kernel[(programs,)](
            g, pos, idx, partials, rows, g.stride(0), idx.stride(0), idx.stride(1),
            H=heads, HKV=kv_heads, S=slots, K_MAX=block_counts, COLS=cols,
            BLOCK_R=_BLOCK_R, BLOCK_H=triton.next_power_of_2(heads), BLOCK_S=triton.next_power_of_2(slots),
        )
    _finish_kernel[(1,)](partials, out, programs, H=heads, HKV=kv_heads, COLS=cols,
                         BLOCK_P=32, BLOCK_C=triton.next_power_of_2(cols))
