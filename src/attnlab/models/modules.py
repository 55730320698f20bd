"""Small building blocks shared by the model and the mixers."""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F

from attnlab.models import kernels
from attnlab.models.kernels.common.norm import add_rms_norm, rms_norm, rms_norm_swish_gate
from attnlab.models.kernels.eager import compiling


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim, computed in fp32."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, kernels: str = "auto"):
        super().__init__()
        self.eps = eps
        self.kernels = kernels
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def fused(self, x: torch.Tensor) -> bool:
        """Whether this call runs fla's fused norm kernel: not while torch.compile traces the block (the reference is
        what Inductor fuses there)."""
        return not compiling() and kernels.use_fla(self.kernels, x)

    def normed_fp32(self, x: torch.Tensor) -> torch.Tensor:
        """The PyTorch reference: weight * x / rms(x), in fp32."""
        x32 = x.float()
        return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused(x):
            return rms_norm(x, self.weight, self.eps)
        return self.normed_fp32(x).to(x.dtype)


def slow_start_bias(n: int) -> torch.Tensor:
    """n biases b with softplus(b) = dt, dt log-uniform in [1e-3, 0.1]: Mamba-2's init of its dt, which starts a
    decay -softplus(W x + b) slow (the inverse softplus of dt)."""
    dt = torch.exp(torch.rand(n) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).clamp(min=1e-4)
    return dt + torch.log(-torch.expm1(-dt))


def output_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the next matrix product computes in: autocast's when it is on, else the input's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class PreNorm(RMSNorm):
    """The RMSNorm in front of a residual branch, with the residual add fused in.

    `norm(x)` returns the normed stream; `norm(x, residual)` adds first and returns
    (normed, residual + x): the sum stays in the residual's dtype (fp32 under autocast) and only the
    normed copy is cast. Under autocast the normed output is already in autocast's dtype, so the
    branch's input projections (q, k, v, gates; MLP gate and up) share one saved copy for the
    backward instead of each casting and keeping its own."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        dtype = output_dtype(x if residual is None else residual)
        if self.fused(x):
            return add_rms_norm(x, residual, self.weight, self.eps, dtype)
        summed = x if residual is None else residual + x
        normed = self.normed_fp32(summed).to(dtype)
        return normed if residual is None else (normed, summed)


class GatedRMSNorm(RMSNorm):
    """RMSNorm of `x` multiplied by swish(`gate`), as fla's `FusedRMSNormGated`."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if self.fused(x):
            return rms_norm_swish_gate(x, gate, self.weight, self.eps)
        return (self.normed_fp32(x) * F.silu(gate.float())).to(gate.dtype)


class FusedProjections:
    """A module whose input projections (plain, bias-free `nn.Linear`s reading the same input)
    can run as fewer, larger matrix products. While decoding, the runner stacks their weights once
    per `generate` call (`fuse_projections`) and sets `fused_weight` for its forward passes
    (`fused_projections`): a one-token step then reads the weights in one batched product per run
    of equally wide projections instead of one small product each (each bound by its launch rather
    than by memory bandwidth), and every output is a contiguous [.., width] tensor as the kernels
    downstream want. Training, and any module with a wrapped projection (a LoRA adapter), keeps
    the separate products."""

    fused_weight: list[torch.Tensor] | None = None  # one [G, width, in] stack per run of equal widths

    def projection_group(self) -> list[nn.Module]:
        raise NotImplementedError

    def fusion_weights(self) -> list[torch.Tensor] | None:
        """The [width, in] weights to stack, in the order `project` returns their products while
        fused; None when a projection is not a plain bias-free `nn.Linear` (an adapter wraps it)."""
        group = self.projection_group()
        if not all(type(linear) is nn.Linear and linear.bias is None for linear in group):
            return None
        return [linear.weight for linear in group]

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.fused_weight is None:
            return tuple(linear(x) for linear in self.projection_group())
        flat = x.reshape(-1, x.shape[-1])
        outs: list[torch.Tensor] = []
        for stack in self.fused_weight:
            if stack.shape[0] == 1:
                outs.append(F.linear(x, stack[0]))
            else:
                product = torch.matmul(flat, stack.transpose(1, 2))  # [G, rows, width]: each slice contiguous
                outs.extend(p.view(*x.shape[:-1], stack.shape[1]) for p in product)
        return tuple(outs)


def fuse_projections(model: nn.Module) -> list[tuple[nn.Module, list[torch.Tensor]]]:
    """(module, stacked weights) for every `FusedProjections` module of `model` whose group is all
    plain bias-free `nn.Linear`s of one dtype and device; consecutive projections of equal width
    share a stack. The stacks are copies, made once per call."""
    pairs = []
    with torch.no_grad():
        for module in model.modules():
            if not isinstance(module, FusedProjections):
                continue
            weights = module.fusion_weights()
            if weights is None:
                continue
            if len({(w.dtype, w.device) for w in weights}) != 1:
                continue
            runs: list[list[torch.Tensor]] = []
            for w in weights:
                if runs and runs[-1][0].shape == w.shape:
                    runs[-1].append(w)
                else:
                    runs.append([w])
            pairs.append((module, [torch.stack(run) for run in runs]))
    return pairs


@contextmanager
def fused_projections(pairs: list[tuple[nn.Module, list[torch.Tensor]]]):
    """Forward passes inside use the stacked weights of `fuse_projections`; outside, the modules' own."""
    for module, weight in pairs:
        module.fused_weight = weight
    try:
        yield
    finally:
        for module, _ in pairs:
            module.fused_weight = None


class SwiGLU(FusedProjections, nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int, kernels: str = "auto"):
        super().__init__()
        self.kernels = kernels
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def projection_group(self) -> list[nn.Module]:
        return [self.gate_proj, self.up_proj]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.project(x)
        if not compiling() and kernels.use_triton(self.kernels, x):  # attnlab's elementwise kernels (`kernels/common/swiglu.py`)
            from attnlab.models.kernels.common.swiglu import swiglu, swiglu_linear

            if type(self.down_proj) is nn.Linear:  # not when an adapter (LoRA) wraps down_proj
                return swiglu_linear(gate, up, self.down_proj.weight, self.down_proj.bias)
            return self.down_proj(swiglu(gate, up))
        return self.down_proj(F.silu(gate) * up)
