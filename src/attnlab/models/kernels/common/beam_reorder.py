"""Beam search's reorder of a decoding state, in place, in one pass: row r becomes old row rows[r].

Beam search moves rows only among the beams of one prompt (rows [g K, (g + 1) K) for beams K), so a
program that owns a span of columns of one group of K rows can read every source row it needs
before it writes (one tile of its rows, read whole, then written): nothing else reads or writes
there. A row that keeps its own content (rows[r] == r) is neither read nor written; the PyTorch way
(`index_select` into a new tensor, then `copy_` back) reads and writes every row twice.

A buffer is seen as [outer, batch, ...] where, for each (outer, row), the `count` elements from
`start` on are contiguous: the decode stacks [layers, batch, ...] (outer: layers), or a KV buffer's
columns after the prompt (outer: heads of a [batch, heads, capacity, dim] buffer).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

BLOCK = 4096  # elements per program (over its rows): 16 KiB of an fp32 state


@triton.jit
def _reorder_kernel(X, ROWS, outer_stride, row_stride, start, count, K: tl.constexpr, KP: tl.constexpr,
                    BLOCK: tl.constexpr):
    i_c, i_g, i_o = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    beam = tl.arange(0, KP)
    dst = i_g * K + beam
    src = tl.load(ROWS + dst, mask=beam < K, other=0)
    offs = i_c * BLOCK + tl.arange(0, BLOCK)
    moved = ((beam < K) & (src != dst))[:, None] & (offs < count)[None, :]
    base = X + i_o.to(tl.int64) * outer_stride + start + offs[None, :]
    values = tl.load(base + src.to(tl.int64)[:, None] * row_stride, mask=moved)
    tl.debug_barrier()  # every source row of the program read before any of its rows is written
    tl.store(base + dst.to(tl.int64)[:, None] * row_stride, values, mask=moved)


def reorder_rows_(x: torch.Tensor, rows: torch.Tensor, group: int, *, row_dim: int, outer_dim: int | None = None,
                  start: int = 0, count: int | None = None) -> None:
    """x's rows along `row_dim` become its old rows `rows` (each index within its own group of `group`
    rows), in place, over the `count` elements from `start` on of each (outer index, row), which
    must be contiguous. `count` defaults to everything after the row and outer dims (then a
    contiguous block). CUDA tensors go through the kernel (CPU ones too under TRITON_INTERPRET=1),
    other CPU tensors through index_select."""
    batch = x.shape[row_dim]
    if tuple(rows.shape) != (batch,) or group < 1 or batch % group:
        raise ValueError(f"rows must be [{batch}] in groups of {group}, got {tuple(rows.shape)}")
    last = max(row_dim, outer_dim if outer_dim is not None else -1)
    if count is None:
        tail = x[(0,) * (last + 1)]
        if not tail.is_contiguous():
            raise ValueError("the dims after the row and outer dims must be contiguous")
        count = tail.numel()
    outer = x.shape[outer_dim] if outer_dim is not None else 1
    outer_stride = x.stride(outer_dim) if outer_dim is not None else 0
    if count == 0 or batch == 0 or outer == 0:
        return
    if not (x.is_cuda or os.environ.get("TRITON_INTERPRET", "0") == "1"):
        view = x.as_strided((outer, batch, count), (outer_stride, x.stride(row_dim), 1), x.storage_offset() + start)
        view.copy_(view.index_select(1, rows.to(x.device)))
        return
    if x.dtype == torch.bool:
        x = x.view(torch.uint8)
    beams = triton.next_power_of_2(group)
    block = max(16, BLOCK // beams)
    grid = (triton.cdiv(count, block), batch // group, outer)
    _reorder_kernel[grid](x, rows.to(device=x.device, dtype=torch.int64).contiguous(), outer_stride, x.stride(row_dim),
                          start, count, K=group, KP=beams, BLOCK=block, num_warps=4)
