"""attnlab's causal depthwise conv kernel (`models/kernels/common/conv.py`) against `F.conv1d`: through
Triton's interpreter on CPU (TRITON_INTERPRET=1, tiny shapes), and compiled on a CUDA GPU in bf16
(marked `cuda`, skipped without a GPU), alone and inside the two mixers that use it."""

import pytest
import torch
import torch.nn.functional as F

from attnlab.models import AttnLabConfig, AttnLabForCausalLM, kernels

pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # numpy's, from inside Triton's interpreter
CUDA = torch.cuda.is_available()  # without one, the kernel runs through Triton's interpreter (tests/conftest.py)


@pytest.fixture(autouse=True)
def exact_fp32_reference(monkeypatch):
    """cuDNN may run fp32 convolutions in TF32; the reference must not."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def reference_conv(x, weight, bias, initial_state, silu):
    """The mixers' reference: cat the state (or zeros), F.conv1d over time, SiLU; and the last K - 1 inputs."""
    width = weight.shape[1] - 1
    if initial_state is None:
        initial_state = x.new_zeros(x.shape[0], width, x.shape[2])
    padded = torch.cat((initial_state.to(x.dtype), x), dim=1)  # [B, K-1+T, C]
    y = F.conv1d(padded.transpose(1, 2), weight[:, None], bias, groups=x.shape[2]).transpose(1, 2)
    return (F.silu(y) if silu else y), padded[:, -width:]


def conv_inputs(B, T, C, K, device, seed, with_state=True, with_bias=True):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(B, T, C, device=device, generator=g)
    weight = torch.randn(C, K, device=device, generator=g) / K**0.5
    bias = torch.randn(C, device=device, generator=g) if with_bias else None
    state = torch.randn(B, K - 1, C, device=device, generator=g) if with_state else None
    dy = torch.randn(B, T, C, device=device, generator=g)
    dstate = torch.randn(B, K - 1, C, device=device, generator=g)
    return [x, weight, bias, state], dy, dstate


def run_conv(conv, leaves, dy, dstate, silu, dtype=None, channel_major=False):
    """y, the final state and the gradients of (y * dy).sum() + (final * dstate).sum() wrt every leaf."""
    inputs = [None if t is None else t.clone().requires_grad_() for t in leaves]
    x, weight, bias, state = inputs
    if dtype is not None:
        x = x.to(dtype)
        state = None if state is None else state.to(dtype)
    if channel_major:  # the state as Mamba-2 caches it: [B, C, K-1], read through a transposed view
        state = None if state is None else state.transpose(1, 2).contiguous().transpose(1, 2)
        y, final = conv(x, weight, bias, state, silu, channel_major_state=True)
        assert final.transpose(1, 2).is_contiguous()
    else:
        y, final = conv(x, weight, bias, state, silu)
    ((y.float() * dy).sum() + (final.float() * dstate).sum()).backward()
    return y, final, {name: t.grad for name, t in zip(("x", "weight", "bias", "state"), inputs) if t is not None}


def fused_conv():
    from attnlab.models.kernels.common.conv import causal_conv1d

    return causal_conv1d


def assert_conv_matches(B, T, C, K, silu, with_state, with_bias, device="cpu", dtype=None, tol=1e-5, seed=0, channel_major=False):
    leaves, dy, dstate = conv_inputs(B, T, C, K, device, seed, with_state, with_bias)
    ref_y, ref_final, ref_grads = run_conv(reference_conv, leaves, dy, dstate, silu)
    y, final, grads = run_conv(fused_conv(), leaves, dy, dstate, silu, dtype, channel_major)
    assert y.dtype == (dtype or torch.float32) and final.dtype == y.dtype
    assert y.shape == ref_y.shape and final.shape == ref_final.shape
    assert rel_err(y, ref_y) <= tol, ("output", rel_err(y, ref_y))
    assert rel_err(final, ref_final) <= tol, ("final state", rel_err(final, ref_final))
    assert set(grads) == set(ref_grads)
    for name in grads:
        assert grads[name].dtype == ref_grads[name].dtype, name
        assert rel_err(grads[name], ref_grads[name]) <= tol, (name, rel_err(grads[name], ref_grads[name]))


