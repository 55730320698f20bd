"""attnlab's chunked SSD kernels (`kernels/mamba2/ssd.py`) against the PyTorch reference `ops.mamba2`:
on CPU through Triton's interpreter at tiny shapes, and in bf16 on CUDA at the benchmarked layer's."""

import warnings

import pytest
import torch

from attnlab.models.ops.mamba2 import chunk_ssd, naive_recurrent_ssd

triton = pytest.importorskip("triton")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def ssd_inputs(batch, seq_len, heads, head_dim, state_size, groups, with_state, device="cpu", seed=0):
    """x, dt (softplus, a few padding zeros), A < 0, B, C, initial state (or None), all fp32."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(batch, seq_len, heads, head_dim, device=device, generator=gen)
    dt = torch.nn.functional.softplus(torch.randn(batch, seq_len, heads, device=device, generator=gen) - 1)
    dt = dt * (torch.rand(batch, seq_len, 1, device=device, generator=gen) > 0.2)  # padding: no decay, no write
    A = -torch.rand(heads, device=device, generator=gen) * 2 - 0.1
    B = torch.randn(batch, seq_len, groups, state_size, device=device, generator=gen) / state_size ** 0.5
    C = torch.randn(batch, seq_len, groups, state_size, device=device, generator=gen) / state_size ** 0.5
    h0 = torch.randn(batch, heads, head_dim, state_size, device=device, generator=gen) if with_state else None
    return x, dt, A, B, C, h0


def grads_of(fn, inputs, dy, dstate):
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in inputs]
    y, state = fn(*leaves)
    torch.autograd.backward([y, state], [dy.to(y.dtype), dstate])
    return y, state, [None if t is None else t.grad for t in leaves]


NAMES = ["dx", "ddt", "dA", "dB", "dC", "dh0"]


@pytest.mark.parametrize("seq_len, head_dim, state_size, groups, with_state", [
    (1, 8, 8, 1, True), (37, 16, 8, 2, False), (37, 8, 16, 1, True), (70, 16, 16, 2, True), (70, 8, 8, 1, False),
])
def test_chunked_ssd_kernels_match_the_reference_forward_and_backward(seq_len, head_dim, state_size, groups, with_state):
    from attnlab.models.kernels.mamba2.ssd import chunk_ssd_triton

    inputs = ssd_inputs(2, seq_len, 4, head_dim, state_size, groups, with_state, seed=seq_len)
    gen = torch.Generator().manual_seed(1)
    dy = torch.randn(2, seq_len, 4, head_dim, generator=gen)
    dstate = torch.randn(2, 4, head_dim, state_size, generator=gen)
    x, dt, A, B, C, h0 = inputs
    y, state, grads = grads_of(lambda *t: chunk_ssd_triton(*t[:5], 16, t[5]), inputs, dy, dstate)
    y_ref, state_ref, grads_ref = grads_of(lambda *t: chunk_ssd(*t[:5], 16, t[5]), inputs, dy, dstate)
    assert y.dtype == torch.float32 and state.dtype == torch.float32
    assert rel_err(y, y_ref) < 1e-4
    assert rel_err(state, state_ref) < 1e-4
    assert rel_err(y, naive_recurrent_ssd(x, dt, A, B, C, h0)[0]) < 1e-4
    for name, g, g_ref in zip(NAMES, grads, grads_ref):
        if g_ref is None:
            assert g is None, name
            continue
        assert rel_err(g, g_ref) < 1e-4, name


def test_chunked_ssd_kernels_without_a_state_gradient():
    """Only y is used: the final state's gradient arrives as None."""
    from attnlab.models.kernels.mamba2.ssd import chunk_ssd_triton

    inputs = ssd_inputs(2, 20, 4, 8, 8, 2, True, seed=3)
    leaves = [t.clone().requires_grad_() for t in inputs]
    chunk_ssd_triton(*leaves[:5], 16, leaves[5])[0].square().sum().backward()
    ref = [t.clone().requires_grad_() for t in inputs]
    chunk_ssd(*ref[:5], 16, ref[5])[0].square().sum().backward()
    for name, a, b in zip(NAMES, leaves, ref):
        assert rel_err(a.grad, b.grad) < 1e-4, name


