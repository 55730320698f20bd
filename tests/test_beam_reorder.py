"""Beam search's in-place reorder (`kernels/common/beam_reorder.py`) against index_select: through Triton's
interpreter on CPU, compiled on CUDA, and through the static runner's beam search."""

import pytest
import torch

from attnlab.models.kernels.common.beam_reorder import reorder_rows_

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def beam_rows(groups: int, beams: int, generator: torch.Generator) -> torch.Tensor:
    """Each row's source within its own group, as beam search picks them (repeats, keeps, swaps)."""
    return torch.cat([g * beams + torch.randint(0, beams, (beams,), generator=generator) for g in range(groups)])


@pytest.mark.parametrize("beams", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_reorder_equals_index_select_for_stacks_column_tails_and_head_major_buffers(beams, dtype):
    g = torch.Generator().manual_seed(beams)
    batch = 3 * beams
    rows = beam_rows(3, beams, g)

    def fill(*shape):
        x = torch.randn(*shape, generator=g) * 100
        return x > 0 if dtype == torch.bool else x.to(dtype)

    stack = fill(2, batch, 7, 5)  # [layers, batch, ...]
    expected = stack.index_select(1, rows)
    reorder_rows_(stack, rows, beams, row_dim=1, outer_dim=0)
    assert torch.equal(stack, expected)

    kv = fill(2, batch, 9, 4)  # [layers, batch, columns, dim]: only the columns after a prefix of 3 move
    expected = kv.clone()
    expected[:, :, 3:] = kv[:, :, 3:].index_select(1, rows)
    reorder_rows_(kv, rows, beams, row_dim=1, outer_dim=0, start=3 * 4, count=6 * 4)
    assert torch.equal(kv, expected)

    heads = fill(batch, 3, 10, 4)  # [batch, heads, capacity, dim]: columns 2..6 move
    expected = heads.clone()
    expected[:, :, 2:7] = heads[:, :, 2:7].index_select(0, rows)
    reorder_rows_(heads, rows, beams, row_dim=0, outer_dim=1, start=2 * 4, count=5 * 4)
    assert torch.equal(heads, expected)


def test_rows_that_keep_their_content_are_not_written_and_bad_rows_are_refused():
    x = torch.arange(24.0).reshape(1, 4, 6)
    reorder_rows_(x, torch.tensor([0, 1, 2, 3]), 2, row_dim=1, outer_dim=0)  # nothing moves
    assert torch.equal(x, torch.arange(24.0).reshape(1, 4, 6))
    reorder_rows_(x, torch.tensor([1, 1, 3, 2]), 2, row_dim=1, outer_dim=0)
    assert torch.equal(x[0, :, 0], torch.tensor([6.0, 6.0, 18.0, 12.0]))
    with pytest.raises(ValueError, match="groups of 3"):
        reorder_rows_(x, torch.tensor([0, 1, 2, 3]), 3, row_dim=1, outer_dim=0)
    with pytest.raises(ValueError, match=r"rows must be \[4\]"):
        reorder_rows_(x, torch.tensor([0, 1]), 2, row_dim=1, outer_dim=0)


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reorder_on_cuda_equals_index_select_at_a_decoding_state_size(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    stack = torch.randn(4, 32, 16, 2080, 64, device="cuda", generator=g).to(dtype)  # 4 layers of 2mamba's packed state, 8 x 4 beams
    rows = beam_rows(8, 4, torch.Generator().manual_seed(1)).cuda()
    expected = stack.index_select(1, rows)
    reorder_rows_(stack, rows, 4, row_dim=1, outer_dim=0)
    assert torch.equal(stack, expected)


def test_without_the_interpreter_cpu_tensors_reorder_through_index_select(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # a CPU machine's own path: no kernel
    g = torch.Generator().manual_seed(5)
    rows = beam_rows(2, 3, g)
    heads = torch.randn(6, 2, 8, 4, generator=g)
    expected = heads.clone()
    expected[:, :, 1:5] = heads[:, :, 1:5].index_select(0, rows)
    reorder_rows_(heads, rows, 3, row_dim=0, outer_dim=1, start=1 * 4, count=4 * 4)
    assert torch.equal(heads, expected)
    stack = torch.randn(3, 6, 5, generator=g)
    expected = stack.index_select(1, rows)
    reorder_rows_(stack, rows, 3, row_dim=1, outer_dim=0)
    assert torch.equal(stack, expected)
