"""The attention family's quadratic form as tiled Triton kernels: memory linear in the sequence length.

`attention_terms` computes what `attnlab.models.ops.attention_family.attention_terms` computes
(the numerator sum_j w_ij v_j and the row sums sum_j w_ij of the weights

    w_ij = sim(min(scale q_i.k_j, clamp)) * exp(cq_i - ck_j)      for allowed j (causal, not padding)

with sim exp, power1 (s), power2 (s^2) or the truncated exp series) without forming the [T, T]
weights: one program holds a block of queries and walks over blocks of keys, as FlashAttention-2
does, accumulating in fp32 from bf16 (or fp32) operands. For exp with the plain sum denominator the
weights are taken relative to each row's maximum (kept for the backward, without gradient, as in
the reference); the ratio num / den is unchanged. Every other option (the denominator's clamp,
detach, counts and powers, the division) stays in PyTorch on [B, T, H, Dv] tensors.

The backward recomputes the weights block by block: one kernel walks over queries for a block of
keys (dk, dv and the key side of the decay), one over keys for a block of queries (dq and the
query side of the decay). Nothing of size [T, T] is stored in either direction.

The truncated series equals exp to fp32 precision on [lo, hi] (computed per number of terms), where
the kernels use exp. A program that met a score outside that range does its rows again, in small
tiles, with the series summed in float64 there, as the reference does; the others never run that
code, and one launch per kernel serves both.

Under TRITON_INTERPRET=1 the same kernels run on CPU tensors (slowly): the tests use that in CI.
"""

from __future__ import annotations

import functools
import math
import os
import warnings

import torch
import triton
import triton.language as tl

from attnlab.models.ops.attention_family import EXP_SIMILARITIES, SUM_DENOMINATORS
from attnlab.models.ops.attention_family import attention_terms as reference_attention_terms
from attnlab.models.kernels.eager import compiling, outside_compile

SIM_CODES = {"softmax": 0, "exp": 0, "power1": 1, "power2": 2, "taylor": 3}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def taylor_exp_range(terms: int) -> tuple[float, float]:
    """[lo, hi] on which the first `terms` terms of exp's series and the first `terms` - 1 (its
    derivative), summed in float64 as the reference does, agree with exp to 2^-24 relative: there the
    kernels use exp itself. Empty (lo > hi) when there is no such range around 0 wider than 0.5."""
    def series(x: float, n_terms: int) -> float:
        out = 1.0
        for n in range(n_terms - 1, 0, -1):
            out = 1 + out * x / n
        return out

    def agrees(x: float) -> bool:
        return all(abs(series(x, n) - math.exp(x)) <= 2.0**-24 * math.exp(x) for n in (terms, terms - 1))

    hi = 0.0
    while hi < 80 and agrees(hi + 0.25):
        hi += 0.25
    lo = 0.0
    while lo > -80 and agrees(lo - 0.25):
        lo -= 0.25
    return (lo, hi) if hi - lo > 0.5 else (1.0, -1.0)


@triton.jit
def _tile(ptr, b, h, idx, ok, sb, st, sh, offs_d, D):
    """Rows `idx` of one batch and head of a [B, T, H, D] tensor as a [len(idx), BLOCK_D] tile, zeros outside."""
    return tl.load(ptr + b * sb + h * sh + idx[:, None] * st + offs_d[None, :], mask=ok[:, None] & (offs_d[None, :] < D), other=0.0)


@triton.jit
def _vec(ptr, b, h, idx, ok, sb, st):
    """Entries `idx` of one batch and head of a [B, T, H] tensor (heads contiguous), zeros outside."""
    return tl.load(ptr + b * sb + h + idx * st, mask=ok, other=0.0)


@triton.jit
def _allowed(KM, b, skmb, cols, col_ok, query_pos, row_ok, HAS_MASK: tl.constexpr):
    """[queries, keys]: key j is at or before the query's position and is not padding (key mask KM)."""
    allowed = (cols[None, :] <= query_pos[:, None]) & col_ok[None, :] & row_ok[:, None]
    if HAS_MASK:
        allowed = allowed & (tl.load(KM + b * skmb + cols, mask=col_ok, other=0) != 0)[None, :]
    return allowed


