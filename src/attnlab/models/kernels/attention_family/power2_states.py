"""power2's state across chunks on Triton kernels that form the features in registers.

The chunked form (`chunk.py`) carries power2's state between chunks: with phi(x) the d * d features x_a x_b,

    S_{n+1} = exp(G_n) S_n + sum_{t in n} exp(G_n - g_t) scale^2 phi(k_t) [v_t, 1]^T          [d * d, Dv (+ 1)]
    y_t     = exp(g_t) phi(q_t) S_n                                                          (t in chunk n)

S is symmetric (S_ab = S_ba), so the kernels keep its F = d (d + 1) / 2 rows a <= b, packed as the decoding step
packs them (row-major), and so the state handed in and out needs no conversion. The rows of S for one first index a
form a [d, Dv] block, and phi(x) restricted to them is x_a x: a [tokens, d] tile made from x's tile by scaling its
rows. So every product with the features is an ordinary product of tiles in registers, and nothing of size d * d
per token is ever written:

    1. `_chunk_kernel`    one program per (chunk, a few first indices a and a block of Dv, batch * head): the chunk's
                          own share of the packed rows (a, b >= a), v^T (w x_a x_b), one product per first index
                          (narrow bands: the first indices' features side by side as one operand); b runs over a band
                          of columns from a's band start (`_bands`: at d = 64 it forms 2816 rows for the 2080
                          packed). Every chunk at once. REVERSE: with (q, dy) and weights exp(g), the share of the
                          state's gradient. `_chunk_normaliser_kernel`: the
                          normaliser's share, x^T (w x), per chunk.
       `_pass_kernel`     one program per (batch * head, block of packed rows) walks the chunks, stores the state when
                          each chunk starts (in the inputs' dtype: its readers multiply them on it) and moves on,
                          S <- exp(G) S + the chunk's share. REVERSE walks back from the last chunk: the gradient of
                          the state when each chunk ends, and the gradient of the starting state last. The forward's
                          states are kept for the backward (`KEEP_STATES`).
    2. `_output_kernel`   per (block of tokens, batch * head): y = sum over a <= b of (q_b * exp(g) q_a c_ab) S_ab with
                          c_ab 2 above the diagonal and 1 on it, in the same bands (`BANDED`) or on full rows,
                          added to the chunk's own (quadratic) part read from the caller's num (and the
                          normaliser's to its den): the sums are written token-major, num [B, T, H, Dv] and
                          den [B, T, H] fp32, as the division reads them.
    3. `_dq_kernel`       per (block of tokens, batch * head): dq = 2 sum_a (dy * exp(g) q_a) S_a^T over the full rows
                          S_a (row (a, b) read at packed (min, max)), dy and the normaliser's gradient read as given;
                          dq written in q's dtype, and q . dq per token in fp32.
    4. `_dkdv_kernel`     per (block of tokens, batch * head), dS the gradient of the chunk's end state:
                          dk = 2 sum_a (v * w k_a) dS_a^T on full rows, dv = sum over a <= b as the output's; dk, dv
                          in k's and v's dtypes, and k . dk per token in fp32.

The gradient of a state is symmetric too; a packed row a < b stands for two entries of the full one, so the final
state's gradient is halved off the diagonal on the way in and the starting state's doubled on the way out. A sum
denominator's normaliser (the value column of ones) is a vector of packed rows beside the state: a symmetric [d, d]
matrix Z, whose part in the output, dq and dk is one product per block of tokens, (x w) Z (`_symmetric_product`),
not a sum over first indices on the CUDA cores. The gradient of the
log-decays needs no kernel of its own: y is of degree 2 in q and the chunk's state of degree 2 in k, so
<dy_t, y_t> = q_t . dq_t / 2 and <[v_t, 1], d[v_t, 1]> = k_t . dk_t / 2 (the dq and dk kernels write those dots, from
dq and dk in fp32), and each chunk's total adds exp(G_n) <dS_{n+1}, S_n>, which the reverse walk sums as it goes. The
chunk's own part passes through the sum unchanged, and so does its gradient.

Memory beyond the inputs: the chunks' shares while a walk runs and the states per chunk, both packed in 16 bits
(266 KB per head and chunk at d = 64 and Dv = 64). Measured on an H200 (one layer of 16 heads of 64, forward and
backward, chunks of 512; benchmarks/NOTES.md): 20.6 ms at 1 x 65536 against 180 for the tiled kernels and 75 for
the features formed in memory, before the normaliser's products moved onto the tensor cores; at 1 x 16384 its kernels
took 4.1 ms, about 3.3 of them these, before the chunk kernel's split (at 2 x 8192 and 24 heads the mixing then took
6.27 ms, 5.73 after: benchmarks/results/h200-chunk-blocks-power2-split-bands-2x8192.txt). Heads up to `MAX_HEAD_DIM` and values up to `MAX_VALUE_DIM` wide (a program holds
[d, Dv] blocks of the state in registers); wider ones run on PyTorch's products in `chunk.py`. Under
TRITON_INTERPRET=1 the same kernels run on CPU tensors (slowly): the tests use that.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnlab.models.kernels.mamba2.ssd import _dot

MAX_HEAD_DIM = 64  # d: a program's [d, Dv] block of the state and [tokens, d] tiles in registers
MAX_VALUE_DIM = 128
TOKEN_ROWS = 64  # tokens per program of the output and gradient kernels
TOKEN_WARPS = 4
# The output's and dv's products on the state's rows b >= a alone, in bands of second indices (`_banded`), or on its
# full rows (a, b) for every b, read at their packed rows (min, max). On an H200 (2mamba's mixing forward and
# backward): at 1 x 16384 the full rows 5.60 ms, the bands 5.80, the bands on 8 warps 6.24, the full rows on 8 warps
# 6.86 (benchmarks/results/h200-chunk-blocks-power2-folded-1x16384.txt); at 1 x 65536 the full rows 23.28, the bands
# 23.89 (h200-chunk-blocks-power2-banded-or-full-rows.txt). The bands' 31% fewer products do not show; compiled for
# sm_90, both spill registers on 4 warps and neither on 8.
BANDED = False
BANDED_WARPS = 4
# The chunk kernel: tokens per step of its walk through the chunk, warps, first indices per program (a power of two;
# their features side by side in one product, times the widest band's columns over a band's) and its block of value
# columns. On an H200 (2mamba's mixing forward and backward at 1 x 65536, full rows, before the bands;
# benchmarks/results/h200-chunk-blocks-power2-firsts-per-program.txt): 4 first indices in steps of 32 tokens on 4 warps
# 31.38 ms; in steps of 64 32.12; 2 first indices 35.43, 1 first index 41.98, 8 on 8 warps 33.13.
STATE_ROWS = 32
STATE_WARPS = 4
CHUNK_FIRSTS = 4
CHUNK_COLUMNS = 64
# Bands at least this wide run the chunk kernel SPLIT: one product and accumulator per first index, the features formed
# in the layout of x's tile (`_chunk_split`). Side by side in one operand, they pass through a reshape between layouts:
# compiled by the device's Triton 3.6 for sm_90, its step of 32 tokens issues 791 instructions against 364 split, 65 of
# them 16-bit stores to shared memory. Narrower bands keep the one operand, which takes all their first indices in one
# program (the widest band, 32 first indices on 64 columns, takes 437 us split and with the next step's columns read
# ahead against 598 before, a band of 16 columns 133 against 80: Nsight Compute, one direction of the 2 x 8192 shape
# below). On an H200 (2mamba's mixing forward and
# backward at 2 x 8192, 24 heads; benchmarks/results/h200-chunk-blocks-power2-split-2x8192.txt): every band split
# 5.88 ms, none 6.27; with the loads of the next step's columns not issued ahead (`PREFETCH`) 6.33.
SPLIT_MIN_WIDTH = 32
# dq's and dkdv's full rows of the state found from the last first index's packed rows (`_full_row_block`) rather than
# computed anew: compiled for sm_90 by Triton 3.6, 140 instructions per first index against 164 (dq, 164 registers
# either way), 221 against 243 (dkdv, 206 registers against 203). The output kernel held 51 more registers that way
# (219 against 168) and keeps its own.
# Not timed yet.
STEPPED_ROWS = False
# The chunk kernel's and the token kernels' loads that feed no product (x's columns of the first indices, the weights)
# issued a step ahead of their use, by hand: Triton's pipelining issues ahead only the loads of a product's operands
PREFETCH = True
SHARES_16BIT = True  # the chunks' own shares of the state in the inputs' dtype (in fp32: 33.25 against 31.38 ms, above)
# The states when each chunk starts, packed in the inputs' dtype, kept from the forward for the backward (F * Dv per
# chunk and head: at heads of 64 and chunks of 512, 520 bytes a token and head in bf16) rather than walked again:
# 23.89 against 26.45 ms (h200-chunk-blocks-power2-banded-or-full-rows.txt)
KEEP_STATES = True
# The pass kernel's block of a state's packed rows (of all its value columns up to 64) and warps. At 2 x 8192
# (h200-chunk-blocks-power2-split-2x8192.txt): 32 rows on 4 warps 5.68 ms, 64 on 8 5.88 (in three more calls: 6.65
# against 6.81, 6.52 against 6.42, 6.16 against 6.50). Its next chunk's loads issued ahead by Triton's pipelining
# (2 stages): 5.88 against 5.80 without.
PASS_ROWS, PASS_WARPS = 32, 4
PASS_COLUMNS = 64


@triton.jit
def _rows_tile(base, t, stride_t, cols, width, in_t):
    """The [tokens, cols] tile of a matrix whose rows (tokens) are stride_t apart, zero outside."""
    return tl.load(base + t.to(tl.int64)[:, None] * stride_t + cols[None, :], mask=in_t[:, None] & (cols < width)[None, :],
                   other=0.0)


@triton.jit
def _log_decays(G, i_b, i_h, c, j, NC, H: tl.constexpr, CHUNK: tl.constexpr, in_t, HAS_DECAY: tl.constexpr):
    """(g at the chunk positions j of chunk c, G of chunk c): g [B, NC, H, CHUNK] summed from each chunk's start."""
    if HAS_DECAY:
        g_c = G + ((i_b.to(tl.int64) * NC + c) * H + i_h) * CHUNK
        return tl.load(g_c + j, mask=in_t, other=0.0), tl.load(g_c + CHUNK - 1)
    else:
        none = tl.zeros(j.shape, dtype=tl.float32)
        return none, tl.sum(none, axis=0)


