"""Mamba-2's SSD with one scalar decay per head, as chunked Triton kernels of attnlab's own.

Computes `attnlab.models.ops.mamba2.chunk_ssd` and, through `ssd_triton`, the D skip too: per head h, with
a_t = dt_t * A_h and the group g = h // (heads / groups) it reads B, C from,

    S_t = exp(a_t) S_{t-1} + dt_t x_t^T B_t,    y_t = S_t C_t + D_h x_t.

Their direct form (`DIRECT`, `linear_attention_ssd`) takes the log decays a_t themselves in dt's place and leaves
x unscaled: linear attention with a scalar decay per token, the attention family's power1 chunked form.

Time is cut into chunks of `chunk` tokens (a power of two from 16 to 128: the [chunk, chunk] tiles
of the output and backward kernels must fit registers and shared memory). Every kernel that needs
them rebuilds a chunk's log decays s (dt * A summed from the chunk start: a cumsum of `chunk`
values) from dt and A, so no [b, H, T] tensor of them is kept or read. Forward:

    1. `_chunk_states_kernel`  one program per (batch * head, block of P, block of N) walks through
                               the chunks: it stores the state when chunk n starts ([b, H, n, P, N], in
                               the inputs' dtype: see below) and moves on, S <- exp(s_last) S + sum_j exp(s_last - s_j) dt_j x_j^T B_j.
                               Blocks of P, then of N, are halved until 256 programs run (batch 1 too).
    2. `_chunk_output_kernel`  one program per (chunk, batch * head): the [chunk, chunk] matrix
                               (C_i . B_j) exp(s_i - s_j) dt_j is made once, then for each block of P
                               y_i = exp(s_i) S0 C_i + sum_{j <= i} M_ij x_j + D x_i (the skip in fp32).

The autograd function keeps x, dt, A, B, C, D (views are read through their strides, not copied) and
the initial state; no states, no [b, H, T, chunk] tensor. Backward:

    3. `_chunk_states_kernel` again for the states, and in reverse (from the last chunk, with (dy, C)
       and weights exp(s_j)) for the gradient of the state when each chunk ends, starting from the
       final state's gradient; the last one is the initial state's gradient.
    4. `_chunk_backward_bc_kernel`  per (chunk, batch * head), summing over P in blocks:
       dy_i . dt_j x_j, dy S0 and dt x dSe; then writes dB, dC of the head (fp32 [b, T, H, N]; a
       group's heads are summed in PyTorch, and rounded once), the gradient of s except its part through x, and dD's share.
    5. `_chunk_backward_x_kernel`   per (chunk, batch * head): dx (the skip's D dy included), d dt,
       and dA's share, after turning d s into d(dt * A) by a reverse cumsum over the chunk.

Matmuls accumulate in fp32. fp32 inputs multiply in IEEE fp32. bf16 / fp16 inputs multiply on
their dtype (the [chunk, chunk] matrices and the states are rounded to it as matmul operands), except in
the state kernel, which multiplies in TF32 so that the carried state and the final state keep fp32
accuracy. Since its readers round the states to the inputs' dtype, the state kernel stores them in it:
half the bytes of that kernel's stores and of the readers' loads. In Triton's interpreter (CPU tensors, tests) operands are rounded the same way and
multiplied in fp32.

Blocks were chosen with ptxas's report for sm_90 at H 16, P 128, N 64, chunk 64, bf16 (Triton 3.6,
pointers and strides 16-aligned as the launcher specializes them; registers per thread, no spills
anywhere; see `_BLOCK_P` and below): output 128 (4 warps), backward 254 and 182 (4 warps, blocks
of 32 head dims), states 217 / 168 / 168 / 123 for blocks of (P, N) = (64, 64) / (32, 64) /
(16, 64) / (16, 32) (4 warps): two programs or more per SM. Shared memory: at most 57 KB (86 KB at
chunk 128). Grids at (batch, T) = 16x1024, 4x4096,
1x16384: states (256, 2, 1), (64, 4, 1), (16, 8, 2); output and backward (16, 256), (64, 64), (256, 16).
fp32 inputs are for accuracy, not speed: in IEEE fp32 the output and backward kernels spill (1 to 5 KB).

Timing against the fla path (`kernels/mamba2/core.py`), on a GPU, forward and backward of one layer's SSD
(measured on an H100 at 16x1024 / 4x4096 / 1x16384: 1.40 / 1.22 / 1.78 ms, the fla path 3.26 / 3.66 / 3.74):
    # python -c "import torch, triton; from attnlab.models.kernels.mamba2 import ssd as s, core as m; b,T,H,P,N=4,4096,16,128,64; xBC=torch.randn(b,T,H*P+2*N,device='cuda',dtype=torch.bfloat16,requires_grad=True); x,B,C=xBC.split([H*P,N,N],-1); x,B,C=x.view(b,T,H,P),B.view(b,T,1,N),C.view(b,T,1,N); dt=torch.rand(b,T,H,device='cuda',requires_grad=True); A=-torch.rand(H,device='cuda'); D=torch.ones(H,device='cuda',requires_grad=True); paths={'fla GLA': lambda: m.chunk_ssd_gla(x,dt,A,B,C,D)[0], 'attnlab SSD': lambda: s.ssd_triton(x,dt,A,B,C,D,64,None,False)[0]}; [print(k, triton.testing.do_bench(lambda: f().sum().backward()), 'ms fwd+bwd') for k, f in paths.items()]"
"""

