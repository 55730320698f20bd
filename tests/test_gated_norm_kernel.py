"""The grouped gated RMSNorm's kernels (`kernels/common/gated_norm.py`) against PyTorch: through Triton's
interpreter on CPU, compiled on CUDA (bf16 at Mamba-2's shapes)."""

import pytest
import torch

from attnlab.models.kernels.common import gated_norm
from attnlab.models.kernels.common.gated_norm import (
    gated_rms_norm,
    gated_rms_norm_bwd,
    gated_rms_norm_fwd,
)
from attnlab.models.ops.common import gated_rms_norm as gated_rms_norm_reference

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

EPS = 1e-5


def tensors(rows: int, D: int, device="cpu", seed=0):
    """x, z [rows, D] and weight [D] (fp32), from a seeded generator."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(rows, D, device=device, generator=g)
    z = torch.randn(rows, D, device=device, generator=g) * 2
    weight = 1 + 0.5 * torch.randn(D, device=device, generator=g)
    return x, z, weight


def reference(x, z, weight, group_size, dy):
    """(y, dx, dz, dweight, rstd) in fp32 from PyTorch's autograd on the reference."""
    x, z, weight = (t.detach().float().requires_grad_() for t in (x, z, weight))
    y = gated_rms_norm_reference(x, z, weight, group_size, EPS)
    grads = torch.autograd.grad(y, [x, z, weight], dy.float())
    D = x.shape[-1]
    G = D // (group_size or D)
    h = (x * torch.nn.functional.silu(z)).detach().reshape(-1, G, D // G)
    rstd = torch.rsqrt(h.square().mean(-1) + EPS)
    return (y.detach(), *grads, rstd)


@pytest.mark.parametrize("shape, group_size", [
    ((3, 5, 64), 64),   # one group, 15 rows (an odd count) as [B, T, D]
    ((7, 128), 32),     # four groups
    ((9, 96), 24),      # four groups of a width that is no power of two: a masked tile
    ((5, 80), None),    # None: the whole row
])
@pytest.mark.parametrize("programs", [None, 3])  # None: one row a program; 3: several rows a program, a short last block
def test_forward_and_every_gradient_equal_the_reference(shape, group_size, programs, monkeypatch):
    if programs:
        monkeypatch.setattr(gated_norm, "FWD_PROGRAMS", programs)
        monkeypatch.setattr(gated_norm, "BWD_PROGRAMS", programs)
    x, z, weight = tensors(torch.Size(shape[:-1]).numel(), shape[-1])
    x, z, weight = x.reshape(shape).requires_grad_(), z.reshape(shape).requires_grad_(), weight.requires_grad_()
    y = gated_rms_norm(x, z, weight, group_size, EPS)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, [x, z, weight], dy)
    ref_y, *ref_grads, _ = reference(x, z, weight, group_size, dy)
    assert y.shape == x.shape and y.dtype == x.dtype
    torch.testing.assert_close(y, ref_y, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_x_and_z_as_strided_column_slices_of_one_projection():
    rows, D = 6, 64
    g = torch.Generator().manual_seed(1)
    proj = (torch.randn(rows, 2 * D + 11, generator=g) * 2).requires_grad_()
    z, x = proj[:, 3:3 + D], proj[:, D + 7:2 * D + 7]  # row stride 2 D + 11, unaligned starts
    weight = torch.randn(D, generator=g).requires_grad_()
    y = gated_rms_norm(x, z, weight, D // 4, EPS)
    dy = torch.randn_like(y)
    dproj, dweight = torch.autograd.grad(y, [proj, weight], dy)
    ref_y, ref_dx, ref_dz, ref_dweight, _ = reference(x, z, weight, D // 4, dy)
    torch.testing.assert_close(y, ref_y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dproj[:, 3:3 + D], ref_dz, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dproj[:, D + 7:2 * D + 7], ref_dx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dweight, ref_dweight, rtol=1e-5, atol=1e-5)
    assert dproj[:, :3].eq(0).all() and dproj[:, D + 3:D + 7].eq(0).all() and dproj[:, 2 * D + 7:].eq(0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_writes_into_column_slices_of_one_buffer_and_gives_y_back(dtype):
    rows, D, group_size = 7, 64, 16
    x, z, weight = tensors(rows, D, seed=2)
    x, z = x.to(dtype), z.to(dtype)
    dy = torch.randn(rows, D, generator=torch.Generator().manual_seed(3)).to(dtype)
    y, rstd = gated_rms_norm_fwd(x, z, weight, group_size, EPS)
    buffer = torch.full((rows, 2 * D + 9), 7.0, dtype=dtype)  # dx at columns 2.., dz at D + 5..; the rest untouched
    dx_out, dz_out = buffer[:, 2:2 + D], buffer[:, D + 5:2 * D + 5]
    dx, dz, dweight, y_again = gated_rms_norm_bwd(dy, x, z, weight, rstd, group_size, dx_out=dx_out, dz_out=dz_out, want_y=True)
    assert dx.data_ptr() == dx_out.data_ptr() and dz.data_ptr() == dz_out.data_ptr()
    keep = torch.ones(buffer.shape[1], dtype=torch.bool)
    keep[2:2 + D] = keep[D + 5:2 * D + 5] = False
    assert buffer[:, keep].eq(7.0).all()
    ref_y, ref_dx, ref_dz, ref_dweight, ref_rstd = reference(x, z, weight, group_size, dy)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    assert y.dtype == dtype and y.is_contiguous() and rstd.dtype == torch.float32 and rstd.shape == (rows, D // group_size)
    assert y_again.dtype == dy.dtype and dweight.dtype == weight.dtype
    torch.testing.assert_close(y_again, y, rtol=0, atol=0)  # the same fp32 math, rounded alike
    torch.testing.assert_close(rstd, ref_rstd, rtol=1e-5, atol=1e-5)
    for got, want in [(y, ref_y), (dx, ref_dx), (dz, ref_dz), (dweight, ref_dweight)]:
        torch.testing.assert_close(got.float(), want, **tol)
    fresh_dx, fresh_dz, fresh_dweight, none = gated_rms_norm_bwd(dy, x, z, weight, rstd, group_size)
    assert none is None and fresh_dx.is_contiguous() and fresh_dx.dtype == dtype and fresh_dz.dtype == dtype
    torch.testing.assert_close(fresh_dx, dx, rtol=0, atol=0)
    torch.testing.assert_close(fresh_dz, dz, rtol=0, atol=0)
    torch.testing.assert_close(fresh_dweight, dweight, rtol=0, atol=0)


def test_bf16_through_the_autograd_function_and_an_fp32_output():
    x, z, weight = tensors(6, 128, seed=4)
    xb, zb = x.bfloat16().requires_grad_(), z.bfloat16().requires_grad_()
    weight.requires_grad_()
    y = gated_rms_norm(xb, zb, weight, 128, EPS)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, [xb, zb, weight], dy)
    ref_y, *ref_grads, _ = reference(xb, zb, weight, 128, dy)
    assert y.dtype == torch.bfloat16 and [t.dtype for t in grads] == [torch.bfloat16, torch.bfloat16, torch.float32]
    for got, want in zip([y, *grads], [ref_y, *ref_grads]):
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    y32, _ = gated_rms_norm_fwd(xb, zb, weight, 128, EPS, out_dtype=torch.float32)
    assert y32.dtype == torch.float32
    torch.testing.assert_close(y32, ref_y, rtol=1e-5, atol=1e-5)


def test_empty_rows_and_refusals():
    x, z, weight = tensors(0, 32)
    y, rstd = gated_rms_norm_fwd(x, z, weight, 16, EPS)
    assert y.shape == (0, 32) and rstd.shape == (0, 2)
    dx, dz, dweight, _ = gated_rms_norm_bwd(y, x, z, weight, rstd, 16)
    assert dx.shape == dz.shape == (0, 32) and dweight.eq(0).all()
    x, z, weight = tensors(4, 48)
    with pytest.raises(ValueError, match="group_size must divide D = 48"):
        gated_rms_norm(x, z, weight, 20, EPS)
    with pytest.raises(ValueError, match="one shape"):
        gated_rms_norm(x, z[:, :-1], weight, 16, EPS)
    with pytest.raises(ValueError, match=r"weight must be \[D\]"):
        gated_rms_norm(x, z, weight[:-1], 16, EPS)
    big = torch.zeros(1, 2 * gated_norm.MAX_GROUP_SIZE)
    with pytest.raises(ValueError, match=f"group_size up to {gated_norm.MAX_GROUP_SIZE}"):
        gated_rms_norm(big, big, big[0], big.shape[1], EPS)
    y, rstd = gated_rms_norm_fwd(x, z, weight, 16, EPS)
    with pytest.raises(ValueError, match=r"dx_out must be \[rows, D\]"):
        gated_rms_norm_bwd(y, x, z, weight, rstd, 16, dx_out=torch.empty(4, 47))
    with pytest.raises(ValueError, match="rstd must be fp32"):
        gated_rms_norm_bwd(y, x, z, weight, rstd[:, :1], 16)


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("group_size", [2048, 512])
def test_bf16_at_mamba2_shapes_on_cuda_matches_fp32(group_size):
    rows, D, width = 16384, 2048, 4240
    g = torch.Generator(device="cuda").manual_seed(5)
    proj = (torch.randn(rows, width, device="cuda", generator=g) * 2).bfloat16()
    z = proj[:, :D]  # a column slice: row stride 4240
    x = torch.randn(rows, D, device="cuda", generator=g).bfloat16()
    weight = 1 + 0.5 * torch.randn(D, device="cuda", generator=g)
    dy = torch.randn(rows, D, device="cuda", generator=g).bfloat16()
    y, rstd = gated_rms_norm_fwd(x, z, weight, group_size, EPS)
    buffer = torch.zeros(rows, width, device="cuda", dtype=torch.bfloat16)
    dx, dz, dweight, y_again = gated_rms_norm_bwd(dy, x, z, weight, rstd, group_size,
                                                  dx_out=buffer[:, D:2 * D], dz_out=buffer[:, :D], want_y=True)
    assert buffer[:, 2 * D:].eq(0).all()
    ref = reference(x, z, weight, group_size, dy)
    for got, want in zip([y, dx, dz, dweight, rstd], ref):
        err = (got.float() - want).abs().max() / want.abs().max()
        assert err < 2e-2, err
    assert torch.equal(y_again, y)
    again = gated_rms_norm_bwd(dy, x, z, weight, rstd, group_size)
    assert torch.equal(again[2], dweight)  # deterministic: partial sums, no atomics
