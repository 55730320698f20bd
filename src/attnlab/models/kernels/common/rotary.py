"""Rotary positions on q and k, with an elementwise feature map after them, as one Triton kernel each way (training
and prefill; a decoding step has its own, `kernels/softmax/decode.py`).

In PyTorch (`ops.common.apply_rotary` and `ops.attention_family.apply_feature_map`) the rotation of q and k and
their backward make 55 aten calls (61 with elu + 1; counted on CPU with a dispatch mode, views included), most of them
a pass over q or k; here the forward reads each element once and writes it once, and so does the backward. For token t of a row, head h and channel i < D/2, with the
angle a = position[t] * inv_freq[i] in fp32 (the non-interleaved "rotate half" convention of `apply_rotary`):

    r_i       = x_i cos a - x_{i+D/2} sin a
    r_{i+D/2} = x_{i+D/2} cos a + x_i sin a
    y = phi(r rounded to x's dtype)        as `apply_rotary` returns r, and the feature map then reads it

phi is `none`, `relu` or `elu1` (elu + 1). The backward needs no input: phi's derivative follows from y (relu: y > 0;
elu1: 1 where y >= 1, else y, which is exp(r) there), and the rotation's transpose gives

    g = dy * phi'(y)
    dx_i = g_i cos a + g_{i+D/2} sin a,    dx_{i+D/2} = g_{i+D/2} cos a - g_i sin a

so the outputs are all it keeps (the mixing keeps them as its own inputs anyway). Other feature maps (`silu`, the l2
norms) are applied by the caller after a rotation with phi = none.

Design. The work is elementwise and bound by memory. A program owns BLOCK_T consecutive tokens of one head of q or
of k (program_id 1 counts q's heads, then k's, so one launch does both, whatever their head counts); its tile is
[BLOCK_T, D/2] for each half of the head, the angles formed once per tile with libdevice's accurate cos and sin (the
positions reach 65,536 and beyond, where an approximate sine is far off). Rows may be strided (q and k are views of
one projection's output); the last dim must be contiguous. Offsets are int64.

Under TRITON_INTERPRET=1 the same kernel runs on CPU tensors (slowly): the tests use that in CI.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from attnlab.models.ops.attention_family import apply_feature_map
from attnlab.models.ops.common import rotary_inv_freq

FEATURE_MAPS = ("none", "relu", "elu1")  # the feature maps the kernel applies itself
_PHI = {name: code for code, name in enumerate(FEATURE_MAPS)}
BLOCK_T = 16  # tokens per program: a [16, 32] tile per half at head dim 64, 4 bf16 elements a thread at 2 warps


@triton.jit
def _rotary_kernel(IN_A, OUT_A, KEPT_A, sab, sat, sah, heads_a, IN_B, OUT_B, KEPT_B, sbb, sbt, sbh, heads_b,
                   POS, spb, spt, INV_FREQ, seq_len, rows,
                   HALF: tl.constexpr, BH: tl.constexpr, BT: tl.constexpr, PHI: tl.constexpr, BACKWARD: tl.constexpr,
                   LIBDEVICE: tl.constexpr):
    """BT tokens (program_id 0) of one head (program_id 1: q's heads, then k's). Forward: IN the inputs, OUT the
    outputs. Backward: IN the outputs' gradient, KEPT the outputs, OUT the inputs' gradient. OUT and KEPT are
    contiguous [B, T, heads, D]; IN is strided by (b, t, h)."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    row = i_t.to(tl.int64) * BT + tl.arange(0, BT)  # [BT] flattened (batch, token)
    ok_r = row < rows
    b, t = row // seq_len, row % seq_len
    o_d = tl.arange(0, BH)
    ok_d = o_d < HALF
    ok = ok_r[:, None] & ok_d[None, :]
    pos = tl.load(POS + b * spb + t * spt, mask=ok_r, other=0).to(tl.float32)
    angle = pos[:, None] * tl.load(INV_FREQ + o_d, mask=ok_d, other=0.0)[None, :]
    if LIBDEVICE:  # compiled: libdevice's accurate cos and sin (Triton's interpreter has no libdevice; numpy's are accurate)
        cos, sin = libdevice.cos(angle), libdevice.sin(angle)
    else:
        cos, sin = tl.cos(angle), tl.sin(angle)
    if i_h < heads_a:
        h = i_h.to(tl.int64)
        p_in = IN_A + (b * sab + t * sat + h * sah)[:, None] + o_d[None, :]
        at = (row * heads_a + h) * (2 * HALF)
        p_out = OUT_A + at[:, None] + o_d[None, :]
        p_kept = KEPT_A + at[:, None] + o_d[None, :]
    else:
        h = (i_h - heads_a).to(tl.int64)
        p_in = IN_B + (b * sbb + t * sbt + h * sbh)[:, None] + o_d[None, :]
        at = (row * heads_b + h) * (2 * HALF)
        p_out = OUT_B + at[:, None] + o_d[None, :]
        p_kept = KEPT_B + at[:, None] + o_d[None, :]
    x1 = tl.load(p_in, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(p_in + HALF, mask=ok, other=0.0).to(tl.float32)
    if not BACKWARD:
        r1 = (x1 * cos - x2 * sin).to(OUT_A.dtype.element_ty).to(tl.float32)  # rounded as apply_rotary returns it
        r2 = (x2 * cos + x1 * sin).to(OUT_A.dtype.element_ty).to(tl.float32)
        if PHI == 1:  # relu
            r1, r2 = tl.maximum(r1, 0.0), tl.maximum(r2, 0.0)
        elif PHI == 2:  # elu + 1
            r1 = tl.where(r1 > 0, r1 + 1.0, tl.exp(tl.minimum(r1, 0.0)))
            r2 = tl.where(r2 > 0, r2 + 1.0, tl.exp(tl.minimum(r2, 0.0)))
        tl.store(p_out, r1.to(OUT_A.dtype.element_ty), mask=ok)
        tl.store(p_out + HALF, r2.to(OUT_A.dtype.element_ty), mask=ok)
    else:
        if PHI == 1:
            y1 = tl.load(p_kept, mask=ok, other=0.0).to(tl.float32)
            y2 = tl.load(p_kept + HALF, mask=ok, other=0.0).to(tl.float32)
            x1, x2 = tl.where(y1 > 0, x1, 0.0), tl.where(y2 > 0, x2, 0.0)
        elif PHI == 2:
            y1 = tl.load(p_kept, mask=ok, other=0.0).to(tl.float32)
            y2 = tl.load(p_kept + HALF, mask=ok, other=0.0).to(tl.float32)
            x1, x2 = tl.where(y1 >= 1.0, x1, x1 * y1), tl.where(y2 >= 1.0, x2, x2 * y2)
        tl.store(p_out, (x1 * cos + x2 * sin).to(OUT_A.dtype.element_ty), mask=ok)
        tl.store(p_out + HALF, (x2 * cos - x1 * sin).to(OUT_A.dtype.element_ty), mask=ok)


_INV_FREQ: dict[tuple, torch.Tensor] = {}


def _inv_freq(head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """`ops.common.rotary_inv_freq`, kept per device (a training step would otherwise launch its arange and power)."""
    key = (head_dim, float(theta), device)
    if key not in _INV_FREQ:
        _INV_FREQ[key] = rotary_inv_freq(head_dim, theta, device)
    return _INV_FREQ[key]


def _launch(a, b, out_a, out_b, kept_a, kept_b, positions, inv_freq, phi: int, backward: bool) -> None:
    batch, seq_len, heads_a, head_dim = a.shape
    rows = batch * seq_len
    half = head_dim // 2
    grid = (triton.cdiv(rows, BLOCK_T), heads_a + b.shape[2])
    _rotary_kernel[grid](
        a, out_a, kept_a, a.stride(0), a.stride(1), a.stride(2), heads_a,
        b, out_b, kept_b, b.stride(0), b.stride(1), b.stride(2), b.shape[2],
        positions, positions.stride(0), positions.stride(1), inv_freq, seq_len, rows,
        HALF=half, BH=triton.next_power_of_2(half), BT=BLOCK_T, PHI=phi, BACKWARD=backward,
        LIBDEVICE=a.is_cuda, num_warps=2,
    )


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, positions, inv_freq, phi):
        q, k = _last_dim_contiguous(q), _last_dim_contiguous(k)
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        _launch(q, k, q_out, k_out, q_out, k_out, positions, inv_freq, phi, False)
        ctx.phi = phi
        ctx.save_for_backward(q_out if phi else None, k_out if phi else None, positions, inv_freq)
        return q_out, k_out

    @staticmethod
    def backward(ctx, dq_out, dk_out):
        q_out, k_out, positions, inv_freq = ctx.saved_tensors
        dq_out, dk_out = _last_dim_contiguous(dq_out), _last_dim_contiguous(dk_out)
        dq = torch.empty(dq_out.shape, dtype=dq_out.dtype, device=dq_out.device)
        dk = torch.empty(dk_out.shape, dtype=dk_out.dtype, device=dk_out.device)
        kept_q = dq if q_out is None else q_out  # not read without a feature map
        kept_k = dk if k_out is None else k_out
        _launch(dq_out, dk_out, dq, dk, kept_q, kept_k, positions, inv_freq, ctx.phi, True)
        return dq, dk, None, None, None


def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, theta: float,
           feature_map: str = "none") -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, T, H, D] and k [B, T, Hk, D] (one dtype; the last dim contiguous or made so) rotated at integer
    `positions` [B, T] with base `theta`, then through `feature_map` (one of FEATURE_MAPS), with their gradients.
    Returns new contiguous tensors in the inputs' dtype: `apply_rotary` then `apply_feature_map`, in one launch."""
    if feature_map not in _PHI:
        raise ValueError(f"the rotary kernel applies the feature maps {FEATURE_MAPS}, not {feature_map!r}")
    head_dim = q.shape[-1]
    if head_dim % 2 or k.shape[-1] != head_dim or q.dtype != k.dtype or q.shape[:2] != k.shape[:2]:
        raise ValueError(f"the rotary kernel needs q and k of one even head dim, dtype and [B, T]; got {tuple(q.shape)} "
                         f"{q.dtype} and {tuple(k.shape)} {k.dtype}")
    if tuple(positions.shape) != tuple(q.shape[:2]):
        raise ValueError(f"positions {tuple(positions.shape)} do not match q's [B, T] {tuple(q.shape[:2])}")
    return _Rotary.apply(q, k, positions, _inv_freq(head_dim, theta, q.device), _PHI[feature_map])


def rotary_feature_map(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, theta: float,
                       feature_map: str = "none") -> tuple[torch.Tensor, torch.Tensor]:
    """`rotary` for any of the attention family's feature maps: those the kernel applies in the same launch, the
    others (`silu`, the l2 norms) in PyTorch on its rotated output."""
    if feature_map in _PHI:
        return rotary(q, k, positions, theta, feature_map)
    q, k = rotary(q, k, positions, theta)
    return apply_feature_map(q, feature_map), apply_feature_map(k, feature_map)
