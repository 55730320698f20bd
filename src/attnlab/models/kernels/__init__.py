"""Kernel dispatch: the pure-PyTorch reference everywhere, fla's and attnlab's Triton kernels on CUDA.

`config.kernels` chooses: "auto" uses fla's kernels for CUDA tensors when the `gpu` extra
(flash-linear-attention) is installed, and the reference otherwise; "torch" always uses the
reference; "fla" insists on fla and says why when it cannot. attnlab's own Triton kernels (the
attention family's quadratic form, the mixers' causal conv, SwiGLU's activation) follow the same choice. The reference is
the oracle the fast paths are tested against (tests/test_kernels_cuda.py, tests/test_conv_kernel.py).

This module holds the dispatch only; the kernels and their autograd wrappers sit per family (`attention_family/`,
`gla/`, `mamba2/`, `nsa/`, `softmax/`) and, where families share them, in `common/`.
"""

from __future__ import annotations

import importlib.util
import warnings

import torch

from attnlab.models.kernels.eager import compiling
from attnlab.models.kernels.limits import attention_family_gap, causal_conv1d_gap, nsa_gap, nsa_step_gap  # noqa: F401
from attnlab.models.ops import attention_family as attention_family_ops
from attnlab.models.ops import common as common_ops
from attnlab.models.ops import nsa as nsa_ops


# Looked up at import (a plain dict, which torch.compile reads as a constant): dynamo does not trace `find_spec`, so a
# lookup left to the first call broke the graph of a stack compiled before any eager step had made it, and the trainer's
# eager step fell back to compiling block by block
_INSTALLED: dict[str, bool] = {name: importlib.util.find_spec(name) is not None for name in ("fla", "triton")}


def fla_installed() -> bool:
    return _INSTALLED["fla"]


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


def triton_installed() -> bool:
    return _INSTALLED["triton"]


def use_triton(choice: str, x: torch.Tensor, covered: bool = True) -> bool:
    """Whether this call should run one of attnlab's own Triton kernels: a CUDA tensor, a layer the
    kernel covers (`covered`; the layer says why not when it is built), `choice` not "torch", and
    triton installed ("fla" insists on it and says so when it is missing)."""
    if choice == "torch" or not covered or not x.is_cuda:
        return False
    if not triton_installed():
        if choice == "fla":
            raise RuntimeError("model.kernels is 'fla' but triton is not installed (pip install 'attnlab[gpu]')")
        return False
    return True


def attention_family_terms(choice: str, x: torch.Tensor, covered: bool = True):
    """The attention family's `attention_terms` for this call: attnlab's Triton kernels for CUDA
    tensors (memory linear in the sequence length), else the PyTorch reference. `covered`: whether
    the kernels compute the layer's options (the layer says why not when it is built)."""
    if not use_triton(choice, x, covered):
        return attention_family_ops.attention_terms
    from attnlab.models.kernels.attention_family.parallel import attention_terms as fused

    return fused


