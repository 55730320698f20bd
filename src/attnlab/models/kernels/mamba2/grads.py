"""The elementwise part of the SSD's backward on CUDA as one Triton kernel.

Around the chunked GLA, Mamba-2's SSD takes v = x * dt in and adds y = o + x * D out; given the
gradients dv (from the GLA's backward) and dy (of y), for every (token, head) row of P channels:

    dx  = dv * dt + dy * D_h          in x's dtype
    ddt = sum_p dv * x                fp32, one per row (the gate's share is added by the caller)
    dD  = sum_p dy * x                fp32, one per row (summed over rows per head by the caller)

In PyTorch these are about ten passes over [B, T, H, P] fp32 temporaries; here one pass reads
dv, dy and x and writes dx. The PyTorch form is `attnlab.models.ops.mamba2.ssd_skip_grads`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _ssd_skip_grads_kernel(dv, dy, x, dt, D, dx, ddt, dD, M, T,
                           sx_b, sx_t, sx_h, sx_p,
                           H: tl.constexpr, P: tl.constexpr, BM: tl.constexpr, BP: tl.constexpr, HAS_D: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)  # row = (b * T + t) * H + h
    cols = tl.arange(0, BP)
    m_rows, m_cols = rows < M, cols < P
    mask = m_rows[:, None] & m_cols[None, :]
    i_h = rows % H
    i_t = (rows // H) % T
    i_b = rows // (H * T)
    dense = rows[:, None] * P + cols[None, :]  # dv, dy and dx are contiguous [B, T, H, P]
    p_x = x + (i_b * sx_b + i_t * sx_t + i_h * sx_h)[:, None] + cols[None, :] * sx_p
    b_x = tl.load(p_x, mask=mask, other=0.0).to(tl.float32)
    b_dv = tl.load(dv + dense, mask=mask, other=0.0).to(tl.float32)
    b_dt = tl.load(dt + rows, mask=m_rows, other=0.0).to(tl.float32)
    b_dx = b_dv * b_dt[:, None]
    tl.store(ddt + rows, tl.sum(b_dv * b_x, axis=1), mask=m_rows)
    if HAS_D:
        b_dy = tl.load(dy + dense, mask=mask, other=0.0).to(tl.float32)
        b_D = tl.load(D + i_h, mask=m_rows, other=0.0).to(tl.float32)
        b_dx += b_dy * b_D[:, None]
        tl.store(dD + rows, tl.sum(b_dy * b_x, axis=1), mask=m_rows)
    tl.store(dx + dense, b_dx.to(dx.dtype.element_ty), mask=mask)


def ssd_skip_grads(dv: torch.Tensor, dy: torch.Tensor | None, x: torch.Tensor, dt: torch.Tensor, D: torch.Tensor | None):
    """dv, dy: [B, T, H, P] (made contiguous); x: [B, T, H, P], any strides; dt: [B, T, H]; D: [H]
    or None (then dy is not read). Returns (dx [B, T, H, P] in x's dtype, ddt fp32 [B, T, H],
    dD fp32 [B, T, H] per row, or None without D)."""
    batch, seq_len, heads, head_dim = x.shape
    rows = batch * seq_len * heads
    dv = dv.contiguous()
    dy = dv if dy is None or D is None else dy.contiguous()
    dt = dt.float().contiguous()
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    ddt = torch.empty(batch, seq_len, heads, dtype=torch.float32, device=x.device)
    dD = torch.empty_like(ddt) if D is not None else ddt  # not written without D
    block_p = triton.next_power_of_2(head_dim)
    block_m = max(1, min(64, 4096 // block_p))
    _ssd_skip_grads_kernel[(triton.cdiv(rows, block_m),)](
        dv, dy, x, dt, D if D is not None else dt, dx, ddt, dD, rows, seq_len, *x.stride(),
        H=heads, P=head_dim, BM=block_m, BP=block_p, HAS_D=D is not None, num_warps=4,
    )
    return dx, ddt, (dD if D is not None else None)
