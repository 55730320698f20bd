"""attnlab's kernels beside torch.compile.

Where the training step is not captured as CUDA graphs and `train.compile` is on, the trainer compiles each block with
torch.compile (`AttnLabForCausalLM.compile_blocks`): Inductor fuses the glue around the mixer (norms, residual adds, rotary,
gates, SwiGLU's activation) into kernels launched from generated code, and the backward has one autograd node per
compiled part (on an H100 the backward's host time fell by a quarter to a half, the forward's did not:
benchmarks/NOTES.md, "The eager step with its blocks compiled"). The mixers' own kernels (attnlab's and fla's Triton kernels, with autograd functions of their own)
are not traced: each entry point is marked `outside_compile`, so torch.compile runs it as it is, between the block's
compiled parts. The glue's own fused kernels (the norms, SwiGLU) step aside while compiling (`compiling()`): there the
PyTorch reference is what Inductor fuses.
"""

from __future__ import annotations

import torch


def outside_compile(fn):
    """`fn` runs as written under torch.compile (a break in the compiled graph), unchanged otherwise."""
    return torch.compiler.disable(fn, recursive=True)


def compiling() -> bool:
    """Whether torch.compile is tracing this call."""
    return torch.compiler.is_compiling()
