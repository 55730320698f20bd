"""SwiGLU's kernels (`kernels/common/swiglu.py`) against PyTorch: through Triton's interpreter on CPU, compiled
on CUDA (bf16 under autocast, as the model trains)."""

import pytest
import torch
import torch.nn.functional as F

from attnlab.models.kernels.common.swiglu import swiglu, swiglu_linear

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def projected(rows: int, width: int, device="cpu", dtype=torch.float32, seed=0):
    """gate and up as the two halves of one projection's output: strided rows, as the MLP makes them."""
    g = torch.Generator(device=device).manual_seed(seed)
    both = (torch.randn(rows, 2 * width, device=device, generator=g) * 3).to(dtype).requires_grad_()
    gate, up = both.view(2, rows // 2, 2 * width).chunk(2, dim=-1)
    return both, gate, up


@pytest.mark.parametrize("width", [5, 64, 1030])  # one partial block, one block, two blocks
def test_swiglu_and_its_gradients_equal_pytorch_on_strided_rows(width):
    both, gate, up = projected(6, width)
    out = swiglu(gate, up)
    dy = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, both, dy)
    ref_both = both.detach().clone().requires_grad_()
    ref_gate, ref_up = ref_both.view(2, 3, 2 * width).chunk(2, dim=-1)
    ref = F.silu(ref_gate) * ref_up
    (ref_grad,) = torch.autograd.grad(ref, ref_both, dy)
    assert out.shape == gate.shape and out.is_contiguous()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
def test_swiglu_linear_and_every_gradient_equal_pytorch(bias):
    both, gate, up = projected(8, 24, seed=1)
    weight = torch.randn(16, 24, requires_grad=True)
    b = torch.randn(16, requires_grad=True) if bias else None
    out = swiglu_linear(gate, up, weight, b)
    dout = torch.randn_like(out)
    inputs = [both, weight] + ([b] if bias else [])
    grads = torch.autograd.grad(out, inputs, dout)
    ref_inputs = [t.detach().clone().requires_grad_() for t in inputs]
    ref_gate, ref_up = ref_inputs[0].view(2, 4, 48).chunk(2, dim=-1)
    ref = F.linear(F.silu(ref_gate) * ref_up, ref_inputs[1], ref_inputs[2] if bias else None)
    ref_grads = torch.autograd.grad(ref, ref_inputs, dout)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_swiglu_keeps_a_16_bit_dtype_and_refuses_mismatched_shapes():
    _, gate, up = projected(4, 40, dtype=torch.bfloat16, seed=2)
    out = swiglu(gate, up)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), (F.silu(gate.float()) * up.float()), rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="one shape"):
        swiglu(gate, up[..., :-1])


@cuda
@pytest.mark.cuda
def test_swiglu_linear_under_bf16_autocast_on_cuda_matches_fp32():
    both, gate, up = projected(2 * 2048, 2048, device="cuda", seed=3)
    weight = (torch.randn(1024, 2048, device="cuda") / 45).requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = swiglu_linear(gate.bfloat16(), up.bfloat16(), weight, None)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, [both, weight], dout)
    assert out.dtype == torch.bfloat16 and grads[1].dtype == torch.float32
    ref_inputs = [both.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()]
    ref_gate, ref_up = ref_inputs[0].view(2, 2048, 4096).chunk(2, dim=-1)
    ref = F.linear(F.silu(ref_gate) * ref_up, ref_inputs[1])
    ref_grads = torch.autograd.grad(ref, ref_inputs, dout.float())
    for got, want in zip([out, *grads], [ref, *ref_grads]):
        err = (got.float() - want).abs().max() / want.abs().max()
        assert err < 2e-2, err