@triton.jit
def _mm(a, b, IEEE: tl.constexpr):
    """a @ b on the tensor cores, fp32 operands in full precision where IEEE (else as tf32)."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision="tf32")


@triton.jit
def _horner_f64(s, TERMS: tl.constexpr):
    x = s.to(tl.float64)
    out = tl.full(s.shape, 1.0, tl.float64)
    for i in range(1, TERMS):
        out = 1.0 + out * x / (TERMS - i)
    return out.to(tl.float32)


@triton.jit
def _weights(s_raw, allowed, qterm, kterm, SIM: tl.constexpr, HAS_CLAMP: tl.constexpr, CLAMP: tl.constexpr,
             HAS_OFFSET: tl.constexpr, TERMS: tl.constexpr, LO: tl.constexpr, HI: tl.constexpr, EXACT: tl.constexpr):
    """Weights w (0 where not allowed) and dw/ds for a tile of scores s_raw (already scaled).
    With HAS_OFFSET the log-weights gain qterm_i - kterm_j (decay cq_i - ck_j, less the row maximum
    for exp under the plain sum), qterm and kterm given as the tile's broadcastable row / column."""
    s = s_raw
    if HAS_CLAMP:
        s = tl.minimum(s, CLAMP)
    left = tl.zeros([s.shape[0]], tl.int32)
    if SIM == 0:
        logit = s
        if HAS_OFFSET:
            logit = logit + qterm - kterm
        w = tl.exp(tl.where(allowed, logit, float("-inf")))
        dw_ds = w
    else:
        if SIM == 1:
            f = s
            df = tl.full(s.shape, 1.0, tl.float32)
        elif SIM == 2:
            f = s * s
            df = 2.0 * s
        else:  # the series, and its derivative (one term fewer): exp on [LO, HI]
            f = tl.exp(s)
            df = f
            outside = (s < LO) | (s > HI)
            left = tl.max(outside.to(tl.int32), 1)
            if EXACT:
                f = tl.where(outside, _horner_f64(s, TERMS), f)
                df = tl.where(outside, _horner_f64(s, TERMS - 1), df)
        if HAS_OFFSET:
            e = tl.exp(tl.where(allowed, qterm - kterm, float("-inf")))  # 0 where not allowed
        if HAS_OFFSET and SIM == 2:  # s is finite: e masks
            se = s * e
            w = s * se
            dw_ds = 2.0 * se
        elif HAS_OFFSET and SIM == 1:
            w = s * e
            dw_ds = e
        else:  # the series may overflow where not allowed: mask explicitly
            if HAS_OFFSET:
                f = f * e
                df = df * e
            w = tl.where(allowed, f, 0.0)
            dw_ds = tl.where(allowed, df, 0.0)
    if HAS_CLAMP:
        dw_ds = tl.where(s_raw <= CLAMP, dw_ds, 0.0)
    return w, dw_ds, left


# Block shapes (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel and similarity (0 exp, 1 power1,
# 2 power2, 3 taylor), measured best on an H100 for head dims <= 64 among 7 candidates each
# (benchmarks/NOTES.md); larger head dims hold more per thread and take the smaller candidates.
BLOCKS = {
    "fwd": {0: (128, 64, 4, 3), 1: (128, 64, 4, 3), 2: (64, 32, 4, 4), 3: (64, 32, 4, 4)},
    "dkdv": {0: (32, 64, 4, 3), 1: (32, 64, 4, 3), 2: (32, 64, 4, 3), 3: (32, 64, 4, 3)},
    "dq": {0: (64, 32, 4, 3), 1: (128, 32, 4, 3), 2: (128, 32, 4, 3), 3: (64, 32, 4, 3)},
}
WIDE_HEAD_BLOCKS = {"fwd": [(64, 32, 4, 3), (64, 64, 4, 2)], "dkdv": [(16, 64, 4, 3), (32, 64, 8, 2)], "dq": [(64, 16, 4, 3), (64, 32, 8, 2)]}


def _block_shape(shape) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) to launch with: `shape`, or the interpreter's small tiles."""
    return (16, 16, 4, 1) if _interpreting() else shape


def _config(shape) -> triton.Config:
    block_m, block_n, warps, stages = _block_shape(shape)
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=warps, num_stages=stages)


def _wide_heads(kernel, name: str):
    """`kernel` under triton.autotune with the two block shapes of WIDE_HEAD_BLOCKS (the interpreter cannot time: one).
    No pruning function: torch.compile follows an autotuner only without one."""
    configs = [_config(shape) for shape in WIDE_HEAD_BLOCKS[name][:1 if _interpreting() else None]]
    return triton.autotune(configs=configs, key=["DK", "DV", "SIM", "HAS_DECAY", "USE_MAX", "HAS_CLAMP", "IEEE"])(kernel)


REDO_BLOCK = tl.constexpr(16)  # keys (forward, dq) or queries (dk, dv) per tile where a program redoes its rows with the float64 series


