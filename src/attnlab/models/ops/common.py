"""References in plain PyTorch of the pieces several families share: the causal depthwise convolution, the
gated RMSNorm and rotary positions. They are the oracles of `attnlab.models.kernels.common` (`conv`, `gated_norm`,
`rotary`), computed in fp32."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, initial_state: torch.Tensor,
                  silu: bool) -> torch.Tensor:
    """The causal depthwise convolution of x [B, T, C] after the inputs before it, initial_state [B, K - 1, C]
    (which enters in x's dtype), with weight [C, K] and bias [C] or None, then SiLU when `silu`: [B, T, C] fp32."""
    C = x.shape[2]
    padded = torch.cat((initial_state.to(x.dtype).float(), x.float()), dim=1)  # [B, width + T, C]
    out = F.conv1d(padded.transpose(1, 2), weight.float()[:, None], None if bias is None else bias.float(), groups=C)
    out = out.transpose(1, 2)  # [B, T, C]
    return F.silu(out) if silu else out


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int | None, eps: float) -> torch.Tensor:
    """rmsnorm(x * silu(z)) over groups of `group_size` channels (None: the whole row), times weight [D], for
    x, z [..., D]: fp32 math, the result in x's dtype."""
    D = x.shape[-1]
    group_size = D if group_size is None else group_size
    if D % group_size:
        raise ValueError(f"gated_rms_norm: group_size must divide D = {D} (got {group_size})")
    h = x.float() * F.silu(z.float())
    grouped = h.view(*h.shape[:-1], D // group_size, group_size)
    normed = grouped * torch.rsqrt(grouped.square().mean(-1, keepdim=True) + eps)
    return (normed.view(h.shape) * weight.float()).to(x.dtype)


def rotary_inv_freq(head_dim: int, theta: float, device=None) -> torch.Tensor:
    """The rotary frequencies [head_dim / 2], fp32."""
    return theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [B, T, 1, head_dim] for integer positions [B, T]."""
    inv_freq = rotary_inv_freq(head_dim, theta, positions.device)
    angles = positions.float()[..., None] * inv_freq  # [B, T, head_dim / 2]
    angles = torch.cat((angles, angles), dim=-1)[:, :, None, :]  # [B, T, 1, head_dim]
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, T, H, D] by position (the non-interleaved "rotate half" convention)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated_half = torch.cat((-x2, x1), dim=-1)
    return (x.float() * cos + rotated_half * sin).to(x.dtype)
