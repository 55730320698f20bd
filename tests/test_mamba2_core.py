"""Mamba-2's layer between its projections as one autograd node (`kernels.mamba2.core.mamba2_core`) against the
mixer's PyTorch reference: outputs and every gradient, through Triton's interpreter on CPU (fp32) and
compiled on CUDA (bf16 autocast, where the mixer's training path takes it)."""

import pytest
import torch

from attnlab.models import MIXERS, AttnLabConfig
from attnlab.models.kernels.mamba2.core import mamba2_core

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def mixer(hidden: int, heads: int, state: int, groups: int, chunk: int, device="cpu"):
    torch.manual_seed(0)
    options = {"state_size": state, "n_groups": groups, "chunk_size": chunk}
    layer = MIXERS["mamba2"](AttnLabConfig(mixer="mamba2", hidden_size=hidden, num_heads=heads, mixer_options=options,
                                           kernels="torch"), 0).to(device)
    with torch.no_grad():  # norm weights and D away from their initial ones, so that every path matters
        layer.norm.weight.normal_(1.0, 0.2)
        layer.D.normal_(1.0, 0.5)
        layer.conv1d.bias.normal_(0.0, 0.2)
    return layer


def core(layer, x):
    dims = (layer.intermediate_size, layer.conv_dim, layer.num_heads, layer.head_dim, layer.n_groups, layer.ssm_state_size,
            layer.norm.group_size)
    return mamba2_core(layer.in_proj(x), layer.conv1d.weight[:, 0], layer.conv1d.bias, layer.dt_bias, layer.A_log, layer.D,
                       layer.norm.weight, layer.out_proj.weight, dims, layer.chunk_size, layer.norm.eps)


def grads(layer, x, out, dy):
    params = dict(layer.named_parameters())
    found = torch.autograd.grad(out, [x, *params.values()], dy)
    return dict(zip(["x", *params], found))


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "as-traced"])  # as-traced: the backward torch.compile traces
@pytest.mark.parametrize("seq_len,groups", [(37, 1), (16, 2)])  # a partial chunk; two groups of heads
def test_the_core_equals_the_mixers_reference_and_every_gradient(seq_len, groups, traced, monkeypatch):
    import attnlab.models.kernels.mamba2.core as core_module

    monkeypatch.setattr(core_module, "compiling", lambda: traced)
    layer = mixer(hidden=16, heads=2, state=16, groups=groups, chunk=16)
    x = torch.randn(2, seq_len, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    out = core(layer, x)
    ref, _ = layer(x)
    dy = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    found, expected = grads(layer, x, out, dy), grads(layer, x, ref, dy)
    for name in expected:
        torch.testing.assert_close(found[name], expected[name], rtol=1e-4, atol=1e-5, msg=name)


@cuda
@pytest.mark.parametrize("seq_len", [333, 1024])
def test_the_training_path_in_bf16_matches_the_fp32_reference(seq_len):
    fast = mixer(hidden=1024, heads=16, state=64, groups=1, chunk=64, device="cuda")
    fast.kernels = fast.norm.kernels = "auto"
    ref = mixer(hidden=1024, heads=16, state=64, groups=1, chunk=64, device="cuda")
    ref.load_state_dict(fast.state_dict())
    x = torch.randn(2, seq_len, 1024, device="cuda", generator=torch.Generator(device="cuda").manual_seed(3), requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out, _ = fast(x)  # no mask, no cache: the one-node path
    ref_out, _ = ref(x)
    dy = torch.randn(ref_out.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(4))
    found, expected = grads(fast, x, out.float(), dy), grads(ref, x, ref_out, dy)
    assert out.dtype == torch.bfloat16
    assert (out.float() - ref_out).norm() / ref_out.norm() <= 2e-2
    for name in expected:  # per-head parameters sum every token's terms, which cancel: looser, as test_mamba2_cuda
        tol = 5e-2 if name in ("dt_bias", "A_log", "D") else 3e-2
        assert (found[name].float() - expected[name]).norm() / expected[name].norm() <= tol, name
