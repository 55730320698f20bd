"""A causal depthwise convolution over time (+ SiLU) as Triton kernels, forward and backward.

`causal_conv1d` computes what the mixers' reference does with `torch.cat` + `F.conv1d` on [B, T, C]:

    p = cat(initial_state or zeros [B, K-1, C], x)             the K - 1 inputs before x, then x
    y[t] = act(bias + sum_k weight[:, k] * p[t + k])           act: SiLU or none
    final_state = p[-(K-1):]                                   the last K - 1 inputs

without the concatenation or any transposed copy: one program holds a tile of (time, channels) of
x in its own layout (any strides) and reads the K - 1 rows before the tile from x or, before the
sequence, from the initial state. Accumulation is in fp32; y and the final state are in x's dtype.

The forward keeps only x (and the initial state). The backward recomputes the pre-activation:

    dpre[t] = dy[t] * act'(pre[t])
    dx[t] = sum_k weight[:, k] * dpre[t + K-1 - k]             a correlation with the flipped weight
    dweight[:, k] = sum_{b, t} dpre[t] * p[t + k],  dbias = sum_{b, t} dpre[t]

in two passes, each reading every element a fixed few times:

1. `_bwd_dpre_kernel`: each program walks a few time tiles of one batch row and channel block,
   recomputes pre once per element (K loads of x, as the forward), stores dpre and adds dpre * p
   (one tile-shaped fp32 sum per tap) and dpre (for dbias) to sums that it reduces over time once,
   at its end, into its row of an fp32 buffer of partial sums that torch adds up (deterministic: no
   atomics). Without an activation dpre is dy itself: nothing is stored.
2. `_bwd_dx_kernel`: dx from K shifted reads of dpre (the same tile read at K offsets, cache hits).

dpre is stored in x's dtype: in bf16 that is one more rounding (relative 2^-9 per element) of a
value that arrived rounded (dy, in y's dtype) and whose sum dx is rounded again when stored, against
the 2e-2 relative error bf16 gradients are held to; dweight and dbias are summed from the fp32 dpre
before that rounding, and fp32 inputs keep it in fp32. It moves 2 bytes an element less each way
than an fp32 dpre (the passes move x, dy, dpre twice and dx: 10 bytes an element in bf16 against 14).
|dpre| <= 1.1 |dy|, so fp16 cannot overflow where dy did not.

Why two passes: one kernel that recomputed dpre at the K shifts its dx needs (K * K window loads a
tile) and held dx, dweight and the K pre-activations at once used 255 registers a thread for sm_90
(one program per SM) and was latency-bound: 1.47 ms a call for Mamba-2's conv (B 4, T 4096, C 2176,
K 4, SiLU, bf16) on an H100, for a forward under 0.2 ms and ~0.1 ms of memory traffic.

The gradient of the initial state (only its first K - 1 outputs depend on it) is taken in PyTorch
on that [B, K-1, C] slice; the final state's gradient is added to dx's last K - 1 rows.

Under TRITON_INTERPRET=1 the same kernels run on CPU tensors (slowly): the tests use that in CI.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnlab.models.ops.common import causal_conv1d as reference
from attnlab.models.kernels.eager import outside_compile

MAX_KERNEL_SIZE = 8  # the forward unrolls K loads of its tile; the backward one dweight sum per tap, up to 8
# Tiles by up to 128 channels. Forward: 32 steps, 4 warps. Backward: the dpre pass 8 steps by 8 warps (4 elements
# a thread: its K windows, dpre and the K tile-shaped dweight sums live at once), the dx pass 32 steps by 8 warps.
# Compiled for sm_90 as launched (unit channel strides, bf16, SiLU), no spills: the dpre pass 61 / 76 / 80 / 128
# registers at K 2 / 3 / 4 / 8 (100 at K 4 with an initial state) and 12 KiB of shared memory at K 4 (the next
# tile's loads), the dx pass 46 / 60 / 64 / 114.
FWD_BLOCK_T, BWD_BLOCK_T, DX_BLOCK_T = 32, 8, 32
FWD_WARPS, BWD_WARPS, DX_WARPS = 4, 8, 8
BWD_MIN_PROGRAMS = 1024  # the dpre pass walks up to 16 time tiles per program while this many programs remain


@triton.jit
def _window(X, H0, idx, c, c_ok, T, sxt, sxc, sht, shc, K: tl.constexpr, HAS_H0: tl.constexpr):
    """The inputs p at x's time indices `idx` ([BLOCK_T]; below 0: the initial state's rows) as fp32,
    0 outside the sequence. X and H0 point at this program's batch row."""
    ok = (idx >= 0) & (idx < T)
    v = tl.load(X + idx.to(tl.int64)[:, None] * sxt + c[None, :] * sxc, mask=ok[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
    if HAS_H0:
        row = idx + (K - 1)
        before = (idx < 0) & (row >= 0)
        h = tl.load(H0 + row[:, None] * sht + c[None, :] * shc, mask=before[:, None] & c_ok[None, :], other=0.0)
        v += h.to(X.dtype.element_ty).to(tl.float32)  # the state enters in x's dtype, as in the reference
    return v


@triton.jit
def _pre_activation(X, H0, w_ptrs, bias, u, c, c_ok, T, sxt, sxc, sht, shc, swk,
                    K: tl.constexpr, HAS_H0: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """bias + sum_k weight[:, k] * p[u + k] for output times u ([BLOCK_T])."""
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32) + bias[None, :]
    for k in tl.static_range(K):
        w = tl.load(w_ptrs + k * swk, mask=c_ok, other=0.0).to(tl.float32)
        acc += w[None, :] * _window(X, H0, u + (k - (K - 1)), c, c_ok, T, sxt, sxc, sht, shc, K, HAS_H0)
    return acc


@triton.jit
def _fwd_kernel(
    X, W, Bias, H0, Y, T, C,
    sxb, sxt, sxc, swc, swk, shb, sht, shc, syb, syt, syc,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_H0: tl.constexpr, SILU: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, ADVANCE_H0: tl.constexpr,
):
    pid_t, pid_c, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < C
    X += b * sxb
    H0 += b * shb
    bias = tl.zeros((BLOCK_C,), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(Bias + c, mask=c_ok, other=0.0).to(tl.float32)
    y = _pre_activation(X, H0, W + c * swc, bias, t, c, c_ok, T, sxt, sxc, sht, shc, swk, K, HAS_H0, BLOCK_T, BLOCK_C)
    if SILU:
        y = y * tl.sigmoid(y)
    ok = (t < T)[:, None] & c_ok[None, :]
    tl.store(Y + b * syb + t.to(tl.int64)[:, None] * syt + c[None, :] * syc, y.to(Y.dtype.element_ty), mask=ok)
    if ADVANCE_H0:  # one token (T = 1, one program per block of channels): the state becomes its last K - 1 inputs, in place
        tl.debug_barrier()  # every thread has read the state for y before any of it is overwritten
        for r in tl.static_range(0, K - 2):  # row r takes row r + 1 (each channel's loads and stores on one thread)
            tl.store(H0 + r * sht + c * shc, tl.load(H0 + (r + 1) * sht + c * shc, mask=c_ok, other=0.0), mask=c_ok)
        x = tl.load(X + c * sxc, mask=c_ok, other=0.0)
        tl.store(H0 + (K - 2) * sht + c * shc, x.to(H0.dtype.element_ty), mask=c_ok)


@triton.jit
def _tap(acc, j: tl.constexpr, dpre, X, H0, t, c, c_ok, T, sxt, sxc, sht, shc, K: tl.constexpr, HAS_H0: tl.constexpr):
    """acc + dpre[t] * p[t + j - (K-1)]: the terms of dweight[:, j] at times t (none for j >= K)."""
    if j < K:
        acc += dpre * _window(X, H0, t + (j - (K - 1)), c, c_ok, T, sxt, sxc, sht, shc, K, HAS_H0)
    return acc


@triton.jit
def _tap_store(DW, acc, j: tl.constexpr, row, c, c_ok, C, K: tl.constexpr):
    if j < K:
        tl.store(DW + (row * K + j) * C + c, tl.sum(acc, axis=0), mask=c_ok)


@triton.jit
def _bwd_dpre_kernel(
    X, W, Bias, H0, DY, DPRE, DW, DB, T, C, tiles_per_program, time_programs,
    sxb, sxt, sxc, swc, swk, shb, sht, shc, sdyb, sdyt, sdyc, spb, spt, spc,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_H0: tl.constexpr, SILU: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """The backward's first pass over a few time tiles of one batch row and channel block: dpre =
    dy * act'(pre) (stored in DPRE with SiLU; without it dpre is dy) and this program's partial sums
    of dweight [K, C] and dbias [C]. The sums stay tile-shaped over the time tiles (one accumulator
    per tap, unrolled up to MAX_KERNEL_SIZE) and are reduced over time once, at the end."""
    tl.static_assert(K <= 8, "one dweight sum per tap, dw0 to dw7")
    pid_t, pid_c, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < C
    X += b * sxb
    H0 += b * shb
    DY += b * sdyb
    DPRE += b * spb
    w_ptrs = W + c * swc
    bias = tl.zeros((BLOCK_C,), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(Bias + c, mask=c_ok, other=0.0).to(tl.float32)
    db = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    dw0 = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)  # dw<j>[t, c]: sum over tiles of dpre[t] * p[t + j - (K-1)]
    dw1 = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    dw2 = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    dw3 = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    dw4 = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    dw5 = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    dw6 = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    dw7 = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for i in tl.range(tiles_per_program, num_stages=2):  # the next tile's loads in flight (async copies) during this one
        t = (pid_t * tiles_per_program + i) * BLOCK_T + tl.arange(0, BLOCK_T)
        ok = (t < T)[:, None] & c_ok[None, :]
        dpre = tl.load(DY + t.to(tl.int64)[:, None] * sdyt + c[None, :] * sdyc, mask=ok, other=0.0).to(tl.float32)
        if SILU:
            pre = _pre_activation(X, H0, w_ptrs, bias, t, c, c_ok, T, sxt, sxc, sht, shc, swk, K, HAS_H0, BLOCK_T, BLOCK_C)
            sig = tl.sigmoid(pre)
            dpre = dpre * sig * (1.0 + pre * (1.0 - sig))
        db += dpre
        # the K windows of the pre-activation again: with no store in between, the compiler reuses those loads
        dw0 = _tap(dw0, 0, dpre, X, H0, t, c, c_ok, T, sxt, sxc, sht, shc, K, HAS_H0)
        dw1 = _tap(dw1, 1, dpre, X, H0, t, c, c_ok, T, sxt, sxc, sht, shc, K, HAS_H0)
        dw2 = _tap(dw2, 2, dpre, X, H0, t, c, c_ok, T, sxt, sxc, sht, shc, K, HAS_H0)
        dw3 = _tap(dw3, 3, dpre, X, H0, t, c, c_ok, T, sxt, sxc, sht, shc, K, HAS_H0)
        dw4 = _tap(dw4, 4, dpre, X, H0, t, c, c_ok, T, sxt, sxc, sht, shc, K, HAS_H0)
        dw5 = _tap(dw5, 5, dpre, X, H0, t, c, c_ok, T, sxt, sxc, sht, shc, K, HAS_H0)
        dw6 = _tap(dw6, 6, dpre, X, H0, t, c, c_ok, T, sxt, sxc, sht, shc, K, HAS_H0)
        dw7 = _tap(dw7, 7, dpre, X, H0, t, c, c_ok, T, sxt, sxc, sht, shc, K, HAS_H0)
        if SILU:
            tl.store(DPRE + t.to(tl.int64)[:, None] * spt + c[None, :] * spc, dpre.to(DPRE.dtype.element_ty), mask=ok)
    row = b * time_programs + pid_t  # this program's row of the partial sums
    _tap_store(DW, dw0, 0, row, c, c_ok, C, K)
    _tap_store(DW, dw1, 1, row, c, c_ok, C, K)
    _tap_store(DW, dw2, 2, row, c, c_ok, C, K)
    _tap_store(DW, dw3, 3, row, c, c_ok, C, K)
    _tap_store(DW, dw4, 4, row, c, c_ok, C, K)
    _tap_store(DW, dw5, 5, row, c, c_ok, C, K)
    _tap_store(DW, dw6, 6, row, c, c_ok, C, K)
    _tap_store(DW, dw7, 7, row, c, c_ok, C, K)
    if HAS_BIAS:
        tl.store(DB + row * C + c, tl.sum(db, axis=0), mask=c_ok)


@triton.jit
def _bwd_dx_kernel(
    DPRE, W, DX, T, C, spb, spt, spc, swc, swk, sdxb, sdxt, sdxc,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """The backward's second pass: dx[t] = sum_s weight[:, K-1-s] * dpre[t + s] (dpre is 0 past T)."""
    pid_t, pid_c, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < C
    DPRE += b * spb
    dx = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for s in tl.static_range(K):
        u = t + s
        d = tl.load(DPRE + u.to(tl.int64)[:, None] * spt + c[None, :] * spc, mask=(u < T)[:, None] & c_ok[None, :], other=0.0)
        w = tl.load(W + c * swc + (K - 1 - s) * swk, mask=c_ok, other=0.0).to(tl.float32)
        dx += w[None, :] * d.to(tl.float32)
    ok = (t < T)[:, None] & c_ok[None, :]
    tl.store(DX + b * sdxb + t.to(tl.int64)[:, None] * sdxt + c[None, :] * sdxc, dx.to(DX.dtype.element_ty), mask=ok)


def _block_c(C: int) -> int:
    return min(128, triton.next_power_of_2(C))


def _final_state(x: torch.Tensor, h0: torch.Tensor | None, width: int, channel_major: bool) -> torch.Tensor:
    """The last `width` inputs [B, width, C] in x's dtype; stored [B, C, width] when `channel_major`."""
    B, T, C = x.shape
    if T >= width:
        last = x[:, T - width:]
    else:
        before = x.new_zeros(B, width - T, C) if h0 is None else h0[:, T:].to(x.dtype)
        last = torch.cat((before, x), dim=1)
    # a new tensor in either layout (never a view of x, which an autograd.Function must not return)
    shape = (B, C, width) if channel_major else (B, width, C)
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    state = out.transpose(1, 2) if channel_major else out
    return state.copy_(last)


def conv_forward(x, weight, bias, h0, silu: bool, channel_major: bool, want_final: bool = True):
    """The forward on the kernels, outside autograd: (y [B, T, C] in x's dtype, the final state, or None
    without `want_final`)."""
    B, T, C = x.shape
    K = weight.shape[1]
    y = torch.empty(B, T, C, dtype=x.dtype, device=x.device)
    h0_arg = h0 if h0 is not None else x  # a placeholder pointer when there is no state
    sh = h0.stride() if h0 is not None else (0, 0, 0)
    block_c = _block_c(C)
    grid = (triton.cdiv(T, FWD_BLOCK_T), triton.cdiv(C, block_c), B)
    if T and C and B:  # no empty launch
        _fwd_kernel[grid](
            x, weight, bias if bias is not None else weight, h0_arg, y, T, C,
            *x.stride(), *weight.stride(), *sh, *y.stride(),
            K=K, HAS_BIAS=bias is not None, HAS_H0=h0 is not None, SILU=silu,
            BLOCK_T=FWD_BLOCK_T, BLOCK_C=block_c, ADVANCE_H0=False, num_warps=FWD_WARPS,
        )
    return y, (_final_state(x, h0, K - 1, channel_major) if want_final else None)


def conv_step_(x, weight, bias, state, silu: bool) -> torch.Tensor:
    """One token per row (x [B, 1, C], no autograd): y [B, 1, C], and `state` (the K - 1 inputs before x,
    [B, K-1, C], any strides) advanced in place to the last K - 1 inputs: one kernel, no new state to copy."""
    B, T, C = x.shape
    K = weight.shape[1]
    if T != 1 or tuple(state.shape) != (B, K - 1, C):
        raise ValueError(f"conv_step_: x [B, 1, C] and a state [B, K-1, C], got {tuple(x.shape)} and {tuple(state.shape)}")
    y = torch.empty_like(x)
    block_c = _block_c(C)
    _fwd_kernel[(1, triton.cdiv(C, block_c), B)](
        x, weight, bias if bias is not None else weight, state, y, T, C,
        *x.stride(), *weight.stride(), *state.stride(), *y.stride(),
        K=K, HAS_BIAS=bias is not None, HAS_H0=True, SILU=silu, BLOCK_T=FWD_BLOCK_T, BLOCK_C=block_c,
        ADVANCE_H0=True, num_warps=FWD_WARPS,
    )
    return y


def conv_backward(x, weight, bias, h0, silu: bool, dy, dfinal, want_h0_grad: bool, dx_out=None):
    """(dx, dweight, dbias, d initial state) of `conv_forward`'s inputs. dx_out [B, T, C] (any strides):
    where to write dx (a slice of a larger gradient), else a new tensor in x's dtype."""
    B, T, C = x.shape
    K = weight.shape[1]
    width = K - 1
    if dx_out is not None:
        dx = dx_out if dy is not None else dx_out.zero_()
    else:
        dx = torch.empty_like(x, memory_format=torch.contiguous_format) if dy is not None else torch.zeros_like(x)
    dweight = dbias = None
    if dy is not None and T and C and B:
        block_c = _block_c(C)
        channel_blocks = triton.cdiv(C, block_c)
        time_tiles = triton.cdiv(T, BWD_BLOCK_T)
        tiles_per_program = 1
        while tiles_per_program < 16 and B * channel_blocks * triton.cdiv(time_tiles, 2 * tiles_per_program) >= BWD_MIN_PROGRAMS:
            tiles_per_program *= 2
        time_programs = triton.cdiv(time_tiles, tiles_per_program)
        dw_parts = torch.empty(B * time_programs, K, C, dtype=torch.float32, device=x.device)
        db_parts = torch.empty(B * time_programs, C, dtype=torch.float32, device=x.device) if bias is not None else dw_parts
        # dpre in x's dtype (see the module's docstring); without SiLU it is dy itself
        dpre = torch.empty(B, T, C, dtype=x.dtype, device=x.device) if silu else dy
        # the weight tap-major ([C, K] strides (1, C)): each tap's weights are then one contiguous load a tile
        w_tap_major = weight.t().contiguous().t()
        # the state as [B, K-1, C] rows in x's dtype (as the kernel reads it): its loads then take x's layout
        state = h0.to(x.dtype).contiguous() if h0 is not None else None
        sh = state.stride() if state is not None else (0, 0, 0)
        _bwd_dpre_kernel[(time_programs, channel_blocks, B)](
            x, w_tap_major, bias if bias is not None else weight, state if state is not None else x, dy, dpre, dw_parts, db_parts,
            T, C, tiles_per_program, time_programs,
            *x.stride(), *w_tap_major.stride(), *sh, *dy.stride(), *dpre.stride(),
            K=K, HAS_BIAS=bias is not None, HAS_H0=h0 is not None, SILU=silu,
            BLOCK_T=BWD_BLOCK_T, BLOCK_C=block_c, num_warps=BWD_WARPS,
        )
        _bwd_dx_kernel[(triton.cdiv(T, DX_BLOCK_T), channel_blocks, B)](
            dpre, w_tap_major, dx, T, C, *dpre.stride(), *w_tap_major.stride(), *dx.stride(),
            K=K, BLOCK_T=DX_BLOCK_T, BLOCK_C=block_c, num_warps=DX_WARPS,
        )
        dweight = dw_parts.sum(0).t().to(weight.dtype)
        dbias = db_parts.sum(0).to(bias.dtype) if bias is not None else None
    else:
        dweight = torch.zeros_like(weight)
        dbias = torch.zeros_like(bias) if bias is not None else None

    dh0 = None
    if h0 is not None and want_h0_grad:
        if dy is not None and T:  # only the first `width` outputs read the state
            n = min(T, width)
            with torch.enable_grad(), torch.autocast(x.device.type, enabled=False):
                state = h0.detach().requires_grad_()
                out = reference(x[:, :n].detach(), weight.detach(), None if bias is None else bias.detach(), state, silu)
                (dh0,) = torch.autograd.grad(out, state, dy[:, :n].float())
        else:
            dh0 = torch.zeros_like(h0)
    if dfinal is not None:  # the final state is the last `width` rows of cat(state, x)
        first = T - width  # x's time index of the final state's first row
        start = max(0, -first)
        dx[:, first + start:] += dfinal[:, start:].to(dx.dtype)
        if dh0 is not None and start:
            dh0[:, T:] += dfinal[:, :start].to(dh0.dtype)
    if dh0 is not None:
        dh0 = dh0.to(h0.dtype)
    return dx, dweight, dbias, dh0


class _CausalConv1d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, h0, silu, channel_major):
        y, final = conv_forward(x, weight, bias, h0, silu, channel_major)
        ctx.save_for_backward(x, weight, bias, h0)
        ctx.silu = silu
        ctx.set_materialize_grads(False)
        return y, final

    @staticmethod
    def backward(ctx, dy, dfinal):
        x, weight, bias, h0 = ctx.saved_tensors
        dx, dweight, dbias, dh0 = conv_backward(x, weight, bias, h0, ctx.silu, dy, dfinal, ctx.needs_input_grad[3])
        return dx, dweight, dbias, dh0, None, None


@outside_compile(traced=True)
def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    silu: bool = False,
    channel_major_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv over time (+ SiLU). x [B, T, C] (any strides); weight [C, K];
    bias [C] or None; initial_state: the K - 1 inputs before x [B, K-1, C] (any strides) or None
    (zeros). Returns y [B, T, C] in x's dtype and the last K - 1 inputs [B, K-1, C], stored
    [B, C, K-1] (a transposed view of it) when `channel_major_state`."""
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[0] != x.shape[2]:
        raise ValueError(f"causal_conv1d: x [B, T, C] and weight [C, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    K = weight.shape[1]
    if not 2 <= K <= MAX_KERNEL_SIZE:
        raise ValueError(f"causal_conv1d: kernel sizes 2 to {MAX_KERNEL_SIZE}, got {K}")
    if initial_state is not None and tuple(initial_state.shape) != (x.shape[0], K - 1, x.shape[2]):
        raise ValueError(f"causal_conv1d: initial_state must be [B, K-1, C] = {(x.shape[0], K - 1, x.shape[2])}, got {tuple(initial_state.shape)}")
    return _CausalConv1d.apply(x, weight, bias, initial_state, bool(silu), bool(channel_major_state))