from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl
from attnlab.models.kernels.eager import outside_compile


@triton.jit
def _dot(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b accumulated in fp32: in IEEE fp32 (IEEE), else on a and b's dtype (TF32 for fp32, bf16 for
    bf16). UPCAST: a and b (already rounded to their dtype) multiply in fp32, for Triton's interpreter,
    whose bf16 dot is wrong (Triton 3.6)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _tile(base, T, stride_t, d, i_n, i_d, CHUNK: tl.constexpr, BD: tl.constexpr):
    """Pointers to rows i_n * CHUNK.. (time) and columns i_d * BD.. of a [T, d] matrix whose columns
    are contiguous, and the mask of those inside it."""
    t = i_n * CHUNK + tl.arange(0, CHUNK)
    c = i_d * BD + tl.arange(0, BD)
    return base + t.to(tl.int64)[:, None] * stride_t + c[None, :], (t < T)[:, None] & (c < d)[None, :]


@triton.jit
def _load_tile(base, T, stride_t, d, i_n, i_d, CHUNK: tl.constexpr, BD: tl.constexpr):
    """The [CHUNK, BD] tile of `_tile`, zero outside the matrix."""
    ptrs, mask = _tile(base, T, stride_t, d, i_n, i_d, CHUNK, BD)
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _store_tile(base, T, stride_t, d, i_n, i_d, value, CHUNK: tl.constexpr, BD: tl.constexpr):
    ptrs, mask = _tile(base, T, stride_t, d, i_n, i_d, CHUNK, BD)
    tl.store(ptrs, value, mask=mask)


@triton.jit
def _load_state(base, P: tl.constexpr, N: tl.constexpr, i_p, i_nb, BP: tl.constexpr, BN: tl.constexpr):
    """The [BP, BN] tile (i_p, i_nb) of a contiguous [P, N] state, zero outside it."""
    return _load_tile(base, P, N, N, i_p, i_nb, BP, BN)


@triton.jit
def _store_state(base, P: tl.constexpr, N: tl.constexpr, i_p, i_nb, value, BP: tl.constexpr, BN: tl.constexpr):
    _store_tile(base, P, N, N, i_p, i_nb, value, BP, BN)


@triton.jit
def _local_decay(dt_bh, A, i_h, i_n, T, H: tl.constexpr, CHUNK: tl.constexpr, DIRECT: tl.constexpr):
    """A chunk's dt [chunk] (0 past T; dt_bh points at dt[b, 0, h]), its log decays s [chunk] summed
    from the chunk start, and their total s_last (the same number as s[chunk - 1]). DIRECT: dt holds the
    log decays a_t themselves and nothing scales x (the dt returned is 1 inside the sequence, 0 past T)."""
    t = i_n * CHUNK + tl.arange(0, CHUNK)
    dtj = tl.load(dt_bh + t.to(tl.int64) * H, mask=t < T, other=0.0).to(tl.float32)
    if DIRECT:
        s = tl.cumsum(dtj, axis=0)
        dtj = tl.where(t < T, 1.0, 0.0)
    else:
        s = tl.cumsum(dtj * tl.load(A + i_h).to(tl.float32), axis=0)
    s_last = tl.sum(tl.where(tl.arange(0, CHUNK) == CHUNK - 1, s, 0.0), axis=0)
    return dtj, s, s_last


