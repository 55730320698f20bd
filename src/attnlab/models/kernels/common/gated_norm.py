"""Mamba-2's grouped gated RMSNorm as two Triton kernels (forward; backward, which may also give the
normed output back), in place of fla's `rmsnorm_fn` (norm_before_gate=False, is_rms_norm=True).

Each row of width D splits into G = D / group_size groups of `group_size` channels (G = 1: one group,
the whole row). With fp32 math from any float dtype:

    h = x * silu(z)
    rstd[g] = 1 / sqrt(mean(h[g]^2) + eps)               over group g's channels
    y = h * rstd[group] * weight                         weight [D]; y in `out_dtype` (x's by default)

The backward, per group of n channels, with r = rstd, yhat = h * r and g = dy * weight (the
gradient through weight, in fp32):

    dh = r * (g - yhat * mean(g * yhat))                 d/dh of yhat: r, less its projection on yhat
    dx = dh * silu(z)
    dz = dh * x * sigmoid(z) * (1 + z * (1 - sigmoid(z)))      silu'(z) = s (1 + z (1 - s)), s = sigmoid(z)
    dweight = sum over rows of dy * yhat

The forward keeps x, z and rstd (G fp32 numbers a row), not y: the backward recomputes h and yhat
from x, z and rstd, and with `want_y` stores y = yhat * weight as well (in dy's dtype) in that same
pass, for the caller whose next linear layer needs it for its weight gradient; y is then never kept
between the passes.

Design. The work is elementwise plus one reduction over a group's channels: it is bound by memory
(bf16: the forward reads 4 and writes 2 bytes an element, the backward reads 6 and writes 4, or 6
with y), so the block shapes are fixed, not autotuned (autotuning compiles every candidate on first
use, seconds in a cold process). A program owns one group of a block of consecutive rows and walks
them one at a time; a group's channels are one tile of BLOCK_N = next_power_of_2(group_size) lanes
(masked past group_size), so its sum of squares and its mean(g * yhat) are each one in-register
reduction. Warps scale with the tile: about 8 elements a thread per tensor (one 16-byte vector load
of bf16), 8 warps for Mamba-2's 2048-wide groups, 2 for 512-wide ones; group_size is limited to
MAX_GROUP_SIZE (16 warps, 16 elements a thread per tensor).

The weight gradient needs a sum over all rows. Each backward program adds dy * yhat for its rows
into an fp32 vector of its tile's width and stores it, once, into its row of an fp32 buffer
[row programs, D]; torch sums that buffer (deterministic: no atomics). Rows per program are chosen
so that about BWD_PROGRAMS programs run over all groups (16 rows each at rows 16384 and one group:
1024 programs, ~7.8 per SM of an H100's 132): enough to fill the GPU, while the partial sums (8 MiB
written and read again at D 2048) stay small next to the 320 MiB (384 with y) the bf16 backward moves.

Rows may be strided (z is usually a column slice of the input projection's output, x a view of the
SSD's); the last dim must be contiguous (it is made so where it is not), and the row offsets are
int64 (row * stride passes 2^31 past about 506K rows of a 4240-wide projection).
The backward may write dx and dz straight into preallocated strided views (`dx_out`, `dz_out`: for
instance column slices of the gradient buffer of that projection's output).

Under TRITON_INTERPRET=1 the same kernels run on CPU tensors (slowly): the tests use that in CI.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Compiled for sm_90 as launched (bf16, strides divisible by 16), no spills up to 4096-wide groups: the forward 40
# registers a thread at 2048 and 512 (6 programs of 8 warps an SM at 2048), the backward 123 / 127 at 2048 with / without
# y (2 programs of 8 warps an SM: 4096 elements of each tensor in flight) and 89-94 at 512; at 8192 (16 warps, 128
# registers, the most 512 threads may have) the backward keeps 64-144 bytes a thread on the stack.
MAX_GROUP_SIZE = 8192  # one group is one tile in registers: 8192 lanes at 16 warps is 16 elements a thread per tensor
ELEMENTS_PER_THREAD = 8  # per tensor and tile: one 16-byte load of bf16 a thread; warps = tile / (32 * this), 1 to 16
MAX_WARPS = 16
FWD_PROGRAMS = 4096  # the forward takes rows per program so that about this many programs run (over all groups)
BWD_PROGRAMS = 1024  # the backward fewer, as each stores a [group_size] fp32 partial sum of dweight


@triton.jit
def _fwd_kernel(X, Z, W, Y, RSTD, rows, rows_per_program, sx, sz, sy, N, G, eps, BLOCK_N: tl.constexpr):
    """One group (program_id 1) of `rows_per_program` consecutive rows (program_id 0): y and rstd."""
    grp = tl.program_id(1)
    lane = tl.arange(0, BLOCK_N)
    ok = lane < N
    cols = grp * N + lane
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    first = tl.program_id(0).to(tl.int64) * rows_per_program  # int64 bounds: the loop's row index is int64
    last = tl.minimum(first + rows_per_program, rows)
    for r64 in tl.range(first, last):
        x = tl.load(X + r64 * sx + cols, mask=ok, other=0.0).to(tl.float32)
        z = tl.load(Z + r64 * sz + cols, mask=ok, other=0.0).to(tl.float32)
        h = x * (z * tl.sigmoid(z))  # 0 on the masked lanes; the backward's order of products, so its y is this one
        rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / N + eps)
        tl.store(RSTD + r64 * G + grp, rstd)
        tl.store(Y + r64 * sy + cols, (h * rstd * w).to(Y.dtype.element_ty), mask=ok)


@triton.jit
def _bwd_kernel(X, Z, W, RSTD, DY, DX, DZ, Y, DW, rows, rows_per_program, sx, sz, sdy, sdx, sdz, sy, N, D, G,
                WANT_Y: tl.constexpr, BLOCK_N: tl.constexpr):
    """One group of a block of rows: dx, dz (and y with WANT_Y) for each row, and the block's sum of
    dy * yhat stored into this program's row of DW [row programs, D] (fp32)."""
    pid = tl.program_id(0)
    grp = tl.program_id(1)
    lane = tl.arange(0, BLOCK_N)
    ok = lane < N
    cols = grp * N + lane
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    first = pid.to(tl.int64) * rows_per_program  # int64 bounds: the loop's row index is int64
    last = tl.minimum(first + rows_per_program, rows)
    for r64 in tl.range(first, last):
        x = tl.load(X + r64 * sx + cols, mask=ok, other=0.0).to(tl.float32)
        z = tl.load(Z + r64 * sz + cols, mask=ok, other=0.0).to(tl.float32)
        dy = tl.load(DY + r64 * sdy + cols, mask=ok, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + r64 * G + grp)
        s = tl.sigmoid(z)
        silu = z * s
        yhat = x * silu * rstd  # 0 on the masked lanes, as are dy and g
        g = dy * w
        dh = rstd * (g - yhat * (tl.sum(g * yhat, axis=0) / N))
        dw += dy * yhat
        tl.store(DX + r64 * sdx + cols, (dh * silu).to(DX.dtype.element_ty), mask=ok)
        tl.store(DZ + r64 * sdz + cols, (dh * x * s * (1.0 + z * (1.0 - s))).to(DZ.dtype.element_ty), mask=ok)
        if WANT_Y:
            tl.store(Y + r64 * sy + cols, (yhat * w).to(Y.dtype.element_ty), mask=ok)
    tl.store(DW + pid.to(tl.int64) * D + cols, dw, mask=ok)


