"""References in plain PyTorch of the pieces several families share: the causal depthwise convolution and the
gated RMSNorm. They are the oracles of `attnlab.models.kernels.common` (`conv`, `gated_norm`), computed in fp32."""

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