@triton.jit
def _fwd_keys(K, V, CK, KM, b, h, q, cq, query_pos, row_ok, n_end,
              skb, skt, skh, svb, svt, svh, sdb, sdt, skmb, Tk, DK, DV, scale,
              SIM: tl.constexpr, HAS_CLAMP: tl.constexpr, CLAMP: tl.constexpr, TERMS: tl.constexpr, LO: tl.constexpr,
              HI: tl.constexpr, HAS_DECAY: tl.constexpr, HAS_MASK: tl.constexpr, USE_MAX: tl.constexpr,
              WANT_SUM: tl.constexpr, IEEE: tl.constexpr, EXACT: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr):
    """A block of queries over the keys [0, n_end): (numerator, row sums, row maxima, rows that met a
    score outside the series' [LO, HI])."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    left = tl.zeros([BLOCK_M], tl.int32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for start_n in range(0, n_end, BLOCK_N):
        cols = start_n + offs_n
        col_ok = cols < Tk
        k = _tile(K, b, h, cols, col_ok, skb, skt, skh, offs_dk, DK)
        v = _tile(V, b, h, cols, col_ok, svb, svt, svh, offs_dv, DV)
        allowed = _allowed(KM, b, skmb, cols, col_ok, query_pos, row_ok, HAS_MASK)
        ck = tl.zeros([BLOCK_N], tl.float32)
        if HAS_DECAY:
            ck = _vec(CK, b, h, cols, col_ok, sdb, sdt)
        s = (_mm(q, tl.trans(k), IEEE) * scale).to(tl.float32)  # fp32 also where the scale came as fp64 (Inductor's launch)
        if USE_MAX:  # exp under the plain sum: online maximum, as FlashAttention-2
            logit = s
            if HAS_CLAMP:
                logit = tl.minimum(logit, CLAMP)
            if HAS_DECAY:
                logit = logit + (cq[:, None] - ck[None, :])
            logit = tl.where(allowed, logit, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(logit, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            w = tl.exp(logit - m_safe[:, None])
            acc = acc * alpha[:, None]
            l_i = l_i * alpha
            m_i = m_new
        else:
            w, _, left_tile = _weights(s, allowed, cq[:, None], ck[None, :], SIM, HAS_CLAMP, CLAMP, HAS_DECAY, TERMS, LO, HI, EXACT)
            left = tl.maximum(left, left_tile)
        if WANT_SUM:
            l_i += tl.sum(w, 1)
        acc += _mm(w.to(v.dtype), v, IEEE)
    return acc, l_i, m_i, left


@triton.jit
def _fwd_kernel(
    Q, K, V, CQ, CK, KM, NUM, L, M,
    sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, scb, sct, sdb, sdt, skmb, snb, snt, snh, slb, slt,
    Tq, Tk, H, DK, DV, scale,
    SIM: tl.constexpr, HAS_CLAMP: tl.constexpr, CLAMP: tl.constexpr, TERMS: tl.constexpr, LO: tl.constexpr, HI: tl.constexpr,
    HAS_DECAY: tl.constexpr, HAS_MASK: tl.constexpr, USE_MAX: tl.constexpr, WANT_SUM: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    past = Tk - Tq
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < Tq
    q = _tile(Q, b, h, offs_m, row_ok, sqb, sqt, sqh, offs_dk, DK)
    cq = tl.zeros([BLOCK_M], tl.float32)
    if HAS_DECAY:
        cq = _vec(CQ, b, h, offs_m, row_ok, scb, sct)
    query_pos = past + offs_m
    n_end = tl.minimum(Tk, past + start_m + BLOCK_M)
    acc, l_i, m_i, left = _fwd_keys(K, V, CK, KM, b, h, q, cq, query_pos, row_ok, n_end, skb, skt, skh, svb, svt, svh, sdb,
                                    sdt, skmb, Tk, DK, DV, scale, SIM, HAS_CLAMP, CLAMP, TERMS, LO, HI, HAS_DECAY, HAS_MASK,
                                    USE_MAX, WANT_SUM, IEEE, False, BLOCK_M, BLOCK_N, BLOCK_DK, BLOCK_DV)
    if SIM == 3:
        if tl.max(left, 0) > 0:  # a score outside [LO, HI]: these rows again, the series summed in float64 there
            acc, l_i, m_i, left = _fwd_keys(K, V, CK, KM, b, h, q, cq, query_pos, row_ok, n_end, skb, skt, skh, svb, svt,
                                            svh, sdb, sdt, skmb, Tk, DK, DV, scale, SIM, HAS_CLAMP, CLAMP, TERMS, LO, HI,
                                            HAS_DECAY, HAS_MASK, USE_MAX, WANT_SUM, IEEE, True, BLOCK_M, REDO_BLOCK,
                                            BLOCK_DK, BLOCK_DV)
    tl.store(NUM + b * snb + h * snh + offs_m[:, None] * snt + offs_dv[None, :], acc.to(NUM.dtype.element_ty),
             mask=row_ok[:, None] & (offs_dv[None, :] < DV))
    if WANT_SUM:
        tl.store(L + b * slb + h + offs_m * slt, l_i, mask=row_ok)
    if USE_MAX:
        tl.store(M + b * slb + h + offs_m * slt, tl.where(m_i == float("-inf"), 0.0, m_i), mask=row_ok)


@triton.jit
def _dkdv_queries(Q, CQ, M, DNUM, DL, b, h, k, v, ck, cols, keep_col, first, Tq, past,
                  sqb, sqt, sqh, scb, sct, snb, snt, snh, slb, slt, DK, DV, scale,
                  SIM: tl.constexpr, HAS_CLAMP: tl.constexpr, CLAMP: tl.constexpr, TERMS: tl.constexpr, LO: tl.constexpr,
                  HI: tl.constexpr, HAS_DECAY: tl.constexpr, USE_MAX: tl.constexpr, WANT_SUM: tl.constexpr,
                  IEEE: tl.constexpr, EXACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr):
    """A block of keys over the queries from `first` on: (dk unscaled, dv, the key side of the decay
    gradient, keys that met a score outside the series' [LO, HI])."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    left = tl.zeros([BLOCK_N], tl.int32)
    dk = tl.zeros([BLOCK_N, BLOCK_DK], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    dck = tl.zeros([BLOCK_N], tl.float32)
    for start_m in range(first // BLOCK_M * BLOCK_M, Tq, BLOCK_M):
        rows = start_m + offs_m
        row_ok = rows < Tq
        q_t = tl.load(Q + b * sqb + h * sqh + rows[None, :] * sqt + offs_dk[:, None],
                      mask=row_ok[None, :] & (offs_dk[:, None] < DK), other=0.0)  # [DK, M]
        dnum = _tile(DNUM, b, h, rows, row_ok, snb, snt, snh, offs_dv, DV)  # [M, DV]
        qterm = tl.zeros([BLOCK_M], tl.float32)  # decay less the row maximum, per query
        if HAS_DECAY:
            qterm += _vec(CQ, b, h, rows, row_ok, scb, sct)
        if USE_MAX:
            qterm -= _vec(M, b, h, rows, row_ok, slb, slt)
        allowed = (cols[:, None] <= past + rows[None, :]) & keep_col[:, None] & row_ok[None, :]
        s_t = (_mm(k, q_t, IEEE) * scale).to(tl.float32)  # [N, M]; fp32 also for an fp64 scale
        w_t, dw_ds_t, left_tile = _weights(s_t, allowed, qterm[None, :], ck[:, None], SIM, HAS_CLAMP, CLAMP,
                                           HAS_DECAY or USE_MAX, TERMS, LO, HI, EXACT)
        left = tl.maximum(left, left_tile)
        g_t = _mm(v, tl.trans(dnum), IEEE)  # dL/dw, [N, M]
        if WANT_SUM:
            g_t += _vec(DL, b, h, rows, row_ok, slb, slt)[None, :]
        dv += _mm(w_t.to(dnum.dtype), dnum, IEEE)
        ds_t = g_t * dw_ds_t
        dk += _mm(ds_t.to(q_t.dtype), tl.trans(q_t), IEEE)
        if HAS_DECAY:
            dck -= tl.sum(g_t * w_t, 1)
    return dk, dv, dck, left


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, CQ, CK, KM, M, DNUM, DL, DK_, DV_, DCK,
    sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, scb, sct, sdb, sdt, skmb, snb, snt, snh, slb, slt,
    Tq, Tk, H, DK, DV, scale,
    SIM: tl.constexpr, HAS_CLAMP: tl.constexpr, CLAMP: tl.constexpr, TERMS: tl.constexpr, LO: tl.constexpr, HI: tl.constexpr,
    HAS_DECAY: tl.constexpr, HAS_MASK: tl.constexpr, USE_MAX: tl.constexpr, WANT_SUM: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """For a block of keys: dk, dv (same strides as k, v) and the key side of the decay gradient.
    Tiles are [keys, queries] (transposed), so that sums over queries stay within a row."""
    start_n = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    past = Tk - Tq
    cols = start_n + tl.arange(0, BLOCK_N)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    col_ok = cols < Tk
    k = _tile(K, b, h, cols, col_ok, skb, skt, skh, offs_dk, DK)
    v = _tile(V, b, h, cols, col_ok, svb, svt, svh, offs_dv, DV)
    keep_col = col_ok
    if HAS_MASK:
        keep_col = keep_col & (tl.load(KM + b * skmb + cols, mask=col_ok, other=0) != 0)
    ck = tl.zeros([BLOCK_N], tl.float32)
    if HAS_DECAY:
        ck = _vec(CK, b, h, cols, col_ok, sdb, sdt)
    first = tl.maximum(start_n - past, 0)  # the first query that can see these keys
    dk, dv, dck, left = _dkdv_queries(Q, CQ, M, DNUM, DL, b, h, k, v, ck, cols, keep_col, first, Tq, past, sqb, sqt, sqh,
                                      scb, sct, snb, snt, snh, slb, slt, DK, DV, scale, SIM, HAS_CLAMP, CLAMP, TERMS, LO,
                                      HI, HAS_DECAY, USE_MAX, WANT_SUM, IEEE, False, BLOCK_M, BLOCK_N, BLOCK_DK,
                                      BLOCK_DV)
    if SIM == 3:
        if tl.max(left, 0) > 0:  # a score outside [LO, HI]: these keys again, the series summed in float64 there
            dk, dv, dck, left = _dkdv_queries(Q, CQ, M, DNUM, DL, b, h, k, v, ck, cols, keep_col, first, Tq, past, sqb, sqt,
                                              sqh, scb, sct, snb, snt, snh, slb, slt, DK, DV, scale, SIM, HAS_CLAMP, CLAMP,
                                              TERMS, LO, HI, HAS_DECAY, USE_MAX, WANT_SUM, IEEE, True, REDO_BLOCK,
                                              BLOCK_N, BLOCK_DK, BLOCK_DV)
    tl.store(DK_ + b * skb + h * skh + cols[:, None] * skt + offs_dk[None, :], (dk * scale).to(DK_.dtype.element_ty),
             mask=col_ok[:, None] & (offs_dk[None, :] < DK))
    tl.store(DV_ + b * svb + h * svh + cols[:, None] * svt + offs_dv[None, :], dv.to(DV_.dtype.element_ty),
             mask=col_ok[:, None] & (offs_dv[None, :] < DV))
    if HAS_DECAY:
        tl.store(DCK + b * sdb + h + cols * sdt, dck, mask=col_ok)


@triton.jit
def _dq_keys(K, V, CK, KM, b, h, q, dnum, qterm, dl, rows, row_ok, n_end, past,
             skb, skt, skh, svb, svt, svh, sdb, sdt, skmb, Tk, DK, DV, scale,
             SIM: tl.constexpr, HAS_CLAMP: tl.constexpr, CLAMP: tl.constexpr, TERMS: tl.constexpr, LO: tl.constexpr,
             HI: tl.constexpr, HAS_DECAY: tl.constexpr, HAS_MASK: tl.constexpr, USE_MAX: tl.constexpr,
             IEEE: tl.constexpr, EXACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr):
    """A block of queries over the keys [0, n_end): (dq unscaled, the query side of the decay gradient,
    rows that met a score outside the series' [LO, HI])."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    left = tl.zeros([BLOCK_M], tl.int32)
    dq = tl.zeros([BLOCK_M, BLOCK_DK], tl.float32)
    dcq = tl.zeros([BLOCK_M], tl.float32)
    for start_n in range(0, n_end, BLOCK_N):
        cols = start_n + offs_n
        col_ok = cols < Tk
        k = _tile(K, b, h, cols, col_ok, skb, skt, skh, offs_dk, DK)
        v = _tile(V, b, h, cols, col_ok, svb, svt, svh, offs_dv, DV)
        allowed = _allowed(KM, b, skmb, cols, col_ok, past + rows, row_ok, HAS_MASK)
        ck = tl.zeros([BLOCK_N], tl.float32)
        if HAS_DECAY:
            ck = _vec(CK, b, h, cols, col_ok, sdb, sdt)
        s = (_mm(q, tl.trans(k), IEEE) * scale).to(tl.float32)  # fp32 also where the scale came as fp64 (Inductor's launch)
        w, dw_ds, left_tile = _weights(s, allowed, qterm[:, None], ck[None, :], SIM, HAS_CLAMP, CLAMP, HAS_DECAY or USE_MAX,
                                       TERMS, LO, HI, EXACT)
        left = tl.maximum(left, left_tile)
        g = _mm(dnum, tl.trans(v), IEEE) + dl[:, None]
        ds = g * dw_ds
        dq += _mm(ds.to(k.dtype), k, IEEE)
        if HAS_DECAY:
            dcq += tl.sum(g * w, 1)
    return dq, dcq, left


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, CQ, CK, KM, M, DNUM, DL, DQ_, DCQ,
    sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, scb, sct, sdb, sdt, skmb, snb, snt, snh, slb, slt,
    Tq, Tk, H, DK, DV, scale,
    SIM: tl.constexpr, HAS_CLAMP: tl.constexpr, CLAMP: tl.constexpr, TERMS: tl.constexpr, LO: tl.constexpr, HI: tl.constexpr,
    HAS_DECAY: tl.constexpr, HAS_MASK: tl.constexpr, USE_MAX: tl.constexpr, WANT_SUM: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """For a block of queries: dq (same strides as q) and the query side of the decay gradient."""
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    past = Tk - Tq
    rows = start_m + tl.arange(0, BLOCK_M)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = rows < Tq
    q = _tile(Q, b, h, rows, row_ok, sqb, sqt, sqh, offs_dk, DK)
    dnum = _tile(DNUM, b, h, rows, row_ok, snb, snt, snh, offs_dv, DV)
    qterm = tl.zeros([BLOCK_M], tl.float32)  # decay less the row maximum, per query
    if HAS_DECAY:
        qterm += _vec(CQ, b, h, rows, row_ok, scb, sct)
    if USE_MAX:
        qterm -= _vec(M, b, h, rows, row_ok, slb, slt)
    dl = tl.zeros([BLOCK_M], tl.float32)
    if WANT_SUM:
        dl = _vec(DL, b, h, rows, row_ok, slb, slt)
    n_end = tl.minimum(Tk, past + start_m + BLOCK_M)
    dq, dcq, left = _dq_keys(K, V, CK, KM, b, h, q, dnum, qterm, dl, rows, row_ok, n_end, past, skb, skt, skh, svb, svt,
                             svh, sdb, sdt, skmb, Tk, DK, DV, scale, SIM, HAS_CLAMP, CLAMP, TERMS, LO, HI, HAS_DECAY,
                             HAS_MASK, USE_MAX, IEEE, False, BLOCK_M, BLOCK_N, BLOCK_DK, BLOCK_DV)
    if SIM == 3:
        if tl.max(left, 0) > 0:  # a score outside [LO, HI]: these rows again, the series summed in float64 there
            dq, dcq, left = _dq_keys(K, V, CK, KM, b, h, q, dnum, qterm, dl, rows, row_ok, n_end, past, skb, skt, skh, svb,
                                     svt, svh, sdb, sdt, skmb, Tk, DK, DV, scale, SIM, HAS_CLAMP, CLAMP, TERMS, LO, HI,
                                     HAS_DECAY, HAS_MASK, USE_MAX, IEEE, True, BLOCK_M, REDO_BLOCK, BLOCK_DK, BLOCK_DV)
    tl.store(DQ_ + b * sqb + h * sqh + rows[:, None] * sqt + offs_dk[None, :], (dq * scale).to(DQ_.dtype.element_ty),
             mask=row_ok[:, None] & (offs_dk[None, :] < DK))
    if HAS_DECAY:
        tl.store(DCQ + b * scb + h + rows * sct, dcq, mask=row_ok)


def _head_blocks(dk: int, dv: int) -> dict:
    return dict(BLOCK_DK=max(16, triton.next_power_of_2(dk)), BLOCK_DV=max(16, triton.next_power_of_2(dv)))


class _AttentionTerms(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cq, ck, key_mask, opts, num_dtype):
        batch, num_queries, heads, dk = q.shape
        num_keys, dv = k.shape[1], v.shape[-1]
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # dq, dk, dv take these strides
        num = torch.empty(batch, num_queries, heads, dv, device=q.device, dtype=num_dtype)
        rows = torch.empty(batch, num_queries, heads, device=q.device, dtype=torch.float32)  # row sums
        row_max = torch.empty_like(rows) if opts["USE_MAX"] else rows
        has_decay = cq is not None
        cq = cq.float().contiguous() if has_decay else rows
        ck = ck.float().contiguous() if has_decay else rows
        km = key_mask.to(torch.int8).contiguous() if key_mask is not None else rows
        constexprs = dict(opts, HAS_DECAY=has_decay, HAS_MASK=key_mask is not None, **_head_blocks(dk, dv),
                          IEEE=q.dtype == torch.float32)
        scale = constexprs.pop("scale")
        strides = (*_bht(q), *_bht(k), *_bht(v), cq.stride(0), cq.stride(1), ck.stride(0), ck.stride(1), km.stride(0) if key_mask is not None else 0,
                   *_bht(num), rows.stride(0), rows.stride(1))
        sizes = (num_queries, num_keys, heads, dk, dv, scale)
        _launch("fwd", lambda meta: (triton.cdiv(num_queries, meta["BLOCK_M"]), batch * heads),
                (q, k, v, cq, ck, km, num, rows, row_max), (*strides, *sizes), constexprs)
        ctx.save_for_backward(q, k, v, cq, ck, km, row_max)
        ctx.meta = (strides, sizes, constexprs, has_decay)
        if not opts["WANT_SUM"]:
            ctx.mark_non_differentiable(rows)
        return num, rows

    @staticmethod
    def backward(ctx, dnum, drows):
        q, k, v, cq, ck, km, row_max = ctx.saved_tensors
        strides, sizes, constexprs, has_decay = ctx.meta
        num_queries, num_keys, heads = sizes[:3]
        batch = q.shape[0]
        dnum = dnum.to(q.dtype).contiguous()  # the products run on the tensor cores in the operands' dtype
        if constexprs["WANT_SUM"] and drows is None:  # the row sums did not reach the loss
            drows = torch.zeros(batch, num_queries, heads, device=q.device, dtype=torch.float32)
        elif constexprs["WANT_SUM"]:
            drows = drows.float().contiguous()
        else:  # not read
            drows = row_max
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dcq = torch.empty_like(cq) if has_decay else drows
        dck = torch.empty_like(ck) if has_decay else drows
        args = (*strides[:-5], *_bht(dnum), drows.stride(0), drows.stride(1), *sizes)
        _launch("dkdv", lambda meta: (triton.cdiv(num_keys, meta["BLOCK_N"]), batch * heads),
                (q, k, v, cq, ck, km, row_max, dnum, drows, dk, dv, dck), args, constexprs)
        _launch("dq", lambda meta: (triton.cdiv(num_queries, meta["BLOCK_M"]), batch * heads),
                (q, k, v, cq, ck, km, row_max, dnum, drows, dq, dcq), args, constexprs)
        return dq, dk, dv, (dcq if has_decay else None), (dck if has_decay else None), None, None, None


_KERNELS = {"fwd": _fwd_kernel, "dkdv": _bwd_dkdv_kernel, "dq": _bwd_dq_kernel}  # by name: torch.compile cannot hash a kernel
_WIDE_HEAD_KERNELS = {name: _wide_heads(kernel, name) for name, kernel in _KERNELS.items()}


def _launch(name, grid, tensors, scalars, constexprs) -> None:
    """The kernel `name` ("fwd", "dkdv", "dq") on its block shape measured for the similarity (BLOCKS) where the heads
    are at most 64 wide, else through its autotuner over WIDE_HEAD_BLOCKS. A plain launch with the block shape given
    (not an autotuner that prunes its configurations to one) is what torch.compile can trace."""
    if max(constexprs["BLOCK_DK"], constexprs["BLOCK_DV"]) > 64:
        _WIDE_HEAD_KERNELS[name][grid](*tensors, *scalars, **constexprs)
        return
    block_m, block_n, warps, stages = _block_shape(BLOCKS[name][constexprs["SIM"]])
    _KERNELS[name][grid](*tensors, *scalars, **constexprs, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
                         num_stages=stages)


def _bht(t: torch.Tensor) -> tuple[int, int, int]:
    """Strides of batch, time and head of a [B, T, H, D] tensor whose last dim is contiguous."""
    return t.stride(0), t.stride(1), t.stride(2)


@outside_compile(traced=True)
def attention_terms(
    q, k, v, *, similarity, scale, clamp=None, taylor_terms=80, denominator="sum",
    query_log_decay=None, key_log_decay=None, key_mask=None, out_dtype=None,
):
    """As `attnlab.models.ops.attention_family.attention_terms` (same arguments and results:
    num [B, H, Tq, Dv] and den [B, H, Tq, 1] or None, fp32), through the kernels above. With the
    denominator "none" the numerator is the output: `out_dtype` has it written in that dtype
    (`writes_output`), which spares the division's passes both ways."""
    if out_dtype is not None and denominator != "none":
        raise ValueError("attention_terms writes the output itself only for the denominator 'none'")
    lo, hi = taylor_exp_range(taylor_terms) if similarity == "taylor" else (0.0, 0.0)
    opts = dict(
        SIM=SIM_CODES[similarity], HAS_CLAMP=clamp is not None, CLAMP=float(clamp) if clamp is not None else 0.0,
        TERMS=int(taylor_terms) if similarity == "taylor" else 2, LO=float(lo), HI=float(hi),
        USE_MAX=similarity in EXP_SIMILARITIES and denominator == "sum",
        WANT_SUM=denominator in SUM_DENOMINATORS, scale=float(scale),
    )
    dtypes = {q.dtype, k.dtype, v.dtype}
    if torch.float64 in dtypes:  # Triton's products take bf16, fp16 and fp32
        warnings.warn("attnlab's attention-family kernels take no float64: this call runs the PyTorch reference", stacklevel=2)
        num, den = reference_attention_terms(q, k, v, similarity=similarity, scale=scale, clamp=clamp, taylor_terms=taylor_terms, denominator=denominator,
                             query_log_decay=query_log_decay, key_log_decay=key_log_decay, key_mask=key_mask)
        return (num, den) if out_dtype is None else (num.to(out_dtype), den)
    if len(dtypes) > 1:  # e.g. autocast keeps a normalised q, k in fp32 beside a bf16 v: the products take the narrowest
        dtype = next(d for d in (torch.bfloat16, torch.float16, torch.float32) if d in dtypes)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if compiling() and key_log_decay is not None and key_log_decay is query_log_decay:
        # one tensor as both log-decays (the linearizable variants' training form): dynamo passes a tensor given twice
        # to an autograd function once and keeps one of its two gradients (pytorch/pytorch#181146: torch 2.11 compiled
        # 2mamba's decay gradients wrong, H200); later releases break the graph there instead (pytorch#184281), which
        # inside the compiled stack of blocks would leave the whole stack as written. A tensor of its own for each.
        key_log_decay = key_log_decay.clone()
    num, rows = _AttentionTerms.apply(q, k, v, query_log_decay, key_log_decay, key_mask, opts, out_dtype or torch.float32)
    num = num.transpose(1, 2)  # [B, H, Tq, Dv]
    if denominator in SUM_DENOMINATORS:
        return num, rows.transpose(1, 2)[..., None]
    if denominator in ("count", "count_power"):
        return num, attended_counts(q, k, key_mask)
    return num, None


def attended_counts(q: torch.Tensor, k: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
    """How many keys each query attends to (causal, padding left out): [B, H, Tq, 1] fp32."""
    batch, num_queries, heads = q.shape[:3]
    num_keys = k.shape[1]
    if key_mask is None:
        counts = torch.arange(num_keys - num_queries + 1, num_keys + 1, device=q.device, dtype=torch.float32).expand(batch, -1)
    else:
        counts = key_mask.float().cumsum(-1)[:, num_keys - num_queries:]  # [B, Tq]
    return counts[:, None, :, None].expand(batch, heads, num_queries, 1)


# ---------------------------------------------------------------- the division by the denominator

DIVIDE_MODES = {"none": 0, "sum": 1, "sum_clamped": 2, "sum_detached": 3, "sum_detached_eps": 4}


@triton.jit
def _divisor(den, MODE: tl.constexpr):
    """The finished denominator of raw row sums (1 where it is 0), as `_finish_denominator` then `_divide`."""
    if MODE == 1:
        f = den
    elif MODE == 4:
        f = den + 1e-4  # the ops' DETACHED_EPS
    else:
        f = tl.maximum(den, 1.0)
    return tl.where(f == 0.0, 1.0, f)


@triton.jit
def _divide_fwd_kernel(NUM, ROWS, OUT, n_rows, D, MODE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    ok = (r[:, None] < n_rows) & (cols[None, :] < D)
    o = tl.load(NUM + r[:, None] * D + cols[None, :], mask=ok, other=0.0)
    if MODE != 0:
        o = o / _divisor(tl.load(ROWS + r, mask=r < n_rows, other=1.0), MODE)[:, None]
    tl.store(OUT + r[:, None] * D + cols[None, :], o.to(OUT.dtype.element_ty), mask=ok)


@triton.jit
def _divide_bwd_kernel(DO, NUM, ROWS, DNUM, DROWS, n_rows, D, MODE: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_D: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    row_ok = r < n_rows
    ok = row_ok[:, None] & (cols[None, :] < D)
    do = tl.load(DO + r[:, None] * D + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    if MODE == 0:
        tl.store(DNUM + r[:, None] * D + cols[None, :], do, mask=ok)
    else:
        den = tl.load(ROWS + r, mask=row_ok, other=1.0)
        f = _divisor(den, MODE)
        tl.store(DNUM + r[:, None] * D + cols[None, :], do / f[:, None], mask=ok)
        if MODE == 1 or MODE == 2:  # d(num / f) / d den = -(do . num) / f^2 where f follows den (not at 0, not under the clamp)
            num = tl.load(NUM + r[:, None] * D + cols[None, :], mask=ok, other=0.0)
            follows = (den != 0.0) if MODE == 1 else (den >= 1.0)
            g = -tl.sum(do * num, 1) / (f * f)
            tl.store(DROWS + r, tl.where(follows, g, 0.0), mask=row_ok)


class _Divide(torch.autograd.Function):
    """o = num / finished(den) in the output dtype, one pass each way over [rows, D] (rows: B * Tq * H)."""

    @staticmethod
    def forward(ctx, num, rows, mode, out_dtype):
        n_rows, dim = num.numel() // num.shape[-1], num.shape[-1]
        out = torch.empty(num.shape, device=num.device, dtype=out_dtype)
        grid, blocks = _divide_grid(n_rows, dim)
        _divide_fwd_kernel[grid](num, num if rows is None else rows, out, n_rows, dim, MODE=mode, **blocks)
        ctx.save_for_backward(num if mode in (1, 2) else None, rows if mode else None)
        ctx.mode = mode
        return out

    @staticmethod
    def backward(ctx, dout):
        num, rows = ctx.saved_tensors
        mode = ctx.mode
        dout = dout.contiguous()
        dnum = torch.empty(dout.shape, device=dout.device, dtype=torch.float32)
        drows = torch.empty_like(rows) if mode in (1, 2) else None
        n_rows, dim = dout.numel() // dout.shape[-1], dout.shape[-1]
        grid, blocks = _divide_grid(n_rows, dim)
        _divide_bwd_kernel[grid](dout, num if num is not None else dnum, rows if rows is not None else dnum, dnum,
                                 drows if drows is not None else dnum, n_rows, dim, MODE=mode, **blocks)
        return dnum, drows, None, None


def _divide_grid(n_rows: int, dim: int):
    block_d = max(16, triton.next_power_of_2(dim))
    block_r = max(1, min(64, 4096 // block_d))
    return (triton.cdiv(n_rows, block_r),), dict(BLOCK_R=block_r, BLOCK_D=block_d)


@outside_compile(traced=True)
def divide(num: torch.Tensor, den: torch.Tensor | None, denominator: str, out_dtype: torch.dtype) -> torch.Tensor | None:
    """`_divide(_finish_denominator(den))` then the transpose of `parallel_attention`, fused: num [B, H, Tq, Dv]
    and den [B, H, Tq, 1] as `attention_terms` above returns them -> o [B, Tq, H, Dv] in `out_dtype`.
    None where it does not apply (the count denominators: the caller divides)."""
    mode = DIVIDE_MODES.get(denominator)
    if mode is None or num.dtype != torch.float32:
        return None
    num = num.transpose(1, 2).contiguous()  # the kernel's own layout: no copy
    if not mode:
        return _Divide.apply(num, None, mode, out_dtype)
    return _Divide.apply(num, den[..., 0].transpose(1, 2).contiguous(), mode, out_dtype)


attention_terms.divide = divide  # `parallel_attention` divides through it
attention_terms.writes_output = True  # and, for the denominator "none", has the output written by the forward kernel
