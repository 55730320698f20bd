"""What attnlab's own Triton kernels cover: a layer beyond these sizes runs the PyTorch reference (its mixer
says why once, when it is built)."""

from __future__ import annotations

ATTENTION_FAMILY_MAX_HEAD_DIM = 256  # the tiled kernels hold a block of queries and keys with their head dims in registers


def attention_family_gap(head_dim: int) -> str | None:
    """None when attnlab's attention-family kernels cover a layer with this head dim, else what they do not cover."""
    if head_dim > ATTENTION_FAMILY_MAX_HEAD_DIM:
        return f"head dims above {ATTENTION_FAMILY_MAX_HEAD_DIM} (this model has {head_dim})"
    return None


CONV_MAX_KERNEL_SIZE = 8  # as kernels/common/conv.py: its backward unrolls one dweight sum per tap, up to 8


def causal_conv1d_gap(kernel_size: int) -> str | None:
    """None when attnlab's causal conv kernel covers this kernel size, else what it does not cover."""
    if not 2 <= kernel_size <= CONV_MAX_KERNEL_SIZE:
        return f"the conv kernel size {kernel_size} (it takes 2 to {CONV_MAX_KERNEL_SIZE})"
    return None


NSA_MAX_HEAD_DIM = 256  # the NSA kernels hold a tile of queries and keys with their head dims in registers
NSA_MAX_BLOCK_SIZE = 256  # a selected block is one tile of keys
NSA_MAX_GROUP = 128  # a selected-branch program holds the group's query heads as rows


def nsa_gap(head_dim: int, block_size: int, groups: int) -> str | None:
    """None when attnlab's NSA kernels cover a layer with these sizes, else what they do not cover."""
    for name, value, most in (("head dims", head_dim, NSA_MAX_HEAD_DIM), ("block sizes", block_size, NSA_MAX_BLOCK_SIZE),
                              ("query heads per kv head", groups, NSA_MAX_GROUP)):
        if value > most:
            return f"{name} above {most} (this model has {value})"
    return None


NSA_STEP_MAX_HEAD_DIM = 128  # kernels/nsa/step.py: the group's rows, a tile of keys and three fp32 outputs in registers
NSA_STEP_MAX_BLOCK_SIZE = 64  # a selected block is one tile of keys
NSA_STEP_MAX_GROUP = 64  # the group's query heads are the rows of every tile


def nsa_step_gap(head_dim: int, block_size: int, groups: int) -> str | None:
    """None when attnlab's NSA decoding-step kernel covers a layer with these sizes, else what it does not cover."""
    for name, value, most in (("head dims", head_dim, NSA_STEP_MAX_HEAD_DIM), ("block sizes", block_size, NSA_STEP_MAX_BLOCK_SIZE),
                              ("query heads per kv head", groups, NSA_STEP_MAX_GROUP)):
        if value > most:
            return f"{name} above {most} (this model has {value})"
    return None
