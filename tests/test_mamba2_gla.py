"""Mamba-2's SSD as a GLA (the mapping the CUDA path runs through fla's chunked GLA), checked on CPU
with attnlab's PyTorch GLA in place of fla's kernels: outputs, final state and every gradient."""

import pytest
import torch

from attnlab.models.kernels.mamba2.core import chunk_ssd_gla, ssd, ssd_as_gla, state_from_gla
from attnlab.models.ops.gla import ReferenceGLA
from attnlab.models.ops.gla import chunk_gla, naive_recurrent_gla
from attnlab.models.ops.mamba2 import chunk_ssd, naive_recurrent_ssd


def random_ssd_inputs(batch, seq_len, heads, head_dim, groups, state_size, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq_len, heads, head_dim, generator=gen, dtype=torch.float64)
    dt = torch.nn.functional.softplus(torch.randn(batch, seq_len, heads, generator=gen, dtype=torch.float64) - 1)
    A = -torch.rand(heads, generator=gen, dtype=torch.float64) * 4 - 0.5
    B = torch.randn(batch, seq_len, groups, state_size, generator=gen, dtype=torch.float64)
    C = torch.randn(batch, seq_len, groups, state_size, generator=gen, dtype=torch.float64)
    D = torch.randn(heads, generator=gen, dtype=torch.float64)
    state = torch.randn(batch, heads, head_dim, state_size, generator=gen, dtype=torch.float64)
    return x, dt, A, B, C, D, state


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


@pytest.mark.parametrize("seq_len", [1, 37, 70])
def test_gla_mapping_computes_the_ssd_with_groups_and_an_initial_state(seq_len):
    x, dt, A, B, C, _, state = (t.float() for t in random_ssd_inputs(2, seq_len, 4, 6, 2, 5, seed=seq_len))
    y_ref, state_ref = naive_recurrent_ssd(x, dt, A, B, C, initial_state=state)
    q, k, v, g, h0 = ssd_as_gla(x, dt, A, B, C, state)
    assert q.shape == k.shape == g.shape == (2, seq_len, 4, 5) and v.shape == x.shape and h0.shape == (2, 4, 5, 6)
    for gla in (naive_recurrent_gla, chunk_gla):
        o, final_state = gla(q, k, v, g, initial_state=h0, scale=1.0)
        assert rel_err(o, y_ref) < 1e-5
        assert rel_err(state_from_gla(final_state), state_ref) < 1e-5


