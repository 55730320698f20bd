"""attnlab's attention-family kernels (`models/kernels/attention_family/parallel.py`) against the pure-PyTorch
reference: through Triton's interpreter on CPU (TRITON_INTERPRET=1, small shapes), and compiled on a
CUDA GPU in bf16 for every registered preset (marked `cuda`, skipped without a GPU)."""

import pytest
import torch
import torch.nn.functional as F

from attnlab.models import AttnLabConfig, AttnLabForCausalLM, kernels
from attnlab.models.mixers import MIXERS
from attnlab.models.mixers.attention_family import AttentionFamily
from attnlab.models.ops.attention_family import attention_terms as reference_terms

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # numpy's, from inside Triton's interpreter
CUDA = torch.cuda.is_available()  # without one, the kernels run through Triton's interpreter (tests/conftest.py)

FAMILY_PRESETS = sorted(name for name, cls in MIXERS.items() if issubclass(cls, AttentionFamily) and hasattr(cls, "preset_options"))
# the option combinations the kernels see (similarity, clamp, denominator, decay): one case each
KERNEL_CASES = sorted({
    (o["similarity"], o["clamp_scores"], o["denominator"], o["decay"] != "none")
    for o in (MIXERS[name].resolve_options(None) for name in FAMILY_PRESETS)
}, key=str)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def fused_terms():
    from attnlab.models.kernels.attention_family.parallel import attention_terms

    return attention_terms