def test_the_mixer_entry_adds_the_skip_and_falls_back_on_cpu():
    from attnlab.models.kernels.mamba2.core import ssd, use_fast_ssd

    x, dt, A, B, C, h0 = ssd_inputs(2, 20, 4, 8, 8, 1, True, seed=4)
    D = torch.randn(4)
    assert not use_fast_ssd("auto", x)
    y, state = ssd(x, dt, A, B, C, D, 16, h0, True, "auto")
    y_ref, state_ref = chunk_ssd(x, dt, A, B, C, 16, h0)
    assert rel_err(y, y_ref + x * D[:, None]) < 1e-6 and rel_err(state, state_ref) < 1e-6


@pytest.mark.parametrize("seq_len, groups, with_state", [(37, 2, True), (20, 1, False)])
def test_the_kernels_add_the_skip_and_give_its_gradient(seq_len, groups, with_state):
    """y = SSD + x * D from the output kernel; dD and the skip's share of dx from the backward kernels."""
    from attnlab.models.kernels.mamba2.ssd import _SSD

    x, dt, A, B, C, h0 = ssd_inputs(2, seq_len, 4, 16, 8, groups, with_state, seed=14)
    D = torch.randn(4, generator=torch.Generator().manual_seed(15))
    inputs = [x, dt, A, B, C, D, h0]
    gen = torch.Generator().manual_seed(16)
    dy, dstate = torch.randn(x.shape, generator=gen), torch.randn(2, 4, 16, 8, generator=gen)

    def reference(x, dt, A, B, C, D, h0):
        y, state = chunk_ssd(x, dt, A, B, C, 16, h0)
        return y + x * D[:, None], state

    y, state, grads = grads_of(lambda *t: _SSD.apply(*t[:6], 16, t[6]), inputs, dy, dstate)
    y_ref, state_ref, grads_ref = grads_of(reference, inputs, dy, dstate)
    assert rel_err(y, y_ref) < 1e-4 and rel_err(state, state_ref) < 1e-4
    for name, g, g_ref in zip(["dx", "ddt", "dA", "dB", "dC", "dD", "dh0"], grads, grads_ref):
        if g_ref is None:
            assert g is None, name
            continue
        assert rel_err(g, g_ref) < 1e-4, name


def test_the_mixer_entry_on_the_kernels_runs_other_chunk_sizes_at_64_and_says_so_once(monkeypatch):
    """Not a power of two, or above 128: the kernels run at 64, with one warning per chunk size."""
    from attnlab.models.kernels.mamba2 import core
    from attnlab.models.kernels.mamba2 import ssd as kernels

    monkeypatch.setattr(core, "use_fast_ssd", lambda choice, x: True)  # the kernels, through the interpreter
    monkeypatch.setattr(kernels, "_warned_chunks", set())
    x, dt, A, B, C, h0 = ssd_inputs(1, 70, 2, 8, 8, 1, True, seed=17)
    D = torch.randn(2)
    with pytest.warns(UserWarning, match="chunk_size 24 runs at 64"):
        y, state = core.ssd(x, dt, A, B, C, D, 24, h0, True, "auto")
    y_ref, state_ref = chunk_ssd(x, dt, A, B, C, 24, h0)
    assert rel_err(y, y_ref + x * D[:, None]) < 1e-4 and rel_err(state, state_ref) < 1e-4
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert core.ssd(x, dt, A, B, C, D, 24, h0, False, "auto")[1] is None
    assert not [w for w in caught if "chunk_size" in str(w.message)]
    with pytest.warns(UserWarning, match="chunk_size 256 runs at 64"):  # [256, 256] tiles would not fit
        y, _ = core.ssd(x, dt, A, B, C, D, 256, h0, False, "auto")
    assert rel_err(y, y_ref + x * D[:, None]) < 1e-4
    with pytest.raises(ValueError, match="from 16 to 128"):
        kernels.chunk_ssd_triton(x, dt, A, B, C, 256, h0)


