"""One NSA decoding step as one Triton kernel: what `attnlab.models.ops.nsa.nsa_step` computes (the
module docstring there defines the function), read straight from the static cache's buffers.

One program per (batch row, kv head) holds the G query heads of its group as the rows of a tile
(padded to a power of two, at least 16, for `tl.dot`) and, in order:

1. compressed branch: an online softmax over the row's complete blocks (c + 1) * bs - 1 <= pos, in
   tiles of compressed keys; a row with no complete block outputs 0, as `_masked_softmax` does;
2. importance: a second pass over the same tiles writes each visible block's compressed attention
   probability summed over the group's heads into a small fp32 scratch row [C];
3. selection, as `select_blocks` defines it: the forced blocks first (the first `initial_blocks`,
   then the `local_blocks` ending at the query's own block, in increasing order, none after it),
   then one round per remaining slot, each taking the visible, not forced block of highest
   importance below the previous pick in the order (importance descending, block index
   ascending): equal importances go to the lower block index first. torch.topk gives no such
   promise for ties, so the reference may fill the last slot with another block of the same
   importance (the outputs then agree; the index sets may not). Slots with nothing left hold -1;
4. selected branch: an online softmax over each selected block's tokens at or before pos, taken as
   the block is chosen; then the sliding window (the last `window_size` tokens, pos included);
5. the gates mix the three branch outputs in fp32; o is written in q's dtype and the selected
   blocks to block_indices [B, Hkv, S] in the order above.

Keys and values are read in their own dtype ([B, L, Hkv, D] with any strides, the head dim
contiguous) into `tl.dot` (fp32 accumulation; fp32 operands use IEEE fp32, not tf32); nothing is
copied. The eager reference launches ~150 small kernels per layer (gathers, fp32 copies, einsums,
topk); a decode step is bound by their number. Under TRITON_INTERPRET=1 the kernel runs on CPU
tensors (tests/test_nsa_step_kernel.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnlab.models.kernels.limits import nsa_step_gap
from attnlab.models.ops.nsa import check_selection_counts

LOG2E = 1.4426950408889634  # log2(e): the kernel works in base 2
SELECT_TILE = 1024  # importances read at a time while choosing a block


@triton.jit
def _attend_tokens(q, m_i, l_i, acc, K, V, k_base, v_base, stride_kt, stride_vt, first, stop, offs_d, d_ok, qk_scale,
                   BT: tl.constexpr, PRECISION: tl.constexpr):
    """One online-softmax update of the rows of q over the tokens [first, stop) (at most BT)."""
    toks = first + tl.arange(0, BT)
    ok = toks < stop
    toks64 = toks.to(tl.int64)
    k = tl.load(K + k_base + toks64[:, None] * stride_kt + offs_d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
    v = tl.load(V + v_base + toks64[:, None] * stride_vt + offs_d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
    s = tl.where(ok[None, :], tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _nsa_step_kernel(
    Q, K, V, KC, VC, GC, GS, GW, POS, O, IDX, IMP,
    stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
    stride_gcb, stride_gch, stride_gsb, stride_gsh, stride_gwb, stride_gwh, stride_ob, stride_oh,
    length, num_cmp, window, qk_scale,
    HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, S: tl.constexpr,
    INITIAL: tl.constexpr, LOCAL: tl.constexpr,
    BG: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BSEL: tl.constexpr, PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    b = (pid // HKV).to(tl.int64)
    h = pid % HKV
    pos = tl.load(POS + b).to(tl.int32)
    rows = tl.arange(0, BG)
    row_ok = rows < G
    heads = h * G + rows
    offs_d = tl.arange(0, BD)
    d_ok = offs_d < D
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q = q.to(K.dtype.element_ty)

    # 1. compressed branch over the complete blocks at or before pos (that have compressed keys)
    n_vis = tl.minimum(tl.maximum(pos + 1, 0) // BS, num_cmp)
    kc_base = b * stride_kcb + h * stride_kch
    vc_base = b * stride_vcb + h * stride_vch
    m_i = tl.full([BG], float("-inf"), tl.float32)
    l_i = tl.zeros([BG], tl.float32)
    acc = tl.zeros([BG, BD], tl.float32)
    for start in range(0, n_vis, BC):
        cols = start + tl.arange(0, BC)
        col_ok = cols < n_vis
        kc = tl.load(KC + kc_base + cols[:, None].to(tl.int64) * stride_kct + offs_d[None, :], mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        vc = tl.load(VC + vc_base + cols[:, None].to(tl.int64) * stride_vct + offs_d[None, :], mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        s = tl.where(col_ok[None, :], tl.dot(q, tl.trans(kc), input_precision=PRECISION) * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(vc.dtype), vc, input_precision=PRECISION)
        m_i = m_new
    seen = l_i > 0
    l_safe = tl.where(seen, l_i, 1.0)
    g_off = b * stride_gcb + heads * stride_gch
    g_cmp = tl.load(GC + g_off, mask=row_ok, other=0.0).to(tl.float32)
    out = (acc / l_safe[:, None]) * g_cmp[:, None]

    # 2. importance: the group's summed compressed probabilities of each visible block
    lse = tl.where(seen & row_ok, m_i + tl.log2(l_safe), float("inf"))  # +inf: the row adds nothing
    imp_row = IMP + pid.to(tl.int64) * num_cmp
    for start in range(0, n_vis, BC):
        cols = start + tl.arange(0, BC)
        col_ok = cols < n_vis
        kc = tl.load(KC + kc_base + cols[:, None].to(tl.int64) * stride_kct + offs_d[None, :], mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        s = tl.dot(q, tl.trans(kc), input_precision=PRECISION) * qk_scale
        p = tl.where(col_ok[None, :], tl.exp2(s - lse[:, None]), 0.0)
        tl.store(imp_row + cols, tl.sum(p, 0), mask=col_ok)
    tl.debug_barrier()  # every thread's importance is written before any thread reads it

    # 3-4. selection, each chosen block attended as it is chosen
    k_base = b * stride_kb + h * stride_kh
    v_base = b * stride_vb + h * stride_vh
    idx_row = IDX + pid.to(tl.int64) * S
    current = tl.where(pos >= 0, pos // BS, -1)  # the query's own block
    stop_pos = tl.minimum(pos + 1, length)  # tokens at or before pos
    m_i = tl.full([BG], float("-inf"), tl.float32)
    l_i = tl.zeros([BG], tl.float32)
    acc = tl.zeros([BG, BD], tl.float32)
    slot = tl.full([], 0, tl.int32)
    n_initial = tl.minimum(current + 1, INITIAL)
    for c in range(n_initial):  # forced: the first blocks
        m_i, l_i, acc = _attend_tokens(q, m_i, l_i, acc, K, V, k_base, v_base, stride_kt, stride_vt, c * BS,
                                       tl.minimum((c + 1) * BS, stop_pos), offs_d, d_ok, qk_scale, BT, PRECISION)
        tl.store(idx_row + slot, (tl.zeros([], IDX.dtype.element_ty) + c))
        slot += 1
    for c in range(tl.maximum(current - LOCAL + 1, INITIAL), current + 1):  # forced: the local blocks
        m_i, l_i, acc = _attend_tokens(q, m_i, l_i, acc, K, V, k_base, v_base, stride_kt, stride_vt, c * BS,
                                       tl.minimum((c + 1) * BS, stop_pos), offs_d, d_ok, qk_scale, BT, PRECISION)
        tl.store(idx_row + slot, (tl.zeros([], IDX.dtype.element_ty) + c))
        slot += 1
    prev_v = tl.full([], float("inf"), tl.float32)
    prev_i = tl.full([], -1, tl.int32)
    for _ in range(slot, S):  # the best other visible blocks, one per round
        best_v = tl.full([], -1.0, tl.float32)  # importances are >= 0
        best_i = tl.full([], -1, tl.int32)
        for start in range(0, n_vis, BSEL):
            cols = start + tl.arange(0, BSEL)
            imp = tl.load(imp_row + cols, mask=cols < n_vis, other=-1.0)
            forced = (cols < INITIAL) | (cols > current - LOCAL)
            after_prev = (imp < prev_v) | ((imp == prev_v) & (cols > prev_i))
            ok = (cols < n_vis) & (~forced) & after_prev
            v = tl.where(ok, imp, -1.0)
            tile_v = tl.max(v, 0)
            tile_i = tl.min(tl.where(ok & (v == tile_v), cols, 2147483647), 0)
            take = tile_v > best_v  # tiles go up in block index: an equal value later is a higher index
            best_i = tl.where(take, tile_i, best_i)
            best_v = tl.where(take, tile_v, best_v)
        first = best_i * BS
        stop = tl.where(best_i >= 0, tl.minimum(first + BS, stop_pos), first)
        m_i, l_i, acc = _attend_tokens(q, m_i, l_i, acc, K, V, k_base, v_base, stride_kt, stride_vt, first, stop,
                                       offs_d, d_ok, qk_scale, BT, PRECISION)
        tl.store(idx_row + slot, best_i.to(IDX.dtype.element_ty))
        slot += 1
        prev_v = best_v
        prev_i = best_i
    g_slc = tl.load(GS + b * stride_gsb + heads * stride_gsh, mask=row_ok, other=0.0).to(tl.float32)
    out += (acc / tl.where(l_i > 0, l_i, 1.0)[:, None]) * g_slc[:, None]

    # 4. sliding window: the last `window` tokens, pos included
    m_i = tl.full([BG], float("-inf"), tl.float32)
    l_i = tl.zeros([BG], tl.float32)
    acc = tl.zeros([BG, BD], tl.float32)
    for start in range(tl.maximum(pos - window + 1, 0), stop_pos, BT):
        m_i, l_i, acc = _attend_tokens(q, m_i, l_i, acc, K, V, k_base, v_base, stride_kt, stride_vt, start,
                                       tl.minimum(start + BT, stop_pos), offs_d, d_ok, qk_scale, BT, PRECISION)
    g_swa = tl.load(GW + b * stride_gwb + heads * stride_gwh, mask=row_ok, other=0.0).to(tl.float32)
    out += (acc / tl.where(l_i > 0, l_i, 1.0)[:, None]) * g_swa[:, None]

    o_ptr = O + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptr, out.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _strides(x: torch.Tensor, name: str) -> tuple[int, ...]:
    if x.stride(-1) != 1:
        raise ValueError(f"nsa_step_kernel: {name} must be contiguous in its last dim, got strides {x.stride()}")
    return x.stride()[:-1]


def nsa_step_kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cmp: torch.Tensor,
    v_cmp: torch.Tensor,
    g_cmp: torch.Tensor,
    g_slc: torch.Tensor,
    g_swa: torch.Tensor,
    block_size: int,
    block_counts: int,
    window_size: int,
    q_pos: torch.Tensor,
    scale: float | None = None,
    initial_blocks: int = 1,
    local_blocks: int = 2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`nsa_step` in one launch. q [B, H, D]; k, v [B, L, Hkv, D]; k_cmp, v_cmp [B, C, Hkv, D]; gates
    [B, H]; q_pos [B] (-1: padding). Returns (o [B, H, D] in q's dtype, block_indices [B, Hkv, S]
    int64, -1 in unused slots; order: forced blocks, then by importance, see the module docstring)."""
    check_selection_counts(block_counts, initial_blocks, local_blocks)
    batch, heads, dim = q.shape
    length, kv_heads = k.shape[1], k.shape[2]
    num_cmp = k_cmp.shape[1]
    if heads % kv_heads or v.shape != k.shape or k_cmp.shape[2:] != k.shape[2:] or v_cmp.shape != k_cmp.shape:
        raise ValueError(f"nsa_step_kernel: inconsistent shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"k_cmp {tuple(k_cmp.shape)}, v_cmp {tuple(v_cmp.shape)}")
    if len({k.dtype, v.dtype, k_cmp.dtype, v_cmp.dtype}) > 1 or k.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"nsa_step_kernel: k, v, k_cmp, v_cmp must share one dtype of bf16, fp16, fp32, got "
                         f"{k.dtype}, {v.dtype}, {k_cmp.dtype}, {v_cmp.dtype}")
    groups = heads // kv_heads
    gap = nsa_step_gap(dim, block_size, groups)
    if gap:
        raise ValueError(f"nsa_step_kernel does not cover {gap}")
    scale = dim ** -0.5 if scale is None else scale
    o = torch.empty(batch, heads, dim, dtype=q.dtype, device=q.device)
    block_indices = torch.empty(batch, kv_heads, block_counts, dtype=torch.long, device=q.device)
    importance = torch.empty(batch * kv_heads, max(num_cmp, 1), dtype=torch.float32, device=q.device)
    q_pos = q_pos.contiguous()
    BT = max(16, triton.next_power_of_2(block_size))
    BC = max(16, min(32, triton.next_power_of_2(max(num_cmp, 1))))  # compressed keys per tile
    BSEL = max(16, min(SELECT_TILE, triton.next_power_of_2(max(num_cmp, 1))))
    # sm_90, compiled ahead: 4 warps hold bf16 head dims up to 64 without spilling (128 registers a
    # thread at 64, blocks of 16); wider heads and fp32 operands spill with 4 and take 8
    num_warps = 4 if k.element_size() <= 2 and dim <= 64 else 8
    _nsa_step_kernel[(batch * kv_heads,)](
        q, k, v, k_cmp, v_cmp, g_cmp, g_slc, g_swa, q_pos, o, block_indices, importance,
        *_strides(q, "q"), *_strides(k, "k"), *_strides(v, "v"), *_strides(k_cmp, "k_cmp"), *_strides(v_cmp, "v_cmp"),
        *g_cmp.stride(), *g_slc.stride(), *g_swa.stride(), *_strides(o, "o"),
        length, num_cmp, window_size, scale * LOG2E,
        HKV=kv_heads, G=groups, D=dim, BS=block_size, S=block_counts, INITIAL=initial_blocks, LOCAL=local_blocks,
        BG=max(16, triton.next_power_of_2(groups)), BD=max(16, triton.next_power_of_2(dim)), BT=BT, BC=BC, BSEL=BSEL,
        PRECISION="ieee" if k.dtype == torch.float32 else "tf32", num_warps=num_warps,
    )
    return o, block_indices