@triton.jit
def _packed_row(a, b, D: tl.constexpr):
    """Row (a, b), a <= b, of a packed state: the rows a <= b of the full one, row-major."""
    return a * D - a * (a - 1) // 2 + b - a


@triton.jit
def _chunk_weights(G, i_b, i_h, c, pos, NC, scale2, in_t, H: tl.constexpr, CHUNK: tl.constexpr,
                   HAS_DECAY: tl.constexpr, REVERSE: tl.constexpr):
    """The chunk kernel's weights of the tokens at positions pos of chunk c, zero outside the sequence: forward
    scale2 exp(G_n - g), REVERSE exp(g)."""
    g, g_last = _log_decays(G, i_b, i_h, c, pos, NC, H, CHUNK, in_t, HAS_DECAY)
    if REVERSE:
        w = tl.exp(g)
    else:
        w = tl.exp(g_last - g) * scale2
    return tl.where(in_t, w, 0.0)


@triton.jit
def _first_share(x, x_a, w, vt, UPCAST: tl.constexpr):
    """One first index a's term of a chunk's share, vt @ (x * w x_a) for vt [BP, SUB], x [SUB, BW] and its column a,
    x_a [SUB]: the features formed in fp32 and rounded once to the products' dtype."""
    phi = (x.to(tl.float32) * (x_a.to(tl.float32) * w)[:, None]).to(vt.dtype)
    return _dot(vt, phi, vt.dtype == tl.float32, UPCAST)


@triton.jit
def _step_columns(x_bh, G, sxt, a0, A_END, c, sub, j, T, NC, scale2, i_b, i_h, H: tl.constexpr, CHUNK: tl.constexpr,
                  SUB: tl.constexpr, FIRSTS: tl.constexpr, HAS_DECAY: tl.constexpr, REVERSE: tl.constexpr):
    """What one step of `_chunk_split` reads beside its tiles: the tokens' weights and x's columns of the FIRSTS first
    indices from a0 (4 of them, the unused ones zero); a first index past A_END reads the last one's column (its rows
    are not stored)."""
    t = c * CHUNK + sub * SUB + j
    in_t = t < T
    w = _chunk_weights(G, i_b, i_h, c, sub * SUB + j, NC, scale2, in_t, H, CHUNK, HAS_DECAY, REVERSE)
    x_t = x_bh + t.to(tl.int64) * sxt
    x0 = tl.load(x_t + a0, mask=in_t, other=0.0)
    x1 = tl.zeros_like(x0)
    x2 = tl.zeros_like(x0)
    x3 = tl.zeros_like(x0)
    if FIRSTS >= 2:
        x1 = tl.load(x_t + tl.minimum(a0 + 1, A_END - 1), mask=in_t, other=0.0)
    if FIRSTS >= 4:
        x2 = tl.load(x_t + tl.minimum(a0 + 2, A_END - 1), mask=in_t, other=0.0)
        x3 = tl.load(x_t + tl.minimum(a0 + 3, A_END - 1), mask=in_t, other=0.0)
    return w, x0, x1, x2, x3


@triton.jit
def _share_store(LOCAL, here, S, a, seconds, cols, A_END, D: tl.constexpr, P: tl.constexpr):
    """First index a's packed rows (a, b >= a) of a chunk's share, from S [BP, BW] (transposed) over the columns
    `seconds`, to the share's [F, P] rows at `here`."""
    rows_ok = (seconds >= a) & (seconds < D) & (seconds * 0 + a < A_END)
    tl.store(LOCAL + here * P + _packed_row(a, seconds, D).to(tl.int64)[:, None] * P + cols[None, :],
             tl.trans(S).to(LOCAL.dtype.element_ty), mask=rows_ok[:, None] & (cols < P)[None, :])


