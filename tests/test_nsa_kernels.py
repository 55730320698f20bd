"""attnlab's NSA Triton kernels (`attnlab.models.kernels.nsa.parallel.parallel_nsa`) against the PyTorch
reference (`attnlab.models.ops.nsa.parallel_nsa`): outputs, selected blocks and the gradients of
q, k, v, the compressed keys and values and the three gates. On CPU the kernels run through
Triton's interpreter on tiny shapes, in fp32; on CUDA in bf16 against the fp32 reference at the
benchmarked sizes, and the mixer end to end."""

import warnings

import pytest
import torch

from attnlab.models import AttnLabConfig, AttnLabForCausalLM
from attnlab.models.kernels import nsa_gap
from attnlab.models.kernels.nsa.parallel import parallel_nsa as fused_nsa
from attnlab.models.ops.nsa import mean_pool_blocks
from attnlab.models.ops.nsa import parallel_nsa as reference_nsa
from conftest import compiled_stack_trains_as_written, random_nsa_inputs

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
NAMES = ("q", "k", "v", "k_cmp", "v_cmp", "g_cmp", "g_slc", "g_swa")


def nsa_case(batch, seq_len, heads, kv_heads, dim, block_size, padding=0, keys=None, seed=0, device="cpu"):
    """Leaves (q, k, v, k_cmp, v_cmp, g_cmp, g_slc, g_swa) in fp32 and q_pos: `seq_len` queries at the
    end of `keys` left-aligned keys; the second row starts with `padding` padding queries (its keys,
    left-aligned, end earlier: the entries past them are unused)."""
    keys = keys or seq_len
    q, k, v, gates = random_nsa_inputs(batch, keys, heads, kv_heads, dim, seed=seed)
    q, gates = q[:, keys - seq_len:], [g[:, keys - seq_len:] for g in gates]
    q_pos = torch.arange(keys - seq_len, keys).repeat(batch, 1)
    if padding:
        q_pos[1, :padding] = -1
        q_pos[1, padding:] = torch.arange(keys - seq_len, keys - padding)
    leaves = (q, k, v, mean_pool_blocks(k, block_size), mean_pool_blocks(v, block_size), *gates)
    return [x.to(device) for x in leaves], q_pos.to(device)


def run(fn, leaves, q_pos, do, dtype=torch.float32, **options):
    """Output, block indices and gradients of one NSA function on copies of `leaves` cast to `dtype`."""
    leaves = [x.clone().requires_grad_() for x in leaves]
    o, block_indices = fn(*(x.to(dtype) for x in leaves), q_pos=q_pos, **options)
    (o.float() * do).sum().backward()
    return o.float(), block_indices, [x.grad for x in leaves]