# ---------------------------------------------------------------- CPU, through the interpreter

@pytest.mark.parametrize("T", [1, 5, 37])
@pytest.mark.parametrize("C", [6, 48])
@pytest.mark.parametrize("K", [2, 3, 4])
def test_kernel_matches_conv1d_with_and_without_state_silu_and_bias(T, C, K):
    if CUDA:
        pytest.skip("on a GPU the compiled kernel is tested below")
    for case, (silu, with_state, with_bias) in enumerate([(True, True, True), (False, False, True), (True, False, False), (False, True, False)]):
        assert_conv_matches(2, T, C, K, silu, with_state, with_bias, seed=T * 100 + C * 10 + K + case)


@pytest.mark.parametrize("T", [2, 70])
def test_kernel_reads_and_writes_a_channel_major_state_and_strided_inputs(T):
    """Mamba-2's cache layout [B, C, K-1], and x as a column slice of a wider projection."""
    if CUDA:
        pytest.skip("on a GPU the compiled kernel is tested below")
    assert_conv_matches(2, T, 10, 4, True, True, True, seed=T, channel_major=True)
    leaves, dy, _ = conv_inputs(2, T, 10, 3, "cpu", seed=T + 1)
    wide = torch.randn(2, T, 25)
    wide[..., 7:17] = leaves[0]
    x = wide.requires_grad_()
    y, final = fused_conv()(x[..., 7:17], *leaves[1:], silu=True)
    ref_y, ref_final = reference_conv(leaves[0], *leaves[1:], silu=True)
    assert rel_err(y, ref_y) <= 1e-5 and rel_err(final, ref_final) <= 1e-5
    (y * dy).sum().backward()
    x_ref = leaves[0].clone().requires_grad_()
    (reference_conv(x_ref, *leaves[1:], silu=True)[0] * dy).sum().backward()
    assert rel_err(x.grad[..., 7:17], x_ref.grad) <= 1e-5 and not x.grad[..., :7].any()


@pytest.mark.parametrize("K, silu, with_state, with_bias", [(4, True, True, True), (2, False, False, False), (3, True, False, True),
                                                         (8, True, True, False), (5, False, True, True)])
def test_backward_walking_several_time_tiles_per_program_sums_the_same(monkeypatch, K, silu, with_state, with_bias):
    """The dpre pass keeps one dweight sum per tap (unrolled up to 8) over the tiles a program walks."""
    if CUDA:
        pytest.skip("on a GPU the compiled kernel is tested below")
    from attnlab.models.kernels.common import conv

    monkeypatch.setattr(conv, "BWD_MIN_PROGRAMS", 1)  # 16 tiles per program: 203 steps take two programs, the second partly empty
    assert 16 * conv.BWD_BLOCK_T < 203 < 32 * conv.BWD_BLOCK_T
    assert_conv_matches(2, 203, 6, K, silu, with_state, with_bias, seed=K)


@pytest.mark.parametrize("silu", [True, False])
def test_backward_reads_a_strided_gradient(silu):
    """dy as a column slice of a wider tensor: the dpre pass reads it through its strides, and without SiLU
    the dx pass reads it in place of a dpre buffer."""
    if CUDA:
        pytest.skip("on a GPU the compiled kernel is tested below")
    leaves, dy, _ = conv_inputs(2, 29, 10, 4, "cpu", seed=5)
    wide = torch.randn(2, 29, 31)
    wide[..., 4:14] = dy
    dy_strided = wide[..., 4:14]
    assert not dy_strided.is_contiguous()
    grads = {}
    for name, conv, grad_out in (("kernel", fused_conv(), dy_strided), ("reference", reference_conv, dy)):
        inputs = [t.clone().requires_grad_() for t in leaves]
        y, _ = conv(*inputs, silu)
        grads[name] = torch.autograd.grad(y, inputs, grad_out)
    for got, want in zip(grads["kernel"], grads["reference"]):
        assert rel_err(got, want) <= 1e-5