def test_gla_mapping_reads_each_group_for_its_own_heads():
    x, dt, A, B, C, _, _ = (t.float() for t in random_ssd_inputs(1, 9, 6, 4, 3, 5, seed=3))
    q, k, _, _, _ = ssd_as_gla(x, dt, A, B, C)
    for head in range(6):
        assert torch.equal(q[:, :, head], C[:, :, head // 2]) and torch.equal(k[:, :, head], B[:, :, head // 2])


@pytest.mark.parametrize("seq_len, padded", [(33, False), (45, True)])
def test_chunk_ssd_through_gla_matches_the_reference_forward_and_backward(seq_len, padded):
    inputs = random_ssd_inputs(2, seq_len, 4, 6, 2, 5, seed=seq_len)
    if padded:  # left padding: dt = 0 there, so the state neither decays nor takes a write
        keep = torch.ones(2, seq_len, 1, dtype=torch.float64)
        keep[1, :7] = 0
        inputs = (inputs[0], inputs[1] * keep, *inputs[2:])
    leaves = [t.clone().requires_grad_() for t in inputs]
    ref_leaves = [t.clone().requires_grad_() for t in inputs]
    x, dt, A, B, C, D, state = leaves
    y, final_state = chunk_ssd_gla(x, dt, A, B, C, D, state, output_final_state=True, backend=ReferenceGLA)
    rx, rdt, rA, rB, rC, rD, rstate = ref_leaves
    y_ref, state_ref = chunk_ssd(rx, rdt, rA, rB, rC, chunk_size=16, initial_state=rstate)
    y_ref = y_ref + rx * rD[:, None]
    assert y.dtype == x.dtype and final_state.dtype == torch.float32
    assert rel_err(y, y_ref) < 1e-5 and rel_err(final_state, state_ref) < 1e-5
    gen = torch.Generator().manual_seed(0)
    dy = torch.randn(y_ref.shape, generator=gen, dtype=torch.float64)
    dstate = torch.randn(state_ref.shape, generator=gen, dtype=torch.float64)
    ((y * dy).sum() + (final_state * dstate).sum()).backward()
    ((y_ref * dy).sum() + (state_ref * dstate).sum()).backward()
    for name, fast, ref in zip(("x", "dt", "A", "B", "C", "D", "state"), leaves, ref_leaves):
        assert rel_err(fast.grad, ref.grad) < 1e-5, name


def test_chunk_ssd_through_gla_without_a_state_or_a_final_state():
    x, dt, A, B, C, D, _ = (t.requires_grad_() for t in random_ssd_inputs(1, 20, 2, 3, 1, 4, seed=5))
    y, final_state = chunk_ssd_gla(x, dt, A, B, C, D, backend=ReferenceGLA)
    y_ref, _ = naive_recurrent_ssd(x, dt, A, B, C)
    assert final_state is None and rel_err(y, y_ref + x * D[:, None]) < 1e-5
    y.sum().backward()
    assert all(t.grad is not None for t in (x, dt, A, B, C, D))


def test_ssd_dispatch_keeps_the_reference_on_cpu_for_every_choice():
    """Mamba-2's kernels (SSD, convolution, gated norm) are attnlab's own, compiled for CUDA: on CPU
    every choice runs the reference, `kernels: fla` included (nothing of fla's is needed)."""
    x, dt, A, B, C, D, state = (t.float() for t in random_ssd_inputs(1, 12, 2, 3, 1, 4))
    for choice in ("auto", "torch", "fla"):
        y, final_state = ssd(x, dt, A, B, C, D, 16, state, False, choice)
        y_ref, state_ref = chunk_ssd(x, dt, A, B, C, chunk_size=16, initial_state=state)
        assert torch.equal(y, y_ref + x * D[:, None]) and torch.equal(final_state, state_ref)
    from attnlab.models.kernels.mamba2.core import use_fast_ssd

    assert not any(use_fast_ssd(choice, x) for choice in ("auto", "torch", "fla"))


# ---------------------------------------------------------------- the mixer's fast path, wired on CPU


def reference_grouped_gated_rms_norm(x, z, weight, group_size, eps):
    """What fla's gated norm computes (rmsnorm(x * silu(z)) per group, times the weight), in x's dtype."""
    h = (x.float() * torch.nn.functional.silu(z.float())).unflatten(-1, (-1, group_size))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h.flatten(-2) * weight.float()).to(x.dtype)


@pytest.fixture
def fast_path_on_cpu(monkeypatch):
    """The mixer's CUDA path on CPU: the dispatch says yes; unpadded, the one-node path runs attnlab's kernels
    through Triton's interpreter; padded, the PyTorch GLA and norm stand in for the kernels."""
    import attnlab.models.kernels.mamba2.core as fast
    import attnlab.models.mixers.mamba2 as mixer

    monkeypatch.setattr(fast, "use_fla", lambda choice, x: choice != "torch")
    monkeypatch.setattr(mixer, "use_fast_ssd", lambda choice, x: choice != "torch")
    monkeypatch.setattr(fast.FlaGLA, "forward", ReferenceGLA.forward)
    monkeypatch.setattr(fast.FlaGLA, "backward", ReferenceGLA.backward)
    monkeypatch.setattr(mixer, "grouped_gated_rms_norm", reference_grouped_gated_rms_norm)
    monkeypatch.setattr(mixer, "gated_norm_linear", lambda x, z, norm_weight, weight, group_size, eps: torch.nn.functional.linear(
        reference_grouped_gated_rms_norm(x, z, norm_weight, group_size, eps), weight))


def mixer_pair(seed=0):
    from attnlab.models import MIXERS, AttnLabConfig

    torch.manual_seed(seed)
    cfg = dict(mixer="mamba2", hidden_size=32, num_heads=4, mixer_options={"state_size": 8, "n_groups": 2, "chunk_size": 16})
    fast = MIXERS["mamba2"](AttnLabConfig(kernels="auto", **cfg), 0)
    with torch.no_grad():
        fast.norm.weight.normal_(1.0, 0.2)
        fast.D.normal_(1.0, 0.5)
    ref = MIXERS["mamba2"](AttnLabConfig(kernels="torch", **cfg), 0)
    ref.load_state_dict(fast.state_dict())
    return fast, ref


@pytest.mark.parametrize("padded", [False, True])
def test_mixer_fast_path_wiring_matches_the_reference_outputs_and_gradients(fast_path_on_cpu, padded):
    fast, ref = mixer_pair()
    x = torch.randn(2, 37, 32, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 37, dtype=torch.long)
    if padded:
        mask[1, :9] = 0
    x_fast, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, cache = fast(x_fast, attention_mask=mask if padded else None, use_cache=True)
    ref_out, ref_cache = ref(x_ref, attention_mask=mask if padded else None, use_cache=True)
    assert rel_err(out, ref_out) < 1e-5
    assert rel_err(cache["recurrent_state"], ref_cache["recurrent_state"]) < 1e-5
    dy = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(2))
    (out * dy).sum().backward()
    (ref_out * dy).sum().backward()
    assert rel_err(x_fast.grad, x_ref.grad) < 1e-5
    ref_params = dict(ref.named_parameters())
    for name, p in fast.named_parameters():
        assert rel_err(p.grad, ref_params[name].grad) < 1e-5, name


