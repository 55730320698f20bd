"""SwiGLU's activation, silu(gate) * up, as two elementwise Triton kernels (forward; backward, which
may also give the product back), and the MLP's `down(silu(gate) * up)` keeping only gate and up for
the backward.

Elementwise work is bound by memory, not by the block shape: one shape serves every width, so a new
process compiles two kernels and times none (an autotuned kernel compiles each of its candidates on
first use, which used to be most of a cold process's first step). Math in fp32 from any float dtype,
results in the inputs' dtype. Rows may be strided (gate and up are often views of one projection's
output); the last dim must be contiguous.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

BLOCK = 1024
WARPS = 4


@triton.jit
def _fwd_kernel(G, U, Y, sg, su, sy, D, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < D
    g = tl.load(G + row * sg + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(U + row * su + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + row * sy + cols, (g * tl.sigmoid(g) * u).to(Y.dtype.element_ty), mask=ok)


@triton.jit
def _bwd_kernel(G, U, DY, DG, DU, Y, sg, su, sdy, sdg, sdu, sy, D, WANT_Y: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < D
    g = tl.load(G + row * sg + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(U + row * su + cols, mask=ok, other=0.0).to(tl.float32)
    dy = tl.load(DY + row * sdy + cols, mask=ok, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    silu = g * s
    tl.store(DU + row * sdu + cols, (dy * silu).to(DU.dtype.element_ty), mask=ok)
    tl.store(DG + row * sdg + cols, (dy * u * s * (1.0 + g * (1.0 - s))).to(DG.dtype.element_ty), mask=ok)  # silu' = s (1 + g (1 - s))
    if WANT_Y:
        tl.store(Y + row * sy + cols, (silu * u).to(Y.dtype.element_ty), mask=ok)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, D] with a contiguous last dim (a view where one exists)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 or rows.shape[-1] == 1 else rows.contiguous()


def _grid(rows: torch.Tensor) -> tuple[int, int]:
    return rows.shape[0], triton.cdiv(rows.shape[1], BLOCK)


def swiglu_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have one shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    g, u = _rows(gate), _rows(up)
    y = torch.empty(g.shape, dtype=gate.dtype, device=gate.device)
    if y.numel():
        _fwd_kernel[_grid(g)](g, u, y, g.stride(0), u.stride(0), y.stride(0), g.shape[1], BLOCK=BLOCK, num_warps=WARPS)
    return y.view(gate.shape)


def swiglu_backward(gate: torch.Tensor, up: torch.Tensor, dy: torch.Tensor, want_product: bool = False):
    """(d gate, d up) and, with `want_product`, silu(gate) * up recomputed in the same pass."""
    g, u, d = _rows(gate), _rows(up), _rows(dy)
    dg = torch.empty(g.shape, dtype=gate.dtype, device=gate.device)
    du = torch.empty(u.shape, dtype=up.dtype, device=up.device)
    y = torch.empty(g.shape, dtype=gate.dtype, device=gate.device) if want_product else dg
    if dg.numel():
        _bwd_kernel[_grid(g)](g, u, d, dg, du, y, g.stride(0), u.stride(0), d.stride(0), dg.stride(0), du.stride(0), y.stride(0),
                              g.shape[1], WANT_Y=want_product, BLOCK=BLOCK, num_warps=WARPS)
    out = (dg.view(gate.shape), du.view(up.shape))
    return (*out, y.view(gate.shape)) if want_product else out


class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return swiglu_forward(gate, up)

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        return swiglu_backward(gate, up, dy)


class SwiGLULinearFunction(torch.autograd.Function):
    """F.linear(silu(gate) * up, weight, bias), keeping gate and up (not the product) for the backward.
    Under autocast the projection computes in autocast's dtype, both ways."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, gate, up, weight, bias):
        product = swiglu_forward(gate, up)
        ctx.save_for_backward(gate, up, weight)
        ctx.has_bias = bias is not None
        return F.linear(product, weight, bias)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, dout):
        gate, up, weight = ctx.saved_tensors
        dproduct = F.linear(dout, weight.t()).to(gate.dtype)  # [..., I]
        dgate, dup, product = swiglu_backward(gate, up, dproduct, want_product=True)
        flat_out = dout.reshape(-1, dout.shape[-1])
        dweight = (flat_out.t().to(product.dtype) @ product.reshape(-1, product.shape[-1])).to(weight.dtype)
        dbias = flat_out.sum(0).to(weight.dtype) if ctx.has_bias else None
        return dgate, dup, dweight, dbias


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return SwiGLUFunction.apply(gate, up)


def swiglu_linear(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return SwiGLULinearFunction.apply(gate, up, weight, bias)