def test_the_state_kernels_split_the_state_over_programs(monkeypatch):
    """Few (batch * head)s: blocks of 16 head dims and of 32 state channels, the last ones partly masked."""
    from attnlab.models.kernels.mamba2 import ssd as kernels

    monkeypatch.setattr(kernels, "_STATE_PROGRAMS", 10**6)
    assert kernels._state_blocks(2, 40, 40) == (16, 32)
    inputs = ssd_inputs(1, 37, 2, 40, 40, 1, True, seed=18)
    gen = torch.Generator().manual_seed(19)
    dy, dstate = torch.randn(inputs[0].shape, generator=gen), torch.randn(1, 2, 40, 40, generator=gen)
    y, state, grads = grads_of(lambda *t: kernels.chunk_ssd_triton(*t[:5], 16, t[5]), inputs, dy, dstate)
    y_ref, state_ref, grads_ref = grads_of(lambda *t: chunk_ssd(*t[:5], 16, t[5]), inputs, dy, dstate)
    assert rel_err(y, y_ref) < 1e-4 and rel_err(state, state_ref) < 1e-4
    for name, g, g_ref in zip(NAMES, grads, grads_ref):
        assert rel_err(g, g_ref) < 1e-4, name


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_chunked_ssd_in_bf16_matches_the_fp32_reference(with_state):
    from attnlab.models.kernels.mamba2.ssd import chunk_ssd_triton

    inputs = ssd_inputs(2, 1000, 16, 128, 64, 1, with_state, device="cuda", seed=7)
    x, dt, A, B, C, h0 = inputs
    gen = torch.Generator(device="cuda").manual_seed(8)
    dy = torch.randn(x.shape, device="cuda", generator=gen)
    dstate = torch.randn(2, 16, 128, 64, device="cuda", generator=gen)
    low = [x.bfloat16(), dt, A, B.bfloat16(), C.bfloat16(), h0]
    dy = dy.bfloat16()
    # the reference reads the same bf16-rounded values in fp32: what is compared is the kernels' error
    high = [None if t is None else t.float() for t in low]
    y, state, grads = grads_of(lambda *t: chunk_ssd_triton(*t[:5], 64, t[5]), low, dy, dstate)
    y_ref, state_ref, grads_ref = grads_of(lambda *t: chunk_ssd(*t[:5], 64, t[5]), high, dy.float(), dstate)
    assert y.dtype == torch.bfloat16 and state.dtype == torch.float32
    assert rel_err(y, y_ref) < 2e-2
    assert rel_err(state, state_ref) < 2e-2
    for name, g, g_ref in zip(NAMES, grads, grads_ref):
        if g_ref is None:
            continue
        assert rel_err(g, g_ref) < 2e-2, name


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_chunked_ssd_in_fp32_on_cuda_matches_the_reference():
    from attnlab.models.kernels.mamba2.ssd import chunk_ssd_triton

    inputs = ssd_inputs(2, 300, 16, 128, 64, 2, True, device="cuda", seed=9)
    gen = torch.Generator(device="cuda").manual_seed(10)
    dy = torch.randn(inputs[0].shape, device="cuda", generator=gen)
    dstate = torch.randn(2, 16, 128, 64, device="cuda", generator=gen)
    y, state, grads = grads_of(lambda *t: chunk_ssd_triton(*t[:5], 64, t[5]), inputs, dy, dstate)
    y_ref, state_ref, grads_ref = grads_of(lambda *t: chunk_ssd(*t[:5], 64, t[5]), inputs, dy, dstate)
    assert rel_err(y, y_ref) < 1e-4 and rel_err(state, state_ref) < 1e-4
    for name, g, g_ref in zip(NAMES, grads, grads_ref):
        assert rel_err(g, g_ref) < 1e-4, name


def test_chunked_ssd_kernels_with_the_head_dims_split_over_programs(monkeypatch):
    """The output and backward kernels loop over head dims in blocks of 16 (64 and 32 on the GPU), the
    last one partly masked: the sums over P add up across blocks."""
    from attnlab.models.kernels.mamba2 import ssd as kernels

    monkeypatch.setattr(kernels, "_BLOCK_P", 16)
    monkeypatch.setattr(kernels, "_BWD_BLOCK_P", 16)
    inputs = ssd_inputs(2, 37, 4, 40, 8, 2, True, seed=5)
    gen = torch.Generator().manual_seed(6)
    dy = torch.randn(2, 37, 4, 40, generator=gen)
    dstate = torch.randn(2, 4, 40, 8, generator=gen)
    y, state, grads = grads_of(lambda *t: kernels.chunk_ssd_triton(*t[:5], 16, t[5]), inputs, dy, dstate)
    y_ref, state_ref, grads_ref = grads_of(lambda *t: chunk_ssd(*t[:5], 16, t[5]), inputs, dy, dstate)
    assert rel_err(y, y_ref) < 1e-4 and rel_err(state, state_ref) < 1e-4
    for name, g, g_ref in zip(NAMES, grads, grads_ref):
        assert rel_err(g, g_ref) < 1e-4, name