def terms_inputs(case, batch, num_queries, past, heads, dim, device, seed):
    """Random q, k, v, decay terms and a left-padding key mask for one option combination."""
    similarity, clamp, denominator, decay = case
    g = torch.Generator(device=device).manual_seed(seed)
    num_keys = num_queries + past
    q = torch.randn(batch, num_queries, heads, dim, device=device, generator=g)
    k = torch.randn(batch, num_keys, heads, dim, device=device, generator=g)
    v = torch.randn(batch, num_keys, heads, dim, device=device, generator=g)
    if similarity == "power1" and denominator in ("sum", "sum_clamped", "sum_detached"):
        q, k = F.elu(q) + 1, F.elu(k) + 1  # the non-negative feature map such presets use
    cq = ck = None
    if decay:
        c = (-F.softplus(torch.randn(batch, num_keys, heads, device=device, generator=g))).cumsum(1)
        cq, ck = c[:, past:].clone(), c
    key_mask = torch.ones(batch, num_keys, dtype=torch.bool, device=device)
    key_mask[0, : num_keys // 3] = False  # a left-padded row
    kwargs = dict(similarity=similarity, scale=dim**-0.5, clamp=clamp, taylor_terms=80, denominator=denominator)
    return [q, k, v, cq, ck], key_mask, kwargs


def run_terms(terms, leaves, key_mask, kwargs, dtype, grad_out):
    """o = num / den (0 where den is 0) and the gradients of (o * grad_out).sum() wrt every leaf."""
    inputs = [None if t is None else t.clone().requires_grad_() for t in leaves]
    cast = [t if t is None or i >= 3 else t.to(dtype) for i, t in enumerate(inputs)]
    num, den = terms(*cast[:3], query_log_decay=cast[3], key_log_decay=cast[4], key_mask=key_mask, **kwargs)
    o = num if den is None else num / torch.where(den == 0, torch.ones_like(den), den)
    (o.float() * grad_out).sum().backward()
    return o, [t.grad for t in inputs if t is not None]


def assert_terms_match(case, batch, num_queries, past, heads, dim, device, dtype, tol, seed=0):
    leaves, key_mask, kwargs = terms_inputs(case, batch, num_queries, past, heads, dim, device, seed)
    for mask in (None, key_mask):
        grad_out = torch.randn(batch, heads, num_queries, dim, device=device, generator=torch.Generator(device=device).manual_seed(seed + 1))
        ref_o, ref_grads = run_terms(reference_terms, leaves, mask, kwargs, torch.float32, grad_out)
        o, grads = run_terms(fused_terms(), leaves, mask, kwargs, dtype, grad_out)
        assert rel_err(o, ref_o) <= tol, (case, "output", rel_err(o, ref_o))
        names = ["q", "k", "v", "query decay", "key decay"]
        for name, fast, ref in zip(names, grads, ref_grads):
            if name == "query decay" and kwargs["denominator"] == "sum":
                # under a plain sum the query's own decay cancels: its gradient is 0 up to rounding
                assert float(fast.abs().max()) <= tol * float(ref_grads[0].abs().max()) + 1e-3
                continue
            assert rel_err(fast, ref) <= tol, (case, name, rel_err(fast, ref))


# ---------------------------------------------------------------- CPU, through Triton's interpreter


@pytest.mark.parametrize("case", KERNEL_CASES, ids=str)
@pytest.mark.parametrize("num_queries, past", [(37, 0), (21, 13)])
def test_kernels_match_the_reference_through_the_interpreter(case, num_queries, past):
    pytest.importorskip("triton")
    if CUDA:
        pytest.skip("on a GPU the compiled kernels are tested below")
    assert_terms_match(case, 2, num_queries, past, 2, 16, "cpu", torch.float32, 1e-4)


@pytest.mark.parametrize("terms", [2, 5, 80])
def test_taylor_kernel_uses_exp_only_where_the_series_equals_it(terms):
    pytest.importorskip("triton")
    from attnlab.models.kernels.attention_family.parallel import taylor_exp_range
    from attnlab.models.ops.attention_family import taylor_series_exp

    lo, hi = taylor_exp_range(terms)
    if lo > hi:
        assert terms < 10  # too few terms: the kernel always sums the series
        return
    x = torch.linspace(lo, hi, 1001, dtype=torch.float64)
    for n in (terms, terms - 1):  # the series and its derivative, to a few fp32 ulps between the checked points
        assert float(((taylor_series_exp(x, n) - x.exp()) / x.exp()).abs().max()) <= 2.0**-22
    assert lo < -10 and hi > 10


@pytest.mark.parametrize("similarity, scores_scale", [("taylor", 8.0), ("power2", 1.0)])
def test_kernels_match_the_reference_with_scores_far_from_zero(similarity, scores_scale):
    """Large scores: the truncated series leaves exp's range (summed in float64 there, as the reference)."""
    pytest.importorskip("triton")
    if CUDA:
        pytest.skip("on a GPU the compiled kernels are tested below")
    leaves, key_mask, kwargs = terms_inputs((similarity, None, "sum", False), 1, 19, 0, 2, 16, "cpu", seed=3)
    leaves[0] = leaves[0] * scores_scale
    grad_out = torch.randn(1, 2, 19, 16)
    ref_o, ref_grads = run_terms(reference_terms, leaves, None, kwargs, torch.float32, grad_out)
    o, grads = run_terms(fused_terms(), leaves, None, kwargs, torch.float32, grad_out)
    assert rel_err(o, ref_o) <= 1e-4
    for fast, ref in zip(grads, ref_grads):
        assert rel_err(fast, ref) <= 1e-4


def family_config(name: str, hidden: int, heads: int, **overrides) -> AttnLabConfig:
    return AttnLabConfig(vocab_size=97, hidden_size=hidden, num_layers=2, num_heads=heads, mixer=name, max_position_embeddings=512, **overrides)


@pytest.mark.parametrize("name", ["2mamba", "2mamba-e", "gated_softmax", "linear_cosine", "softmax_detach_denom_gate"])
def test_model_on_the_kernels_equals_the_reference_with_padding_and_a_continued_cache(name, monkeypatch):
    """The mixer's one dispatch point: a left-padded batch, its gradients, and a prefill continuing a cache."""
    pytest.importorskip("triton")
    if CUDA:
        pytest.skip("on a GPU the compiled kernels are tested below")
    torch.manual_seed(0)
    model = AttnLabForCausalLM(family_config(name, 32, 2)).eval()
    ids = torch.randint(0, 97, (2, 23))
    mask = torch.ones_like(ids)
    mask[0, :6] = 0

    def forward_and_grads():
        model.zero_grad()
        out = model(input_ids=ids, attention_mask=mask)
        first = model(input_ids=ids[:, :15], attention_mask=mask[:, :15], use_cache=True)
        rest = model(input_ids=ids[:, 15:], attention_mask=mask, cache=first.past_key_values, use_cache=True)
        (out.logits * mask[..., None]).square().mean().backward()
        return out.logits.detach(), rest.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ref_logits, ref_rest, ref_grads = forward_and_grads()
    monkeypatch.setattr(kernels, "attention_family_terms", lambda choice, x, covered=True: fused_terms())
    logits, rest, grads = forward_and_grads()
    assert rel_err(logits[mask.bool()], ref_logits[mask.bool()]) <= 1e-4
    assert rel_err(rest, ref_rest) <= 1e-4
    assert set(grads) == set(ref_grads)
    for key in grads:
        assert rel_err(grads[key], ref_grads[key]) <= 1e-3, key


def test_a_head_dim_the_kernels_do_not_cover_falls_back_with_one_line_when_built():
    with pytest.warns(UserWarning, match="do not cover head dims above 256"):
        model = AttnLabForCausalLM(family_config("2mamba-e", 1024, 2))
    layer = model.model.layers[0].attn
    assert layer.kernel_gap and kernels.attention_family_terms("auto", torch.zeros(1), covered=False) is reference_terms


def test_float64_inputs_run_the_reference_and_say_so():
    pytest.importorskip("triton")
    leaves, key_mask, kwargs = terms_inputs(("exp", None, "sum", True), 1, 9, 0, 2, 16, "cpu", seed=5)
    q, k, v, cq, ck = (t.double() for t in leaves)
    with pytest.warns(UserWarning, match="no float64"):
        num, den = fused_terms()(q, k, v, query_log_decay=cq, key_log_decay=ck, key_mask=key_mask, **kwargs)
    ref_num, ref_den = reference_terms(q, k, v, query_log_decay=cq, key_log_decay=ck, key_mask=key_mask, **kwargs)
    assert torch.equal(num, ref_num) and torch.equal(den, ref_den)


def test_cpu_tensors_and_kernels_torch_use_the_reference():
    assert kernels.attention_family_terms("auto", torch.zeros(1)) is reference_terms
    assert kernels.attention_family_terms("torch", torch.zeros(1)) is reference_terms


# ---------------------------------------------------------------- CUDA, compiled, bf16

@pytest.mark.parametrize("case", KERNEL_CASES, ids=str)
@pytest.mark.parametrize("num_queries, past", [(300, 0), (1000, 0), (77, 300)])
@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_kernels_in_bf16_match_the_fp32_reference_on_cuda(case, num_queries, past):
    assert_terms_match(case, 2, num_queries, past, 4, 64, "cuda", torch.bfloat16, 2e-2, seed=num_queries + past)


@pytest.mark.parametrize("case", [("exp", None, "sum", True), ("power2", None, "sum", True), ("exp", 5.0, "count", False)], ids=str)
@pytest.mark.parametrize("dim", [128, 256])
@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_kernels_with_wide_heads_match_the_fp32_reference_on_cuda(case, dim):
    """Head dims above 64 take other block shapes (tuned between two on first use)."""
    assert_terms_match(case, 1, 333, 0, 2, dim, "cuda", torch.bfloat16, 2e-2, seed=dim)


@pytest.mark.parametrize("name", FAMILY_PRESETS)
@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_every_preset_on_cuda_matches_the_fp32_reference_padded_and_with_a_continued_cache(name):
    """bf16 autocast on the kernels against the fp32 reference (kernels 'torch') with the same weights:
    logits of a left-padded batch of odd length, every parameter's gradient, and a prefill after cached tokens."""
    torch.manual_seed(0)
    ref_model = AttnLabForCausalLM(family_config(name, 256, 4, kernels="torch")).cuda().train()
    model = AttnLabForCausalLM(family_config(name, 256, 4)).cuda().train()
    model.load_state_dict(ref_model.state_dict())
    ids = torch.randint(0, 97, (2, 333), device="cuda")
    mask = torch.ones_like(ids)
    mask[0, :50] = 0
    bf16_ref_model = AttnLabForCausalLM(family_config(name, 256, 4, kernels="torch")).cuda().train()
    bf16_ref_model.load_state_dict(ref_model.state_dict())
    results = []
    for lm, autocast in ((ref_model, False), (model, True), (bf16_ref_model, True)):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            out = lm(input_ids=ids, attention_mask=mask)
            (out.logits.float() * mask[..., None]).square().mean().backward()
            with torch.no_grad():
                first = lm(input_ids=ids[:, :200], attention_mask=mask[:, :200], use_cache=True)
                rest = lm(input_ids=ids[:, 200:], attention_mask=mask, cache=first.past_key_values, use_cache=True)
        results.append((out.logits.float(), rest.logits.float(), {n: p.grad for n, p in lm.named_parameters() if p.grad is not None}))
    (ref_logits, ref_rest, ref_grads), (logits, rest, grads), (_, _, bf16_ref_grads) = results
    keep = mask.bool()
    assert rel_err(logits[keep], ref_logits[keep]) <= 2e-2
    assert rel_err(rest, ref_rest) <= 2e-2
    # Relative to each gradient, floored at 1% of the largest: some are near zero by construction
    # (a per-head gate before a per-head norm reaches the loss only through the norm's epsilon).
    # Within 5e-2, or within 1.5x of what the reference itself loses under the same bf16 autocast: an
    # unnormalised sum over the whole prefix (`linear_cosine`) loses more than 5e-2 in bf16 whoever computes it.
    floor = 1e-2 * max(float(g.norm()) for g in ref_grads.values())
    for key, ref in ref_grads.items():
        scale = max(float(ref.norm()), floor)
        err = float((grads[key].double() - ref.double()).norm()) / scale
        bf16_err = float((bf16_ref_grads[key].double() - ref.double()).norm()) / scale
        assert err <= max(5e-2, 1.5 * bf16_err), (key, err, bf16_err)


@pytest.mark.parametrize("denominator", ["none", "sum", "sum_clamped", "sum_detached", "sum_detached_eps", "count"])
def test_parallel_attention_divides_in_the_kernel_as_the_reference_does(denominator):
    """The fused division (o = num / finished den, written in the output dtype) against the reference's
    `_divide(_finish_denominator(...))`: outputs and gradients, with rows whose den is 0 (a query
    whose keys are all padding) and row sums under 1 (where the clamp holds)."""
    from attnlab.models.kernels.attention_family.parallel import divide
    from attnlab.models.ops.attention_family import parallel_attention

    device = "cuda" if CUDA else "cpu"
    g = torch.Generator(device=device).manual_seed(3)
    q, k, v = (torch.randn(2, 19, 2, 16, device=device, generator=g) for _ in range(3))
    q, k = F.elu(q) + 1, F.elu(k) + 1
    key_mask = torch.ones(2, 19, dtype=torch.bool, device=device)
    key_mask[0, :7] = False  # queries 0..6 of row 0 attend to nothing: den 0
    kwargs = dict(similarity="power1", scale=0.05, denominator=denominator, key_mask=key_mask)  # small scale: sums < 1
    grad_out = torch.randn(2, 19, 2, 16, device=device, generator=g)
    results = []
    for terms in (reference_terms, fused_terms()):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        o = parallel_attention(*leaves, terms=terms, out_dtype=torch.float32, **kwargs)
        (o * grad_out).sum().backward()
        results.append((o, [t.grad for t in leaves]))
    (ref_o, ref_grads), (o, grads) = results
    assert o.shape == ref_o.shape == (2, 19, 2, 16) and o.dtype == torch.float32
    assert rel_err(o, ref_o) < 1e-5
    for fast, ref in zip(grads, ref_grads):
        assert rel_err(fast, ref) < 1e-5
    num, den = fused_terms()(q, k, v, **kwargs)
    assert (divide(num, den, denominator, torch.bfloat16) is None) == (denominator == "count")
    if denominator == "none":  # nothing to divide by: the forward kernel writes the output itself, in the dtype asked for
        o16 = parallel_attention(q, k, v, terms=fused_terms(), out_dtype=torch.bfloat16, **kwargs)
        assert o16.dtype == torch.bfloat16 and o16.shape == (2, 19, 2, 16) and rel_err(o16.float(), ref_o) < 1e-2