def _rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """t as [rows, width] with a contiguous last dim (a view where one exists)."""
    rows = t.reshape(-1, width)
    return rows if rows.stride(-1) == 1 or width == 1 else rows.contiguous()


def _groups(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int | None) -> tuple[int, int]:
    """(D, group_size) after checking the shapes; group_size None means the whole row."""
    if x.shape != z.shape:
        raise ValueError(f"gated_rms_norm: x and z must have one shape, got {tuple(x.shape)} and {tuple(z.shape)}")
    if x.dim() == 0:
        raise ValueError("gated_rms_norm: x must have a last dim of channels, got a scalar")
    D = x.shape[-1]
    if tuple(weight.shape) != (D,):
        raise ValueError(f"gated_rms_norm: weight must be [D] = [{D}], got {tuple(weight.shape)}")
    group_size = D if group_size is None else int(group_size)
    if group_size < 1 or D % group_size:
        raise ValueError(f"gated_rms_norm: group_size must divide D = {D} (got {group_size})")
    if group_size > MAX_GROUP_SIZE:
        raise ValueError(f"gated_rms_norm: group_size up to {MAX_GROUP_SIZE} (one group is one tile in registers), "
                         f"got {group_size}")
    return D, group_size


def _vector(weight: torch.Tensor) -> torch.Tensor:
    return weight if weight.stride(0) == 1 else weight.contiguous()