def test_chunked_ssd_kernels_read_views_of_the_convolutions_output():
    """x, B, C as the mixer has them: views of one [b, T, channels] tensor, with its time stride."""
    from attnlab.models.kernels.mamba2.ssd import chunk_ssd_triton

    x, dt, A, B, C, h0 = ssd_inputs(2, 37, 4, 8, 8, 2, True, seed=11)
    xBC = torch.cat([x.flatten(2), B.flatten(2), C.flatten(2)], dim=-1).requires_grad_()
    xs, Bs, Cs = xBC.split([32, 16, 16], dim=-1)
    xs, Bs, Cs = xs.view(x.shape), Bs.view(B.shape), Cs.view(C.shape)
    assert not xs.is_contiguous()
    y, state = chunk_ssd_triton(xs, dt, A, Bs, Cs, 16, h0)
    (y.square().sum() + state.sum()).backward()
    ref = xBC.detach().clone().requires_grad_()
    xr, Br, Cr = ref.split([32, 16, 16], dim=-1)
    y_ref, state_ref = chunk_ssd(xr.view(x.shape), dt, A, Br.view(B.shape), Cr.view(C.shape), 16, h0)
    (y_ref.square().sum() + state_ref.sum()).backward()
    assert rel_err(y, y_ref) < 1e-4 and rel_err(state, state_ref) < 1e-4
    assert rel_err(xBC.grad, ref.grad) < 1e-4


def test_chunked_ssd_kernels_keep_bf16_inputs_in_bf16():
    """y, dx, dB, dC come back in the inputs' dtype; what differs from the reference is their rounding."""
    from attnlab.models.kernels.mamba2.ssd import chunk_ssd_triton

    x, dt, A, B, C, h0 = ssd_inputs(2, 40, 4, 16, 16, 2, True, seed=12)
    low = [x.bfloat16(), dt, A, B.bfloat16(), C.bfloat16(), h0]
    high = [t.float() for t in low]
    gen = torch.Generator().manual_seed(13)
    dy, dstate = torch.randn(x.shape, generator=gen).bfloat16(), torch.randn(h0.shape, generator=gen)
    y, state, grads = grads_of(lambda *t: chunk_ssd_triton(*t[:5], 16, t[5]), low, dy, dstate)
    y_ref, state_ref, grads_ref = grads_of(lambda *t: chunk_ssd(*t[:5], 16, t[5]), high, dy.float(), dstate)
    assert y.dtype == torch.bfloat16 and state.dtype == torch.float32
    assert rel_err(y, y_ref) < 1e-2 and rel_err(state, state_ref) < 1e-4
    for name, g, g_ref, t in zip(NAMES, grads, grads_ref, low):
        assert g.dtype == t.dtype, name
        assert rel_err(g, g_ref) < 1e-2, name


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_mixer_entry_in_bf16_with_the_skip_matches_the_fp32_reference():
    """`ssd` as the mixer calls it: x, B, C views of one bf16 tensor, D, the final state asked for."""
    from attnlab.models.kernels.mamba2.core import ssd

    x, dt, A, B, C, h0 = ssd_inputs(2, 1000, 16, 128, 64, 1, True, device="cuda", seed=20)
    D = torch.randn(16, device="cuda", generator=torch.Generator(device="cuda").manual_seed(21))
    xBC = torch.cat([x.flatten(2), B.flatten(2), C.flatten(2)], dim=-1).bfloat16()
    gen = torch.Generator(device="cuda").manual_seed(22)
    dy = torch.randn(x.shape, device="cuda", generator=gen).bfloat16()
    dstate = torch.randn(h0.shape, device="cuda", generator=gen)

    def run(xBC, dt, D, h0, fn):
        xs, Bs, Cs = xBC.split([16 * 128, 64, 64], dim=-1)
        return fn(xs.view(x.shape), dt, A, Bs.view(B.shape), Cs.view(C.shape), D, h0)

    fast = lambda *t: run(*t, lambda *a: ssd(*a[:6], 64, a[6], True, "auto"))
    reference = lambda *t: run(*t, lambda *a: ssd(*a[:6], 64, a[6], True, "torch"))
    y, state, grads = grads_of(fast, [xBC, dt, D, h0], dy, dstate)
    y_ref, state_ref, grads_ref = grads_of(reference, [xBC.float(), dt, D, h0], dy.float(), dstate)
    assert y.dtype == torch.bfloat16
    assert rel_err(y, y_ref) < 2e-2 and rel_err(state, state_ref) < 2e-2
    for name, g, g_ref in zip(["dxBC", "ddt", "dD", "dh0"], grads, grads_ref):
        assert rel_err(g, g_ref) < 2e-2, name
