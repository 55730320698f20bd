"""One GLA decoding step as one Triton kernel: the log forget gate (logsigmoid of the gate's
logits, scaled), the state update in place and the output, for every (batch row, head).

    g = logsigmoid(logits + bias) / normalizer          (fp32)
    S = diag(exp(g)) S + k^T v                          (S: fp32 [K, V], updated where it lies)
    o = (scale * q) S

The eager form takes five to seven kernels per layer (the gate's cast, logsigmoid and scaling,
the recurrence, and a copy of the new state into the decoding state's buffer); a decode step is
bound by its number of kernels, each too short to use the GPU's bandwidth. The PyTorch reference
is `attnlab.models.ops.gla.fused_recurrent_gla_step`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gla_step_kernel(q, k, v, logits, bias, keep, state, o, scale, inv_normalizer,
                     stride_q, stride_k, stride_v, stride_l,
                     H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     HAS_BIAS: tl.constexpr, HAS_KEEP: tl.constexpr):
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    b_q = tl.load(q + i_b * stride_q + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32) * scale
    b_k = tl.load(k + i_b * stride_k + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_x = tl.load(logits + i_b * stride_l + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    if HAS_BIAS:
        b_x += tl.load(bias + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    # logsigmoid(x) = min(x, 0) - log(1 + exp(-|x|)), without overflow for either sign
    b_g = (tl.minimum(b_x, 0.0) - tl.log(1.0 + tl.exp(-tl.abs(b_x)))) * inv_normalizer
    if HAS_KEEP:  # 0 for a padding position: no decay (its k and v are zero already)
        b_g = b_g * tl.load(keep + i_b).to(tl.float32)
    b_v = tl.load(v + i_b * stride_v + i_h * V + o_v, mask=m_v, other=0.0).to(tl.float32)
    p_s = state + i_bh.to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]
    m_s = m_k[:, None] & m_v[None, :]
    b_s = tl.load(p_s, mask=m_s, other=0.0)
    b_s = b_s * tl.exp(b_g)[:, None] + b_k[:, None] * b_v[None, :]
    tl.store(p_s, b_s, mask=m_s)
    b_o = tl.sum(b_s * b_q[:, None], axis=0)
    tl.store(o + i_bh * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)


def _rows(x: torch.Tensor, name: str) -> int:
    """The batch stride of a [B, H, D] tensor whose heads lie next to each other in a row."""
    if x.dim() != 3 or x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        raise ValueError(f"{name} must be [B, H, D] with each row's heads contiguous, got shape {tuple(x.shape)} strides {x.stride()}")
    return x.stride(0)


def gla_step_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, logits: torch.Tensor, state: torch.Tensor,
              normalizer: float, scale: float, bias: torch.Tensor | None = None, keep: torch.Tensor | None = None) -> torch.Tensor:
    """q, k, logits: [B, H, K]; v: [B, H, V]; state: fp32 [B, H, K, V], contiguous, advanced in
    place; bias: [H * K] or None; keep: [B] (1 for a token, 0 for padding) or None. Returns
    o [B, H, V] in q's dtype."""
    batch, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    if state.dtype != torch.float32 or not state.is_contiguous() or state.shape != (batch, heads, key_dim, value_dim):
        raise ValueError(f"state must be a contiguous fp32 [{batch}, {heads}, {key_dim}, {value_dim}] tensor")
    o = torch.empty(batch, heads, value_dim, dtype=q.dtype, device=q.device)
    block_v = min(64, triton.next_power_of_2(value_dim))
    grid = (triton.cdiv(value_dim, block_v), batch * heads)
    _gla_step_kernel[grid](
        q, k, v, logits, bias if bias is not None else logits, keep if keep is not None else logits, state, o, scale, 1.0 / normalizer,
        _rows(q, "q"), _rows(k, "k"), _rows(v, "v"), _rows(logits, "logits"),
        H=heads, K=key_dim, V=value_dim, BK=triton.next_power_of_2(key_dim), BV=block_v, HAS_BIAS=bias is not None,
        HAS_KEEP=keep is not None, num_warps=4,
    )
    return o