# Sequence lengths from which a linearizable attention-family layer (power1, power2 without a clamp) trains and
# prefills chunked, in linear time (`kernels/attention_family/chunk.py`), instead of on the tiled quadratic kernels.
# Measured on an H100 (torch 2.11, Triton 3.6; gpu.sh stage chunk-crossover: one layer's mixing forward and backward,
# 16 heads of 64), chunked at its best chunk size over tiled:
#   power1  on the SSD kernels (`chunk.power1_on_ssd`; benchmarks/results/h100-chunk-crossover-power1-ssd.txt):
#           shape               16x1024  8x2048  4x4096  2x8192  1x16384  1x32768  1x65536
#           linear__output_norm    1.50    1.22    0.93    0.55     0.38     0.17     0.08
#           linear_elu             1.28    1.20    1.06    0.76     0.44     0.22     0.11
#           The whole 20-layer model at 4 x 4096 (`benchmarks/memory_peak.py`, captured): linear__output_norm tiled
#           164,171 tokens/s, chunked 185,120; linear_elu 120,147 and 119,555 (its sum denominator's normaliser is a
#           65th value column, which the kernels run as blocks of 64 and 1). From 8192 tokens both win.
#   power2  2mamba, its packed state on `power2_states`' kernels (the features in registers; chunks of 512), on an H200
#           (benchmarks/results/h200-chunk-crossover-power2-packed-bands.txt, and for 4x4096 to 1x16384 with the states
#           kept for the backward, h200-chunk-crossover-power2-kept-states-4-warps.txt):
#           shape               4x4096  2x8192  1x16384  1x32768  1x65536
#           2mamba                1.63    1.02     0.53     0.27     0.13
#           states kept           1.43    0.97     0.54
#           parts folded                  0.85     0.47    (h200-chunk-crossover-power2-folded.txt)
#           (the features formed in memory for cuBLAS, before them: 0.97 at 1 x 32768 and 0.48 at 1 x 65536 on an H100,
#           benchmarks/results/h100-chunk-power2-in-memory.txt). From 8192 tokens chunked wins: the paper's medium model
#           (hidden 1536, 27 layers, 24 heads) at 2 x 8192 trained at 42,949 tokens/s chunked against 41,499 tiled (H200,
#           `memory_peak.py`, benchmarks/results/h200-memory-medium-2x8192-tiled-chunked-llama.txt).
# Both pass the CUDA tests against the fp32 reference (tests/test_attention_family_chunk.py).
CHUNKED_MIN_TOKENS: dict[str, int] = {"power1": 8192, "power2": 8192}


def attention_family_chunked(choice: str, x: torch.Tensor, seq_len: int, similarity: str, prompt: bool = False):
    """attnlab's chunked, linear-time form of a linearizable attention-family layer (`chunk_attention` of
    `kernels/attention_family/chunk.py`) for a call of `seq_len` tokens on this tensor, or None: the
    quadratic form runs (the tiled kernels on CUDA, the reference elsewhere). Chosen on CUDA (as attnlab's
    other kernels) from `CHUNKED_MIN_TOKENS` tokens on, for every option of those layers. A `prompt` (a
    prefill that hands on its state) longer than the quadratic form's one chunk (`FUSED_FIRST_CHUNK`) takes it
    from there: the prefill's alternative is PyTorch's loop over chunks of features (for power2 at 1 x 16384, a
    20-layer model's prefill took 588 ms that way, against 199 ms chunked at 1 x 32768: H200,
    benchmarks/prefill_scaling.py)."""
    if similarity not in CHUNKED_MIN_TOKENS or not use_triton(choice, x):
        return None
    threshold = CHUNKED_MIN_TOKENS[similarity]
    if prompt:
        threshold = min(threshold, attention_family_ops.FUSED_FIRST_CHUNK + 1)
    if seq_len < threshold:
        return None
    from attnlab.models.kernels.attention_family.chunk import chunk_attention_recomputable

    return chunk_attention_recomputable


def attention_family_step_fn(choice: str, x: torch.Tensor):
    """attnlab's fused decoding step for linearizable attention-family layers (power1, power2
    without a clamp; `kernels/attention_family/step.py`: the state advanced in place) for this CUDA
    tensor, or None: the mixer runs the PyTorch reference `recurrent_step`. It covers every
    similarity, decay and denominator of those layers; float64 runs the reference (with a warning)."""
    if not use_triton(choice, x):
        return None
    if x.dtype == torch.float64:  # the kernel computes in fp32
        warnings.warn("attnlab's attention-family step kernel takes no float64: the step runs the PyTorch reference", stacklevel=3)
        return None
    from attnlab.models.kernels.attention_family.step import attention_family_step_

    return attention_family_step_


def attention_family_state_update_fn(choice: str, x: torch.Tensor):
    """attnlab's kernel for a linearizable attention-family layer's state after a prompt (power2's
    d^2 features formed in registers only; `kernels/attention_family/step.py`) for this CUDA tensor,
    or None: the prefill runs the PyTorch reference `linear_state_update`, a chunk of features at a time."""
    if not use_triton(choice, x) or x.dtype == torch.float64:
        return None
    from attnlab.models.kernels.attention_family.step import linear_state_update

    return linear_state_update


