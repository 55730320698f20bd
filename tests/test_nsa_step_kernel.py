"""The NSA decoding step's Triton kernel (kernels/nsa/step.py) against `nsa_step`, the PyTorch
reference, on the static cache's buffers: through Triton's interpreter on CPU (tiny shapes), and
in bf16 on CUDA at a realistic shape."""

import pytest
import torch

from attnlab.models.ops.nsa import mean_pool_blocks, nsa_step


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def static_buffers(batch, heads, kv_heads, dim, block_size, capacity, lengths, dtype=torch.float32, device="cpu", seed=0):
    """Left-aligned keys and values in buffers of `capacity` columns (zeros after each row's
    tokens), their compressed blocks (mean of each complete block, zeros after), a query and gates."""
    g = torch.Generator(device=device).manual_seed(seed)
    k = torch.randn(batch, capacity, kv_heads, dim, generator=g, device=device)
    v = torch.randn(batch, capacity, kv_heads, dim, generator=g, device=device)
    pos = torch.tensor(lengths, device=device)
    written = torch.arange(capacity, device=device)[None, :] <= pos[:, None]  # the step's token is in
    k, v = k * written[..., None, None], v * written[..., None, None]
    blocks = -(-capacity // block_size)
    k_cmp, v_cmp = torch.zeros(batch, blocks, kv_heads, dim, device=device), torch.zeros(batch, blocks, kv_heads, dim, device=device)
    k_cmp[:, : capacity // block_size] = mean_pool_blocks(k, block_size)
    v_cmp[:, : capacity // block_size] = mean_pool_blocks(v, block_size)
    q = torch.randn(batch, heads, dim, generator=g, device=device) * 2  # sharper compressed attention
    gates = torch.rand(batch, heads, 3, generator=g, device=device).unbind(-1)  # strided, as the mixer's
    cast = [x.to(dtype) for x in (q, k, v, k_cmp, v_cmp)]
    return (*cast, *gates, pos)


def check_against_reference(args, **options):
    from attnlab.models.kernels.nsa.step import nsa_step_kernel

    o, idx = nsa_step_kernel(*args[:8], q_pos=args[8], **options)
    o_ref, idx_ref = nsa_step(*args[:8], q_pos=args[8], **options)
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-5)
    assert idx.shape == idx_ref.shape
    for row, row_ref in zip(idx.flatten(0, 1).tolist(), idx_ref.flatten(0, 1).tolist()):
        assert sorted(row) == sorted(row_ref)  # topk's order among equal scores is not defined
    return idx


BRANCH = dict(block_size=4, block_counts=3, window_size=6)


@pytest.mark.parametrize("kv_heads, groups, dim", [(1, 1, 8), (2, 2, 16), (1, 2, 12)])
def test_nsa_step_kernel_matches_the_reference_at_positions_around_block_boundaries(kv_heads, groups, dim):
    # positions: inside the first block, at its last token, the first of the next one, mid-way,
    # at the end of a block, and the buffer's last column
    for lengths, capacity in (([1, 3], 32), ([4, 13], 32), ([15, 31], 32), ([0, 47], 48)):
        args = static_buffers(2, kv_heads * groups, kv_heads, dim, 4, capacity, lengths, seed=sum(lengths) + dim)
        check_against_reference(args, **BRANCH)


def test_nsa_step_kernel_orders_forced_blocks_first_then_by_importance():
    args = static_buffers(2, 2, 1, 8, 4, 48, [29, 40], seed=3)
    idx = check_against_reference(args, block_size=4, block_counts=5, window_size=6, initial_blocks=1, local_blocks=2)
    # position 29: own block 7; forced 0, 6, 7; position 40: own block 10; forced 0, 9, 10
    assert idx[0, 0, :3].tolist() == [0, 6, 7] and idx[1, 0, :3].tolist() == [0, 9, 10]


@pytest.mark.parametrize("initial_blocks, local_blocks", [(0, 1), (2, 0), (0, 0)])
def test_nsa_step_kernel_follows_the_forced_block_counts(initial_blocks, local_blocks):
    args = static_buffers(2, 2, 1, 8, 4, 32, [2, 22], seed=5)
    check_against_reference(args, **BRANCH, initial_blocks=initial_blocks, local_blocks=local_blocks)


def test_nsa_step_kernel_fills_unused_slots_and_padding_rows():
    """Fewer blocks than slots give -1; a padding row (q_pos -1) outputs 0 and selects nothing."""
    args = list(static_buffers(2, 2, 1, 8, 4, 32, [5, 0], seed=7))
    args[8] = torch.tensor([5, -1])
    idx = check_against_reference(args, block_size=4, block_counts=6, window_size=6)
    assert idx[1].eq(-1).all() and idx[0].eq(-1).sum() == 4  # row 0: blocks 0 and 1 only
    from attnlab.models.kernels.nsa.step import nsa_step_kernel

    o, _ = nsa_step_kernel(*args[:8], q_pos=args[8], block_size=4, block_counts=6, window_size=6)
    assert o[1].eq(0).all()


def test_nsa_step_kernel_walks_many_tiles_of_compressed_keys_and_importances(monkeypatch):
    """40 complete blocks: two tiles of compressed keys, three of importances (16 at a time)."""
    from attnlab.models.kernels.nsa import step as module

    monkeypatch.setattr(module, "SELECT_TILE", 16)
    args = static_buffers(2, 4, 2, 8, 4, 168, [163, 99], seed=11)
    check_against_reference(args, block_size=4, block_counts=8, window_size=6)
    args = list(args)
    args[3] = torch.zeros_like(args[3])  # equal importances in every tile
    _, idx = module.nsa_step_kernel(*args[:8], q_pos=args[8], block_size=4, block_counts=20, window_size=6)
    assert idx[0, 0].tolist() == [0, 39, 40, *range(1, 18)]  # the picks run on from the first tile into the second


def test_nsa_step_kernel_breaks_importance_ties_toward_the_lower_block():
    """Equal compressed keys give equal importances: the kernel takes the lowest blocks first."""
    args = list(static_buffers(1, 1, 1, 8, 4, 48, [43], seed=9))
    args[3] = torch.zeros_like(args[3])  # every compressed key the same: uniform importance
    from attnlab.models.kernels.nsa.step import nsa_step_kernel

    _, idx = nsa_step_kernel(*args[:8], q_pos=args[8], block_size=4, block_counts=5, window_size=6)
    assert idx[0, 0].tolist() == [0, 9, 10, 1, 2]  # forced 0, 9, 10; then 1 and 2 of the equal 1..8


@pytest.mark.parametrize("compression, num_kv_heads", [("mean", 1), ("mlp", 2)])
def test_static_step_through_the_kernel_decodes_as_through_the_reference(compression, num_kv_heads, monkeypatch):
    """The mixer's static step hands the kernel its buffers, rotated query and strided gates as it
    hands them to `nsa_step` (the kernel forced on CPU tensors, through the interpreter)."""
    import copy

    from attnlab.models import AttnLabConfig, kernels
    from attnlab.models.mixers.nsa import NativeSparseAttention

    torch.manual_seed(0)
    config = AttnLabConfig(vocab_size=259, hidden_size=32, num_layers=1, num_heads=4, mixer="nsa",
                           mixer_options=dict(block_size=4, block_counts=3, window_size=6, compression=compression,
                                              num_kv_heads=num_kv_heads))
    layer = NativeSparseAttention(config, 0).eval()
    x = torch.randn(2, 13, 32)
    mask = torch.ones(2, 13, dtype=torch.long)
    mask[1, :4] = 0  # a left-padded row: 9 tokens
    with torch.no_grad():
        _, cache = layer(x, attention_mask=mask, use_cache=True)
        reference, fused = layer.static_state(cache, 24), layer.static_state(copy.deepcopy(cache), 24)
        steps = torch.randn(2, 6, 32)
        for t in range(6):
            monkeypatch.setattr(kernels, "use_triton", lambda choice, x, covered=True: False)
            y_ref, _ = layer(steps[:, t:t + 1], cache=reference)
            monkeypatch.setattr(kernels, "use_triton", lambda choice, x, covered=True: covered and choice != "torch")
            y, _ = layer(steps[:, t:t + 1], cache=fused)
            torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-5)
    assert torch.equal(fused["length"], reference["length"])


def test_a_layer_the_step_kernel_does_not_cover_says_so_when_built():
    from attnlab.models import AttnLabConfig
    from attnlab.models.mixers.nsa import NativeSparseAttention

    config = AttnLabConfig(vocab_size=259, hidden_size=512, num_layers=1, num_heads=2, mixer="nsa")  # head dim 256
    with pytest.warns(UserWarning, match="decoding-step kernel does not cover head dims above 128"):
        layer = NativeSparseAttention(config, 0)
    assert layer.step_gap and not layer.kernel_gap
    quiet = AttnLabConfig(vocab_size=259, hidden_size=512, num_layers=1, num_heads=8, mixer="nsa")
    assert NativeSparseAttention(quiet, 0).step_gap is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kv_heads", [1, 4, 16])
def test_nsa_step_kernel_in_bf16_matches_the_fp32_reference_on_cuda(kv_heads):
    from attnlab.models.kernels.nsa.step import nsa_step_kernel

    capacity, lengths = 2304, [0, 15, 16, 100, 1023, 2047, 2100, 2303]
    args = static_buffers(8, 16, kv_heads, 64, 16, capacity, lengths, dtype=torch.bfloat16, device="cuda", seed=kv_heads)
    options = dict(block_size=16, block_counts=16, window_size=512)
    o, idx = nsa_step_kernel(*args[:8], q_pos=args[8], **options)
    reference = [x.float() for x in args[:5]] + list(args[5:8])
    o_ref, idx_ref = nsa_step(*reference, q_pos=args[8], **options)
    assert o.dtype == torch.bfloat16 and rel_err(o, o_ref) < 2e-2
    same = [set(a) == set(b) for a, b in zip(idx.flatten(0, 1).tolist(), idx_ref.flatten(0, 1).tolist())]
    assert sum(same) >= 0.9 * len(same)  # bf16 scores may swap blocks of nearly equal importance


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_static_step_on_cuda_in_bf16_matches_the_reference_step(monkeypatch):
    """A bf16 layer of the benchmarked shape (hidden 1024, 16 heads, blocks of 16) steps over its
    static cache through the kernel as through `nsa_step`, across a block boundary."""
    import copy

    from attnlab.models import AttnLabConfig, kernels
    from attnlab.models.mixers.nsa import NativeSparseAttention

    torch.manual_seed(0)
    config = AttnLabConfig(vocab_size=259, hidden_size=1024, num_layers=1, num_heads=16, mixer="nsa",
                           mixer_options=dict(block_size=16, block_counts=16, window_size=64, num_kv_heads=4))
    layer = NativeSparseAttention(config, 0).cuda().bfloat16().eval()
    x = torch.randn(4, 300, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        _, cache = layer(x, use_cache=True)
        fused, reference = layer.static_state(cache, 512), layer.static_state(copy.deepcopy(cache), 512)
        for t in range(6):  # positions 300..305: the block [288, 304) completes at 303
            step = torch.randn(4, 1, 1024, device="cuda", dtype=torch.bfloat16)
            y, _ = layer(step, cache=fused)
            monkeypatch.setattr(kernels, "use_triton", lambda choice, x, covered=True: False)
            y_ref, _ = layer(step, cache=reference)
            monkeypatch.undo()
            assert rel_err(y, y_ref.float()) < 2e-2