def test_gradient_of_the_final_state_alone_reaches_x_and_the_initial_state():
    """y unused (no dy): dx is the final state's gradient on x's last rows, the state takes what lies before x,
    dweight and dbias are zero."""
    if CUDA:
        pytest.skip("on a GPU the compiled kernel is tested below")
    for T in (2, 7):  # shorter than the window (K - 1 = 3) and longer
        leaves, _, dstate = conv_inputs(2, T, 6, 4, "cpu", seed=T)
        grads = {}
        for name, conv in (("kernel", fused_conv()), ("reference", reference_conv)):
            inputs = [t.clone().requires_grad_() for t in leaves]
            _, final = conv(*inputs, True)
            (final * dstate).sum().backward()
            grads[name] = [torch.zeros_like(t) if t.grad is None else t.grad for t in inputs]
        for got, want in zip(grads["kernel"], grads["reference"]):
            assert torch.equal(got, want)


@pytest.mark.parametrize("silu", [True, False])
def test_bf16_inputs_with_dpre_stored_in_bf16_match_the_fp32_reference(silu):
    """x in bf16: dpre is kept in bf16 between the two passes; the gradients stay within bf16's tolerance."""
    if CUDA:
        pytest.skip("on a GPU the compiled kernel is tested below")
    assert_conv_matches(2, 45, 12, 4, silu, True, True, dtype=torch.bfloat16, tol=2e-2, seed=11)


def test_kernel_sizes_up_to_eight_and_wrong_shapes_say_what_they_need():
    if CUDA:
        pytest.skip("on a GPU the compiled kernel is tested below")
    assert_conv_matches(1, 11, 6, 8, True, True, True, seed=8)
    with pytest.raises(ValueError, match="kernel sizes 2 to 8"):
        fused_conv()(torch.zeros(1, 3, 4), torch.zeros(4, 9))
    with pytest.raises(ValueError, match="initial_state must be"):
        fused_conv()(torch.zeros(1, 3, 4), torch.zeros(4, 3), None, torch.zeros(1, 4, 2))


def test_dispatch_uses_the_reference_for_cpu_tensors_kernels_torch_and_float64():
    assert kernels.causal_conv1d_fn("auto", torch.zeros(1)) is None
    assert kernels.causal_conv1d_fn("torch", torch.zeros(1)) is None
    assert kernels.causal_conv1d_fn("auto", torch.zeros(1), covered=False) is None
    assert kernels.causal_conv1d_gap(4) is None and kernels.causal_conv1d_gap(2) is None
    assert "kernel size" in kernels.causal_conv1d_gap(9)


MIXER_CONFIGS = {
    "2mamba": {"mixer": "2mamba"},
    "conv3-silu": {"mixer": "linear", "mixer_options": {"conv_size": 3, "conv_activation": "silu"}},
    "mamba2": {"mixer": "mamba2", "mixer_options": {"chunk_size": 16, "state_size": 16, "n_groups": 2}},
}


def mixer_model(setup: str, device="cpu", **overrides) -> AttnLabForCausalLM:
    torch.manual_seed(0)
    config = AttnLabConfig(vocab_size=97, hidden_size=32, num_layers=2, num_heads=2, max_position_embeddings=512,
                           **MIXER_CONFIGS[setup], **overrides)
    return AttnLabForCausalLM(config).to(device).eval()


def padded_batch(device, length=23):
    ids = torch.randint(0, 97, (2, length), generator=torch.Generator().manual_seed(1)).to(device)
    mask = torch.ones_like(ids)
    mask[0, :6] = 0
    return ids, mask


def forward_and_grads(model, ids, mask, split=15):
    """Logits of a left-padded batch with their gradients, and the logits of a prefill continuing a cache
    then of one decoding step."""
    model.zero_grad()
    out = model(input_ids=ids, attention_mask=mask)
    (out.logits.float() * mask[..., None]).square().mean().backward()
    with torch.no_grad():
        first = model(input_ids=ids[:, :split], attention_mask=mask[:, :split], use_cache=True)
        rest = model(input_ids=ids[:, split:-1], attention_mask=mask[:, :-1], cache=first.past_key_values, use_cache=True)
        step = model(input_ids=ids[:, -1:], attention_mask=mask, cache=rest.past_key_values, use_cache=True)
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach().float(), rest.logits.float(), step.logits.float(), grads