ROTARY_KERNEL = True  # False: PyTorch's rotary everywhere (benchmarks/memory_peak.py's `+torch-rotary` measures both)


def rotary_fn(choice: str, x: torch.Tensor):
    """attnlab's rotary kernel for this call (`kernels/common/rotary.py`: `rotary_feature_map`), or None: PyTorch's
    form runs. None as well under torch.compile, which fuses PyTorch's form itself, and for float64 (the kernel
    computes in fp32)."""
    if not ROTARY_KERNEL or not use_triton(choice, x) or compiling() or x.dtype == torch.float64:
        return None
    from attnlab.models.kernels.common.rotary import rotary_feature_map

    return rotary_feature_map


def rotate(choice: str, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, theta: float,
           feature_map: str = "none") -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, T, H, D] and k [B, T, Hk, D] rotated at `positions` [B, T] (rotate-half RoPE, base `theta`), then through
    the attention family's `feature_map`: on attnlab's rotary kernel where `rotary_fn` gives it (one launch each way,
    where PyTorch's form and its backward make 55 aten calls), else `ops.common.apply_rotary` and
    `ops.attention_family.apply_feature_map`."""
    kernel = rotary_fn(choice, x)
    if kernel is not None:
        return kernel(q, k, positions, theta, feature_map)
    cos, sin = common_ops.rotary_cos_sin(positions, q.shape[-1], theta)
    q, k = common_ops.apply_rotary(q, cos, sin), common_ops.apply_rotary(k, cos, sin)
    return attention_family_ops.apply_feature_map(q, feature_map), attention_family_ops.apply_feature_map(k, feature_map)


def causal_conv1d_fn(choice: str, x: torch.Tensor, covered: bool = True):
    """attnlab's causal depthwise conv kernel (`kernels/common/conv.py`: x [B, T, C], weight [C, K], bias,
    initial_state [B, K-1, C], silu -> y, final_state) for this CUDA tensor, or None: the mixer runs
    its PyTorch reference. `covered`: whether the kernel covers the layer's kernel size (the layer
    says why not when it is built)."""
    if not use_triton(choice, x, covered):
        return None
    if x.dtype == torch.float64:  # Triton's kernel accumulates in fp32
        warnings.warn("attnlab's conv kernel takes no float64: the convolution runs the PyTorch reference", stacklevel=3)
        return None
    from attnlab.models.kernels.common.conv import causal_conv1d

    return causal_conv1d


def nsa_parallel(choice: str, x: torch.Tensor, covered: bool = True):
    """NSA's training and prefill form for this call: attnlab's Triton kernels for CUDA tensors
    (memory linear in the sequence length), else the PyTorch reference. `covered`: whether the
    kernels compute the layer's options (the layer says why not when it is built)."""
    if not use_triton(choice, x, covered):
        return nsa_ops.parallel_nsa
    from attnlab.models.kernels.nsa.parallel import parallel_nsa as fused

    return fused


def nsa_step_fn(choice: str, x: torch.Tensor, covered: bool = True):
    """NSA's one-token decoding step over the static cache's buffers for this call: attnlab's Triton
    kernel (`kernels/nsa/step.py`, one launch) for CUDA tensors in bf16, fp16 or fp32, else the PyTorch
    reference `ops.nsa.nsa_step`. `covered`: whether the kernel covers the layer's sizes (the layer
    says why not when it is built)."""
    reference = nsa_ops.nsa_step
    if not use_triton(choice, x, covered):
        return reference
    if x.dtype == torch.float64:  # Triton's kernel accumulates in fp32
        warnings.warn("attnlab's NSA step kernel takes no float64: the step runs the PyTorch reference", stacklevel=3)
        return reference
    from attnlab.models.kernels.nsa.step import nsa_step_kernel

    return nsa_step_kernel
