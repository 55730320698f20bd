"""attnlab's kernels beside torch.compile.

Where the training step is not captured as CUDA graphs, the trainer compiles each block with torch.compile
(`train.compile`, `AttnLabForCausalLM.compile_blocks`): Inductor fuses the glue around the mixer (norms, residual adds,
gates, SwiGLU's activation) into kernels launched from generated code, and the backward has one autograd node per
compiled part. The mixers' own kernels meet torch.compile in one of two ways, chosen where each entry point is marked:

- `outside_compile(traced=True)`: torch.compile traces the entry point, its autograd function and its Triton kernels,
  and Inductor launches those kernels itself from the block's one graph (a launch through its static launcher costs the
  host a fraction of one through Triton's `JITFunction.run`). An entry point is marked so only once the compiled block
  has been checked against the eager one on the GPU, loss and every gradient (`benchmarks/traced_blocks.py`,
  tests/test_compile_blocks.py): the attention family's tiled kernels and its mixing (`_mix_kv`, `_mix_recurrent`),
  the causal convolution, Mamba-2's layer core. A mixer whose training forward then traces whole says so
  (`Mixer.compiles_whole`, `Mixer.compiles_whole_at` for a given length), and `train.compile`'s "auto" compiles its
  blocks, in one process as one graph.
- `outside_compile`: torch.compile runs the entry point as it is, a break between the block's compiled parts (fla's
  kernels, which carry fla's own `torch.compiler.disable`, NSA's kernels, the attention family's chunked form).

The glue's own fused kernels (the norms, SwiGLU, rotary) step aside while compiling (`compiling()`): there the PyTorch
reference is what Inductor fuses.
"""

from __future__ import annotations

import functools

import torch


def outside_compile(fn=None, *, traced: bool = False):
    """Mark a kernel entry point: under torch.compile it runs as written (a break in the compiled graph) or, with
    `traced`, is traced into the graph (`fn` itself, unchanged); unchanged outside torch.compile either way. Use as
    `@outside_compile` or `@outside_compile(traced=True)`."""
    if fn is None:
        return functools.partial(outside_compile, traced=traced)
    return fn if traced else torch.compiler.disable(fn, recursive=True)


def compiling() -> bool:
    """Whether torch.compile is tracing this call."""
    return torch.compiler.is_compiling()
