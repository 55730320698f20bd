"""Mamba-2's SSD with one scalar decay per head, as chunked Triton kernels of attnlab's own.

Computes exactly `attnlab.models.ops.mamba2.chunk_ssd` (the D skip and the gated norm stay with the
mixer): per head h, with a_t = dt_t * A_h and the group g = h // (heads / groups) it reads B, C from,

    S_t = exp(a_t) S_{t-1} + dt_t x_t^T B_t,    y_t = S_t C_t.

Tiling: time is cut into chunks of `chunk` tokens; s is the log decay summed from the chunk start
(a chunk-local cumulative sum of dt * A, [b, H, T] fp32, computed in PyTorch). A program holds one
chunk's x [chunk, BP] for a block of BP head dims, its B, C [chunk, N] and the [chunk, chunk] decay
exp(s_i - s_j) of a head (one matrix per head, not per state channel as through a GLA):

    1. `_chunk_outer_kernel`   each chunk's own state, sum_j exp(s_last - s_j) dt_j x_j^T B_j [P, N];
                               one program per (chunk, batch * head, block of P)
    2. `_state_pass_kernel`    the states carried across chunks, one sequential loop over chunks per
                               (batch * head, block of P * N), in place over the chunk states
    3. `_chunk_output_kernel`  y_i = exp(s_i) S_before C_i + sum_{j <= i} (C_i . B_j) exp(s_i - s_j) dt_j x_j;
                               one program per (chunk, batch * group, block of P): B, C and C B^T are
                               loaded and computed once, then the group's heads run in turn

The backward runs 1 and 2 again (the states are not kept), then the same pair on (dy, C) backwards
in time for the state gradients, then `_chunk_backward_kernel` (programs as 3), which rebuilds the
chunk's [chunk, chunk] scores per head and writes dx, the x-part of d dt and d s per head, and dB,
dC summed over the group's heads in registers. The sums over P (d dt, d s, dB, dC) are written per
block of P and added in PyTorch; d s becomes d(dt * A) by a reverse cumulative sum inside each chunk.
What the autograd function keeps: x, dt, A, B, C (views are read through their strides, not copied)
and the initial state; no [b, H, T, chunk] tensor and no per-head dB, dC.

Matmuls accumulate in fp32; fp32 inputs multiply in IEEE fp32, bf16 / fp16 inputs in TF32.

Timing against the fla path (`kernels/mamba2.py`), on a GPU, at the benchmarked layer's shapes:
    # python -c "import torch, triton; from attnlab.models.kernels import ssd as s, mamba2 as m; b,T,H,P,N=8,2048,16,128,64; x=torch.randn(b,T,H,P,device='cuda',dtype=torch.bfloat16,requires_grad=True); dt=torch.rand(b,T,H,device='cuda',requires_grad=True); A=-torch.rand(H,device='cuda'); B,C=(torch.randn(b,T,1,N,device='cuda',dtype=torch.bfloat16,requires_grad=True) for _ in 'BC'); D=torch.ones(H,device='cuda'); f=lambda mod: mod.ssd(x,dt,A,B,C,D,64,None,False,'auto')[0].sum().backward(); [print(mod.__name__, triton.testing.do_bench(lambda: f(mod)), 'ms fwd+bwd') for mod in (m, s)]"
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _chunk_outer_kernel(v, dt, bc, s, out, T, Tp, NC, sv_b, sv_t, sv_h, sbc_b, sbc_t, sbc_g, H: tl.constexpr, G: tl.constexpr, P: tl.constexpr,
                        N: tl.constexpr, CHUNK: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
                        FROM_START: tl.constexpr, IEEE: tl.constexpr):
    """out[b, h, n] = sum_j w_j v_j^T bc_j over chunk n: [P, N].
    FROM_START: w_j = exp(s_j) (the backward's (dy, C)); else w_j = exp(s_last - s_j) dt_j (x, B)."""
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    i_g = i_h // (H // G)
    j = tl.arange(0, CHUNK)
    t = i_n * CHUNK + j
    m_t = t < T
    p, n = tl.program_id(2) * BP + tl.arange(0, BP), tl.arange(0, BN)
    row = i_b.to(tl.int64) * T + t  # [CHUNK]
    v_off = i_b.to(tl.int64) * sv_b + t.to(tl.int64) * sv_t + i_h * sv_h
    bc_off = i_b.to(tl.int64) * sbc_b + t.to(tl.int64) * sbc_t + i_g * sbc_g
    vj = tl.load(v + v_off[:, None] + p[None, :], mask=m_t[:, None] & (p < P)[None, :], other=0.0).to(tl.float32)
    bcj = tl.load(bc + bc_off[:, None] + n[None, :], mask=m_t[:, None] & (n < N)[None, :], other=0.0).to(tl.float32)
    s_base = s + i_bh.to(tl.int64) * Tp + i_n * CHUNK
    sj = tl.load(s_base + j)
    if FROM_START:
        w = tl.exp(sj)
    else:
        s_last = tl.load(s_base + CHUNK - 1)
        dtj = tl.load(dt + row * H + i_h, mask=m_t, other=0.0)
        w = tl.exp(s_last - sj) * dtj
    w = tl.where(m_t, w, 0.0)
    if IEEE:
        acc = tl.dot(tl.trans(vj * w[:, None]), bcj, input_precision="ieee")
    else:
        acc = tl.dot(tl.trans(vj * w[:, None]), bcj)
    o = out + (i_bh.to(tl.int64) * NC + i_n) * P * N + p[:, None] * N + n[None, :]
    tl.store(o, acc, mask=(p < P)[:, None] & (n < N)[None, :])


@triton.jit
def _state_pass_kernel(states, s, init, final, NC, Tp, PN, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                       HAS_INIT: tl.constexpr, REVERSE: tl.constexpr):
    """In place over states[b, h, n] (the chunks' own terms u_n): state_n <- the carried state when
    chunk n starts (REVERSE: its gradient when chunk n ends), S <- exp(total decay of chunk n) S + u_n.
    The last S goes to final."""
    i_bh, i_blk = tl.program_id(0), tl.program_id(1)
    off = i_blk * BLOCK + tl.arange(0, BLOCK)
    m = off < PN
    base = states + i_bh.to(tl.int64) * NC * PN
    if HAS_INIT:
        S = tl.load(init + i_bh.to(tl.int64) * PN + off, mask=m, other=0.0).to(tl.float32)
    else:
        S = tl.zeros([BLOCK], dtype=tl.float32)
    for k in range(NC):
        if REVERSE:
            i_n = NC - 1 - k
        else:
            i_n = k
        u = tl.load(base + i_n * PN + off, mask=m, other=0.0)
        tl.store(base + i_n * PN + off, S, mask=m)
        total = tl.load(s + i_bh.to(tl.int64) * Tp + i_n * CHUNK + CHUNK - 1)
        S = tl.exp(total) * S + u
    tl.store(final + i_bh.to(tl.int64) * PN + off, S, mask=m)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _chunk_output_kernel(x, dt, B, C, s, states, y, T, Tp, NC, sx_b, sx_t, sx_h, sbc_b, sbc_t, sbc_g,
                         H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr, CHUNK: tl.constexpr,
                         BP: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr):
    """One chunk of one group's heads: C B^T is computed once and serves each head in turn."""
    i_n, i_bg = tl.program_id(0), tl.program_id(1)
    i_b, i_g = i_bg // G, i_bg % G
    j = tl.arange(0, CHUNK)
    t = i_n * CHUNK + j
    m_t = t < T
    p, n = tl.program_id(2) * BP + tl.arange(0, BP), tl.arange(0, BN)
    m_p, m_n = p < P, n < N
    m_xp = m_t[:, None] & m_p[None, :]
    row = i_b.to(tl.int64) * T + t
    bc_off = (i_b.to(tl.int64) * sbc_b + t.to(tl.int64) * sbc_t + i_g * sbc_g)[:, None] + n[None, :]
    Bj = tl.load(B + bc_off, mask=m_t[:, None] & m_n[None, :], other=0.0).to(tl.float32)
    Cj = tl.load(C + bc_off, mask=m_t[:, None] & m_n[None, :], other=0.0).to(tl.float32)
    CB = _dot(Cj, tl.trans(Bj), IEEE)  # [i, j]
    causal = j[:, None] >= j[None, :]
    for hh in range(H // G):
        i_h = i_g * (H // G) + hh
        i_bh = i_b * H + i_h
        y_off = (row * H + i_h)[:, None] * P + p[None, :]  # y is contiguous
        x_off = (i_b.to(tl.int64) * sx_b + t.to(tl.int64) * sx_t + i_h * sx_h)[:, None] + p[None, :]
        xj = tl.load(x + x_off, mask=m_xp, other=0.0).to(tl.float32)
        dtj = tl.load(dt + row * H + i_h, mask=m_t, other=0.0)
        sj = tl.load(s + i_bh.to(tl.int64) * Tp + t)
        S0 = tl.load(states + (i_bh.to(tl.int64) * NC + i_n) * P * N + p[:, None] * N + n[None, :],
                     mask=m_p[:, None] & m_n[None, :], other=0.0)
        decay = tl.exp(tl.where(causal, sj[:, None] - sj[None, :], float("-inf")))  # [i, j]
        acc = _dot(Cj, tl.trans(S0), IEEE) * tl.exp(sj)[:, None]
        acc += _dot(CB * decay * dtj[None, :], xj, IEEE)
        tl.store(y + y_off, acc.to(y.dtype.element_ty), mask=m_xp)


@triton.jit
def _chunk_backward_kernel(x, dt, B, C, s, states, dstates, dy, dx, ddt, dB, dC, ds, T, Tp, NC,
                           sx_b, sx_t, sx_h, sbc_b, sbc_t, sbc_g,
                           H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr, CHUNK: tl.constexpr,
                           BP: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr):
    """One chunk of one group's heads, in turn: S0 the state when the chunk starts, dSe the gradient of
    the state when it ends. Writes dx, ddt = sum_p d(x dt) * x, d s (the gradient of the chunk-local
    cumsum) per head, and dB, dC summed over the group's heads."""
    i_n, i_bg = tl.program_id(0), tl.program_id(1)
    i_b, i_g = i_bg // G, i_bg % G
    j = tl.arange(0, CHUNK)
    t = i_n * CHUNK + j
    m_t = t < T
    p, n = tl.program_id(2) * BP + tl.arange(0, BP), tl.arange(0, BN)
    m_p, m_n = p < P, n < N
    m_xp = m_t[:, None] & m_p[None, :]
    m_bn = m_t[:, None] & m_n[None, :]
    m_pn = m_p[:, None] & m_n[None, :]
    row = i_b.to(tl.int64) * T + t
    bc_off = (i_b.to(tl.int64) * sbc_b + t.to(tl.int64) * sbc_t + i_g * sbc_g)[:, None] + n[None, :]
    Bj = tl.load(B + bc_off, mask=m_bn, other=0.0).to(tl.float32)
    Cj = tl.load(C + bc_off, mask=m_bn, other=0.0).to(tl.float32)
    CB = _dot(Cj, tl.trans(Bj), IEEE)  # [i, j]
    causal = j[:, None] >= j[None, :]
    # ddt, dB, dC and d s sum over P: each block of P writes its own share (summed by the caller)
    i_p = tl.program_id(2).to(tl.int64)
    prow = (i_p * (tl.num_programs(1) // G) + i_b) * T + t  # [CHUNK]
    dBj = tl.zeros([CHUNK, BN], dtype=tl.float32)
    dCj = tl.zeros([CHUNK, BN], dtype=tl.float32)
    for hh in range(H // G):
        i_h = i_g * (H // G) + hh
        i_bh = i_b * H + i_h
        y_off = (row * H + i_h)[:, None] * P + p[None, :]  # dy, dx are contiguous
        x_off = (i_b.to(tl.int64) * sx_b + t.to(tl.int64) * sx_t + i_h * sx_h)[:, None] + p[None, :]
        xj = tl.load(x + x_off, mask=m_xp, other=0.0).to(tl.float32)
        dyj = tl.load(dy + y_off, mask=m_xp, other=0.0).to(tl.float32)
        dtj = tl.load(dt + row * H + i_h, mask=m_t, other=0.0)
        s_base = s + i_bh.to(tl.int64) * Tp + i_n * CHUNK
        sj = tl.load(s_base + j)
        s_last = tl.load(s_base + CHUNK - 1)
        st_off = (i_bh.to(tl.int64) * NC + i_n) * P * N + p[:, None] * N + n[None, :]
        S0 = tl.load(states + st_off, mask=m_pn, other=0.0)
        dSe = tl.load(dstates + st_off, mask=m_pn, other=0.0)

        xdt = xj * dtj[:, None]
        from_start = tl.where(m_t, tl.exp(sj), 0.0)
        to_end = tl.where(m_t, tl.exp(s_last - sj), 0.0)
        decay = tl.exp(tl.where(causal, sj[:, None] - sj[None, :], float("-inf")))  # [i, j]

        # y_i = exp(s_i) S0 C_i: gradients of C and s
        dyS0 = _dot(dyj, S0, IEEE)  # [c, N]
        d_s = from_start * tl.sum(dyS0 * Cj, axis=1)
        dCj += dyS0 * from_start[:, None]
        # y_i += sum_j M_ij xdt_j with M_ij = (C_i . B_j) exp(s_i - s_j)
        M = CB * decay
        dyx = _dot(dyj, tl.trans(xdt), IEEE)  # [i, j] dy_i . xdt_j
        dM = dyx * decay
        W = M * dyx
        d_s += tl.sum(W, axis=1) - tl.sum(W, axis=0)
        dCj += _dot(dM, Bj, IEEE)
        dBj += _dot(tl.trans(dM), Cj, IEEE)
        dxdt = _dot(tl.trans(M), dyj, IEEE)  # [c, P]
        # the state at the chunk end, exp(s_last) S0 + sum_j exp(s_last - s_j) xdt_j^T B_j
        BdS = _dot(Bj, tl.trans(dSe), IEEE)  # [c, P]
        dxdt += BdS * to_end[:, None]
        dBj += _dot(xdt, dSe, IEEE) * to_end[:, None]
        q = to_end * tl.sum(xdt * BdS, axis=1)
        d_s -= q
        d_last = tl.sum(q, axis=0) + tl.exp(s_last) * tl.sum(tl.sum(dSe * S0, axis=1), axis=0)
        d_s += tl.where(j == CHUNK - 1, d_last, 0.0)

        tl.store(dx + y_off, (dxdt * dtj[:, None]).to(dx.dtype.element_ty), mask=m_xp)
        tl.store(ddt + prow * H + i_h, tl.sum(dxdt * xj, axis=1), mask=m_t)
        tl.store(ds + (i_p * (tl.num_programs(1) // G) * H + i_bh) * Tp + i_n * CHUNK + j, d_s)
    hb_off = (prow * G + i_g)[:, None] * N + n[None, :]
    tl.store(dB + hb_off, dBj, mask=m_bn)
    tl.store(dC + hb_off, dCj, mask=m_bn)


_WARPS = 8  # the output and backward kernels hold several [chunk, P] and [P, N] fp32 tiles at once
# head dims per program (forward, backward): fewer fp32 tiles live per program (ptxas at P = 128, N = 64,
# chunk 64, bf16, sm_90: no spills forward, about 1.5 KB per thread backward at 32); the backward's
# sums over P are written per block and added after
_BLOCK_P, _BWD_BLOCK_P = 64, 32


def _block(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


def _p_blocks(head_dim: int, most: int) -> tuple[int, int]:
    """(block of head dims, number of blocks)."""
    block = min(most, _block(head_dim))
    return block, triton.cdiv(head_dim, block)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t [b, T, heads, d] as the kernels read it: any batch and time strides, d contiguous, heads d apart."""
    return t if t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] else t.contiguous()


def _same_strides(B: torch.Tensor, C: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (B, C) if B.stride() == C.stride() else (B.contiguous(), C.contiguous())


def _local_cumsum(dt: torch.Tensor, A: torch.Tensor, chunk: int, padded: int) -> torch.Tensor:
    """s[b, h, t]: dt * A summed from the start of t's chunk through t, fp32, zero-padded to `padded` steps."""
    batch, seq_len, heads = dt.shape
    a = torch.nn.functional.pad(dt.float() * A.float(), (0, 0, 0, padded - seq_len))
    return a.view(batch, padded // chunk, chunk, heads).cumsum(2).permute(0, 3, 1, 2).reshape(batch, heads, padded).contiguous()


def _states(v, dt, bc, s, init, T, chunk, from_start, reverse, ieee):
    """The carried states per chunk [b, H, n, P, N] fp32 and the last one (see `_state_pass_kernel`)."""
    batch, _, heads, head_dim = v.shape
    groups, state_size = bc.shape[2], bc.shape[3]
    padded = s.shape[-1]
    num_chunks = padded // chunk
    states = v.new_empty(batch, heads, num_chunks, head_dim, state_size, dtype=torch.float32)
    block_p, p_blocks = _p_blocks(head_dim, _BLOCK_P)
    _chunk_outer_kernel[(num_chunks, batch * heads, p_blocks)](
        v, dt, bc, s, states, T, padded, num_chunks, *v.stride()[:3], *bc.stride()[:3], H=heads, G=groups, P=head_dim, N=state_size, CHUNK=chunk,
        BP=block_p, BN=_block(state_size), FROM_START=from_start, IEEE=ieee)
    final = v.new_empty(batch, heads, head_dim, state_size, dtype=torch.float32)
    pn = head_dim * state_size
    block = min(1024, triton.next_power_of_2(pn))
    _state_pass_kernel[(batch * heads, triton.cdiv(pn, block))](
        states, s, init if init is not None else final, final, num_chunks, padded, pn, CHUNK=chunk, BLOCK=block,
        HAS_INIT=init is not None, REVERSE=reverse)
    return states, final


class _SSD(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dt, A, B, C, chunk_size, initial_state):
        batch, seq_len, heads, head_dim = x.shape
        x, B, C = _rows(x), *_same_strides(_rows(B), _rows(C))  # views of the conv's output stay views
        dt = dt.float().contiguous()
        h0 = None if initial_state is None else initial_state.float().contiguous()
        chunk = chunk_size
        padded = triton.cdiv(seq_len, chunk) * chunk
        ieee = x.dtype == torch.float32
        s = _local_cumsum(dt, A, chunk, padded)
        states, final = _states(x, dt, B, s, h0, seq_len, chunk, False, False, ieee)
        y = x.new_empty(x.shape)
        block_p, p_blocks = _p_blocks(head_dim, _BLOCK_P)
        _chunk_output_kernel[(padded // chunk, batch * B.shape[2], p_blocks)](
            x, dt, B, C, s, states, y, seq_len, padded, padded // chunk, *x.stride()[:3], *B.stride()[:3], H=heads, G=B.shape[2], P=head_dim,
            N=B.shape[3], CHUNK=chunk, BP=block_p, BN=_block(B.shape[3]), IEEE=ieee, num_warps=_WARPS)
        ctx.save_for_backward(x, dt, A, B, C, h0)
        ctx.chunk, ctx.has_init = chunk, initial_state is not None
        ctx.init_dtype = None if initial_state is None else initial_state.dtype
        return y, final

    @staticmethod
    def backward(ctx, dy, dfinal):
        x, dt, A, B, C, h0 = ctx.saved_tensors
        batch, seq_len, heads, head_dim = x.shape
        groups, state_size = B.shape[2], B.shape[3]
        chunk = ctx.chunk
        padded = triton.cdiv(seq_len, chunk) * chunk
        ieee = x.dtype == torch.float32
        s = _local_cumsum(dt, A, chunk, padded)
        states, _ = _states(x, dt, B, s, h0, seq_len, chunk, False, False, ieee)
        dy = (torch.zeros_like(x) if dy is None else dy).contiguous()
        dfinal = None if dfinal is None else dfinal.float().contiguous()
        dstates, dh0 = _states(dy, dt, C, s, dfinal, seq_len, chunk, True, True, ieee)
        dx = x.new_empty(x.shape)
        block_p, p_blocks = _p_blocks(head_dim, _BWD_BLOCK_P)
        ddt = dt.new_empty(p_blocks, *dt.shape)
        dB = x.new_empty(p_blocks, batch, seq_len, groups, state_size, dtype=torch.float32)
        dC = torch.empty_like(dB)
        ds = s.new_empty(p_blocks, *s.shape)
        _chunk_backward_kernel[(padded // chunk, batch * groups, p_blocks)](
            x, dt, B, C, s, states, dstates, dy, dx, ddt, dB, dC, ds, seq_len, padded, padded // chunk,
            *x.stride()[:3], *B.stride()[:3],
            H=heads, G=groups, P=head_dim, N=state_size, CHUNK=chunk, BP=block_p, BN=_block(state_size),
            IEEE=ieee, num_warps=_WARPS)
        del states, dstates
        ddt, dB, dC, ds = ddt.sum(0), dB.sum(0), dC.sum(0), ds.sum(0)
        # d(dt * A) at t: every s at or after t in its chunk depends on it
        da = ds.view(batch, heads, padded // chunk, chunk).flip(-1).cumsum(-1).flip(-1)
        da = da.reshape(batch, heads, padded)[:, :, :seq_len].transpose(1, 2)  # [b, T, H]
        ddt = ddt + da * A.float()
        dA = (da * dt).sum((0, 1)).to(A.dtype)

        dh0 = dh0.to(ctx.init_dtype) if ctx.has_init else None
        return dx, ddt, dA, dB.to(B.dtype), dC.to(C.dtype), None, dh0


def chunk_ssd_triton(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    chunk_size: int = 64, initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`ops.mamba2.chunk_ssd` on attnlab's Triton kernels: (y [b, T, H, P] in x's dtype, final state
    [b, H, P, N] fp32). chunk_size: a power of two, at least 16 (the tile of the [chunk, chunk] scores)."""
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two >= 16, got {chunk_size}")
    if x.shape[2] % B.shape[2]:
        raise ValueError(f"{x.shape[2]} heads do not split into {B.shape[2]} groups")
    return _SSD.apply(x, dt, A, B, C, chunk_size, initial_state)


def use_triton_ssd(choice: str, x: torch.Tensor) -> bool:
    """Whether Mamba-2's parallel form can run on these kernels: a CUDA tensor, kernels not 'torch'."""
    from attnlab.models.kernels import triton_installed

    return choice != "torch" and x.is_cuda and triton_installed()


def ssd(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
    chunk_size: int, initial_state: torch.Tensor | None, output_final_state: bool, choice: str,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Mamba-2's parallel form with its D skip, y = SSD(x, dt, A, B, C) + x * D, with the signature
    of `kernels.mamba2.ssd`: these kernels for CUDA tensors (y in x's dtype; chunk sizes that are not
    a power of two >= 16 run at 64, which changes nothing but rounding), else the PyTorch reference."""
    if use_triton_ssd(choice, x):
        chunk = chunk_size if chunk_size >= 16 and not chunk_size & (chunk_size - 1) else 64
        y, state = chunk_ssd_triton(x, dt, A, B, C, chunk, initial_state)
        y = torch.addcmul(y.float(), x.float(), D.float()[:, None]).to(x.dtype)
        return y, (state if output_final_state else None)
    from attnlab.models.ops.mamba2 import chunk_ssd

    y, state = chunk_ssd(x, dt, A, B, C, chunk_size=chunk_size, initial_state=initial_state)
    return y + x.float() * D.float()[:, None], state