@triton.jit
def _chunk_states_kernel(v, dt, A, bc, states, init, final, T, NC, sv_b, sv_t, sv_h, sbc_b, sbc_t, sbc_g,
                         H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr, CHUNK: tl.constexpr,
                         BP: tl.constexpr, BN: tl.constexpr, HAS_INIT: tl.constexpr, REVERSE: tl.constexpr,
                         IEEE: tl.constexpr, UPCAST: tl.constexpr, DIRECT: tl.constexpr = False):
    """One (batch * head, block of P, block of N) through every chunk in turn: states[b, h, n] <- S, the
    state when chunk n starts, then S <- exp(s_last) S + sum_j exp(s_last - s_j) dt_j v_j^T bc_j; the
    last S goes to final. REVERSE (v = dy, bc = C): from the last chunk back, states[b, h, n] <- the
    gradient of the state when chunk n ends, S <- exp(s_last) S + sum_j exp(s_j) dy_j^T C_j."""
    i_bh, i_p, i_nb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    i_g = i_h // (H // G)
    v_bh = v + i_b.to(tl.int64) * sv_b + i_h * sv_h
    bc_bg = bc + i_b.to(tl.int64) * sbc_b + i_g * sbc_g
    dt_bh = dt + i_b.to(tl.int64) * T * H + i_h
    st_bh = states + i_bh.to(tl.int64) * NC * P * N
    if HAS_INIT:
        S = _load_state(init + i_bh.to(tl.int64) * P * N, P, N, i_p, i_nb, BP, BN).to(tl.float32)
    else:
        S = tl.zeros([BP, BN], dtype=tl.float32)
    for k in range(NC):
        if REVERSE:
            i_n = NC - 1 - k
        else:
            i_n = k
        _store_state(st_bh + i_n * (P * N), P, N, i_p, i_nb, S, BP, BN)
        dtj, s, s_last = _local_decay(dt_bh, A, i_h, i_n, T, H, CHUNK, DIRECT)
        vj = _load_tile(v_bh, T, sv_t, P, i_n, i_p, CHUNK, BP)
        bcj = _load_tile(bc_bg, T, sbc_t, N, i_n, i_nb, CHUNK, BN)
        if REVERSE:
            w = tl.exp(s)
        else:
            w = tl.exp(s_last - s) * dtj
        # in fp32 (TF32 for bf16 inputs): the states carry every earlier chunk, and the last is an output
        S = tl.exp(s_last) * S + _dot(tl.trans(vj.to(tl.float32) * w[:, None]), bcj.to(tl.float32), IEEE, UPCAST)
    _store_state(final + i_bh.to(tl.int64) * P * N, P, N, i_p, i_nb, S, BP, BN)


@triton.jit
def _chunk_output_kernel(x, dt, A, B, C, D, states, y, T, NC, sx_b, sx_t, sx_h, sbc_b, sbc_t, sbc_g,
                         H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr, CHUNK: tl.constexpr,
                         BP: tl.constexpr, BN: tl.constexpr, HAS_D: tl.constexpr, IEEE: tl.constexpr,
                         UPCAST: tl.constexpr, DIRECT: tl.constexpr = False):
    """y_i = exp(s_i) S0 C_i + sum_{j <= i} (C_i . B_j) exp(s_i - s_j) dt_j x_j (+ D x_i) for one chunk
    and batch * head, S0 the state when the chunk starts: the [chunk, chunk] matrix is made once, then
    the head dims run in blocks of BP."""
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    i_g = i_h // (H // G)
    DT = x.dtype.element_ty
    j = tl.arange(0, CHUNK)
    x_bh = x + i_b.to(tl.int64) * sx_b + i_h * sx_h
    y_bh = y + i_b.to(tl.int64) * T * H * P + i_h * P  # y is contiguous
    bc_bg = i_b.to(tl.int64) * sbc_b + i_g * sbc_g
    st = states + (i_bh.to(tl.int64) * NC + i_n) * P * N
    dtj, s, _ = _local_decay(dt + i_b.to(tl.int64) * T * H + i_h, A, i_h, i_n, T, H, CHUNK, DIRECT)
    Bj = _load_tile(B + bc_bg, T, sbc_t, N, i_n, 0, CHUNK, BN)
    Cj = _load_tile(C + bc_bg, T, sbc_t, N, i_n, 0, CHUNK, BN)
    decay = tl.exp(tl.where(j[:, None] >= j[None, :], s[:, None] - s[None, :], float("-inf")))  # [i, j]
    Mdt = (_dot(Cj, tl.trans(Bj), IEEE, UPCAST) * decay * dtj[None, :]).to(DT)
    from_start = tl.exp(s)
    for i_p in range(tl.cdiv(P, BP)):
        xj = _load_tile(x_bh, T, sx_t, P, i_n, i_p, CHUNK, BP)
        S0 = _load_state(st, P, N, i_p, 0, BP, BN)
        acc = _dot(Cj, tl.trans(S0.to(DT)), IEEE, UPCAST) * from_start[:, None]
        acc += _dot(Mdt, xj, IEEE, UPCAST)
        if HAS_D:
            acc += xj.to(tl.float32) * tl.load(D + i_h).to(tl.float32)
        _store_tile(y_bh, T, H * P, P, i_n, i_p, acc.to(y.dtype.element_ty), CHUNK, BP)


