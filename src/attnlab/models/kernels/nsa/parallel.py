"""Native sparse attention's training and prefill form as Triton kernels: memory linear in the
sequence length, forward and backward.

`parallel_nsa` computes what `attnlab.models.ops.nsa.parallel_nsa` computes (the module docstring
there defines the function) without its dense [T, L] masks:

* compressed branch (`_range_forward` over k_cmp, v_cmp): FlashAttention-2 over the compressed
  keys, key c sitting at position (c + 1) * block_size - 1 (the last token of its block), so that
  "visible" is the causal test. One program holds a tile of queries of one head and walks over
  the tiles of keys its queries can see, with an online softmax; it keeps each row's log-sum-exp.
* sliding window (`_range_forward` over k, v): the same kernels, key j at position j, visible
  when q_pos - window_size < j <= q_pos.
* selection: the group's summed compressed probabilities, recomputed by `_importance` from q,
  k_cmp and the compressed branch's log-sum-exp on chunks of queries (no [B, Hkv, T, C] tensor
  larger than `SELECT_CHUNK_ELEMENTS`), then `select_blocks` itself on each chunk, without
  gradient (as the reference detaches them).
* selected branch (`_selected_forward`): one program per (batch, query, kv head) holds the G query
  heads of its group as the rows of a tile (padded to a power of two, at least 16) and walks over
  its selected blocks. dq comes from the same per-query programs; dk, dv from programs over the
  (query, slot) pairs sorted by block (for each key block, the queries that selected it), a fixed
  number of pairs each, added into fp32 buffers.
* the gates mix the three outputs in fp32 (`_gate_mix`), keeping only the branch outputs.

Forward and backward are one torch custom op each (`attnlab::nsa_parallel_fwd`, `attnlab::nsa_parallel_bwd`).

Rows with nothing to attend (padding queries, q_pos = -1, or no complete block yet) output 0 and
get zero gradient: their log-sum-exp is stored as +inf, so every recomputed probability is 0.
Operands in bf16 (or fp32), accumulation in fp32. Under TRITON_INTERPRET=1 the same kernels run on
CPU tensors (slowly): the tests use that in CI.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from attnlab.models.ops.nsa import cdiv, check_selection_counts, select_blocks
from attnlab.models.kernels.eager import outside_compile

LOG2E = 1.4426950408889634  # log2(e): the kernels work in base 2
NO_WINDOW = 1 << 30  # the compressed branch: every complete past block
NO_WINDOW_INT = tl.constexpr(NO_WINDOW)
SELECT_CHUNK_ELEMENTS = 1 << 24  # fp32 importance scores per chunk of queries while selecting blocks (64 MiB)
ROWS_PER_PROGRAM = 2048  # (query, head) rows per program of the selected branch's dk, dv kernel
QUERY_TILES_PER_PROGRAM = 16  # query tiles per program of the compressed branch's dk, dv kernel
PROGRAMS_WANTED = 512  # the dk, dv kernels of the compressed and window branches split heads up to this


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _tiles(dim: int) -> tuple[int, int]:
    """(queries, keys) per tile of the compressed and window kernels: smaller for wide heads, whose
    tiles and fp32 accumulators would not fit in registers."""
    if _interpreting():
        return 16, 16
    return (64, 64) if dim <= 64 else (64, 32) if dim <= 128 else (32, 32)


def _warps(dim: int, heavy: bool = False) -> int:
    """Warps per program: 8 where 4 would spill registers on an H100 (`heavy`: the dk, dv kernels,
    which hold two fp32 accumulators, and the importance kernel; every kernel past head dim 64),
    else 4 (compiled for sm_90 by Triton 3.6: no spills at head dims 64 and 128, a few at 256)."""
    return 8 if heavy or dim > 64 else 4


def _dim_block(dim: int) -> int:
    return max(16, triton.next_power_of_2(dim))


# ------------------------------------------------------------------ compressed and window branches
#
# q [B, T, H, D], k, v [B, N, Hkv, D], o [B, T, H, D], lse and delta [B, T, H] (fp32, log2 units),
# q_pos [B, T] (int32), all contiguous. Key j sits at position j * KMUL + KOFF; query row i sees it
# when pos_i - WINDOW < j * KMUL + KOFF <= pos_i.


@triton.jit
def _range_fwd(Q, K, V, O, LSE, QPOS, qk_scale, T, N, H, G, D, KMUL, KOFF, WINDOW,
               BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)  # 64-bit only in the per-row base offsets; int32 within a row
    h = bh % H
    kv_heads = H // G
    hk = h // G
    q_base = b * T * H * D + h * D
    kv_base = b * N * kv_heads * D + hk * D
    QPOS += b * T
    LSE += b * T * H + h
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    row_ok = rows < T
    offs_d = tl.arange(0, BD)
    d_ok = offs_d < D
    pos = tl.load(QPOS + rows, mask=row_ok, other=-1)
    q_off = rows[:, None] * (H * D) + offs_d[None, :]
    q = tl.load(Q + q_base + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    pos_max = tl.max(pos, 0)
    pos_min = tl.min(tl.where(pos >= 0, pos, NO_WINDOW_INT), 0)
    first = (tl.maximum(pos_min - WINDOW + 1 - KOFF, 0) + KMUL - 1) // KMUL  # first key some row sees
    stop = tl.minimum((pos_max - KOFF + KMUL) // KMUL, N)  # past the last one
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BD], tl.float32)
    for start in range((first // BN) * BN, stop, BN):
        cols = start + tl.arange(0, BN)
        col_ok = cols < stop
        kv_off = cols[:, None] * (kv_heads * D) + offs_d[None, :]
        k = tl.load(K + kv_base + kv_off, mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(V + kv_base + kv_off, mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        key_pos = cols * KMUL + KOFF
        allowed = (key_pos[None, :] <= pos[:, None]) & (key_pos[None, :] > pos[:, None] - WINDOW) & col_ok[None, :]
        s = tl.where(allowed, (tl.dot(q, tl.trans(k)) * qk_scale).to(tl.float32), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    seen = l_i > 0
    l_safe = tl.where(seen, l_i, 1.0)
    tl.store(O + q_base + q_off, (acc / l_safe[:, None]).to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(LSE + rows * H, tl.where(seen, m_i + tl.log2(l_safe), float("inf")), mask=row_ok)



@triton.jit
def _range_bwd_dq(Q, K, V, DO, DQ, LSE, DELTA, QPOS, qk_scale, sm_scale, T, N, H, G, D, KMUL, KOFF, WINDOW,
                  BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)  # 64-bit only in the per-row base offsets; int32 within a row
    h = bh % H
    kv_heads = H // G
    hk = h // G
    q_base = b * T * H * D + h * D
    kv_base = b * N * kv_heads * D + hk * D
    QPOS += b * T
    LSE += b * T * H + h
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    row_ok = rows < T
    offs_d = tl.arange(0, BD)
    d_ok = offs_d < D
    pos = tl.load(QPOS + rows, mask=row_ok, other=-1)
    q_off = rows[:, None] * (H * D) + offs_d[None, :]
    q = tl.load(Q + q_base + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    do = tl.load(DO + q_base + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    lse = tl.load(LSE + rows * H, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + b * T * H + h + rows * H, mask=row_ok, other=0.0)
    pos_max = tl.max(pos, 0)
    pos_min = tl.min(tl.where(pos >= 0, pos, NO_WINDOW_INT), 0)
    first = (tl.maximum(pos_min - WINDOW + 1 - KOFF, 0) + KMUL - 1) // KMUL
    stop = tl.minimum((pos_max - KOFF + KMUL) // KMUL, N)
    dq = tl.zeros([BM, BD], tl.float32)
    for start in range((first // BN) * BN, stop, BN):
        cols = start + tl.arange(0, BN)
        col_ok = cols < stop
        kv_off = cols[:, None] * (kv_heads * D) + offs_d[None, :]
        k = tl.load(K + kv_base + kv_off, mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(V + kv_base + kv_off, mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        key_pos = cols * KMUL + KOFF
        allowed = (key_pos[None, :] <= pos[:, None]) & (key_pos[None, :] > pos[:, None] - WINDOW) & col_ok[None, :]
        p = tl.where(allowed, tl.exp2((tl.dot(q, tl.trans(k)) * qk_scale).to(tl.float32) - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k)
    tl.store(DQ + q_base + q_off, (dq * sm_scale).to(DQ.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _range_bwd_dkdv(Q, K, V, DO, DK, DV, LSE, DELTA, QPOS, QLO, QHI, qk_scale, sm_scale, T, N, H, G, D,
                    KMUL, KOFF, WINDOW, KEY_TILES, HEADS_PER_PROGRAM, TILES_PER_PROGRAM,
                    ATOMIC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):
    """dk, dv of one tile of keys of one kv head from HEADS_PER_PROGRAM of its query heads
    (program_id(1) picks which) and up to TILES_PER_PROGRAM of the query tiles that may see it
    (program_id(2)); with ATOMIC the partial sums are added into fp32 DK, DV."""
    kv_heads = H // G
    head_splits = tl.cdiv(G, HEADS_PER_PROGRAM)
    bhk = tl.program_id(1) // head_splits
    g_first = (tl.program_id(1) % head_splits) * HEADS_PER_PROGRAM
    b = (bhk // kv_heads).to(tl.int64)
    hk = bhk % kv_heads
    tile = tl.program_id(0)
    cols = tile * BN + tl.arange(0, BN)
    col_ok = cols < N
    offs_d = tl.arange(0, BD)
    d_ok = offs_d < D
    kv_base = b * N * kv_heads * D + hk * D
    kv_off = cols[:, None] * (kv_heads * D) + offs_d[None, :]
    key_pos = cols * KMUL + KOFF
    first = tl.load(QLO + b * KEY_TILES + tile) + tl.program_id(2) * TILES_PER_PROGRAM  # query tiles that may see these keys
    stop = tl.minimum(tl.load(QHI + b * KEY_TILES + tile), first + TILES_PER_PROGRAM)
    if stop > first:
        k = tl.load(K + kv_base + kv_off, mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(V + kv_base + kv_off, mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        dk = tl.zeros([BN, BD], tl.float32)
        dv = tl.zeros([BN, BD], tl.float32)
        for g in range(g_first, tl.minimum(g_first + HEADS_PER_PROGRAM, G)):
            h = hk * G + g
            for m in range(first, stop):
                rows = m * BM + tl.arange(0, BM)
                row_ok = rows < T
                pos = tl.load(QPOS + b * T + rows, mask=row_ok, other=-1)
                q_off = rows[:, None] * (H * D) + offs_d[None, :]
                q_base = b * T * H * D + h * D
                q = tl.load(Q + q_base + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
                do = tl.load(DO + q_base + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
                lse = tl.load(LSE + b * T * H + h + rows * H, mask=row_ok, other=float("inf"))
                delta = tl.load(DELTA + b * T * H + h + rows * H, mask=row_ok, other=0.0)
                allowed = (key_pos[None, :] <= pos[:, None]) & (key_pos[None, :] > pos[:, None] - WINDOW) & col_ok[None, :]
                p = tl.where(allowed, tl.exp2((tl.dot(q, tl.trans(k)) * qk_scale).to(tl.float32) - lse[:, None]), 0.0)  # [BM, BN]
                dv += tl.dot(tl.trans(p).to(do.dtype), do)
                ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
                dk += tl.dot(tl.trans(ds).to(q.dtype), q)
        if ATOMIC:
            tl.atomic_add(DK + kv_base + kv_off, (dk * sm_scale).to(tl.float32), mask=col_ok[:, None] & d_ok[None, :])
            tl.atomic_add(DV + kv_base + kv_off, dv, mask=col_ok[:, None] & d_ok[None, :])
        else:
            tl.store(DK + kv_base + kv_off, (dk * sm_scale).to(DK.dtype.element_ty), mask=col_ok[:, None] & d_ok[None, :])
            tl.store(DV + kv_base + kv_off, dv.to(DV.dtype.element_ty), mask=col_ok[:, None] & d_ok[None, :])


def _query_tile_ranges(q_pos, block_m, key_tiles, block_n, kmul, koff, window):
    """For each row and tile of keys, the query tiles [first, stop) that may see one of its keys:
    int32 [B, key_tiles] each. Holds for any q_pos (padding -1 anywhere), tightest when the
    positions grow along the row."""
    batch, seq_len = q_pos.shape
    tiles = cdiv(seq_len, block_m)
    pos = torch.nn.functional.pad(q_pos.long(), (0, tiles * block_m - seq_len), value=-1).view(batch, tiles, block_m)
    latest = pos.max(-1).values.cummax(-1).values  # no query of an earlier tile is later than this
    earliest = torch.where(pos >= 0, pos, 1 << 40).min(-1).values.flip(-1).cummin(-1).values.flip(-1)
    start = torch.arange(key_tiles, device=q_pos.device) * block_n
    first_pos = (start * kmul + koff).expand(batch, -1).contiguous()
    last_pos = ((start + block_n - 1) * kmul + koff).expand(batch, -1).contiguous()
    # both bounds grow along the tiles: the tiles before `first` are those whose latest query is earlier than the key
    # tile's first key, the ones before `stop` those whose earliest query sees its last key (a count of [B, key tiles,
    # query tiles] comparisons: torch.searchsorted's Inductor lowering does not compile on Triton 3.6)
    first = (latest[:, None, :] < first_pos[:, :, None]).sum(-1)
    stop = (earliest[:, None, :] <= (last_pos + window - 1)[:, :, None]).sum(-1)
    return first.int().contiguous(), stop.int().contiguous()


def _range_forward(q, k, v, q_pos, scale, kmul, koff, window):
    """Softmax attention of q [B, T, H, D] over k, v [B, N, Hkv, D], key j at position j * kmul + koff,
    visible to a query at p when p - window < j * kmul + koff <= p. Returns o [B, T, H, D] and each
    row's log-sum-exp [B, T, H] (fp32, base 2, +inf where nothing is visible)."""
    batch, seq_len, heads, dim = q.shape
    num_keys, kv_heads = k.shape[1], k.shape[2]
    o = torch.empty_like(q)
    lse = torch.empty(batch, seq_len, heads, device=q.device, dtype=torch.float32)
    block_m, block_n = _tiles(dim)
    if num_keys == 0:
        o.zero_()
        lse.fill_(float("inf"))
    else:
        grid = (cdiv(seq_len, block_m), batch * heads)
        _range_fwd[grid](q, k, v, o, lse, q_pos, scale * LOG2E, seq_len, num_keys, heads, heads // kv_heads, dim,
                         kmul, koff, window, BM=block_m, BN=block_n, BD=_dim_block(dim), num_warps=_warps(dim))
    return o, lse


