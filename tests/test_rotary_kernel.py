"""The rotary kernel (`kernels/common/rotary.py`: rotary positions then a feature map on q and k, one launch each
way) against `apply_rotary` and `apply_feature_map`: through Triton's interpreter on CPU, compiled on CUDA."""

import pytest
import torch

from conftest import masked_logits_and_grads

from attnlab.models.kernels.common.rotary import FEATURE_MAPS, rotary
from attnlab.models.ops.common import apply_rotary, rotary_cos_sin
from attnlab.models.ops.attention_family import apply_feature_map

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
THETA = 10000.0


def projected(batch, seq_len, heads, kv_heads, head_dim, device="cpu", dtype=torch.float32, seed=0):
    """q and k as views of one projection's output [B, T, H + Hk + Hk, D] (strided rows), and that output."""
    g = torch.Generator(device=device).manual_seed(seed)
    both = torch.randn(batch, seq_len, heads + 2 * kv_heads, head_dim, device=device, generator=g).to(dtype)
    both.requires_grad_()
    return both, both[:, :, :heads], both[:, :, heads:heads + kv_heads]


def reference(q, k, positions, feature_map):
    cos, sin = rotary_cos_sin(positions, q.shape[-1], THETA)
    return (apply_feature_map(apply_rotary(q, cos, sin), feature_map),
            apply_feature_map(apply_rotary(k, cos, sin), feature_map))


def check(batch, seq_len, heads, kv_heads, head_dim, positions, feature_map, device="cpu", dtype=torch.float32,
          tol=1e-5):
    both, q, k = projected(batch, seq_len, heads, kv_heads, head_dim, device, dtype)
    q_out, k_out = rotary(q, k, positions, THETA, feature_map)
    dq, dk = torch.randn_like(q_out), torch.randn_like(k_out)
    (grad,) = torch.autograd.grad((q_out, k_out), both, (dq, dk))
    ref_both = both.detach().clone().requires_grad_()
    ref_q, ref_k = reference(ref_both[:, :, :heads], ref_both[:, :, heads:heads + kv_heads], positions, feature_map)
    (ref_grad,) = torch.autograd.grad((ref_q, ref_k), ref_both, (dq, dk))
    assert q_out.is_contiguous() and k_out.is_contiguous() and q_out.dtype == dtype
    torch.testing.assert_close(q_out, ref_q, rtol=tol, atol=tol)
    torch.testing.assert_close(k_out, ref_k, rtol=tol, atol=tol)
    torch.testing.assert_close(grad, ref_grad, rtol=tol, atol=tol)
    return grad


@pytest.mark.parametrize("feature_map", FEATURE_MAPS)
def test_rotary_and_feature_map_and_gradients_equal_pytorch(feature_map):
    positions = torch.arange(19).expand(2, 19)  # 19 tokens: a partial block of tokens
    grad = check(2, 19, 3, 1, 8, positions, feature_map)
    assert grad[:, :, 4:].abs().sum() == 0  # the third part of the projection (v) gets nothing


def test_positions_of_padded_rows_and_continued_prefills():
    # left padding (positions 0 repeated), a prefill after 1000 cached tokens, and a position past 65,536
    positions = torch.tensor([[0, 0, 0, 1, 2, 3, 4], [1000, 1001, 1002, 1003, 1004, 1005, 1006],
                              [70000, 70001, 70002, 70003, 70004, 70005, 70006]])
    check(3, 7, 2, 2, 16, positions, "elu1")


def test_head_dim_not_a_power_of_two_and_more_key_heads():
    check(1, 5, 1, 3, 12, torch.arange(5)[None], "relu")


def test_bad_inputs_are_refused():
    q, k = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="feature maps"):
        rotary(q, k, torch.arange(4)[None], THETA, "silu")
    with pytest.raises(ValueError, match="even head dim"):
        rotary(torch.randn(1, 4, 2, 7), torch.randn(1, 4, 2, 7), torch.arange(4)[None], THETA)
    with pytest.raises(ValueError, match="positions"):
        rotary(q, k, torch.arange(5)[None], THETA)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("feature_map", FEATURE_MAPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_on_cuda_equals_pytorch(feature_map, dtype):
    positions = torch.arange(65536 - 300, 65536 + 300, device="cuda").view(2, 300)
    # bf16: the kernel rounds r as apply_rotary does; a product that lands on a rounding boundary may differ by one ulp
    check(2, 300, 16, 16, 64, positions, feature_map, "cuda", dtype, tol=1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("mixer", ["linear_elu", "linear_relu", "linear_cosine", "softmax_detach_denom_gate_clean",
                                   "softmax", "nsa"])
def test_mixers_on_the_rotary_kernel_train_as_on_pytorch(mixer, monkeypatch):
    """The mixers' rotary (training and prefill) on the kernel, run through the interpreter: a left-padded batch's
    logits and every parameter's gradient as with PyTorch's rotary."""
    from attnlab.models import kernels
    from attnlab.models.configuration import AttnLabConfig
    from attnlab.models.kernels.common.rotary import rotary_feature_map
    from attnlab.models.modeling import AttnLabForCausalLM

    torch.manual_seed(0)
    model = AttnLabForCausalLM(AttnLabConfig(vocab_size=97, hidden_size=64, num_layers=2, num_heads=2, mixer=mixer,
                                             kernels="torch" if mixer == "nsa" else "auto"))
    ids = torch.randint(0, 97, (2, 21))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0

    reference = masked_logits_and_grads(model, ids, mask)
    calls = []
    monkeypatch.setattr(kernels, "rotary_fn", lambda choice, x: calls.append(choice) or rotary_feature_map)
    got = masked_logits_and_grads(model, ids, mask)
    assert len(calls) == 2  # each layer's rotary ran on the kernel
    keep = mask.bool()
    torch.testing.assert_close(got[0][keep], reference[0][keep], rtol=1e-4, atol=1e-5)
    assert set(got[1]) == set(reference[1])
    for name, grad in reference[1].items():
        torch.testing.assert_close(got[1][name], grad, rtol=1e-4, atol=1e-6, msg=name)