def assert_mixer_on_the_kernel_matches(setup, device, monkeypatch, tol_out, tol_grad, dtype=None):
    """The same model (kernels 'torch' everywhere else) with its conv on the reference, then on the
    kernel through the mixer's one dispatch point: a left-padded batch with its gradients, a prefill
    continuing a cache and a decoding step."""
    model = mixer_model(setup, device, kernels="torch")
    ids, mask = padded_batch(device)
    autocast = torch.autocast(device, dtype=dtype or torch.bfloat16, enabled=dtype is not None)
    with autocast:
        ref = forward_and_grads(model, ids, mask)
    calls = []

    def kernel_for_every_tensor(choice, x, covered=True):
        calls.append(x.shape[1])
        return fused_conv()

    with monkeypatch.context() as patch:
        patch.setattr(kernels, "causal_conv1d_fn", kernel_for_every_tensor)
        with autocast:
            fast = forward_and_grads(model, ids, mask)
    assert 1 in calls and ids.shape[1] in calls  # the parallel form and a decoding step both ran the kernel
    keep = mask.bool()
    assert rel_err(fast[0][keep], ref[0][keep]) <= tol_out
    assert rel_err(fast[1], ref[1]) <= tol_out and rel_err(fast[2], ref[2]) <= tol_out
    assert set(fast[3]) == set(ref[3])
    largest = max(float(g.abs().max()) for g in ref[3].values())
    for key in fast[3]:
        if dtype is not None and key.endswith("decay_proj.weight"):
            # under a sum denominator each query's own decay cancels: this gradient is a small remainder
            # (1e-6 beside gradients near 1e-1) that bf16 rounding dominates; bounded against the largest
            assert float((fast[3][key] - ref[3][key]).abs().max()) <= tol_grad * largest, key
            continue
        assert rel_err(fast[3][key], ref[3][key]) <= tol_grad, (key, rel_err(fast[3][key], ref[3][key]))


@pytest.mark.parametrize("setup", list(MIXER_CONFIGS))
def test_mixers_on_the_kernel_equal_the_reference_with_padding_a_continued_cache_and_a_step(setup, monkeypatch):
    if CUDA:
        pytest.skip("on a GPU the compiled kernel is tested below")
    assert_mixer_on_the_kernel_matches(setup, "cpu", monkeypatch, 1e-5, 1e-4)


def test_a_kernel_size_the_kernel_does_not_cover_falls_back_with_one_line_when_built():
    with pytest.warns(UserWarning, match="kernel size"):
        model = AttnLabForCausalLM(AttnLabConfig(vocab_size=97, hidden_size=32, num_layers=2, num_heads=2, mixer="mamba2",
                                                 mixer_options={"conv_kernel": 9, "state_size": 8}))
    assert model.model.layers[0].attn.conv_gap


# ---------------------------------------------------------------- CUDA, compiled, bf16

@pytest.mark.parametrize("K", [4, 2])
@pytest.mark.parametrize("silu, with_state", [(True, True), (False, False)])
@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_kernel_in_bf16_matches_the_fp32_reference_on_cuda(K, silu, with_state):
    """The attention family's width at hidden 1024 (3 * 1024 channels), over 1000 steps."""
    assert_conv_matches(2, 1000, 3072, K, silu, with_state, True, device="cuda", dtype=torch.bfloat16, tol=2e-2, seed=K)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_kernel_with_a_channel_major_state_and_short_inputs_matches_on_cuda():
    """Mamba-2's cache layout, decoding steps (T = 1) and prefills shorter than the window."""
    for T in (1, 2, 3, 515):
        assert_conv_matches(3, T, 2176, 4, True, True, True, device="cuda", dtype=torch.bfloat16, tol=2e-2, seed=T, channel_major=True)


