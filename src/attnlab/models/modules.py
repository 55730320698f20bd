"""Small building blocks shared by the model and the mixers."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from attnlab.models import kernels


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim, computed in fp32."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, kernels: str = "auto"):
        super().__init__()
        self.eps = eps
        self.kernels = kernels
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.use_fla(self.kernels, x):
            return kernels.rms_norm(x, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)


class GatedRMSNorm(RMSNorm):
    """RMSNorm of `x` multiplied by swish(`gate`), as fla's `FusedRMSNormGated`."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if kernels.use_fla(self.kernels, x):
            return kernels.rms_norm_swish_gate(x, gate, self.weight, self.eps)
        normed = RMSNorm.forward(self, x.float())
        return (normed * F.silu(gate.float())).to(gate.dtype)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int, kernels: str = "auto"):
        super().__init__()
        self.kernels = kernels
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if kernels.use_fla(self.kernels, x):
            if type(self.down_proj) is nn.Linear:  # not when an adapter (LoRA) wraps down_proj
                return kernels.swiglu_linear(gate, up, self.down_proj.weight, self.down_proj.bias)
            return self.down_proj(kernels.swiglu(gate, up))
        return self.down_proj(F.silu(gate) * up)