def same_blocks(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[B, T, Hkv]: whether two block selections hold the same blocks (in any slot order: the
    forced blocks tie at +inf and may come out of top-k in either order)."""
    return (a.sort(-1).values == b.sort(-1).values).all(-1)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


# (batch, queries, heads, kv heads, dim, block size, block_counts, window, padding queries, keys)
CPU_CASES = {
    "group-1": (2, 48, 2, 2, 16, 8, 3, 6, 0, None),
    "group-2-padded": (2, 36, 4, 2, 16, 8, 4, 10, 7, None),
    "group-3-padded-block-16": (2, 45, 3, 1, 32, 16, 3, 20, 5, None),
    "group-16": (2, 34, 16, 1, 16, 8, 4, 12, 0, None),
    "prefill-after-a-cache-padded": (2, 24, 4, 2, 16, 8, 4, 10, 4, 64),
}


@pytest.mark.parametrize("case", list(CPU_CASES))
def test_nsa_kernels_match_the_reference_outputs_selection_and_gradients(case, monkeypatch):
    monkeypatch.setattr("attnlab.models.kernels.nsa.parallel.SELECT_CHUNK_ELEMENTS", 200)  # selection over several chunks
    batch, seq_len, heads, kv_heads, dim, block_size, block_counts, window, padding, keys = CPU_CASES[case]
    leaves, q_pos = nsa_case(batch, seq_len, heads, kv_heads, dim, block_size, padding, keys, seed=seq_len)
    options = dict(block_size=block_size, block_counts=block_counts, window_size=window)
    do = torch.randn(batch, seq_len, heads, dim, generator=torch.Generator().manual_seed(1))
    o, idx, grads = run(fused_nsa, leaves, q_pos, do, **options)
    ref_o, ref_idx, ref_grads = run(reference_nsa, leaves, q_pos, do, **options)
    assert same_blocks(idx, ref_idx).all()
    torch.testing.assert_close(o, ref_o, rtol=1e-4, atol=1e-5)
    if padding:
        assert o[1, :padding].abs().max() == 0, "padding queries output 0"
    for name, grad, ref_grad in zip(NAMES, grads, ref_grads):
        torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=2e-5, msg=lambda m: f"d{name}: {m}")


def test_nsa_kernels_give_zero_output_and_gradient_before_the_first_complete_block():
    leaves, q_pos = nsa_case(1, 6, 2, 1, 16, 8)  # no complete block: the compressed branch sees nothing
    options = dict(block_size=8, block_counts=3, window_size=4)
    do = torch.randn(1, 6, 2, 16, generator=torch.Generator().manual_seed(2))
    o, idx, grads = run(fused_nsa, leaves, q_pos, do, **options)
    ref_o, ref_idx, ref_grads = run(reference_nsa, leaves, q_pos, do, **options)
    assert same_blocks(idx, ref_idx).all()
    torch.testing.assert_close(o, ref_o, rtol=1e-4, atol=1e-5)
    assert grads[5].abs().max() == 0, "the compressed gate has nothing to scale"
    for name, grad, ref_grad in zip(NAMES, grads, ref_grads):
        torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=2e-5, msg=lambda m: f"d{name}: {m}")


def test_the_parallel_form_is_a_custom_op_pair_that_passes_torchs_checks():
    """Forward and backward are torch custom ops (`attnlab::nsa_parallel_fwd` / `_bwd`): their schemas, fake forms
    (the shapes a compiled graph plans with) and autograd registration pass `torch.library.opcheck`."""
    from attnlab.models.kernels.nsa.parallel import _nsa_bwd, _nsa_fwd

    leaves, q_pos = nsa_case(2, 20, 4, 2, 16, 8, padding=3, seed=5)
    options = (8 ** -0.5, 8, 3, 6, 1, 1)  # scale, block_size, block_counts, window_size, initial_blocks, local_blocks
    args = (*(x.clone().requires_grad_() for x in leaves), q_pos, *options)
    torch.library.opcheck(_nsa_fwd, args)
    outputs = _nsa_fwd(*(x.detach() for x in leaves), q_pos, *options)
    do = torch.randn(2, 20, 4, 16, generator=torch.Generator().manual_seed(3))
    torch.library.opcheck(_nsa_bwd, (*leaves, q_pos, *outputs[1:], do, options[0], options[1], options[3]))


def test_the_parallel_form_compiles_into_one_graph_with_the_values_and_gradients_it_has_eagerly():
    """Under torch.compile the op pair is an opaque call in one graph (fullgraph, glue on both sides, as in an NSA
    block): the kernels run as they run eagerly, outputs and gradients equal."""
    from attnlab.models.kernels.nsa.parallel import _nsa_fwd

    torch._dynamo.reset()
    leaves, q_pos = nsa_case(2, 24, 4, 2, 16, 8, seed=7)
    weight = torch.randn(16, 16, generator=torch.Generator().manual_seed(4))

    def step(q, k, v, k_cmp, v_cmp, g_cmp, g_slc, g_swa):
        o, block_indices, *_ = _nsa_fwd((q @ weight).tanh(), k, v, k_cmp, v_cmp, g_cmp.sigmoid(), g_slc, g_swa, q_pos,
                                        0.25, 8, 3, 10, 1, 1)
        return (o * o).sum() + block_indices.float().sum() * 0, block_indices

    compiled = torch.compile(step, fullgraph=True)
    results = []
    for fn in (step, compiled):
        inputs = [x.clone().requires_grad_() for x in leaves]
        loss, block_indices = fn(*inputs)
        loss.backward()
        results.append((loss.detach(), block_indices, [x.grad for x in inputs]))
    (want, want_idx, want_grads), (got, got_idx, got_grads) = results
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(got_idx, want_idx)
    for name, grad, want_grad in zip(NAMES, got_grads, want_grads):
        torch.testing.assert_close(grad, want_grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"d{name}: {m}")
    torch._dynamo.reset()


def test_an_nsa_model_on_the_op_pair_compiled_as_one_graph_trains_as_it_does_eagerly(monkeypatch):
    """The blocks of an NSA model on the kernels, their entry point traced (the mark that keeps it a break lifted, as
    `compiles_whole` would have it): the stack compiles to one graph with no break, the op pair opaque in it, and the
    loss and every gradient equal the model as written on the same kernels."""
    from attnlab.models import kernels

    monkeypatch.setattr(kernels, "nsa_parallel", lambda choice, x, covered=True: fused_nsa.__wrapped__)
    config = AttnLabConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, mixer="nsa", tie_word_embeddings=False,
                           mixer_options={"block_size": 8, "block_counts": 3, "window_size": 16})
    torch._dynamo.reset()
    compiled_stack_trains_as_written(config, torch.randint(0, 64, (2, 48), generator=torch.Generator().manual_seed(1)))
    torch._dynamo.reset()


def test_nsa_kernels_cover_the_usual_sizes_and_the_mixer_warns_once_when_they_do_not(monkeypatch):
    assert nsa_gap(64, 64, 16) is None and nsa_gap(128, 16, 3) is None
    assert "head dims" in nsa_gap(512, 64, 16)
    config = dict(vocab_size=64, hidden_size=64, num_layers=2, num_heads=4, mixer="nsa",
                  mixer_options={"block_size": 8, "block_counts": 4, "window_size": 6, "num_kv_heads": 2})
    monkeypatch.setattr("attnlab.models.kernels.limits.NSA_MAX_HEAD_DIM", 8)
    with pytest.warns(UserWarning, match="do not cover head dims above 8") as caught:
        AttnLabForCausalLM(AttnLabConfig(**config))
    assert len([w for w in caught if "nsa" in str(w.message)]) == 1, "one warning per model, not per layer"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        AttnLabForCausalLM(AttnLabConfig(**config, kernels="torch"))


# ---------------------------------------------------------------- CUDA: bf16 against the fp32 reference

# (heads, kv heads, block_counts, window, padding queries, keys)
CUDA_CASES = {
    "group-1": (4, 4, 16, 512, 0, None),
    "group-4-padded": (8, 2, 16, 512, 100, None),
    "group-16": (16, 1, 16, 512, 0, None),
    "group-16-padded": (16, 1, 16, 512, 333, None),
    "group-16-few-blocks-short-window": (16, 1, 4, 128, 0, None),
    "group-16-prefill-after-a-cache": (16, 1, 16, 512, 50, 1800),
    "group-3-few-blocks": (6, 2, 5, 200, 21, None),
}


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("case", list(CUDA_CASES))
def test_nsa_kernels_in_bf16_match_the_fp32_reference_on_cuda(case):
    heads, kv_heads, block_counts, window, padding, keys = CUDA_CASES[case]
    batch, seq_len, dim, block_size = 2, 1000, 64, 64
    leaves, q_pos = nsa_case(batch, seq_len, heads, kv_heads, dim, block_size, padding, keys, seed=heads, device="cuda")
    leaves = [x.bfloat16().float() for x in leaves]  # both sides select from the same scores
    options = dict(block_size=block_size, block_counts=block_counts, window_size=window)
    do = torch.randn(batch, seq_len, heads, dim, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    o, idx, grads = run(fused_nsa, leaves, q_pos, do, dtype=torch.bfloat16, **options)
    ref_o, ref_idx, ref_grads = run(reference_nsa, leaves, q_pos, do, **options)
    assert (~same_blocks(idx, ref_idx)).float().mean() < 1e-3  # near-ties may fall either way
    assert rel_err(o, ref_o) < 2e-2
    for name, grad, ref_grad in zip(NAMES, grads, ref_grads):
        assert grad.isfinite().all() and rel_err(grad, ref_grad) < 2e-2, name


def stats_case(batch, seq_len, heads, kv_heads, slots, cap, seed=0):
    """Gates (one head collapsed onto its window branch), positions with left padding in row 1, and
    selected blocks with unused slots (-1)."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.rand(batch, seq_len, heads, 3, generator=gen)
    g[:, :, 0] = torch.tensor([0.001, 0.002, 0.995])
    pos = torch.arange(seq_len).repeat(batch, 1)
    pos[1, :5] = -1
    idx = torch.randint(0, 50, (batch, seq_len, kv_heads, slots), generator=gen)
    idx[torch.rand(idx.shape, generator=gen) < 0.3] = -1
    idx[0, :7] = torch.arange(slots)  # some pairs at the cap
    return g, pos, idx, cap


@pytest.mark.parametrize("heads, kv_heads, slots, cap", [(4, 1, 5, 5), (6, 3, 4, 4), (16, 2, 16, 16)])
def test_the_statistics_kernels_match_the_pytorch_statistics(heads, kv_heads, slots, cap):
    from attnlab.models.kernels.nsa.stats import record_stats
    from attnlab.models.ops.nsa import stats_values

    g, pos, idx, cap = stats_case(2, 70, heads, kv_heads, slots, cap)
    expected, tokens = stats_values(g, idx, pos, cap)
    out = torch.full((8,), 7.0)
    record_stats(out, g, pos, idx, cap)
    assert tokens == 135
    assert torch.allclose(out, expected, rtol=1e-5, atol=1e-6), (out, expected)
    assert expected[2] == 1 / heads  # the collapsed head
    pos[:] = -1  # no real token: the previous values stay
    record_stats(out, g, pos, idx, cap)
    assert torch.allclose(out, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.cuda
@needs_cuda
def test_nsa_mixer_on_cuda_matches_the_reference_mixer_end_to_end():
    config = dict(vocab_size=256, hidden_size=256, num_layers=2, num_heads=8, mixer="nsa",
                  mixer_options={"block_size": 32, "block_counts": 4, "window_size": 64, "num_kv_heads": 2})
    torch.manual_seed(0)
    reference = AttnLabForCausalLM(AttnLabConfig(**config, kernels="torch")).cuda()
    fast = AttnLabForCausalLM(AttnLabConfig(**config, kernels="auto")).cuda()
    fast.load_state_dict(reference.state_dict())
    tokens = torch.randint(0, 256, (2, 300), device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    mask = torch.ones_like(tokens)
    mask[1, :37] = 0  # left padding
    outputs, stats = [], []
    for model in (reference, fast):
        model.enable_health_stats(True)  # the fast model's on the statistics kernels
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(tokens, attention_mask=mask, labels=tokens)
        out.loss.backward()
        outputs.append((out.logits.float(), {n: p.grad for n, p in model.named_parameters()}))
        stats.append(model.health_stats())
    (ref_logits, ref_grads), (logits, grads) = outputs
    assert stats[0].keys() == stats[1].keys() and len(stats[0]) == 9
    for key, value in stats[0].items():  # the selection may differ where bf16 scores tie
        assert abs(stats[1][key] - value) <= 1e-2 * max(1.0, abs(value)), key
    real = mask.bool()
    assert rel_err(logits[real], ref_logits[real]) < 2e-2
    for name, ref_grad in ref_grads.items():
        assert rel_err(grads[name], ref_grad) < 5e-2, name


def test_the_kernels_index_tables_are_the_sorted_searches_they_replace():
    """The query-tile ranges of each key tile and the ends of the (query, block) segments, computed by counting (so that
    torch.compile can trace them: torch.searchsorted's Inductor lowering does not compile on Triton 3.6), equal what
    torch.searchsorted gives."""
    from attnlab.models.kernels.nsa.parallel import _pairs_by_block, _query_tile_ranges

    gen = torch.Generator().manual_seed(0)
    for q_pos in (torch.arange(100).expand(3, -1),  # positions along the row
                  torch.arange(100).expand(3, -1) * torch.tensor([[1], [0], [1]]) + torch.tensor([[0], [5], [-1]]),
                  torch.randint(-1, 100, (3, 100), generator=gen)):  # any order, padding (-1) anywhere
        q_pos = torch.where(q_pos < 0, -1, q_pos)
        for block_m, key_tiles, block_n, kmul, koff, window in ((16, 7, 16, 1, 0, 32), (32, 4, 8, 16, 15, 1 << 30)):
            first, stop = _query_tile_ranges(q_pos, block_m, key_tiles, block_n, kmul, koff, window)
            tiles = -(-100 // block_m)
            pos = torch.nn.functional.pad(q_pos.long(), (0, tiles * block_m - 100), value=-1).view(3, tiles, block_m)
            latest = pos.max(-1).values.cummax(-1).values
            earliest = torch.where(pos >= 0, pos, 1 << 40).min(-1).values.flip(-1).cummin(-1).values.flip(-1)
            start = torch.arange(key_tiles) * block_n
            first_pos = (start * kmul + koff).expand(3, -1).contiguous()
            last_pos = ((start + block_n - 1) * kmul + koff).expand(3, -1).contiguous()
            assert torch.equal(first, torch.searchsorted(latest.contiguous(), first_pos, side="left").int())
            assert torch.equal(stop, torch.searchsorted(earliest.contiguous(), last_pos + window - 1, side="right").int())

    block_indices = torch.randint(-1, 9, (2, 50, 3, 4), generator=gen)
    seg, query, seg_end = _pairs_by_block(block_indices, num_blocks=9)
    assert torch.equal(seg_end, torch.searchsorted(seg.long(), torch.arange(2 * 3 * 10), side="right").int())
    assert torch.equal(seg, seg.sort().values) and seg_end[-1] == seg.numel()