def _range_backward(q, k, v, o, lse, q_pos, do, scale, kmul, koff, window):
    """(dq, dk, dv) of `_range_forward`'s o for its gradient `do`."""
    batch, seq_len, heads, dim = q.shape
    num_keys, kv_heads = k.shape[1], k.shape[2]
    if num_keys == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)  # keys no query sees keep 0
    do = do.contiguous()
    delta = (do.float() * o.float()).sum(-1)  # [B, T, H]
    block_m, block_n = _tiles(dim)
    common = (scale * LOG2E, scale, seq_len, num_keys, heads, heads // kv_heads, dim, kmul, koff, window)
    blocks = dict(BM=block_m, BN=block_n, BD=_dim_block(dim))
    _range_bwd_dq[(cdiv(seq_len, block_m), batch * heads)](q, k, v, do, dq, lse, delta, q_pos, *common, **blocks,
                                                           num_warps=_warps(dim))
    key_tiles = cdiv(num_keys, block_n)
    first, stop = _query_tile_ranges(q_pos, block_m, key_tiles, block_n, kmul, koff, window)
    groups = heads // kv_heads
    # Enough programs to fill the GPU: the heads of a group, and for the compressed keys (few
    # tiles, each seen by every later query) the query tiles too, split over programs whose
    # partial sums are added into fp32 buffers.
    query_tiles = cdiv(seq_len, block_m)
    per_program = 2 if _interpreting() else QUERY_TILES_PER_PROGRAM  # the tests split too
    splits = 1 if window < NO_WINDOW else cdiv(query_tiles, per_program)
    tiles_per_program = query_tiles if splits == 1 else per_program
    head_splits = min(groups, cdiv(PROGRAMS_WANTED, key_tiles * batch * kv_heads * splits))
    heads_per_program = cdiv(groups, head_splits)
    head_splits = cdiv(groups, heads_per_program)
    atomic = splits > 1 or head_splits > 1
    if atomic:
        dk32 = torch.zeros(k.shape, device=k.device, dtype=torch.float32)
        dv32 = torch.zeros(v.shape, device=v.device, dtype=torch.float32)
    grid = (key_tiles, batch * kv_heads * head_splits, splits)
    _range_bwd_dkdv[grid](q, k, v, do, dk32 if atomic else dk, dv32 if atomic else dv, lse, delta, q_pos, first, stop,
                          *common, key_tiles, heads_per_program, tiles_per_program, ATOMIC=atomic, **blocks,
                          num_warps=_warps(dim, heavy=True))
    if atomic:
        dk, dv = dk32.to(k.dtype), dv32.to(v.dtype)
    return dq, dk, dv


# ------------------------------------------------------------------ selected branch
#
# block_indices [B, T, Hkv, S] (int32, -1 unused); a program's rows are the G heads of one kv head
# at one query (GP rows, the ones past G masked).


@triton.jit
def _slc_fwd(Q, K, V, O, LSE, QPOS, IDX, qk_scale, T, L, H, G, D, S, BLOCK,
             GP: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr):
    t = tl.program_id(0)
    bhk = tl.program_id(1)
    kv_heads = H // G
    b = (bhk // kv_heads).to(tl.int64)
    hk = bhk % kv_heads
    g = tl.arange(0, GP)
    g_ok = g < G
    offs_d = tl.arange(0, BD)
    d_ok = offs_d < D
    offs_k = tl.arange(0, BK)
    pos = tl.load(QPOS + b * T + t)
    head = hk * G + g  # int32 offsets within the query's row of heads, 64-bit bases
    q_base = (b * T + t) * H * D
    kv_base = b * L * kv_heads * D + hk * D
    LSE += (b * T + t) * H
    q_off = head[:, None] * D + offs_d[None, :]
    q = tl.load(Q + q_base + q_off, mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, BD], tl.float32)
    for slot in range(0, S):
        block = tl.load(IDX + ((b * T + t) * kv_heads + hk) * S + slot)
        cols = block * BLOCK + offs_k
        col_ok = (cols >= 0) & (offs_k < BLOCK) & (cols <= pos) & (cols < L)
        kv_off = cols[:, None] * (kv_heads * D) + offs_d[None, :]
        k = tl.load(K + kv_base + kv_off, mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(V + kv_base + kv_off, mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        s = tl.where(col_ok[None, :], (tl.dot(q, tl.trans(k)) * qk_scale).to(tl.float32), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    seen = l_i > 0
    l_safe = tl.where(seen, l_i, 1.0)
    tl.store(O + q_base + q_off, (acc / l_safe[:, None]).to(O.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
    tl.store(LSE + head, tl.where(seen, m_i + tl.log2(l_safe), float("inf")), mask=g_ok)


@triton.jit
def _slc_bwd_dq(Q, K, V, DO, DQ, LSE, DELTA, QPOS, IDX, qk_scale, sm_scale, T, L, H, G, D, S, BLOCK,
                GP: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr):
    t = tl.program_id(0)
    bhk = tl.program_id(1)
    kv_heads = H // G
    b = (bhk // kv_heads).to(tl.int64)
    hk = bhk % kv_heads
    g = tl.arange(0, GP)
    g_ok = g < G
    offs_d = tl.arange(0, BD)
    d_ok = offs_d < D
    offs_k = tl.arange(0, BK)
    pos = tl.load(QPOS + b * T + t)
    head = hk * G + g  # int32 offsets within the query's row of heads, 64-bit bases
    q_base = (b * T + t) * H * D
    kv_base = b * L * kv_heads * D + hk * D
    LSE += (b * T + t) * H
    q_off = head[:, None] * D + offs_d[None, :]
    q = tl.load(Q + q_base + q_off, mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    do = tl.load(DO + q_base + q_off, mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    lse = tl.load(LSE + head, mask=g_ok, other=float("inf"))
    delta = tl.load(DELTA + (b * T + t) * H + head, mask=g_ok, other=0.0)
    dq = tl.zeros([GP, BD], tl.float32)
    for slot in range(0, S):
        block = tl.load(IDX + ((b * T + t) * kv_heads + hk) * S + slot)
        cols = block * BLOCK + offs_k
        col_ok = (cols >= 0) & (offs_k < BLOCK) & (cols <= pos) & (cols < L)
        kv_off = cols[:, None] * (kv_heads * D) + offs_d[None, :]
        k = tl.load(K + kv_base + kv_off, mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(V + kv_base + kv_off, mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        p = tl.where(col_ok[None, :], tl.exp2((tl.dot(q, tl.trans(k)) * qk_scale).to(tl.float32) - lse[:, None]), 0.0)
        ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k)
    tl.store(DQ + q_base + q_off, (dq * sm_scale).to(DQ.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


@triton.jit
def _slc_bwd_dkdv(Q, K, V, DO, DK, DV, LSE, DELTA, QPOS, SEG, TQ, SEG_END, qk_scale, sm_scale, T, L, H, G, D,
                  SEGS_PER_HEAD, PAIRS, PAIRS_PER_PROGRAM, BLOCK,
                  GP: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr):
    """Pairs [start, stop) of the (query, slot) pairs sorted by segment (batch, kv head, block + 1);
    for each segment met, dk and dv of that block from the pairs' G heads, added into DK, DV (fp32)."""
    kv_heads = H // G
    start = tl.program_id(0) * PAIRS_PER_PROGRAM
    stop = tl.minimum(start + PAIRS_PER_PROGRAM, PAIRS)
    r = tl.arange(0, BR)
    pair_of_row = r // GP
    g = r % GP
    g_ok = g < G
    offs_d = tl.arange(0, BD)
    d_ok = offs_d < D
    offs_k = tl.arange(0, BK)
    here = start
    while here < stop:
        seg = tl.load(SEG + here)
        seg_stop = tl.minimum(tl.load(SEG_END + seg), stop)
        block = seg % SEGS_PER_HEAD - 1  # -1: the unused slots
        bhk = seg // SEGS_PER_HEAD
        b = (bhk // kv_heads).to(tl.int64)
        hk = bhk % kv_heads
        cols = block * BLOCK + offs_k
        col_ok = (cols >= 0) & (offs_k < BLOCK) & (cols < L)
        kv_base = b * L * kv_heads * D + hk * D
        kv_off = cols[:, None] * (kv_heads * D) + offs_d[None, :]
        k = tl.load(K + kv_base + kv_off, mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(V + kv_base + kv_off, mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        dk = tl.zeros([BK, BD], tl.float32)
        dv = tl.zeros([BK, BD], tl.float32)
        for first in range(here, tl.where(block >= 0, seg_stop, here), BR // GP):
            pair = first + pair_of_row
            row_ok = (pair < seg_stop) & g_ok
            t = tl.load(TQ + pair, mask=row_ok, other=0)
            pos = tl.load(QPOS + b * T + t, mask=row_ok, other=-1)
            row = t * H + hk * G + g  # within the batch row: int32
            q_off = row[:, None] * D + offs_d[None, :]
            q = tl.load(Q + b * T * H * D + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
            do = tl.load(DO + b * T * H * D + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
            lse = tl.load(LSE + b * T * H + row, mask=row_ok, other=float("inf"))
            delta = tl.load(DELTA + b * T * H + row, mask=row_ok, other=0.0)
            allowed = (cols[None, :] <= pos[:, None]) & col_ok[None, :] & row_ok[:, None]
            p = tl.where(allowed, tl.exp2((tl.dot(q, tl.trans(k)) * qk_scale).to(tl.float32) - lse[:, None]), 0.0)  # [BR, BK]
            dv += tl.dot(tl.trans(p).to(do.dtype), do)
            ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
            dk += tl.dot(tl.trans(ds).to(q.dtype), q)
        tl.atomic_add(DK + kv_base + kv_off, (dk * sm_scale).to(tl.float32), mask=col_ok[:, None] & d_ok[None, :])
        tl.atomic_add(DV + kv_base + kv_off, dv, mask=col_ok[:, None] & d_ok[None, :])
        here = seg_stop


def _group_rows(groups: int) -> int:
    return max(16, triton.next_power_of_2(groups))


def _block_tile(block_size: int) -> int:
    return max(16, triton.next_power_of_2(block_size))


def _pairs_by_block(block_indices: torch.Tensor, num_blocks: int):
    """The (query, slot) pairs sorted by segment (batch, kv head, block + 1), stable (queries in
    order within a segment): (segment [P], query [P], end of each segment [B * Hkv * (num_blocks + 1)]),
    int32."""
    batch, seq_len, kv_heads, slots = block_indices.shape
    device = block_indices.device
    head = torch.arange(batch, device=device)[:, None, None, None] * kv_heads + torch.arange(kv_heads, device=device)[:, None]
    seg = (head * (num_blocks + 1) + block_indices.long() + 1).flatten()
    seg, order = torch.sort(seg, stable=True)
    query = torch.div(order, kv_heads * slots, rounding_mode="floor") % seq_len
    # each segment's end: the pairs of it and of every earlier one (bincount would wait for the device to size its
    # result; torch.searchsorted's Inductor lowering does not compile on Triton 3.6)
    counts = seg.new_zeros(batch * kv_heads * (num_blocks + 1)).index_add_(0, seg, torch.ones_like(seg))
    seg_end = counts.cumsum(0)
    return seg.int().contiguous(), query.int().contiguous(), seg_end.int().contiguous()


def _selected_forward(q, k, v, q_pos, block_indices, scale, block_size):
    """Each query head over the tokens (<= its position) of the blocks its kv head selected: (o, lse)."""
    batch, seq_len, heads, dim = q.shape
    length, kv_heads = k.shape[1], k.shape[2]
    slots = block_indices.shape[-1]
    o = torch.empty_like(q)
    lse = torch.empty(batch, seq_len, heads, device=q.device, dtype=torch.float32)
    groups = heads // kv_heads
    _slc_fwd[(seq_len, batch * kv_heads)](
        q, k, v, o, lse, q_pos, block_indices, scale * LOG2E, seq_len, length, heads, groups, dim, slots, block_size,
        GP=_group_rows(groups), BK=_block_tile(block_size), BD=_dim_block(dim), num_warps=_warps(dim),
    )
    return o, lse


def _selected_backward(q, k, v, o, lse, q_pos, block_indices, do, scale, block_size):
    """(dq, dk, dv) of `_selected_forward`'s o for its gradient `do`."""
    batch, seq_len, heads, dim = q.shape
    length, kv_heads = k.shape[1], k.shape[2]
    slots = block_indices.shape[-1]
    groups = heads // kv_heads
    do = do.contiguous()
    delta = (do.float() * o.float()).sum(-1)  # [B, T, H]
    dq = torch.empty_like(q)
    gp, bk, bd = _group_rows(groups), _block_tile(block_size), _dim_block(dim)
    _slc_bwd_dq[(seq_len, batch * kv_heads)](
        q, k, v, do, dq, lse, delta, q_pos, block_indices, scale * LOG2E, scale,
        seq_len, length, heads, groups, dim, slots, block_size, GP=gp, BK=bk, BD=bd, num_warps=_warps(dim),
    )
    num_blocks = cdiv(length, block_size)
    seg, query, seg_end = _pairs_by_block(block_indices, num_blocks)
    pairs = seg.numel()
    head_rows = triton.next_power_of_2(groups)  # rows of one pair in the dk, dv tiles
    rows = max(64 if dim <= 64 else 32, head_rows)
    per_program = max(rows // head_rows, ROWS_PER_PROGRAM // head_rows)
    dk = torch.zeros(k.shape, device=k.device, dtype=torch.float32)
    dv = torch.zeros(v.shape, device=v.device, dtype=torch.float32)
    if pairs:
        _slc_bwd_dkdv[(cdiv(pairs, per_program),)](
            q, k, v, do, dk, dv, lse, delta, q_pos, seg, query, seg_end, scale * LOG2E, scale,
            seq_len, length, heads, groups, dim, num_blocks + 1, pairs, per_program, block_size,
            GP=head_rows, BR=rows, BK=bk, BD=bd, num_warps=_warps(dim, heavy=True),
        )
    return dq, dk.to(k.dtype), dv.to(v.dtype)


# ------------------------------------------------------------------ gates and selection


def _gate_mix(o_cmp, o_slc, o_swa, g_cmp, g_slc, g_swa):
    """sum_x g_x * o_x over the three branches, in fp32, out in the outputs' dtype."""
    out = o_cmp.float() * g_cmp.float()[..., None]
    out += o_slc.float() * g_slc.float()[..., None]
    out += o_swa.float() * g_swa.float()[..., None]
    return out.to(o_cmp.dtype)


def _gate_mix_backward(do, outs, gates):
    """(the branch outputs' gradients, the gates' gradients) of `_gate_mix` for its gradient `do`."""
    do = do.float()
    d_outs = [(do * g.float()[..., None]).to(o.dtype) for o, g in zip(outs, gates)]
    d_gates = [(do * o.float()).sum(-1).to(g.dtype) for o, g in zip(outs, gates)]
    return d_outs, d_gates


@triton.jit
def _importance(Q, KC, LSE, QPOS, OUT, qk_scale, T, C, H, G, D, BLOCK, T0, TC,
                BM: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr):
    """OUT [B, Hkv, TC, C] (fp32): for the queries T0 .. T0 + TC, the compressed attention
    probabilities exp(s - lse) of the group's heads summed, 0 where a block is not visible."""
    bhk = tl.program_id(1)
    kv_heads = H // G
    b = (bhk // kv_heads).to(tl.int64)
    hk = bhk % kv_heads
    local = tl.program_id(0) * BM + tl.arange(0, BM)
    row_ok = local < TC
    rows = T0 + local
    cols = tl.program_id(2) * BC + tl.arange(0, BC)
    col_ok = cols < C
    offs_d = tl.arange(0, BD)
    d_ok = offs_d < D
    pos = tl.load(QPOS + b * T + rows, mask=row_ok, other=-1)
    kc_off = cols[:, None] * (kv_heads * D) + offs_d[None, :]
    kc = tl.load(KC + b * C * kv_heads * D + hk * D + kc_off, mask=col_ok[:, None] & d_ok[None, :], other=0.0)
    visible = (((cols + 1) * BLOCK - 1)[None, :] <= pos[:, None]) & col_ok[None, :]
    acc = tl.zeros([BM, BC], tl.float32)
    for g in range(0, G):
        h = hk * G + g
        q_off = rows[:, None] * (H * D) + offs_d[None, :]
        q = tl.load(Q + b * T * H * D + h * D + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        lse = tl.load(LSE + b * T * H + h + rows * H, mask=row_ok, other=float("inf"))
        acc += tl.where(visible, tl.exp2((tl.dot(q, tl.trans(kc)) * qk_scale).to(tl.float32) - lse[:, None]), 0.0)
    tl.store(OUT + bhk.to(tl.int64) * TC * C + local[:, None] * C + cols[None, :], acc, mask=row_ok[:, None] & col_ok[None, :])


@torch.no_grad()
def select_blocks_chunked(q, k_cmp, lse_cmp, q_pos, scale, block_size, block_counts, num_blocks, initial_blocks, local_blocks):
    """The reference's block selection (the group's summed compressed attention probabilities,
    recomputed from q, k_cmp and the compressed branch's log-sum-exp, then `select_blocks`) on chunks
    of queries, so that no [B, Hkv, T, C] score tensor exists: [B, T, Hkv, S] int64, -1 in unused slots.
    q, k_cmp contiguous in one dtype; lse_cmp [B, T, H] (base 2); q_pos [B, T]."""
    batch, seq_len, heads, dim = q.shape
    num_cmp, kv_heads = k_cmp.shape[1], k_cmp.shape[2]
    chunk = max(1, SELECT_CHUNK_ELEMENTS // max(1, batch * kv_heads * num_cmp))
    q_pos32 = q_pos.to(torch.int32).contiguous()
    block_m, block_c = _tiles(dim)
    out = []
    for start in range(0, seq_len, chunk):
        rows = min(chunk, seq_len - start)
        importance = torch.empty(batch, kv_heads, rows, num_cmp, device=q.device, dtype=torch.float32)
        if num_cmp:  # the kernel writes every entry
            grid = (cdiv(rows, block_m), batch * kv_heads, cdiv(num_cmp, block_c))
            _importance[grid](q, k_cmp, lse_cmp, q_pos32, importance, scale * LOG2E, seq_len, num_cmp, heads,
                              heads // kv_heads, dim, block_size, start, rows, BM=block_m, BC=block_c, BD=_dim_block(dim),
                              num_warps=_warps(dim, heavy=True))
        pos = q_pos[:, start : start + rows]
        out.append(select_blocks(importance, pos, block_size, block_counts, num_blocks, initial_blocks, local_blocks))
    return torch.cat(out, dim=1)


# ------------------------------------------------------------------ the parallel form as torch custom ops
#
# The forward and the backward are torch custom ops (`attnlab::nsa_parallel_fwd`, `attnlab::nsa_parallel_bwd`), each
# with a fake form that gives its outputs' shapes: torch.compile can keep them in a graph as opaque calls that run the
# kernels as they run eagerly, where tracing the kernels themselves gave a compiled step with wrong gradients (an H100,
# torch 2.11; benchmarks/NOTES.md). The forward returns what the backward reads (each branch's output and log-sum-exp).


@torch.library.custom_op("attnlab::nsa_parallel_fwd", mutates_args=())
def _nsa_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor,
             g_cmp: torch.Tensor, g_slc: torch.Tensor, g_swa: torch.Tensor, q_pos: torch.Tensor, scale: float,
             block_size: int, block_counts: int, window_size: int, initial_blocks: int,
             local_blocks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                         torch.Tensor, torch.Tensor]:
    """o [B, T, H, D] in q's dtype, block_indices [B, T, Hkv, S] int64, then each branch's output
    [B, T, H, D] and log-sum-exp [B, T, H] (fp32, base 2)."""
    q, k, v, k_cmp, v_cmp = (x.contiguous() for x in (q, k, v, k_cmp, v_cmp))
    pos32 = q_pos.to(torch.int32).contiguous()
    o_cmp, lse_cmp = _range_forward(q, k_cmp, v_cmp, pos32, scale, block_size, block_size - 1, NO_WINDOW)
    block_indices = select_blocks_chunked(
        q, k_cmp, lse_cmp, q_pos, scale, block_size, block_counts, cdiv(k.shape[1], block_size), initial_blocks,
        local_blocks,
    ).contiguous()
    o_slc, lse_slc = _selected_forward(q, k, v, pos32, block_indices.to(torch.int32).contiguous(), scale, block_size)
    o_swa, lse_swa = _range_forward(q, k, v, pos32, scale, 1, 0, window_size)
    o = _gate_mix(o_cmp, o_slc, o_swa, g_cmp, g_slc, g_swa)
    return o, block_indices, o_cmp, lse_cmp, o_slc, lse_slc, o_swa, lse_swa


@_nsa_fwd.register_fake
def _(q, k, v, k_cmp, v_cmp, g_cmp, g_slc, g_swa, q_pos, scale, block_size, block_counts, window_size, initial_blocks,
      local_blocks):
    batch, seq_len, heads, _ = q.shape
    block_indices = q.new_empty((batch, seq_len, k.shape[2], block_counts), dtype=torch.int64)
    branch = lambda: (q.new_empty(q.shape), q.new_empty((batch, seq_len, heads), dtype=torch.float32))  # noqa: E731
    return q.new_empty(q.shape), block_indices, *branch(), *branch(), *branch()


@torch.library.custom_op("attnlab::nsa_parallel_bwd", mutates_args=())
def _nsa_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor,
             g_cmp: torch.Tensor, g_slc: torch.Tensor, g_swa: torch.Tensor, q_pos: torch.Tensor,
             block_indices: torch.Tensor, o_cmp: torch.Tensor, lse_cmp: torch.Tensor, o_slc: torch.Tensor,
             lse_slc: torch.Tensor, o_swa: torch.Tensor, lse_swa: torch.Tensor, do: torch.Tensor, scale: float,
             block_size: int, window_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                         torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of q, k, v, k_cmp, v_cmp and the three gates, each in its input's dtype."""
    q, k, v, k_cmp, v_cmp = (x.contiguous() for x in (q, k, v, k_cmp, v_cmp))
    pos32 = q_pos.to(torch.int32).contiguous()
    (d_cmp, d_slc, d_swa), d_gates = _gate_mix_backward(do, (o_cmp, o_slc, o_swa), (g_cmp, g_slc, g_swa))
    dq_cmp, dk_cmp, dv_cmp = _range_backward(q, k_cmp, v_cmp, o_cmp, lse_cmp, pos32, d_cmp, scale, block_size,
                                             block_size - 1, NO_WINDOW)
    dq_slc, dk_slc, dv_slc = _selected_backward(q, k, v, o_slc, lse_slc, pos32, block_indices.to(torch.int32).contiguous(),
                                                d_slc, scale, block_size)
    dq_swa, dk_swa, dv_swa = _range_backward(q, k, v, o_swa, lse_swa, pos32, d_swa, scale, 1, 0, window_size)
    dq = (dq_cmp.float() + dq_slc.float() + dq_swa.float()).to(q.dtype)
    dk = (dk_slc.float() + dk_swa.float()).to(k.dtype)
    dv = (dv_slc.float() + dv_swa.float()).to(v.dtype)
    return dq, dk, dv, dk_cmp, dv_cmp, *d_gates


@_nsa_bwd.register_fake
def _(q, k, v, k_cmp, v_cmp, g_cmp, g_slc, g_swa, q_pos, block_indices, o_cmp, lse_cmp, o_slc, lse_slc, o_swa, lse_swa,
      do, scale, block_size, window_size):
    return tuple(x.new_empty(x.shape) for x in (q, k, v, k_cmp, v_cmp, g_cmp, g_slc, g_swa))


def _setup_context(ctx, inputs, output):
    q, k, v, k_cmp, v_cmp, g_cmp, g_slc, g_swa, q_pos, scale, block_size, _, window_size, _, _ = inputs
    _, block_indices, o_cmp, lse_cmp, o_slc, lse_slc, o_swa, lse_swa = output
    ctx.save_for_backward(q, k, v, k_cmp, v_cmp, g_cmp, g_slc, g_swa, q_pos, block_indices, o_cmp, lse_cmp, o_slc,
                          lse_slc, o_swa, lse_swa)
    ctx.scale, ctx.block_size, ctx.window_size = scale, block_size, window_size
    ctx.mark_non_differentiable(*output[1:])


def _backward(ctx, do, *_):
    """Only o carries a gradient: the block indices are a selection, the branch outputs and log-sum-exps what the
    backward reads."""
    grads = _nsa_bwd(*ctx.saved_tensors, do, ctx.scale, ctx.block_size, ctx.window_size)
    return *grads, None, None, None, None, None, None, None


_nsa_fwd.register_autograd(_backward, setup_context=_setup_context)


# A break in compiled blocks until a block compiled whole with the op pair is verified on the GPU (benchmarks/NOTES.md):
# traced, NSA's kernels themselves gave a compiled step with wrong gradients (an H100, torch 2.11). The kernels cast
# scores and key gradients to fp32 and the index tables are counted (torch.searchsorted's Inductor lowering fails on
# Triton 3.6), as tracing them needed.
@outside_compile
def parallel_nsa(
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
    q_pos: torch.Tensor | None = None,
    scale: float | None = None,
    initial_blocks: int = 1,
    local_blocks: int = 2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`attnlab.models.ops.nsa.parallel_nsa` with memory linear in the sequence length.
    Returns (o [B, T, H, D] in q's dtype, block_indices [B, T, Hkv, S])."""
    check_selection_counts(block_counts, initial_blocks, local_blocks)
    batch, seq_len, heads, dim = q.shape
    length, kv_heads = k.shape[1], k.shape[2]
    if heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of key/value heads ({kv_heads})")
    if max(seq_len * heads, length * kv_heads) * dim >= 2**31:
        raise ValueError(f"NSA kernels: one row of q or k ({seq_len} x {heads} or {length} x {kv_heads} heads of {dim}) "
                         "needs 64-bit offsets; use shorter rows (or kernels 'torch')")
    scale = dim ** -0.5 if scale is None else scale
    if q_pos is None:
        q_pos = torch.arange(length - seq_len, length, device=q.device).expand(batch, seq_len)
    dtype = q.dtype
    k, v, k_cmp, v_cmp = (x.to(dtype) for x in (k, v, k_cmp, v_cmp))
    o, block_indices, *_ = _nsa_fwd(q, k, v, k_cmp, v_cmp, g_cmp, g_slc, g_swa, q_pos, float(scale), block_size,
                                    block_counts, window_size, initial_blocks, local_blocks)
    return o, block_indices