@triton.jit
def _backward_program(x, dt, A, T, NC, sx_b, sx_h, sbc_b, sbc_g, i_n, i_bh, H: tl.constexpr, G: tl.constexpr,
                      P: tl.constexpr, N: tl.constexpr, CHUNK: tl.constexpr, DIRECT: tl.constexpr):
    """What both backward kernels' programs start from, for chunk i_n of batch * head i_bh: the batch
    row and head, the chunk's steps and which are in the sequence, x's head, the offset of dy's and
    dx's head (contiguous [b, T, H, P]) and of B's and C's group, the chunk's state offset, and dt,
    s, s_last of the chunk."""
    i_b, i_h = i_bh // H, i_bh % H
    i_g = i_h // (H // G)
    j = tl.arange(0, CHUNK)
    m_t = i_n * CHUNK + j < T
    x_bh = x + i_b.to(tl.int64) * sx_b + i_h * sx_h
    yh = i_b.to(tl.int64) * T * H * P + i_h * P
    bc_bg = i_b.to(tl.int64) * sbc_b + i_g * sbc_g
    st = (i_bh.to(tl.int64) * NC + i_n) * P * N
    dtj, s, s_last = _local_decay(dt + i_b.to(tl.int64) * T * H + i_h, A, i_h, i_n, T, H, CHUNK, DIRECT)
    return i_b, i_h, j, m_t, x_bh, yh, bc_bg, st, dtj, s, s_last


@triton.jit
def _chunk_backward_bc_kernel(x, dt, A, B, C, states, dstates, dy, dB, dC, ds, dD, T, NC,
                              sx_b, sx_t, sx_h, sbc_b, sbc_t, sbc_g,
                              H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
                              CHUNK: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, HAS_D: tl.constexpr,
                              IEEE: tl.constexpr, UPCAST: tl.constexpr, DIRECT: tl.constexpr = False):
    """The backward, first half, for one chunk and batch * head: S0 is the state when the chunk starts,
    dSe the gradient of the state when it ends. Sums over P, in blocks of BP, dy_i . dt_j x_j, dy S0
    and dt x dSe, then writes dB and dC of this head (the caller adds a group's heads), the gradient
    of the log decays s except the part through x (`_chunk_backward_x_kernel` adds it) and this
    chunk's share of dD."""
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h, j, m_t, x_bh, yh, bc_bg, st, dtj, s, s_last = _backward_program(
        x, dt, A, T, NC, sx_b, sx_h, sbc_b, sbc_g, i_n, i_bh, H, G, P, N, CHUNK, DIRECT)
    DT = x.dtype.element_ty
    dy_bh = dy + yh  # dy is contiguous

    dyx = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)  # [i, j] dy_i . dt_j x_j
    dyS0 = tl.zeros([CHUNK, BN], dtype=tl.float32)
    xdS = tl.zeros([CHUNK, BN], dtype=tl.float32)  # dt x dSe
    dSS = tl.zeros([BN], dtype=tl.float32)  # sum_p dSe * S0
    dy_x = tl.zeros([CHUNK], dtype=tl.float32)  # sum_p dy * x
    for i_p in range(tl.cdiv(P, BP)):
        xj = _load_tile(x_bh, T, sx_t, P, i_n, i_p, CHUNK, BP)
        dyj = _load_tile(dy_bh, T, H * P, P, i_n, i_p, CHUNK, BP)
        S0 = _load_state(states + st, P, N, i_p, 0, BP, BN).to(tl.float32)
        dSe = _load_state(dstates + st, P, N, i_p, 0, BP, BN).to(tl.float32)
        xdt = (xj.to(tl.float32) * dtj[:, None]).to(DT)
        dyx += _dot(dyj, tl.trans(xdt), IEEE, UPCAST)
        dyS0 += _dot(dyj, S0.to(DT), IEEE, UPCAST)
        xdS += _dot(xdt, dSe.to(DT), IEEE, UPCAST)
        dSS += tl.sum(dSe * S0, axis=0)
        if HAS_D:
            dy_x += tl.sum(dyj.to(tl.float32) * xj.to(tl.float32), axis=1)

    Bj = _load_tile(B + bc_bg, T, sbc_t, N, i_n, 0, CHUNK, BN)
    Cj = _load_tile(C + bc_bg, T, sbc_t, N, i_n, 0, CHUNK, BN)
    # y_i = exp(s_i) S0 C_i + sum_j M_ij dt_j x_j, with M_ij = (C_i . B_j) exp(s_i - s_j)
    decay = tl.exp(tl.where(j[:, None] >= j[None, :], s[:, None] - s[None, :], float("-inf")))  # [i, j]
    W = _dot(Cj, tl.trans(Bj), IEEE, UPCAST) * decay * dyx
    d_s = tl.sum(W, axis=1) - tl.sum(W, axis=0)
    dM = (dyx * decay).to(DT)
    from_start = tl.where(m_t, tl.exp(s), 0.0)
    hb = i_b.to(tl.int64) * T * H * N + i_h * N  # dB, dC per head: [b, T, H, N] fp32
    dCj = _dot(dM, Bj, IEEE, UPCAST) + dyS0 * from_start[:, None]
    d_s += tl.sum(dyS0 * Cj.to(tl.float32), axis=1) * from_start
    _store_tile(dC + hb, T, H * N, N, i_n, 0, dCj, CHUNK, BN)
    # the state at the chunk end, exp(s_last) S0 + sum_j exp(s_last - s_j) dt_j x_j^T B_j
    to_end = tl.where(m_t, tl.exp(s_last - s), 0.0)
    dBj = _dot(tl.trans(dM), Cj, IEEE, UPCAST) + xdS * to_end[:, None]
    _store_tile(dB + hb, T, H * N, N, i_n, 0, dBj, CHUNK, BN)
    d_s += tl.where(j == CHUNK - 1, tl.exp(s_last) * tl.sum(dSS, axis=0), 0.0)
    tl.store(ds + (i_bh.to(tl.int64) * NC + i_n) * CHUNK + j, d_s)
    if HAS_D:
        tl.store(dD + i_bh.to(tl.int64) * NC + i_n, tl.sum(dy_x, axis=0))