def _tile(group_size: int) -> tuple[int, int]:
    """(BLOCK_N, warps) for a group of `group_size` channels."""
    block_n = triton.next_power_of_2(group_size)
    return block_n, max(1, min(MAX_WARPS, block_n // (32 * ELEMENTS_PER_THREAD)))


def _rows_per_program(rows: int, groups: int, programs: int) -> int:
    return max(1, triton.cdiv(rows, max(1, programs // groups)))


def _out(t: torch.Tensor | None, rows: int, D: int, dtype: torch.dtype, device, name: str) -> torch.Tensor:
    """A preallocated output, checked ([rows, D], contiguous last dim), or a new contiguous one."""
    if t is None:
        return torch.empty(rows, D, dtype=dtype, device=device)
    if tuple(t.shape) != (rows, D):
        raise ValueError(f"gated_rms_norm_bwd: {name} must be [rows, D] = [{rows}, {D}], got {tuple(t.shape)}")
    if t.stride(-1) != 1 and D > 1:
        raise ValueError(f"gated_rms_norm_bwd: {name} must have a contiguous last dim, got strides {t.stride()}")
    return t


def gated_rms_norm_fwd(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int | None, eps: float,
                       out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [rows, D] contiguous in `out_dtype` (x's by default), rstd [rows, G] fp32) for x, z [..., D]
    (rows of any stride) and weight [D]."""
    D, group_size = _groups(x, z, weight, group_size)
    G = D // group_size
    xr, zr = _rows(x, D), _rows(z, D)
    rows = xr.shape[0]
    y = torch.empty(rows, D, dtype=out_dtype or x.dtype, device=x.device)
    rstd = torch.empty(rows, G, dtype=torch.float32, device=x.device)
    if y.numel():
        block_n, warps = _tile(group_size)
        per = _rows_per_program(rows, G, FWD_PROGRAMS)
        _fwd_kernel[(triton.cdiv(rows, per), G)](
            xr, zr, _vector(weight), y, rstd, rows, per, xr.stride(0), zr.stride(0), y.stride(0), group_size, G, float(eps),
            BLOCK_N=block_n, num_warps=warps,
        )
    return y, rstd


def gated_rms_norm_bwd(dy: torch.Tensor, x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                       group_size: int | None, dx_out: torch.Tensor | None = None, dz_out: torch.Tensor | None = None,
                       want_y: bool = False):
    """(dx, dz, dweight, y or None) for the forward's inputs x, z [..., D] and its rstd [rows, G].
    dx and dz are [rows, D]: `dx_out` / `dz_out` when given (any row stride; written in place, in
    their dtype), else new contiguous tensors in x's / z's dtype. dweight is in weight's dtype. With
    `want_y`, also the forward's output y [rows, D] in dy's dtype, recomputed in the same pass."""
    D, group_size = _groups(x, z, weight, group_size)
    G = D // group_size
    xr, zr = _rows(x, D), _rows(z, D)
    rows = xr.shape[0]
    if dy.numel() != xr.numel() or dy.shape[-1] != D:
        raise ValueError(f"gated_rms_norm_bwd: dy must be [rows, D] = [{rows}, {D}], got {tuple(dy.shape)}")
    if tuple(rstd.shape) != (rows, G) or rstd.dtype != torch.float32:
        raise ValueError(f"gated_rms_norm_bwd: rstd must be fp32 [rows, G] = [{rows}, {G}], got {rstd.dtype} {tuple(rstd.shape)}")
    dyr = _rows(dy, D)
    rstd = rstd.contiguous()
    dx = _out(dx_out, rows, D, x.dtype, x.device, "dx_out")
    dz = _out(dz_out, rows, D, z.dtype, z.device, "dz_out")
    y = torch.empty(rows, D, dtype=dy.dtype, device=x.device) if want_y else None
    if not xr.numel():
        return dx, dz, torch.zeros_like(weight), y
    block_n, warps = _tile(group_size)
    per = _rows_per_program(rows, G, BWD_PROGRAMS)
    row_programs = triton.cdiv(rows, per)
    dw_parts = torch.empty(row_programs, D, dtype=torch.float32, device=x.device)
    y_arg = y if want_y else dx  # a placeholder pointer when y is not wanted
    _bwd_kernel[(row_programs, G)](
        xr, zr, _vector(weight), rstd, dyr, dx, dz, y_arg, dw_parts, rows, per,
        xr.stride(0), zr.stride(0), dyr.stride(0), dx.stride(0), dz.stride(0), y_arg.stride(0), group_size, D, G,
        WANT_Y=bool(want_y), BLOCK_N=block_n, num_warps=warps,
    )
    return dx, dz, dw_parts.sum(0).to(weight.dtype), y


class GatedRMSNorm(torch.autograd.Function):
    """rmsnorm(x * silu(z)) per group of `group_size` channels, times weight, keeping x, z, weight
    and the fp32 rstd (not the output) for the backward."""

    @staticmethod
    def forward(ctx, x, z, weight, group_size, eps):
        y, rstd = gated_rms_norm_fwd(x, z, weight, group_size, eps)
        ctx.save_for_backward(x, z, weight, rstd)
        ctx.group_size = group_size
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x, z, weight, rstd = ctx.saved_tensors
        dx, dz, dweight, _ = gated_rms_norm_bwd(dy, x, z, weight, rstd, ctx.group_size)
        return dx.view(x.shape), dz.view(z.shape), dweight, None, None


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int | None, eps: float) -> torch.Tensor:
    """rmsnorm(x * silu(z)) over groups of `group_size` channels (None: the whole row), times weight
    [D], for x, z [..., D]; [..., D] in x's dtype, differentiable in x, z and weight."""
    _groups(x, z, weight, group_size)
    return GatedRMSNorm.apply(x, z, weight, group_size, float(eps))