@pytest.mark.parametrize("silu", [True, False])
@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_backward_on_mamba2s_strided_projection_matches_on_cuda(silu):
    """Mamba-2's conv as it trains (hidden 1024): x a column slice (2176 channels) of the in_proj output
    (4256), 4096 steps, bf16, bias, no state: the dpre pass walks 16 time tiles per program."""
    from attnlab.models.kernels.common import conv

    B, T, C, K = 2, 4096, 2176, 4
    assert B * triton_cdiv(C, 128) * triton_cdiv(T, 16 * conv.BWD_BLOCK_T) >= conv.BWD_MIN_PROGRAMS
    leaves, dy, _ = conv_inputs(B, T, C, K, "cuda", seed=21, with_state=False)
    x, weight, bias, _ = leaves
    projection = torch.randn(B, T, 4256, device="cuda", dtype=torch.bfloat16)
    projection[..., 2048:2048 + C] = x.to(torch.bfloat16)
    projection.requires_grad_()
    weight_k, bias_k = weight.clone().requires_grad_(), bias.clone().requires_grad_()
    y, _ = fused_conv()(projection[..., 2048:2048 + C], weight_k, bias_k, None, silu)
    (y.float() * dy).sum().backward()
    x_ref, weight_ref, bias_ref = (t.clone().requires_grad_() for t in (projection[..., 2048:2048 + C].detach().float(), weight, bias))
    y_ref, _ = reference_conv(x_ref, weight_ref, bias_ref, None, silu)
    (y_ref * dy).sum().backward()
    assert rel_err(y, y_ref) <= 2e-2
    assert rel_err(projection.grad[..., 2048:2048 + C], x_ref.grad) <= 2e-2
    assert not projection.grad[..., :2048].any() and not projection.grad[..., 2048 + C:].any()
    assert rel_err(weight_k.grad, weight_ref.grad) <= 2e-2 and rel_err(bias_k.grad, bias_ref.grad) <= 2e-2


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_kernel_in_fp32_matches_the_reference_closely_on_cuda():
    assert_conv_matches(2, 333, 200, 4, True, True, True, device="cuda", tol=1e-5, seed=4)


@pytest.mark.parametrize("setup", list(MIXER_CONFIGS))
@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_mixers_on_the_kernel_match_the_reference_on_cuda(setup, monkeypatch):
    """Same weights, the conv on the reference and on the kernel: fp32 closely, and under bf16 autocast."""
    assert kernels.causal_conv1d_fn("auto", torch.zeros(1, device="cuda")) is fused_conv()
    assert_mixer_on_the_kernel_matches(setup, "cuda", monkeypatch, 1e-4, 1e-3)
    # under autocast the reference rounds the conv weights to bf16 and the kernel keeps them in fp32: the two differ
    # by bf16 rounding through a layer (2.3e-2 measured on an H100 for 2mamba's prefill output)
    assert_mixer_on_the_kernel_matches(setup, "cuda", monkeypatch, 4e-2, 5e-2, dtype=torch.bfloat16)


@pytest.mark.parametrize("kernel_size", [2, 3, 4])
def test_the_one_token_step_advances_its_state_in_place(kernel_size):
    """`conv_step_` (a decoding step): the output and the last K - 1 inputs of `causal_conv1d`, the
    state written where it lies, also as a view into a wider buffer."""
    from attnlab.models.kernels.common.conv import causal_conv1d, conv_step_

    gen = torch.Generator().manual_seed(kernel_size)
    batch, channels = 3, 40
    weight, bias = torch.randn(channels, kernel_size, generator=gen), torch.randn(channels, generator=gen)
    state, x = torch.randn(batch, kernel_size - 1, channels, generator=gen), torch.randn(batch, 1, channels, generator=gen)
    y_ref, final = causal_conv1d(x, weight, bias, state.clone(), silu=True)
    wide = torch.zeros(batch, kernel_size - 1, 2 * channels)
    view = wide[:, :, :channels]
    view.copy_(state)
    y = conv_step_(x, weight, bias, view, True)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(view, final)
    assert wide[:, :, channels:].eq(0).all()
    with pytest.raises(ValueError, match="one token|\\[B, 1, C\\]"):
        conv_step_(torch.randn(batch, 2, channels), weight, bias, view, True)