@triton.jit
def _chunk_backward_x_kernel(x, dt, A, B, C, D, dstates, dy, ds, dx, ddt, dA, T, NC,
                             sx_b, sx_t, sx_h, sbc_b, sbc_t, sbc_g, sdx_b, sdx_t,
                             H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
                             CHUNK: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, HAS_D: tl.constexpr,
                             IEEE: tl.constexpr, UPCAST: tl.constexpr, DIRECT: tl.constexpr = False):
    """The backward, second half, for one chunk and batch * head: d(dt x) = M^T dy + exp(s_last - s) B dSe^T
    in blocks of BP; writes dx, d dt and this chunk's share of dA. d s (from the first half, plus what
    the end state's dependence on dt x gives) becomes d(dt * A) by a reverse cumulative sum over the chunk.
    dx may be a view (rows sdx_t apart, batches sdx_b, heads P apart): a slice of the convolution's gradient."""
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h, j, m_t, x_bh, yh, bc_bg, st, dtj, s, s_last = _backward_program(
        x, dt, A, T, NC, sx_b, sx_h, sbc_b, sbc_g, i_n, i_bh, H, G, P, N, CHUNK, DIRECT)
    DT = x.dtype.element_ty  # dy is contiguous (at yh)
    dx_bh = dx + i_b.to(tl.int64) * sdx_b + i_h * P
    Bj = _load_tile(B + bc_bg, T, sbc_t, N, i_n, 0, CHUNK, BN)
    Cj = _load_tile(C + bc_bg, T, sbc_t, N, i_n, 0, CHUNK, BN)
    decay = tl.exp(tl.where(j[:, None] >= j[None, :], s[:, None] - s[None, :], float("-inf")))  # [i, j]
    Mt = tl.trans((_dot(Cj, tl.trans(Bj), IEEE, UPCAST) * decay).to(DT))  # [j, i]
    to_end = tl.where(m_t, tl.exp(s_last - s), 0.0)
    ddt_x = tl.zeros([CHUNK], dtype=tl.float32)  # sum_p d(dt x) * x
    q = tl.zeros([CHUNK], dtype=tl.float32)  # sum_p x * B dSe^T
    for i_p in range(tl.cdiv(P, BP)):
        xj = _load_tile(x_bh, T, sx_t, P, i_n, i_p, CHUNK, BP).to(tl.float32)
        dyj = _load_tile(dy + yh, T, H * P, P, i_n, i_p, CHUNK, BP)
        dSe = _load_state(dstates + st, P, N, i_p, 0, BP, BN)
        BdS = _dot(Bj, tl.trans(dSe.to(DT)), IEEE, UPCAST)  # [c, BP]
        dxdt = _dot(Mt, dyj, IEEE, UPCAST) + BdS * to_end[:, None]
        q += tl.sum(xj * BdS, axis=1)
        ddt_x += tl.sum(dxdt * xj, axis=1)
        dxj = dxdt * dtj[:, None]
        if HAS_D:
            dxj += dyj.to(tl.float32) * tl.load(D + i_h).to(tl.float32)
        _store_tile(dx_bh, T, sdx_t, P, i_n, i_p, dxj.to(dx.dtype.element_ty), CHUNK, BP)
    q *= to_end * dtj
    d_s = tl.load(ds + (i_bh.to(tl.int64) * NC + i_n) * CHUNK + j) - q
    d_s += tl.where(j == CHUNK - 1, tl.sum(q, axis=0), 0.0)
    # d(dt * A) at t: every s at or after t in its chunk depends on it
    da = tl.cumsum(d_s, axis=0, reverse=True)
    t = i_n * CHUNK + j
    if DIRECT:  # dt held the log decays: their gradient is da, and there is no A
        tl.store(ddt + i_b.to(tl.int64) * T * H + t.to(tl.int64) * H + i_h, da, mask=t < T)
    else:
        tl.store(ddt + i_b.to(tl.int64) * T * H + t.to(tl.int64) * H + i_h, ddt_x + da * tl.load(A + i_h).to(tl.float32),
                 mask=t < T)
        tl.store(dA + i_bh.to(tl.int64) * NC + i_n, tl.sum(da * dtj, axis=0))


