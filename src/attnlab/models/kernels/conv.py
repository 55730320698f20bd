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

in one kernel: each program walks over a few time tiles of one batch row and channel block,
recomputing dpre at the K shifts its dx needs, and writes its partial sums of dweight and dbias to
an fp32 buffer that torch sums (deterministic: no atomics). The gradient of the initial state (only
its first K - 1 outputs depend on it) is taken in PyTorch on that [B, K-1, C] slice.

Under TRITON_INTERPRET=1 the same kernels run on CPU tensors (slowly): the tests use that in CI.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

MAX_KERNEL_SIZE = 8  # each program unrolls K (forward) and K * K (backward) loads of its tile
# Tiles of 32 steps (forward, 4 warps) and 16 steps (backward, 8 warps) by up to 128 channels:
# compiled for sm_90, no kernel size up to 4 spills registers (the backward holds dx and recomputes
# the K pre-activations it needs; the compiler keeps all their loads in flight).
FWD_BLOCK_T, BWD_BLOCK_T = 32, 16
FWD_WARPS, BWD_WARPS = 4, 8
BWD_MIN_PROGRAMS = 1024  # the backward walks up to 16 time tiles per program while this many programs remain


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
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
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


@triton.jit
def _bwd_kernel(
    X, W, Bias, H0, DY, DX, DW, DB, T, C, tiles_per_program, time_programs,
    sxb, sxt, sxc, swc, swk, shb, sht, shc, sdyb, sdyt, sdyc, sdxb, sdxt, sdxc,
    K: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_H0: tl.constexpr, SILU: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    pid_t, pid_c, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < C
    X += b * sxb
    H0 += b * shb
    DY += b * sdyb
    DX += b * sdxb
    w_ptrs = W + c * swc
    bias = tl.zeros((BLOCK_C,), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(Bias + c, mask=c_ok, other=0.0).to(tl.float32)
    taps = tl.arange(0, BLOCK_K)
    dw = tl.zeros((BLOCK_K, BLOCK_C), dtype=tl.float32)  # row k: sum_t dpre[t] * p[t + k]
    db = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for i in range(tiles_per_program):
        t = (pid_t * tiles_per_program + i) * BLOCK_T + tl.arange(0, BLOCK_T)
        dx = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
        for s in tl.static_range(K):  # dx[t] takes weight[:, K-1-s] * dpre[t + s]
            u = t + s
            dpre = tl.load(DY + u.to(tl.int64)[:, None] * sdyt + c[None, :] * sdyc, mask=(u < T)[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
            if SILU:
                pre = _pre_activation(X, H0, w_ptrs, bias, u, c, c_ok, T, sxt, sxc, sht, shc, swk, K, HAS_H0, BLOCK_T, BLOCK_C)
                sig = tl.sigmoid(pre)
                dpre = dpre * sig * (1.0 + pre * (1.0 - sig))
            w = tl.load(w_ptrs + (K - 1 - s) * swk, mask=c_ok, other=0.0).to(tl.float32)
            dx += w[None, :] * dpre
            if s == 0:  # this tile's own times: its terms of dweight and dbias
                db += tl.sum(dpre, axis=0)
                for k in tl.static_range(K):
                    p = _window(X, H0, t + (k - (K - 1)), c, c_ok, T, sxt, sxc, sht, shc, K, HAS_H0)
                    dw = tl.where(taps[:, None] == k, dw + tl.sum(dpre * p, axis=0)[None, :], dw)
        ok = (t < T)[:, None] & c_ok[None, :]
        tl.store(DX + t.to(tl.int64)[:, None] * sdxt + c[None, :] * sdxc, dx.to(DX.dtype.element_ty), mask=ok)
    row = b * time_programs + pid_t  # this program's row of the partial sums
    tl.store(DW + (row * K + taps[:, None]) * C + c[None, :], dw, mask=(taps < K)[:, None] & c_ok[None, :])
    if HAS_BIAS:
        tl.store(DB + row * C + c, db, mask=c_ok)


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


def _reference(x, weight, bias, h0, silu: bool) -> torch.Tensor:
    """The convolution in PyTorch (fp32) on a few rows: used for the initial state's gradient."""
    C = x.shape[2]
    padded = torch.cat((h0.to(x.dtype).float(), x.float()), dim=1)  # [B, width + T, C]
    out = F.conv1d(padded.transpose(1, 2), weight.float()[:, None], None if bias is None else bias.float(), groups=C)
    out = out.transpose(1, 2)  # [B, T, C]
    return F.silu(out) if silu else out


class _CausalConv1d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, h0, silu, channel_major):
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
                BLOCK_T=FWD_BLOCK_T, BLOCK_C=block_c, num_warps=FWD_WARPS,
            )
        final = _final_state(x, h0, K - 1, channel_major)
        ctx.save_for_backward(x, weight, bias, h0)
        ctx.silu = silu
        ctx.set_materialize_grads(False)
        return y, final

    @staticmethod
    def backward(ctx, dy, dfinal):
        x, weight, bias, h0 = ctx.saved_tensors
        B, T, C = x.shape
        K = weight.shape[1]
        width = K - 1
        dx = torch.empty_like(x, memory_format=torch.contiguous_format) if dy is not None else torch.zeros_like(x)
        dweight = dbias = None
        if dy is not None and T and C and B:
            block_c = _block_c(C)
            time_tiles = triton.cdiv(T, BWD_BLOCK_T)
            channel_blocks = triton.cdiv(C, block_c)
            tiles_per_program = 1
            while tiles_per_program < 16 and B * channel_blocks * triton.cdiv(time_tiles, 2 * tiles_per_program) >= BWD_MIN_PROGRAMS:
                tiles_per_program *= 2
            time_programs = triton.cdiv(time_tiles, tiles_per_program)
            dw_parts = torch.empty(B * time_programs, K, C, dtype=torch.float32, device=x.device)
            db_parts = torch.empty(B * time_programs, C, dtype=torch.float32, device=x.device) if bias is not None else dw_parts
            sh = h0.stride() if h0 is not None else (0, 0, 0)
            _bwd_kernel[(time_programs, channel_blocks, B)](
                x, weight, bias if bias is not None else weight, h0 if h0 is not None else x, dy, dx, dw_parts, db_parts,
                T, C, tiles_per_program, time_programs,
                *x.stride(), *weight.stride(), *sh, *dy.stride(), *dx.stride(),
                K=K, BLOCK_K=triton.next_power_of_2(K), HAS_BIAS=bias is not None, HAS_H0=h0 is not None, SILU=ctx.silu,
                BLOCK_T=BWD_BLOCK_T, BLOCK_C=block_c, num_warps=BWD_WARPS,
            )
            dweight = dw_parts.sum(0).t().to(weight.dtype)
            dbias = db_parts.sum(0).to(bias.dtype) if bias is not None else None
        else:
            dweight = torch.zeros_like(weight)
            dbias = torch.zeros_like(bias) if bias is not None else None

        dh0 = None
        if h0 is not None and ctx.needs_input_grad[3]:
            if dy is not None and T:  # only the first `width` outputs read the state
                n = min(T, width)
                with torch.enable_grad(), torch.autocast(x.device.type, enabled=False):
                    state = h0.detach().requires_grad_()
                    out = _reference(x[:, :n].detach(), weight.detach(), None if bias is None else bias.detach(), state, ctx.silu)
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
        return dx, dweight, dbias, dh0, None, None


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
