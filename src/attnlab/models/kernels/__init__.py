"""Kernel dispatch: the pure-PyTorch reference everywhere, fla's Triton kernels on CUDA.

`config.kernels` chooses: "auto" uses fla's kernels for CUDA tensors when the `gpu` extra
(flash-linear-attention) is installed, and the reference otherwise; "torch" always uses the
reference; "fla" insists on fla and says why when it cannot. The reference is the oracle the
fast paths are tested against (tests/test_kernels_cuda.py).
"""

from __future__ import annotations

import functools
import importlib.util

import torch

KERNEL_CHOICES = ("auto", "torch", "fla")


@functools.cache
def fla_installed() -> bool:
    return importlib.util.find_spec("fla") is not None


def use_fla(choice: str, x: torch.Tensor) -> bool:
    """Whether this call should run fla's kernel."""
    if choice == "torch":
        return False
    if x.is_cuda and fla_installed():
        return True
    if choice == "fla":
        why = "the tensor is not on a CUDA device" if not x.is_cuda else "flash-linear-attention is not installed (pip install 'attnlab[gpu]')"
        raise RuntimeError(f"model.kernels is 'fla' but {why}; use kernels 'auto' to fall back to the PyTorch reference")
    return False


def gla_chunk(q, k, v, gk, scale, initial_state, output_final_state: bool):
    """fla's chunked GLA: [B, T, H, D] layout, fp32 state [B, H, K, V]."""
    from fla.ops.gla import chunk_gla

    return chunk_gla(q, k, v, g=gk, scale=scale, initial_state=initial_state, output_final_state=output_final_state)


def gla_recurrent(q, k, v, gk, scale, initial_state, output_final_state: bool):
    """fla's fused recurrent GLA (decoding and short prefills)."""
    from fla.ops.gla import fused_recurrent_gla

    return fused_recurrent_gla(q, k, v, gk=gk, scale=scale, initial_state=initial_state, output_final_state=output_final_state)


def rms_norm(x, weight, eps: float):
    from fla.modules.norm.layernorm import rms_norm as fla_rms_norm

    return fla_rms_norm(x, weight, None, eps=eps)


def rms_norm_swish_gate(x, gate, weight, eps: float):
    from fla.modules.norm.fused_norm_gate import rms_norm_gated

    return rms_norm_gated(x, gate, weight, None, activation="swish", eps=eps)


def swiglu(gate, up):
    from fla.modules.activations import swiglu as fla_swiglu

    return fla_swiglu(gate, up)


def swiglu_linear(gate, up, weight, bias):
    """down(swiglu(gate, up)) that keeps only gate and up for the backward (the product is recomputed)."""
    from fla.modules.activations import swiglu_linear as fla_swiglu_linear

    return fla_swiglu_linear(gate, up, weight, bias)


def cross_entropy(logits, labels, ignore_index: int = -100, reduction: str = "mean"):
    """Token cross-entropy over [N, V] logits without materialising fp32 copies."""
    from fla.modules import FusedCrossEntropyLoss

    return FusedCrossEntropyLoss(ignore_index=ignore_index, reduction=reduction)(logits, labels)