def test_mixer_fast_path_prefill_after_a_cache_and_decoding_match_the_reference(fast_path_on_cpu):
    fast, ref = mixer_pair()
    x = torch.randn(2, 41, 32, generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 41, dtype=torch.long)
    mask[1, :5] = 0
    with torch.no_grad():
        ref_out, ref_cache = ref(x, attention_mask=mask, use_cache=True)
        first, cache = fast(x[:, :13], attention_mask=mask[:, :13], use_cache=True)
        second, cache = fast(x[:, 13:38], attention_mask=mask[:, :38], cache=cache, use_cache=True)
        steps = []
        for t in range(38, 41):
            step, cache = fast(x[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=cache, use_cache=True)
            steps.append(step)
    assert rel_err(torch.cat([first, second, *steps], dim=1), ref_out) < 1e-5
    assert rel_err(cache["recurrent_state"], ref_cache["recurrent_state"]) < 1e-5


# ---------------------------------------------------------------- the backward's elementwise kernel


@pytest.mark.parametrize("with_D", [True, False])
def test_skip_grads_kernel_matches_its_pytorch_form(with_D):
    from attnlab.models.ops.mamba2 import ssd_skip_grads as _skip_grads_torch
    from attnlab.models.kernels.mamba2.grads import ssd_skip_grads

    gen = torch.Generator().manual_seed(7)
    batch, seq_len, heads, head_dim = 2, 5, 3, 6  # head_dim not a power of two: masked columns
    # x as the convolution leaves it: time fastest, channels next ([B, channels, T] transposed)
    x = torch.randn(batch, heads * head_dim, seq_len, generator=gen).transpose(1, 2).unflatten(-1, (heads, head_dim))
    dv = torch.randn(batch, seq_len, heads, head_dim, generator=gen)
    dy = torch.randn(batch, seq_len, heads, head_dim, generator=gen)
    dt = torch.rand(batch, seq_len, heads, generator=gen)
    D = torch.randn(heads, generator=gen) if with_D else None
    got = ssd_skip_grads(dv, dy, x, dt, D)
    want = _skip_grads_torch(dv.clone(), dy, x, dt, D)
    for a, b in zip(got, want):
        if b is None:
            assert a is None
        else:
            assert a.dtype == b.dtype and torch.allclose(a, b, rtol=1e-5, atol=1e-5)