# Blocks and warps, from ptxas's report for sm_90 at P = 128, N = 64, chunk 64, bf16 (registers per
# thread: output 128, backward 254 and 182, states 123 to 217 by block): no spills, two programs or
# more per SM. The output and backward kernels loop over P in blocks of these many head dims.
_BLOCK_P, _BWD_BLOCK_P = 64, 32
_WARPS, _BWD_WARPS, _STATE_WARPS = 4, 4, 4
_STATE_PROGRAMS = 256  # the state kernels split P and N into blocks until this many programs run
_LOW_PRECISION_STATES = True  # the states per chunk in the inputs' 16-bit dtype (see `_states`)


def _block(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


def _state_blocks(programs: int, head_dim: int, state_size: int) -> tuple[int, int]:
    """(block of P, block of N) for the state kernels: halved (P first, down to 16; then N, down to 32)
    while fewer than _STATE_PROGRAMS programs would run."""
    bp, bn = min(64, _block(head_dim)), min(64, _block(state_size))

    def count(bp, bn):
        return programs * triton.cdiv(head_dim, bp) * triton.cdiv(state_size, bn)

    while count(bp, bn) < _STATE_PROGRAMS and bp > 16:
        bp //= 2
    while count(bp, bn) < _STATE_PROGRAMS and bn > 32:
        bn //= 2
    return bp, bn


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t [b, T, heads, d] as the kernels read it: any batch and time strides, d contiguous, heads d apart."""
    return t if t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] else t.contiguous()


def _same_strides(B: torch.Tensor, C: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (B, C) if B.stride() == C.stride() else (B.contiguous(), C.contiguous())


def _states(v, dt, A, bc, init, chunk, reverse, ieee, direct=False):
    """The states per chunk [b, H, n, P, N] and the last one (fp32; see `_chunk_states_kernel`). The states
    per chunk are stored in v's dtype where their readers round them to it anyway (16-bit inputs): the
    output and backward kernels multiply them on that dtype. fp32 inputs keep fp32 states."""
    batch, seq_len, heads, head_dim = v.shape
    groups, state_size = bc.shape[2], bc.shape[3]
    num_chunks = triton.cdiv(seq_len, chunk)
    stored = torch.float32 if ieee or not _LOW_PRECISION_STATES else v.dtype
    states = v.new_empty(batch, heads, num_chunks, head_dim, state_size, dtype=stored)
    final = v.new_empty(batch, heads, head_dim, state_size, dtype=torch.float32)
    bp, bn = _state_blocks(batch * heads, head_dim, state_size)
    _chunk_states_kernel[(batch * heads, triton.cdiv(head_dim, bp), triton.cdiv(state_size, bn))](
        v, dt, A, bc, states, init if init is not None else final, final, seq_len, num_chunks,
        *v.stride()[:3], *bc.stride()[:3], H=heads, G=groups, P=head_dim, N=state_size, CHUNK=chunk, BP=bp, BN=bn,
        HAS_INIT=init is not None, REVERSE=reverse, IEEE=ieee, UPCAST=not v.is_cuda, DIRECT=direct, num_warps=_STATE_WARPS)
    return states, final


def ssd_forward(x, dt, A, B, C, D, chunk, initial_state, direct=False, out_dtype=None):
    """The forward on the kernels, outside autograd: (y [b, T, H, P] in `out_dtype` (default x's dtype), final
    state [b, H, P, N] fp32, what `ssd_backward` takes). x, B, C are read through their strides (views of the
    convolution's output stay views). direct: dt [b, T, H] holds the log decays a_t themselves (A is not read)
    and x enters unscaled: S_t = exp(a_t) S_{t-1} + x_t^T B_t, the linear attention of `linear_attention_ssd`."""
    batch, seq_len, heads, head_dim = x.shape
    groups, state_size = B.shape[2], B.shape[3]
    x, B, C = _rows(x), *_same_strides(_rows(B), _rows(C))
    dt_c, A_c = dt.contiguous(), A.contiguous()
    D = None if D is None else D.contiguous()
    h0 = None if initial_state is None else initial_state.float().contiguous()
    ieee = x.dtype == torch.float32
    states, final = _states(x, dt_c, A_c, B, h0, chunk, False, ieee, direct)
    num_chunks = states.shape[2]
    y = x.new_empty(x.shape, dtype=out_dtype or x.dtype)
    _chunk_output_kernel[(num_chunks, batch * heads)](
        x, dt_c, A_c, B, C, D if D is not None else A_c, states, y, seq_len, num_chunks, *x.stride()[:3],
        *B.stride()[:3], H=heads, G=groups, P=head_dim, N=state_size, CHUNK=chunk, BP=min(_BLOCK_P, _block(head_dim)),
        BN=_block(state_size), HAS_D=D is not None, IEEE=ieee, UPCAST=not x.is_cuda, DIRECT=direct, num_warps=_WARPS)
    return y, final, (x, dt_c, A_c, B, C, D, h0)


def ssd_backward(saved, chunk, dy, dfinal, dx_out=None, dB_out=None, dC_out=None, direct=False):
    """The gradients (dx, d dt fp32, dA (None when `direct`), dB, dC, dD, d initial state fp32) of `ssd_forward`'s
    inputs, from its `saved` tuple. dx_out [b, T, H, P] (heads P apart, any batch and time strides) and dB_out, dC_out
    [b, T, G, N] (any strides): where to write dx, dB, dC (slices of the convolution's gradient), else new
    tensors in x's, B's, C's dtype."""
    x, dt, A, B, C, D, h0 = saved
    batch, seq_len, heads, head_dim = x.shape
    groups, state_size = B.shape[2], B.shape[3]
    ieee = x.dtype == torch.float32
    states, _ = _states(x, dt, A, B, h0, chunk, False, ieee, direct)
    num_chunks = states.shape[2]
    dy = (torch.zeros_like(x) if dy is None else dy).to(x.dtype).contiguous()
    dfinal = None if dfinal is None else dfinal.float().contiguous()
    dstates, dh0 = _states(dy, dt, A, C, dfinal, chunk, True, ieee, direct)
    dx = x.new_empty(x.shape) if dx_out is None else dx_out
    if dx.stride(-1) != 1 or dx.stride(-2) != head_dim or dx.shape != x.shape:
        raise ValueError(f"ssd_backward: dx_out must be [b, T, H, P] = {tuple(x.shape)} with heads {head_dim} apart")
    ddt = x.new_empty(batch, seq_len, heads, dtype=torch.float32)
    dB = x.new_empty(batch, seq_len, heads, state_size, dtype=torch.float32)  # per head, fp32: rounded once, after the sum
    dC = torch.empty_like(dB)
    dA = x.new_empty(batch, heads, num_chunks, dtype=torch.float32)  # per chunk
    dD = torch.empty_like(dA) if D is not None else dA
    ds = x.new_empty(batch * heads, num_chunks * chunk, dtype=torch.float32)  # d s but the part through x
    meta = {"H": heads, "G": groups, "P": head_dim, "N": state_size, "CHUNK": chunk, "BP": min(_BWD_BLOCK_P, _block(head_dim)),
            "BN": _block(state_size), "HAS_D": D is not None, "IEEE": ieee, "UPCAST": not x.is_cuda, "DIRECT": direct,
            "num_warps": _BWD_WARPS}
    _chunk_backward_bc_kernel[(num_chunks, batch * heads)](
        x, dt, A, B, C, states, dstates, dy, dB, dC, ds, dD, seq_len, num_chunks, *x.stride()[:3], *B.stride()[:3],
        **meta)
    _chunk_backward_x_kernel[(num_chunks, batch * heads)](
        x, dt, A, B, C, D if D is not None else A, dstates, dy, ds, dx, ddt, dA, seq_len, num_chunks,
        *x.stride()[:3], *B.stride()[:3], dx.stride(0), dx.stride(1), **meta)
    del states, dstates
    per_group = (batch, seq_len, groups, heads // groups, state_size)  # a group's heads summed
    dB = dB.view(per_group).sum(3)
    dC = dC.view(per_group).sum(3)
    dB = dB.to(B.dtype) if dB_out is None else dB_out.copy_(dB)
    dC = dC.to(C.dtype) if dC_out is None else dC_out.copy_(dC)
    dA = None if direct else dA.sum((0, 2)).to(A.dtype)
    dD = dD.sum((0, 2)).to(D.dtype) if D is not None else None
    return dx, ddt, dA, dB, dC, dD, dh0


class _SSD(torch.autograd.Function):
    """`ssd_forward` with its gradients; `direct`: its direct form (dt holds the log decays, A is not read)."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, D, chunk, initial_state, direct=False, out_dtype=None):
        y, final, saved = ssd_forward(x, dt, A, B, C, D, chunk, initial_state, direct=direct, out_dtype=out_dtype)
        ctx.save_for_backward(*saved)
        ctx.chunk, ctx.direct = chunk, direct
        ctx.dtypes = dt.dtype, None if initial_state is None else initial_state.dtype
        return y, final

    @staticmethod
    def backward(ctx, dy, dfinal):
        dx, ddt, dA, dB, dC, dD, dh0 = ssd_backward(ctx.saved_tensors, ctx.chunk, dy, dfinal, direct=ctx.direct)
        dt_dtype, init_dtype = ctx.dtypes
        dh0 = dh0.to(init_dtype) if init_dtype is not None else None
        return dx, ddt.to(dt_dtype), dA, dB, dC, dD, None, dh0, None, None


def _chunk_ok(chunk_size: int) -> bool:
    """A power of two from 16 (the smallest matmul tile) to 128 (the [chunk, chunk] tiles fit registers
    and shared memory)."""
    return 16 <= chunk_size <= 128 and not chunk_size & (chunk_size - 1)


def _check(x: torch.Tensor, B: torch.Tensor, chunk_size: int) -> None:
    if not _chunk_ok(chunk_size):
        raise ValueError(f"chunk_size must be a power of two from 16 to 128, got {chunk_size}")
    if x.shape[2] % B.shape[2]:
        raise ValueError(f"{x.shape[2]} heads do not split into {B.shape[2]} groups")


def chunk_ssd_triton(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    chunk_size: int = 64, initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`ops.mamba2.chunk_ssd` on attnlab's Triton kernels: (y [b, T, H, P] in x's dtype, final state
    [b, H, P, N] fp32). chunk_size: a power of two from 16 to 128 (the tile of the [chunk, chunk] scores)."""
    _check(x, B, chunk_size)
    return _SSD.apply(x, dt, A, B, C, None, chunk_size, initial_state)


_warned_chunks: set[int] = set()


def kernel_chunk(chunk_size: int) -> int:
    """The chunk the kernels run: chunk_size if it is a power of two from 16 to 128, else 64 (with a
    warning, once per size): that changes nothing but rounding."""
    if _chunk_ok(chunk_size):
        return chunk_size
    if chunk_size not in _warned_chunks:
        _warned_chunks.add(chunk_size)
        warnings.warn(f"the SSD kernels take a power-of-two chunk size from 16 to 128; chunk_size {chunk_size} "
                      "runs at 64", stacklevel=3)
    return 64


@outside_compile
def ssd_triton(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
    chunk_size: int, initial_state: torch.Tensor | None, output_final_state: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Mamba-2's parallel form with its D skip, y = SSD(x, dt, A, B, C) + x * D, on these kernels (the fast path
    that `kernels.mamba2.core.ssd` chooses): y in x's dtype, the skip added in fp32 inside the output kernel; the
    final state [b, H, P, N] fp32 when asked for, else None. A chunk size that is not a power of two from 16 to
    128 runs at 64 (with a warning, once): that changes nothing but rounding."""
    chunk = kernel_chunk(chunk_size)
    _check(x, B, chunk)
    y, state = _SSD.apply(x, dt, A, B, C, D, chunk, initial_state)
    return y, (state if output_final_state else None)


@outside_compile
def linear_attention_ssd(
    x: torch.Tensor, log_decay: torch.Tensor | None, B: torch.Tensor, C: torch.Tensor, chunk_size: int = 64,
    initial_state: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Linear attention with a scalar decay per token and head on these kernels: per head h,

        S_t = exp(a_t) S_{t-1} + x_t^T B_t,    y_t = S_t C_t,

    x [b, T, H, P] (the values), B and C [b, T, G, N] (the keys and the queries, G dividing H), a = log_decay
    [b, T, H] (None: no decay), initial_state [b, H, P, N] or None. Returns (y [b, T, H, P] in `out_dtype`,
    default x's dtype; the final state [b, H, P, N] fp32). The attention family's power1 chunked form runs on it
    (`kernels/attention_family/chunk.py`). chunk_size: as `ssd_triton`'s."""
    chunk = kernel_chunk(chunk_size)
    _check(x, B, chunk)
    if log_decay is None:
        log_decay = x.new_zeros(x.shape[:3], dtype=torch.float32)
    no_A = x.new_ones(x.shape[2], dtype=torch.float32)  # the direct form reads no A
    return _SSD.apply(x, log_decay, no_A, B, C, None, chunk, initial_state, True, out_dtype)