@triton.jit
def _chunk_split(LOCAL, T, NC, a0, A_END, x_bh, v_bh, G, scale2, cols, seconds, c, i_b, i_h, i_bh, sxt, svt,
                 H: tl.constexpr, D: tl.constexpr, P: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr,
                 BW: tl.constexpr, BP: tl.constexpr, FIRSTS: tl.constexpr, HAS_DECAY: tl.constexpr,
                 REVERSE: tl.constexpr, UPCAST: tl.constexpr, PREFETCH: tl.constexpr):
    """`_chunk_kernel`'s share as FIRSTS (1, 2 or 4) products of two-dimensional tiles, one accumulator [BP, BW] per
    first index: the features x * w x_a are formed in the layout of x's tile, with no reshape between layouts."""
    j = tl.arange(0, SUB)
    S0 = tl.zeros([BP, BW], dtype=tl.float32)
    S1 = tl.zeros([BP, BW], dtype=tl.float32)
    S2 = tl.zeros([BP, BW], dtype=tl.float32)
    S3 = tl.zeros([BP, BW], dtype=tl.float32)
    # the weights and columns of the next step read while this one multiplies: their loads feed no product, so
    # Triton's pipelining leaves them to wait for at their use
    if PREFETCH:
        w, x0, x1, x2, x3 = _step_columns(x_bh, G, sxt, a0, A_END, c, 0, j, T, NC, scale2, i_b, i_h, H, CHUNK, SUB,
                                          FIRSTS, HAS_DECAY, REVERSE)
    STEPS: tl.constexpr = CHUNK // SUB
    for sub in range(STEPS):
        t = c * CHUNK + sub * SUB + j
        in_t = t < T
        if PREFETCH:
            w_n, x0_n, x1_n, x2_n, x3_n = _step_columns(x_bh, G, sxt, a0, A_END, c, tl.minimum(sub + 1, STEPS - 1), j, T,
                                                        NC, scale2, i_b, i_h, H, CHUNK, SUB, FIRSTS, HAS_DECAY, REVERSE)
        else:
            w, x0, x1, x2, x3 = _step_columns(x_bh, G, sxt, a0, A_END, c, sub, j, T, NC, scale2, i_b, i_h, H, CHUNK,
                                              SUB, FIRSTS, HAS_DECAY, REVERSE)
        vt = tl.trans(_rows_tile(v_bh, t, svt, cols, P, in_t))  # [BP, SUB]
        x = _rows_tile(x_bh, t, sxt, seconds, D, in_t)  # [SUB, BW]
        S0 += _first_share(x, x0, w, vt, UPCAST)
        if FIRSTS >= 2:
            S1 += _first_share(x, x1, w, vt, UPCAST)
        if FIRSTS >= 4:
            S2 += _first_share(x, x2, w, vt, UPCAST)
            S3 += _first_share(x, x3, w, vt, UPCAST)
        if PREFETCH:
            w, x0, x1, x2, x3 = w_n, x0_n, x1_n, x2_n, x3_n
    here = (i_bh.to(tl.int64) * NC + c) * (D * (D + 1) // 2)
    _share_store(LOCAL, here, S0, a0, seconds, cols, A_END, D, P)
    if FIRSTS >= 2:
        _share_store(LOCAL, here, S1, a0 + 1, seconds, cols, A_END, D, P)
    if FIRSTS >= 4:
        _share_store(LOCAL, here, S2, a0 + 2, seconds, cols, A_END, D, P)
        _share_store(LOCAL, here, S3, a0 + 3, seconds, cols, A_END, D, P)


@triton.jit
def _chunk_kernel(X, V, G, LOCAL, T, NC, A0, A_END, B0, scale2, sxb, sxt, sxh, svb, svt, svh,
                  H: tl.constexpr, D: tl.constexpr, P: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr,
                  BW: tl.constexpr, BP: tl.constexpr, FIRSTS: tl.constexpr, HAS_DECAY: tl.constexpr,
                  REVERSE: tl.constexpr, UPCAST: tl.constexpr, SPLIT: tl.constexpr, PREFETCH: tl.constexpr):
    """One (chunk n, FIRSTS first indices a from A0 and a block of P, batch * head): the chunk's own share of the
    packed rows (a, b), b >= a, of the state ([D (D + 1) / 2, P] per chunk); b runs over the BW columns from B0 (a
    band: `_bands`). Forward (X = k, V = v): v^T (k_a k_b * scale2 exp(G_n - g)); REVERSE (X = q, V = dy):
    dy^T (q_a q_b * exp(g)). SPLIT: one product and accumulator per first index (`_chunk_split`); else the features
    of the FIRSTS first indices side by side as one [tokens, FIRSTS * BW] operand, formed from one load of X's tile
    and its columns a (narrow bands: many first indices a program, the tiles read once for all of them)."""
    c, i_ap, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NP: tl.constexpr = (P + BP - 1) // BP
    F: tl.constexpr = D * (D + 1) // 2
    i_a, i_p = i_ap // NP, i_ap % NP
    i_b, i_h = i_bh // H, i_bh % H
    x_bh = X + i_b.to(tl.int64) * sxb + i_h * sxh
    v_bh = V + i_b.to(tl.int64) * svb + i_h * svh
    cols = i_p * BP + tl.arange(0, BP)
    seconds = B0 + tl.arange(0, BW)
    if SPLIT:
        _chunk_split(LOCAL, T, NC, A0 + i_a * FIRSTS, A_END, x_bh, v_bh, G, scale2, cols, seconds, c, i_b, i_h, i_bh, sxt,
                     svt, H, D, P, CHUNK, SUB, BW, BP, FIRSTS, HAS_DECAY, REVERSE, UPCAST, PREFETCH)
    else:
        firsts = A0 + i_a * FIRSTS + tl.arange(0, FIRSTS)
        pairs = tl.arange(0, FIRSTS * BW)  # the operand's columns: (a, b) with b the faster
        a = A0 + i_a * FIRSTS + pairs // BW
        b = B0 + pairs % BW
        j = tl.arange(0, SUB)
        S = tl.zeros([BP, FIRSTS * BW], dtype=tl.float32)
        for sub in range(CHUNK // SUB):
            t = c * CHUNK + sub * SUB + j
            in_t = t < T
            w = _chunk_weights(G, i_b, i_h, c, sub * SUB + j, NC, scale2, in_t, H, CHUNK, HAS_DECAY, REVERSE)
            vt = _rows_tile(v_bh, t, svt, cols, P, in_t)
            x = _rows_tile(x_bh, t, sxt, seconds, D, in_t).to(tl.float32)  # [SUB, BW]
            x_a = _rows_tile(x_bh, t, sxt, firsts, D, in_t).to(tl.float32) * w[:, None]  # [SUB, FIRSTS]
            phi = tl.reshape(x_a[:, :, None] * x[:, None, :], (SUB, FIRSTS * BW))  # the features, weighted
            S += _dot(tl.trans(vt), phi.to(vt.dtype), vt.dtype == tl.float32, UPCAST)
        here = (i_bh.to(tl.int64) * NC + c) * F
        in_rows = (a < A_END) & (b >= a) & (b < D)
        tl.store(LOCAL + here * P + _packed_row(a, b, D).to(tl.int64)[:, None] * P + cols[None, :],
                 tl.trans(S).to(LOCAL.dtype.element_ty), mask=in_rows[:, None] & (cols < P)[None, :])


@triton.jit
def _chunk_normaliser_kernel(X, E, G, LOCAL_Z, T, NC, scale2, sxb, sxt, sxh, seb, set_, seh, H: tl.constexpr,
                             D: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr, BD: tl.constexpr,
                             HAS_DECAY: tl.constexpr, REVERSE: tl.constexpr, UPCAST: tl.constexpr):
    """One (chunk, batch * head): the chunk's own share of the normaliser's packed rows in fp32: x^T (w x) with the
    chunk kernel's weights w, times E (the normaliser column's gradient) in REVERSE."""
    c, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    x_bh = X + i_b.to(tl.int64) * sxb + i_h * sxh
    rows = tl.arange(0, BD)
    j = tl.arange(0, SUB)
    Z = tl.zeros([BD, BD], dtype=tl.float32)
    for sub in range(CHUNK // SUB):
        t = c * CHUNK + sub * SUB + j
        in_t = t < T
        w = _chunk_weights(G, i_b, i_h, c, sub * SUB + j, NC, scale2, in_t, H, CHUNK, HAS_DECAY, REVERSE)
        if REVERSE:
            e = tl.load(E + i_b.to(tl.int64) * seb + i_h * seh + t.to(tl.int64) * set_, mask=in_t, other=0.0)
            w = w * e.to(tl.float32)
        x = _rows_tile(x_bh, t, sxt, rows, D, in_t)
        Z += _dot(tl.trans((x.to(tl.float32) * w[:, None]).to(x.dtype)), x, x.dtype == tl.float32, UPCAST)
    F: tl.constexpr = D * (D + 1) // 2
    tl.store(LOCAL_Z + (i_bh.to(tl.int64) * NC + c) * F + _packed_row(rows[:, None], rows[None, :], D), Z,
             mask=(rows[:, None] <= rows[None, :]) & (rows < D)[None, :])


@triton.jit
def _pass_kernel(LOCAL, LOCAL_Z, G, INIT, INIT_Z, STATES, ZS, FINAL, FINAL_Z, PREV, PREV_Z, TIMES, DOTS, NC,
                 H: tl.constexpr, D: tl.constexpr, P: tl.constexpr, CHUNK: tl.constexpr, BR: tl.constexpr,
                 BP: tl.constexpr, HAS_DECAY: tl.constexpr, HAS_INIT: tl.constexpr, HAS_ONES: tl.constexpr,
                 REVERSE: tl.constexpr, WANT_DOTS: tl.constexpr):
    """One (batch * head, block of BR packed state rows, block of P) through every chunk: STATES[bh, n] <- S, the state
    when chunk n starts, then S <- exp(G_n) S + the chunk's own share (LOCAL). REVERSE: from the last chunk
    back, STATES[bh, n] <- the gradient of the state when chunk n ends, and the same recurrence; with WANT_DOTS,
    DOTS[bh, n, rows block, block of P] <- exp(G_n) <dS, S_n> over the block's rows, each counted TIMES times as in the
    full layout (PREV: the forward's states). The last S goes to FINAL (fp32). All packed."""
    i_bh, i_r, i_p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NP: tl.constexpr = (P + BP - 1) // BP
    F: tl.constexpr = D * (D + 1) // 2
    NR: tl.constexpr = (F + BR - 1) // BR
    i_b, i_h = i_bh // H, i_bh % H
    rows = i_r * BR + tl.arange(0, BR)
    cols = i_p * BP + tl.arange(0, BP)
    in_rows = rows < F
    block = rows[:, None] * P + cols[None, :]  # the block's offsets in a packed [F, P] state (int32; int64 bases)
    in_block = in_rows[:, None] & (cols < P)[None, :]
    z_mine = in_rows & (rows * 0 + i_p == 0)  # the normaliser's rows: the first block of P alone keeps them
    j = tl.arange(0, 16)
    if HAS_INIT:
        S = tl.load(INIT + i_bh.to(tl.int64) * F * P + block, mask=in_block, other=0.0).to(tl.float32)
        z = tl.load(INIT_Z + i_bh.to(tl.int64) * F + rows, mask=in_rows, other=0.0).to(tl.float32)
    else:
        S = tl.zeros([BR, BP], dtype=tl.float32)
        z = tl.zeros([BR], dtype=tl.float32)
    for step in range(NC):
        if REVERSE:
            c = NC - 1 - step
        else:
            c = step
        packed = (i_bh.to(tl.int64) * NC + c) * F
        tl.store(STATES + packed * P + block, S.to(STATES.dtype.element_ty), mask=in_block)
        if HAS_ONES:
            tl.store(ZS + packed + rows, z, mask=z_mine)
        g_first, g_last = _log_decays(G, i_b, i_h, c, j, NC, H, CHUNK, j < 0, HAS_DECAY)
        decay = tl.exp(g_last)
        if WANT_DOTS:
            times = tl.load(TIMES + rows, mask=in_rows, other=0.0)
            prev = tl.load(PREV + packed * P + block, mask=in_block, other=0.0).to(tl.float32)
            dot = tl.sum(tl.sum(S * prev, axis=1) * times, axis=0)
            if HAS_ONES:
                dot += tl.sum(z * tl.load(PREV_Z + packed + rows, mask=z_mine, other=0.0) * times, axis=0)
            tl.store(DOTS + ((i_bh.to(tl.int64) * NC + c) * NR + i_r) * NP + i_p, decay * dot)
        S = S * decay + tl.load(LOCAL + packed * P + block, mask=in_block, other=0.0).to(tl.float32)
        if HAS_ONES:
            z = z * decay + tl.load(LOCAL_Z + packed + rows, mask=in_rows, other=0.0)
    tl.store(FINAL + i_bh.to(tl.int64) * F * P + block, S, mask=in_block)
    if HAS_ONES:
        tl.store(FINAL_Z + i_bh.to(tl.int64) * F + rows, z, mask=z_mine)


@triton.jit
def _token_block(X, G, sxb, sxt, sxh, T, NC, H: tl.constexpr, D: tl.constexpr, CHUNK: tl.constexpr, BL: tl.constexpr,
                 BD: tl.constexpr, HAS_DECAY: tl.constexpr):
    """What the per-token kernels' programs start from: the batch row and head, the chunk, the tokens and which are
    in the sequence, X's head, its [BL, BD] tile in fp32, g and G of the tokens' chunk."""
    i_l, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    first = i_l * BL
    c = first // CHUNK
    t = first + tl.arange(0, BL)
    in_t = t < T
    x_bh = X + i_b.to(tl.int64) * sxb + i_h * sxh
    cols = tl.arange(0, BD)
    x = _rows_tile(x_bh, t, sxt, cols, D, in_t).to(tl.float32)
    g, g_last = _log_decays(G, i_b, i_h, c, t - c * CHUNK, NC, H, CHUNK, in_t, HAS_DECAY)
    return i_bh, i_b, i_h, c, t, in_t, x_bh, x, g, g_last


@triton.jit
def _state_tile(i_bh, c, NC, D: tl.constexpr, P: tl.constexpr, BD: tl.constexpr, BP: tl.constexpr):
    """One first index's [BD, BP] block of a packed state: its second indices and columns, which of them exist, and
    the first row of chunk c's state of batch * head i_bh in a [B * H, NC, F, P] tensor of them."""
    rows = tl.arange(0, BD)
    cols = tl.arange(0, BP)
    return rows, cols, (rows < D)[:, None] & (cols < P)[None, :], (i_bh.to(tl.int64) * NC + c) * (D * (D + 1) // 2)


@triton.jit
def _full_rows(a, rows, D: tl.constexpr):
    """The packed rows of the symmetric state's full rows (a, b) for b in rows: (min, max)."""
    return _packed_row(tl.minimum(a, rows), tl.maximum(a, rows), D)


@triton.jit
def _symmetric_product(x, ZS, here, rows, D: tl.constexpr, UPCAST: tl.constexpr):
    """x @ Z for x [tokens, BD] fp32 and the symmetric [D, D] matrix Z whose packed rows ZS holds from `here` (fp32):
    one product on the tensor cores in fp32's accuracy (three TF32 passes), where a sum over the first indices of
    x_a z_a costs the CUDA cores as much as the state's products inside the loops."""
    Z = tl.load(ZS + here + _full_rows(rows[:, None], rows[None, :], D), mask=(rows < D)[:, None] & (rows < D)[None, :],
                other=0.0)
    if UPCAST:
        return tl.dot(x, Z, input_precision="ieee")
    else:
        return tl.dot(x, Z, input_precision="tf32x3")


@triton.jit
def _band_products(acc, x, x_bh, t, sxt, in_t, weight, STATES, here, A0: tl.constexpr, A1: tl.constexpr,
                   BW: tl.constexpr, D: tl.constexpr, P: tl.constexpr, BP: tl.constexpr, UPCAST: tl.constexpr):
    """acc += sum over A0 <= a < A1 of (x_b * weight x_a * c_ab) S_ab over the BW columns b from A0 (x [BL, BW] those
    of X), c_ab 2 above the diagonal, 1 on it and 0 below: the symmetric state's products on its rows b >= a alone."""
    seconds = A0 + tl.arange(0, BW)
    cols = tl.arange(0, BP)
    in_tile = (seconds < D)[:, None] & (cols < P)[None, :]
    DT = STATES.dtype.element_ty
    for a in range(A0, A1):
        xa = tl.load(x_bh + t.to(tl.int64) * sxt + a, mask=in_t, other=0.0).to(tl.float32) * weight
        times = tl.where(seconds > a, 2.0, tl.where(seconds == a, 1.0, 0.0))
        phi = x * xa[:, None] * times[None, :]
        S_a = tl.load(STATES + (here + _packed_row(a, seconds, D)).to(tl.int64)[:, None] * P + cols[None, :],
                      mask=in_tile & (seconds >= a)[:, None], other=0.0)
        acc += _dot(phi.to(DT), S_a, DT == tl.float32, UPCAST)
    return acc


@triton.jit
def _banded(acc, x_bh, t, sxt, in_t, weight, STATES, here, D: tl.constexpr, P: tl.constexpr, BD: tl.constexpr,
            BP: tl.constexpr, BANDS: tl.constexpr, SPLIT1: tl.constexpr, SPLIT2: tl.constexpr, UPCAST: tl.constexpr):
    """`_band_products` over the bands of `_bands`: first indices [0, SPLIT1) on BD columns, [SPLIT1, SPLIT2) on BD / 2,
    [SPLIT2, D) on BD / 4 (BANDS of them; the last ends at D). Each band loads its own columns of X: the kernels' own
    load of the whole tile is then unused and left out by the compiler (reusing it for the first band spilled more
    registers, compiled for sm_90)."""
    END0: tl.constexpr = D if BANDS == 1 else SPLIT1
    x = _rows_tile(x_bh, t, sxt, tl.arange(0, BD), D, in_t).to(tl.float32)
    acc = _band_products(acc, x, x_bh, t, sxt, in_t, weight, STATES, here, 0, END0, BD, D, P, BP, UPCAST)
    if BANDS > 1:
        END1: tl.constexpr = D if BANDS == 2 else SPLIT2
        x = _rows_tile(x_bh, t, sxt, SPLIT1 + tl.arange(0, BD // 2), D, in_t).to(tl.float32)
        acc = _band_products(acc, x, x_bh, t, sxt, in_t, weight, STATES, here, SPLIT1, END1, BD // 2, D, P, BP, UPCAST)
    if BANDS > 2:
        x = _rows_tile(x_bh, t, sxt, SPLIT2 + tl.arange(0, BD // 4), D, in_t).to(tl.float32)
        acc = _band_products(acc, x, x_bh, t, sxt, in_t, weight, STATES, here, SPLIT2, D, BD // 4, D, P, BP, UPCAST)
    return acc


@triton.jit
def _full_row_block(STATES, here, a, row_a, rows, cols, in_block, D: tl.constexpr, P: tl.constexpr,
                    STEPPED: tl.constexpr):
    """(full row a's [BD, BP] block of the packed state at `here`, what the next first index takes as row_a): with
    STEPPED, row_a holds row a's packed rows (`_full_rows`), and row a + 1's follow from them: entry (a, b) lies at
    packed row (b, a) for b < a and (a, b) for b >= a, and moving to a + 1 adds 1 to the first and D - 1 - a to the
    second (b = a moves from (a, a) to (a, a + 1): 1); else they are computed anew."""
    if STEPPED:
        block = tl.load(STATES + (here + row_a).to(tl.int64)[:, None] * P + cols[None, :], mask=in_block, other=0.0)
        return block, row_a + tl.where(rows <= a, 1, D - 1 - a)
    else:
        block = tl.load(STATES + (here + _full_rows(a, rows, D)).to(tl.int64)[:, None] * P + cols[None, :],
                        mask=in_block, other=0.0)
        return block, row_a


@triton.jit
def _column_ahead(x_t, a, loaded, in_t, D: tl.constexpr, PREFETCH: tl.constexpr):
    """(what the next step of a loop over first indices a takes as `loaded`, x's column a): with PREFETCH, `loaded` is
    column a (read a step before) and column a + 1 is read now, so that its load waits for no one; else column a is
    read now."""
    if PREFETCH:
        return tl.load(x_t + tl.minimum(a + 1, D - 1), mask=in_t, other=0.0), loaded
    else:
        column = tl.load(x_t + a, mask=in_t, other=0.0)
        return column, column


@triton.jit
def _output_kernel(Q, G, STATES, ZS, NUM, DEN, NUM_OUT, DEN_OUT, T, NC, sqb, sqt, sqh, snb, snt, snh, sdb, sdt, sdh,
                   H: tl.constexpr, D: tl.constexpr, P: tl.constexpr, CHUNK: tl.constexpr, BL: tl.constexpr,
                   BD: tl.constexpr, BP: tl.constexpr, HAS_DECAY: tl.constexpr, HAS_ONES: tl.constexpr,
                   UPCAST: tl.constexpr, BANDED: tl.constexpr, BANDS: tl.constexpr, SPLIT1: tl.constexpr,
                   SPLIT2: tl.constexpr, PREFETCH: tl.constexpr):
    """num = the chunk's own part NUM + exp(g) phi(q) S_n for a block of tokens of chunk n: BANDED, sum over a <= b of
    (q_b * exp(g) q_a * c_ab) S_ab in the bands of `_bands` (`_banded`), else sum over a of (q * exp(g) q_a) S_a, to
    NUM_OUT; with HAS_ONES the normaliser's part plus DEN to DEN_OUT. NUM and NUM_OUT [B, T, H, P] fp32, both at the
    strides snb, snt, snh; DEN and DEN_OUT [B, T, H] fp32 at sdb, sdt, sdh. The chunk's own part is read at the end
    (read first, its tile kept through the products spilled registers, compiled for sm_90)."""
    i_bh, i_b, i_h, c, t, in_t, q_bh, q, g, _ = _token_block(Q, G, sqb, sqt, sqh, T, NC, H, D, CHUNK, BL, BD, HAS_DECAY)
    rows, cols, in_block, here = _state_tile(i_bh, c, NC, D, P, BD, BP)
    weight = tl.where(in_t, tl.exp(g), 0.0)
    acc = tl.zeros([BL, BP], dtype=tl.float32)
    if BANDED:
        acc = _banded(acc, q_bh, t, sqt, in_t, weight, STATES, here, D, P, BD, BP, BANDS, SPLIT1, SPLIT2, UPCAST)
    else:
        DT = STATES.dtype.element_ty
        q_t = q_bh + t.to(tl.int64) * sqt
        qa = tl.load(q_t, mask=in_t, other=0.0)
        for a in range(D):
            qa, q_a = _column_ahead(q_t, a, qa, in_t, D, PREFETCH)
            phi = q * (q_a.to(tl.float32) * weight)[:, None]
            S_a = tl.load(STATES + (here + _full_rows(a, rows, D)).to(tl.int64)[:, None] * P + cols[None, :],
                          mask=in_block, other=0.0)
            acc += _dot(phi.to(DT), S_a, DT == tl.float32, UPCAST)
    if HAS_ONES:  # sum over a, b of w q_a q_b z_ab
        den = tl.sum(_symmetric_product(q * weight[:, None], ZS, here, rows, D, UPCAST) * q, axis=1)
    here_n = i_b.to(tl.int64) * snb + i_h * snh + t.to(tl.int64)[:, None] * snt + cols[None, :]
    in_n = in_t[:, None] & (cols < P)[None, :]
    tl.store(NUM_OUT + here_n, acc + tl.load(NUM + here_n, mask=in_n, other=0.0), mask=in_n)
    if HAS_ONES:
        here_d = i_b.to(tl.int64) * sdb + i_h * sdh + t.to(tl.int64) * sdt
        tl.store(DEN_OUT + here_d, den + tl.load(DEN + here_d, mask=in_t, other=0.0), mask=in_t)


@triton.jit
def _dq_kernel(Q, G, DY, DDEN, STATES, ZS, DQ, QDQ, T, NC, sqb, sqt, sqh, syb, syt, syh, seb, set_, seh,
               H: tl.constexpr, D: tl.constexpr, P: tl.constexpr, CHUNK: tl.constexpr, BL: tl.constexpr,
               BD: tl.constexpr, BP: tl.constexpr, HAS_DECAY: tl.constexpr, HAS_ONES: tl.constexpr,
               UPCAST: tl.constexpr, PREFETCH: tl.constexpr, STEPPED: tl.constexpr):
    """dq = 2 exp(g) sum_a q_a S_a [dy, dden] for a block of tokens (S symmetric), dy [B, T, H, P] and the
    normaliser's gradient dden [B, T, H] (HAS_ONES) at their strides; DQ in its own dtype, laid out as Q; with
    HAS_DECAY, QDQ [B, T, H] fp32 (contiguous) <- q . dq, from dq before its rounding."""
    i_bh, i_b, i_h, c, t, in_t, q_bh, q, g, _ = _token_block(Q, G, sqb, sqt, sqh, T, NC, H, D, CHUNK, BL, BD, HAS_DECAY)
    rows, cols, in_block, here = _state_tile(i_bh, c, NC, D, P, BD, BP)
    weight = tl.where(in_t, tl.exp(g), 0.0)
    DT = STATES.dtype.element_ty
    dy_bh = DY + i_b.to(tl.int64) * syb + i_h * syh
    dy = _rows_tile(dy_bh, t, syt, cols, P, in_t).to(tl.float32) * weight[:, None]
    if HAS_ONES:
        dden_bh = DDEN + i_b.to(tl.int64) * seb + i_h * seh
        dden = tl.load(dden_bh + t.to(tl.int64) * set_, mask=in_t, other=0.0).to(tl.float32) * weight
    dq = tl.zeros([BL, BD], dtype=tl.float32)
    q_t = q_bh + t.to(tl.int64) * sqt
    qa = tl.load(q_t, mask=in_t, other=0.0)
    row_a = rows  # full row 0: the packed rows (0, b)
    for a in range(D):
        qa, q_a = _column_ahead(q_t, a, qa, in_t, D, PREFETCH)
        S_a, row_a = _full_row_block(STATES, here, a, row_a, rows, cols, in_block, D, P, STEPPED)
        dq += _dot((dy * q_a.to(tl.float32)[:, None]).to(DT), tl.trans(S_a), DT == tl.float32, UPCAST)
    in_q = in_t[:, None] & (rows < D)[None, :]
    if HAS_ONES or HAS_DECAY:  # q read again, at addresses from the block's first token: the start's tile or its
        # addresses kept through the loop would hold registers
        here_q = i_b.to(tl.int64) * sqb + i_h * sqh + tl.program_id(0).to(tl.int64) * BL * sqt
        q = tl.load(Q + here_q + tl.arange(0, BL)[:, None] * sqt + rows[None, :], mask=in_q, other=0.0).to(tl.float32)
    if HAS_ONES:  # sum over a of dden q_a z_a
        dq += dden[:, None] * _symmetric_product(q, ZS, here, rows, D, UPCAST)
    dq = 2.0 * dq
    dq_bh = DQ + i_b.to(tl.int64) * sqb + i_h * sqh  # DQ is laid out as Q
    tl.store(dq_bh + t.to(tl.int64)[:, None] * sqt + rows[None, :], dq.to(DQ.dtype.element_ty), mask=in_q)
    if HAS_DECAY:
        tl.store(QDQ + (i_b.to(tl.int64) * T + t) * H + i_h, tl.sum(q * dq, axis=1), mask=in_t)


@triton.jit
def _dkdv_kernel(K, V, G, DSTATES, DZS, DK, DV, KDK, T, NC, scale2, skb, skt, skh, svb, svt, svh,
                 H: tl.constexpr, D: tl.constexpr, P: tl.constexpr, CHUNK: tl.constexpr, BL: tl.constexpr,
                 BD: tl.constexpr, BP: tl.constexpr, HAS_DECAY: tl.constexpr, HAS_ONES: tl.constexpr,
                 UPCAST: tl.constexpr, BANDED: tl.constexpr, BANDS: tl.constexpr, SPLIT1: tl.constexpr,
                 SPLIT2: tl.constexpr, PREFETCH: tl.constexpr, STEPPED: tl.constexpr):
    """For a block of tokens of chunk n, dS the gradient of the state when the chunk ends and w = scale2 exp(G - g):
    dk = 2 sum_a (v * w k_a) dS_a^T (+ w k_a dz_a), dv = sum_a (k * w k_a) dS_a (BANDED: on the rows b >= a,
    `_banded`); DK, DV in their own dtypes, laid out as K, V; with HAS_DECAY, KDK [B, T, H] fp32 (contiguous)
    <- k . dk, from dk before its rounding."""
    i_bh, i_b, i_h, c, t, in_t, k_bh, k, g, g_last = _token_block(K, G, skb, skt, skh, T, NC, H, D, CHUNK, BL, BD,
                                                                  HAS_DECAY)
    rows, cols, in_block, here = _state_tile(i_bh, c, NC, D, P, BD, BP)
    weight = tl.where(in_t, tl.exp(g_last - g) * scale2, 0.0)
    DT = DSTATES.dtype.element_ty
    v_bh = V + i_b.to(tl.int64) * svb + i_h * svh
    v = _rows_tile(v_bh, t, svt, cols, P, in_t).to(tl.float32)
    dk = tl.zeros([BL, BD], dtype=tl.float32)
    dv = tl.zeros([BL, BP], dtype=tl.float32)
    if BANDED:
        dv = _banded(dv, k_bh, t, skt, in_t, weight, DSTATES, here, D, P, BD, BP, BANDS, SPLIT1, SPLIT2, UPCAST)
    k_t = k_bh + t.to(tl.int64) * skt
    ka = tl.load(k_t, mask=in_t, other=0.0)
    row_a = rows  # full row 0: the packed rows (0, b)
    for a in range(D):
        ka, k_a = _column_ahead(k_t, a, ka, in_t, D, PREFETCH)
        kw = k_a.to(tl.float32) * weight
        dS_a, row_a = _full_row_block(DSTATES, here, a, row_a, rows, cols, in_block, D, P, STEPPED)
        dk += _dot((v * kw[:, None]).to(DT), tl.trans(dS_a), DT == tl.float32, UPCAST)
        if not BANDED:
            dv += _dot((k * kw[:, None]).to(DT), dS_a, DT == tl.float32, UPCAST)
    # addresses from the block's first token: those of the start's loads kept through the loops (as they are with the
    # same expression) would hold registers; k read again for k dZ and k . dk for the same reason
    first = tl.program_id(0).to(tl.int64) * BL
    j = tl.arange(0, BL)
    dv_at = DV + i_b.to(tl.int64) * svb + i_h * svh + first * svt + j[:, None] * svt + cols[None, :]
    tl.store(dv_at, dv.to(DV.dtype.element_ty), mask=in_t[:, None] & (cols < P)[None, :])
    in_k = in_t[:, None] & (rows < D)[None, :]
    if HAS_ONES or HAS_DECAY:
        k = tl.load(K + i_b.to(tl.int64) * skb + i_h * skh + first * skt + j[:, None] * skt + rows[None, :], mask=in_k,
                    other=0.0).to(tl.float32)
    if HAS_ONES:  # sum over a of w k_a dz_a
        dk += weight[:, None] * _symmetric_product(k, DZS, here, rows, D, UPCAST)
    dk = 2.0 * dk
    if HAS_DECAY:
        tl.store(KDK + (i_b.to(tl.int64) * T + t) * H + i_h, tl.sum(k * dk, axis=1), mask=in_t)
    dk_at = DK + i_b.to(tl.int64) * skb + i_h * skh + first * skt + j[:, None] * skt + rows[None, :]
    tl.store(dk_at, dk.to(DK.dtype.element_ty), mask=in_k)


def _block(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def _rows(chunk: int, rows: int) -> int:
    """The tokens a program or step takes: `rows`, or the whole chunk where it is shorter."""
    return min(rows, chunk)


def covers(head_dim: int, value_dim: int, chunk: int) -> bool:
    """Whether these kernels take heads of head_dim, values of value_dim and chunks of `chunk` tokens: blocks of
    tokens (`TOKEN_ROWS`, `STATE_ROWS`, or the chunk where shorter) are powers of two from 16 that tile the chunk."""

    def tiles(rows: int) -> bool:
        used = _rows(chunk, rows)
        return used >= 16 and not used & (used - 1) and chunk % used == 0

    return head_dim <= MAX_HEAD_DIM and value_dim <= MAX_VALUE_DIM and tiles(TOKEN_ROWS) and tiles(STATE_ROWS)


def _bands(head_dim: int) -> list[tuple[int, int, int, int]]:
    """The chunk kernel's bands (first a, end of a, first b, columns of b): the packed rows b >= a of first indices
    a0 <= a < a1 lie in the columns b0 <= b < b0 + width, halved from band to band while 16 or wider (heads of 64:
    2816 of the 4096 full rows formed, for the 2080 packed)."""
    bands, start, width = [], 0, _block(head_dim)
    while width // 2 >= 16 and start + width // 2 < head_dim:
        bands.append((start, start + width // 2, start, width))
        start, width = start + width // 2, width // 2
    bands.append((start, head_dim, start, width))
    return bands


def _walk(x, v, e, g, init, init_z, chunk, scale2, reverse, ones, prev=None, prev_z=None, times=None):
    """The states of `_chunk_kernel` and `_pass_kernel`, packed (F = D (D + 1) / 2 rows): (states [B * H, NC, F, P] in
    v's dtype, their normaliser rows [B * H, NC, F] fp32 or None, the last state [B * H, F, P] fp32, its normaliser
    rows [B * H, F] or None, the dots [B * H, NC, row blocks, P blocks] fp32 or None). init, init_z: packed, or None;
    prev, prev_z: the forward's states, with `times` [F] (how often each packed row stands in the full layout) for the
    dots."""
    batch, seq_len, heads, head_dim = x.shape
    value_dim = v.shape[-1]
    chunks = seq_len // chunk
    packed = head_dim * (head_dim + 1) // 2
    local = v.new_empty(batch * heads, chunks, packed, value_dim, dtype=v.dtype if SHARES_16BIT else torch.float32)
    local_z = v.new_empty(batch * heads, chunks, packed, dtype=torch.float32) if ones else local
    bp = min(_block(value_dim), CHUNK_COLUMNS)
    g_arg = g if g is not None else local
    sub = _rows(chunk, STATE_ROWS)
    for first, end, second, width in _bands(head_dim):
        split = width >= SPLIT_MIN_WIDTH
        if split:
            firsts = min(CHUNK_FIRSTS, triton.next_power_of_2(end - first))
        else:
            firsts = min(CHUNK_FIRSTS * _block(head_dim) // width, triton.next_power_of_2(end - first))
        _chunk_kernel[(chunks, triton.cdiv(end - first, firsts) * triton.cdiv(value_dim, bp), batch * heads)](
            x, v, g_arg, local, seq_len, chunks, first, end, second, scale2, *x.stride()[:3], *v.stride()[:3], H=heads,
            D=head_dim, P=value_dim, CHUNK=chunk, SUB=sub, BW=width, BP=bp, FIRSTS=firsts, HAS_DECAY=g is not None,
            REVERSE=reverse, UPCAST=not x.is_cuda, SPLIT=split, PREFETCH=PREFETCH, num_warps=STATE_WARPS)
    if ones:
        _chunk_normaliser_kernel[(chunks, batch * heads)](
            x, e if e is not None else local_z, g_arg, local_z, seq_len, chunks, scale2, *x.stride()[:3],
            *(e.stride()[:3] if e is not None else (0, 0, 0)), H=heads, D=head_dim, CHUNK=chunk, SUB=sub,
            BD=_block(head_dim), HAS_DECAY=g is not None, REVERSE=reverse, UPCAST=not x.is_cuda, num_warps=STATE_WARPS)
    states = v.new_empty(batch * heads, chunks, packed, value_dim)
    final = v.new_empty(batch * heads, packed, value_dim, dtype=torch.float32)
    zs = v.new_empty(batch * heads, chunks, packed, dtype=torch.float32) if ones else final
    final_z = v.new_empty(batch * heads, packed, dtype=torch.float32) if ones else final
    br, bp = min(PASS_ROWS, _block(packed)), min(PASS_COLUMNS, _block(value_dim))
    grid = (batch * heads, triton.cdiv(packed, br), triton.cdiv(value_dim, bp))
    dots = v.new_empty(batch * heads, chunks, grid[1], grid[2], dtype=torch.float32) if prev is not None else final
    _pass_kernel[grid](
        local, local_z, g_arg, init if init is not None else final, init_z if init_z is not None else final, states, zs,
        final, final_z, prev if prev is not None else final, prev_z if prev_z is not None else final,
        times if times is not None else final, dots, chunks,
        H=heads, D=head_dim, P=value_dim, CHUNK=chunk, BR=br, BP=bp, HAS_DECAY=g is not None, HAS_INIT=init is not None,
        HAS_ONES=ones, REVERSE=reverse, WANT_DOTS=prev is not None, num_warps=PASS_WARPS)
    return states, zs if ones else None, final, final_z if ones else None, dots if prev is not None else None


def _meta(heads, head_dim, value_dim, chunk, g, ones, x, banded=False):
    """The token kernels' constants; `banded` (the output and dk/dv kernels): `BANDED` and the bands of `_bands` as
    `_banded` takes them (how many, and where the second and third start)."""
    meta = dict(H=heads, D=head_dim, P=value_dim, CHUNK=chunk, BL=_rows(chunk, TOKEN_ROWS), BD=_block(head_dim),
                BP=_block(value_dim), HAS_DECAY=g is not None, HAS_ONES=ones, UPCAST=not x.is_cuda, PREFETCH=PREFETCH,
                num_warps=TOKEN_WARPS)
    if banded:
        starts = [first for first, _, _, _ in _bands(head_dim)[1:]] + [0, 0]
        meta.update(BANDED=BANDED, BANDS=len(_bands(head_dim)), SPLIT1=starts[0], SPLIT2=starts[1])
        if BANDED:
            meta["num_warps"] = BANDED_WARPS
    return meta


class Power2States(torch.autograd.Function):
    """power2's output before the division, the chunks' own part plus exp(g_t) phi(q_t) S_n, and the state after the
    last chunk, on the kernels above. q, k [B, T, H, d] and v [B, T, H, Dv] with rows of `chunk` tokens (T a multiple
    of it; the caller pads), last dims contiguous; g [B, T / chunk, H, chunk] fp32 (log-decays summed from each
    chunk's start) or None; init [B, H, F, Dv] and init_z [B, H, F] fp32 (packed: the F = d (d + 1) / 2 rows a <= b)
    or None; num [B, T, H, Dv] and (with `ones`) den [B, T, H] fp32: the chunks' own (quadratic) parts, token-major
    (the layout of the tiled kernels' output, `parallel.attention_terms`); ones: the normaliser's column.
    Returns (num [B, T, H, Dv] fp32 and, with `ones`, den [B, T, H] fp32 (else None), both contiguous and summed with
    the states' parts; the final state [B, H, F, Dv] fp32, packed; its normaliser rows [B, H, F] fp32 or None). The
    chunks' own parts get the gradients of num and den unchanged."""

    @staticmethod
    def forward(ctx, q, k, v, g, init, init_z, num, den, scale2, chunk, ones):
        batch, seq_len, heads, head_dim = q.shape
        value_dim = v.shape[-1]
        flat = lambda t: None if t is None else t.reshape(batch * heads, *t.shape[2:]).contiguous()  # noqa: E731
        states, zs, final, final_z, _ = _walk(k, v, None, g, flat(init), flat(init_z), chunk, scale2, False, ones)
        num = num.contiguous()  # the kernel reads it at num_out's strides (the tiled kernels' output already is)
        num_out = torch.empty(batch, seq_len, heads, value_dim, dtype=torch.float32, device=q.device)
        den_out = None
        if ones:
            den = den.contiguous()
            den_out = torch.empty(batch, seq_len, heads, dtype=torch.float32, device=q.device)
        _output_kernel[(seq_len // _rows(chunk, TOKEN_ROWS), batch * heads)](
            q, g if g is not None else num_out, states, zs if ones else states, num, den if ones else num_out, num_out,
            den_out if ones else num_out, seq_len, seq_len // chunk, *q.stride()[:3], *num_out.stride()[:3],
            *(den_out.stride() if ones else (0, 0, 0)),
            **_meta(heads, head_dim, value_dim, chunk, g, ones, q, banded=True))
        kept = (states, zs) if KEEP_STATES else (None, None)
        ctx.save_for_backward(q, k, v, g, flat(init), flat(init_z), *kept)
        ctx.opts = scale2, chunk, ones, init is not None
        ctx.set_materialize_grads(False)  # the backward takes None for an output that did not reach the loss
        final = final.view(batch, heads, *final.shape[1:])
        return num_out, den_out, final, None if final_z is None else final_z.view(batch, heads, -1)

    @staticmethod
    def backward(ctx, dnum, dden, dfinal, dfinal_z):
        q, k, v, g, init, init_z, states, zs = ctx.saved_tensors
        scale2, chunk, ones, has_init = ctx.opts
        batch, seq_len, heads, head_dim = q.shape
        value_dim = v.shape[-1]
        chunks = seq_len // chunk
        # a packed row a < b stands for two of the full layout, (a, b) and (b, a)
        a, b = torch.triu_indices(head_dim, head_dim, device=q.device)
        times = (a != b).float() + 1.0
        if states is None:  # the forward's walk again
            states, zs, _, _, _ = _walk(k, v, None, g, init, init_z, chunk, scale2, False, ones)
        if dnum is None:
            dnum = v.new_zeros(batch, seq_len, heads, value_dim, dtype=torch.float32)
        elif dnum.stride(-1) != 1:  # the kernels read rows of it whose columns are contiguous
            dnum = dnum.contiguous()
        if ones and dden is None:
            dden = v.new_zeros(batch, seq_len, heads, dtype=torch.float32)
        d_init = None
        if dfinal is not None:  # the gradient of the full, symmetric state, packed
            d_init = (dfinal.float() / times[:, None]).reshape(batch * heads, -1, value_dim)
        d_init_z = None
        if ones and dfinal_z is not None:
            d_init_z = (dfinal_z.float() / times).reshape(batch * heads, -1)
        # dnum [B, T, H, Dv] in v's dtype: the products' operand, as the forward's v; dden [B, T, H] at its strides
        dstates, dzs, d_start, d_start_z, dots = _walk(
            q, dnum.to(v.dtype), dden, g, d_init, d_init_z, chunk, 1.0, True, ones, prev=states, prev_z=zs, times=times)
        meta = dict(_meta(heads, head_dim, value_dim, chunk, g, ones, q), STEPPED=STEPPED_ROWS)
        grid = (seq_len // _rows(chunk, TOKEN_ROWS), batch * heads)
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        # q . dq and k . dk per token ([B, T, H] fp32) for the log-decays' gradient
        qdq = q.new_empty(batch, seq_len, heads, dtype=torch.float32) if g is not None else dq
        _dq_kernel[grid](q, g if g is not None else dq, dnum, dden if ones else dnum, states, zs if ones else states,
                         dq, qdq, seq_len, chunks, *q.stride()[:3], *dnum.stride()[:3],
                         *(dden.stride() if ones else (0, 0, 0)), **meta)
        del states, zs
        dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
        kdk = k.new_empty(batch, seq_len, heads, dtype=torch.float32) if g is not None else dk
        _dkdv_kernel[grid](k, v, g if g is not None else dk, dstates, dzs if ones else dstates, dk, dv, kdk, seq_len,
                           chunks, scale2, *k.stride()[:3], *v.stride()[:3],
                           STEPPED=STEPPED_ROWS, **_meta(heads, head_dim, value_dim, chunk, g, ones, k, banded=True))
        del dstates, dzs
        dg = None
        if g is not None:
            # <dy_t, y_t> = q_t . dq_t / 2 and <[v_t, 1], d[v_t, 1]> = k_t . dk_t / 2 (degree 2 in q and in k)
            qdq = qdq.view(batch, chunks, chunk, heads).transpose(2, 3)
            kdk = kdk.view(batch, chunks, chunk, heads).transpose(2, 3)  # [B, NC, H, C]
            dg = (qdq - kdk) * 0.5
            # each chunk's total G also scales the state it starts from and weights all its keys
            totals = dots.sum((-1, -2)).view(batch, heads, chunks).transpose(1, 2) + kdk.sum(-1) * 0.5
            dg[..., -1] += totals
        d_init = (d_start * times[:, None]).view(batch, heads, -1, value_dim) if has_init else None
        d_init_z = (d_start_z * times).view(batch, heads, -1) if has_init and ones else None
        # the chunks' own parts were added: their gradients are num's and den's
        return dq, dk, dv, dg, d_init, d_init_z, dnum, dden if ones else None, None, None, None
