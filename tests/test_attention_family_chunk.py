"""The attention family's chunked, linear-time form (`models/kernels/attention_family/chunk.py`) against
the pure-PyTorch reference: outputs and gradients for every option combination of the linearizable
presets, padded and unpadded, T not a multiple of the chunk, several groups of chunks, a prefill
continuing a cache (the state handed on in the decoding layout), causality; the chunks' quadratic part
on attnlab's Triton kernels through the interpreter on CPU; every linearizable preset's model with the
mixer's dispatch choosing the chunked form; and, on a CUDA GPU, the bf16 fast path against the fp32
reference (marked `cuda`)."""

import functools

import pytest
import torch
import torch.nn.functional as F

from attnlab.models import AttnLabConfig, AttnLabForCausalLM, kernels
from attnlab.models.kernels.attention_family.chunk import CHUNK_SIZES, _Power2Features, chunk_attention, chunk_attention_recomputable
from attnlab.models.mixers import MIXERS
from attnlab.models.mixers.attention_family import AttentionFamily, is_linearizable
from attnlab.models.ops.attention_family import (
    FUSED_FIRST_CHUNK,
    chunk_linear_attention,
    linear_features,
    log_decay_cumsum,
    parallel_attention,
)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # numpy's, from inside Triton's interpreter
CUDA = torch.cuda.is_available()

LINEARIZABLE = sorted(
    name for name, cls in MIXERS.items()
    if issubclass(cls, AttentionFamily) and hasattr(cls, "preset_options") and is_linearizable(cls.resolve_options(None))
)
# what the chunked form sees of a linearizable preset: (similarity, denominator, decay); the sum denominators
# other than "sum" and "count" (without a power) are no preset's but are the same products
CASES = sorted({
    (o["similarity"], o["denominator"], o["decay"] != "none")
    for o in (MIXERS[name].resolve_options(None) for name in LINEARIZABLE)
} | {(s, d, decay) for s in ("power1", "power2") for d in ("sum_clamped", "sum_detached_eps", "count") for decay in (False, True)},
    key=str)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def case_inputs(case, batch, seq_len, heads, dim, device="cpu", seed=0, masked=False):
    """q, k, v, per-token log-decays (or None) and a left-padding mask (or None), padding zeroed as the mixer zeroes it."""
    similarity, denominator, decay = case
    g = torch.Generator(device=device).manual_seed(seed)
    q, k, v = (torch.randn(batch, seq_len, heads, dim, device=device, generator=g) for _ in range(3))
    if similarity == "power1" and denominator.startswith("sum"):
        q, k = F.elu(q) + 1, F.elu(k) + 1  # the non-negative feature map such presets use
    log_decay = -F.softplus(torch.randn(batch, seq_len, heads, device=device, generator=g)) if decay else None
    mask = None
    if masked:
        mask = torch.ones(batch, seq_len, dtype=torch.bool, device=device)
        mask[0, : seq_len // 3] = False
        k, v = k * mask[..., None, None], v * mask[..., None, None]
        if log_decay is not None:
            log_decay = log_decay * mask[..., None]
    return q, k, v, log_decay, mask


def reference_and_chunked(case, q, k, v, log_decay, mask, grad_seed=1, dtype=None, autocast=False, **chunk_kwargs):
    """(reference o, its gradients), (chunked o, its gradients): gradients of (o * r).sum() for a random r
    wrt q, k, v and the log-decays; the reference in fp32 from fp32 inputs, the chunked form from `dtype`."""
    similarity, denominator, _ = case
    count_power = torch.sigmoid(torch.randn(q.shape[2], device=q.device)) if denominator == "count_power" else None
    kwargs = dict(similarity=similarity, scale=q.shape[-1] ** -0.5, denominator=denominator, count_power=count_power)
    inputs = [t for t in (q, k, v, log_decay) if t is not None]
    grad_out = torch.randn(v.shape, device=q.device, generator=torch.Generator(device=q.device).manual_seed(grad_seed))
    leaves = [t.clone().requires_grad_() for t in inputs]
    c = log_decay_cumsum(leaves[3]) if log_decay is not None else None
    ref = parallel_attention(*leaves[:3], query_log_decay=c, key_log_decay=c, key_mask=mask, **kwargs)
    ref_grads = torch.autograd.grad((ref * grad_out).sum(), leaves)
    leaves = [t.clone().requires_grad_() for t in inputs]
    cast = [t.to(dtype) if dtype is not None and i < 3 else t for i, t in enumerate(leaves)]
    with torch.autocast(q.device.type, dtype=torch.bfloat16, enabled=autocast):
        o, _, _ = chunk_attention(*cast[:3], cast[3] if log_decay is not None else None, key_mask=mask, **kwargs, **chunk_kwargs)
    grads = torch.autograd.grad((o.float() * grad_out).sum(), leaves)
    return (ref, ref_grads), (o, grads)


# bf16's bound on the gradients: with a sum denominator the gradient of the features is the difference of the
# values' part and the normaliser column's (d(num / den)), each from bf16 operands (0.9e-2 for the quadratic
# form alone, 2.1e-2 chunked, at the CPU test's shape); the outputs keep 2e-2
BF16_GRAD_TOLERANCE = 3e-2


def assert_close(reference, chunked, tol, what, grad_tol=None):
    (ref, ref_grads), (o, grads) = reference, chunked
    assert rel_err(o, ref) <= tol, (what, "output", rel_err(o, ref))
    for name, fast, slow in zip(["q", "k", "v", "log-decay"], grads, ref_grads):
        assert rel_err(fast, slow) <= (grad_tol or tol), (what, name, rel_err(fast, slow))


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("masked", [False, True], ids=["unpadded", "padded"])
def test_chunked_outputs_and_gradients_match_the_reference(case, masked):
    """37 tokens in chunks of 8 (the last one short), two chunks a group: five chunks in three groups."""
    q, k, v, log_decay, mask = case_inputs(case, 2, 37, 2, 8, masked=masked)
    reference, chunked = reference_and_chunked(case, q, k, v, log_decay, mask, chunk_size=8, group_chunks=2)
    assert_close(reference, chunked, 1e-5, case)


@pytest.mark.parametrize("case", [("power2", "sum", True), ("power1", "sum", False), ("power2", "none", False)], ids=str)
def test_bf16_inputs_under_autocast_stay_within_bf16_tolerance_of_the_fp32_reference(case):
    """bf16 q, k, v under (CPU) autocast, as a model trains on CUDA: the products run in bf16, the states
    and sums in fp32; outputs and gradients within 2e-2 of the fp32 reference."""
    q, k, v, log_decay, mask = case_inputs(case, 2, 100, 2, 16, masked=True)
    reference, chunked = reference_and_chunked(case, q, k, v, log_decay, mask, dtype=torch.bfloat16, autocast=True,
                                               chunk_size=16, group_chunks=3)
    assert_close(reference, chunked, 2e-2, case, grad_tol=BF16_GRAD_TOLERANCE)


@pytest.mark.parametrize("case", [("power2", "sum", True), ("power1", "none", False)], ids=str)
def test_the_split_into_chunks_and_groups_does_not_change_the_result(case):
    q, k, v, log_decay, mask = case_inputs(case, 1, 50, 2, 8, masked=True)
    kwargs = dict(similarity=case[0], scale=8**-0.5, denominator=case[1], key_mask=mask)
    outputs = [chunk_attention(q, k, v, log_decay, chunk_size=chunk, group_chunks=group, **kwargs)[0]
               for chunk, group in ((16, 1), (16, 4), (8, 3), (64, 1))]
    for o in outputs[1:]:
        assert rel_err(o, outputs[0]) <= 1e-6


@pytest.mark.parametrize("case", [("power1", "sum", True), ("power2", "sum", True), ("power2", "none", False),
                                  ("power1", "count", True), ("power2", "count_power", True)], ids=str)
@pytest.mark.parametrize("packed", [False, True], ids=["full", "packed"])
def test_a_prefill_after_cached_tokens_continues_the_state_in_the_decoding_layout(case, packed, chunk_size=8):
    """The state and normaliser of 10 earlier tokens in, 29 tokens on: outputs, the state and normaliser
    handed on (power2's packed d (d + 1) / 2 rows or full d^2) as the reference prefill computes them."""
    similarity, denominator, _ = case
    q, k, v, log_decay, _ = case_inputs(case, 2, 39, 2, 8)
    count_power = torch.sigmoid(torch.randn(2)) if denominator == "count_power" else None
    kwargs = dict(similarity=similarity, scale=8**-0.5, denominator=denominator, count_power=count_power, packed=packed)
    head = slice(0, 10)
    tail = slice(10, None)
    decay = (lambda part: None) if log_decay is None else (lambda part: log_decay[:, part])
    _, state, normalizer = chunk_linear_attention(q[:, head], k[:, head], v[:, head], decay(head), None, None,
                                                  torch.zeros(2, dtype=torch.long), **kwargs)
    before = torch.full((2,), 10)
    ref = chunk_linear_attention(q[:, tail], k[:, tail], v[:, tail], decay(tail), state, normalizer, before, **kwargs)
    got = chunk_attention(q[:, tail], k[:, tail], v[:, tail], decay(tail), state=state, normalizer=normalizer,
                          count_before=before, chunk_size=chunk_size, group_chunks=2, **kwargs)
    assert got[1].shape == ref[1].shape
    for name, fast, slow in zip(("output", "state", "normalizer"), got, ref):
        assert (fast is None) == (slow is None), name
        if fast is not None:
            assert rel_err(fast, slow) <= 1e-5, (name, rel_err(fast, slow))


@pytest.mark.parametrize("case", [("power2", "sum", True), ("power1", "sum", False), ("power2", "none", False)], ids=str)
def test_gradients_reach_the_earlier_state_and_flow_from_the_state_handed_on(case, chunk_size=8):
    """A loss on the outputs and on the state and normaliser handed on: the gradients of q, k, v, the
    log-decays and the earlier state and normaliser, as the differentiable reference prefill gives them."""
    similarity, denominator, _ = case
    q, k, v, log_decay, _ = case_inputs(case, 2, 27, 2, 8)
    features = 8 if similarity == "power1" else 36
    g = torch.Generator().manual_seed(4)
    state = torch.randn(2, 2, features, 8, generator=g)
    normalizer = torch.rand(2, 2, features, generator=g) if denominator == "sum" else None
    if similarity == "power1":
        state = state.abs()
    weights = [torch.randn(2, 27, 2, 8, generator=g), torch.randn(2, 2, features, 8, generator=g),
               torch.randn(2, 2, features, generator=g)]
    kwargs = dict(similarity=similarity, scale=8**-0.5, denominator=denominator, packed=True)
    inputs = [t for t in (q, k, v, log_decay, state, normalizer) if t is not None]

    def grads(fn):
        leaves = [t.clone().requires_grad_() for t in inputs]
        named = dict(zip([n for n, t in zip("q k v log_decay state normalizer".split(), (q, k, v, log_decay, state, normalizer))
                          if t is not None], leaves))
        o, s, z = fn(named)
        loss = (o * weights[0]).sum() + (s * weights[1]).sum() + (0 if z is None else (z * weights[2]).sum())
        return torch.autograd.grad(loss, leaves)

    before = torch.full((2,), 5)
    ref = grads(lambda t: chunk_linear_attention(t["q"], t["k"], t["v"], t.get("log_decay"), t["state"], t.get("normalizer"),
                                                 before, chunk_size=27, **kwargs))
    got = grads(lambda t: chunk_attention(t["q"], t["k"], t["v"], t.get("log_decay"), state=t["state"],
                                          normalizer=t.get("normalizer"), count_before=before, chunk_size=chunk_size, group_chunks=2,
                                          **kwargs))
    for fast, slow in zip(got, ref):
        assert rel_err(fast, slow) <= 1e-5


@pytest.mark.parametrize("case", [("power2", "sum", True), ("power1", "count", False)], ids=str)
def test_chunked_outputs_are_causal(case, chunk_size=8):
    """Changing the tokens after position t, across chunk and group boundaries, leaves outputs through t."""
    q, k, v, log_decay, _ = case_inputs(case, 1, 40, 2, 8)
    kwargs = dict(similarity=case[0], scale=8**-0.5, denominator=case[1], chunk_size=chunk_size, group_chunks=2)
    o = chunk_attention(q, k, v, log_decay, **kwargs)[0]
    cut = 21
    q2, k2, v2 = (t.clone() for t in (q, k, v))
    for t in (q2, k2, v2):
        t[:, cut:] = torch.randn_like(t[:, cut:]).abs()
    decay2 = None if log_decay is None else torch.cat((log_decay[:, :cut], -torch.rand_like(log_decay[:, cut:])), 1)
    o2 = chunk_attention(q2, k2, v2, decay2, **kwargs)[0]
    assert torch.equal(o[:, :cut], o2[:, :cut])
    assert not torch.allclose(o[:, cut:], o2[:, cut:])


def test_power2_features_and_their_gradient_match_the_outer_product():
    """The packed features, doubled off the diagonal on the query side, give (q . k)^2, and their custom
    backward equals autograd's through the plain formula (float64 gradcheck)."""
    x = torch.randn(3, 5, 6, dtype=torch.float64, requires_grad=True)
    y = torch.randn(3, 5, 6, dtype=torch.float64)
    product = (_Power2Features.apply(x, True) * _Power2Features.apply(y, False)).sum(-1)
    assert torch.allclose(product, (x * y).sum(-1) ** 2)
    assert torch.allclose(_Power2Features.apply(x, False), linear_features(x, "power2", packed=True))
    for query in (False, True):
        assert torch.autograd.gradcheck(lambda t: _Power2Features.apply(t, query), (x,))


@pytest.mark.parametrize("head_dim", [8, 12])
@pytest.mark.parametrize("query", [False, True], ids=["key", "query"])
def test_power2_feature_kernels_match_pytorch_through_the_interpreter(query, head_dim):
    """power2's feature kernels (CUDA's path) on a strided [B, H, n, C, d] view, through Triton's interpreter:
    the features, and x's gradient from theirs."""
    pytest.importorskip("triton")
    if CUDA:
        pytest.skip("on a GPU the compiled kernels run in the tests below")
    from attnlab.models.kernels.attention_family import chunk as chunked

    x = torch.randn(2, 5, 37, 3, head_dim).permute(0, 3, 1, 2, 4)  # [B, H, n, C, d], a view of [B, n, C, H, d]
    features = chunked._features_triton(x, query)
    assert torch.allclose(features, chunked.power2_features(x, query))
    grad = torch.randn_like(features)
    assert torch.allclose(chunked._features_backward_triton(x, grad, query), chunked.power2_features_backward(x, grad, query),
                          rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", [("power2", "sum", True), ("power1", "none", True), ("power2", "count", False)], ids=str)
def test_chunks_on_the_triton_kernels_match_the_reference_through_the_interpreter(case, monkeypatch):
    """CUDA's path through Triton's interpreter on CPU: the chunks' quadratic part on attnlab's tiled kernels,
    power2's features on theirs; 45 tokens in chunks of 16, padded, outputs and gradients."""
    pytest.importorskip("triton")
    if CUDA:
        pytest.skip("on a GPU the compiled kernels are tested below")
    from attnlab.models.kernels.attention_family import chunk as chunked
    from attnlab.models.kernels.attention_family.parallel import attention_terms as fused

    monkeypatch.setattr(chunked, "_use_feature_kernels", lambda x: x.dim() == 5 and x.stride(-1) == 1)

    q, k, v, log_decay, mask = case_inputs(case, 2, 45, 2, 16, masked=True)
    reference, chunked = reference_and_chunked(case, q, k, v, log_decay, mask, chunk_size=16, group_chunks=2, intra_terms=fused)
    assert_close(reference, chunked, 1e-5, case)


def test_dispatch_chooses_the_chunked_form_only_for_long_linearizable_calls_on_cuda(monkeypatch):
    cpu = torch.zeros(1)
    assert kernels.attention_family_chunked("auto", cpu, 10**6, "power2") is None  # CPU: the reference
    monkeypatch.setattr(kernels, "use_triton", lambda choice, x, covered=True: choice != "torch")
    monkeypatch.setattr(kernels, "CHUNKED_MIN_TOKENS", {"power1": 2048, "power2": 8192})
    for similarity, threshold in kernels.CHUNKED_MIN_TOKENS.items():
        assert kernels.attention_family_chunked("auto", cpu, threshold, similarity) is chunk_attention_recomputable
        assert kernels.attention_family_chunked("auto", cpu, threshold - 1, similarity) is None
        assert kernels.attention_family_chunked("torch", cpu, threshold, similarity) is None
    for similarity in ("exp", "softmax", "taylor"):
        assert kernels.attention_family_chunked("auto", cpu, 10**6, similarity) is None
    # a prompt past the quadratic form's one chunk is chunked from there, whatever the training threshold
    monkeypatch.setattr(kernels, "CHUNKED_MIN_TOKENS", {"power1": 8192, "power2": 32768})
    first = FUSED_FIRST_CHUNK
    assert kernels.attention_family_chunked("auto", cpu, first + 1, "power2", prompt=True) is chunk_attention_recomputable
    assert kernels.attention_family_chunked("auto", cpu, first, "power2", prompt=True) is None
    assert kernels.attention_family_chunked("auto", cpu, first + 1, "power2") is None


def family_config(name: str, hidden: int, heads: int, **overrides) -> AttnLabConfig:
    return AttnLabConfig(**{"vocab_size": 97, "hidden_size": hidden, "num_layers": 2, "num_heads": heads, "mixer": name,
                            "max_position_embeddings": 2048, **overrides})


@pytest.mark.parametrize("recompute", [False, True], ids=["saved", "recomputed"])
@pytest.mark.parametrize("name", LINEARIZABLE)
def test_every_linearizable_preset_trains_and_prefills_chunked_as_the_reference(name, recompute, monkeypatch):
    """The mixer's dispatch point choosing the chunked form (chunks of 8 here): a left-padded batch of 23
    tokens and every parameter's gradient, a prefill of 8 more tokens continuing a cache of 15, and a
    decoding step after it, against the quadratic reference; with `RECOMPUTE_IN_BACKWARD` on too."""
    torch.manual_seed(0)
    model = AttnLabForCausalLM(family_config(name, 32, 2)).eval()
    ids = torch.randint(0, 97, (2, 24))
    mask = torch.ones_like(ids)
    mask[0, :6] = 0

    def forward_and_grads():
        model.zero_grad()
        out = model(input_ids=ids[:, :23], attention_mask=mask[:, :23])
        (out.logits * mask[:, :23, None]).square().mean().backward()
        with torch.no_grad():
            first = model(input_ids=ids[:, :15], attention_mask=mask[:, :15], use_cache=True)
            rest = model(input_ids=ids[:, 15:23], attention_mask=mask[:, :23], cache=first.past_key_values, use_cache=True)
            step = model(input_ids=ids[:, 23:], attention_mask=mask, cache=rest.past_key_values, use_cache=True)
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return out.logits.detach(), rest.logits, step.logits, grads

    reference = forward_and_grads()
    calls = []

    def chunked(choice, x, seq_len, similarity, prompt=False):
        calls.append(seq_len)
        return functools.partial(chunk_attention_recomputable, chunk_size=8, group_chunks=2) if seq_len > 1 else None

    from attnlab.models.kernels.attention_family import chunk as chunk_module

    monkeypatch.setattr(chunk_module, "RECOMPUTE_IN_BACKWARD", recompute)
    recomputed = []
    real = chunk_module.chunk_attention
    monkeypatch.setattr(chunk_module, "chunk_attention", lambda *a, **k: recomputed.append(torch.is_grad_enabled()) or real(*a, **k))

    monkeypatch.setattr(kernels, "attention_family_chunked", chunked)
    got = forward_and_grads()
    assert 23 in calls and 8 in calls
    if recompute:  # the training call's forward ran again in the backward (the two layers': 2 + 2), the prefill's once
        assert recomputed.count(True) == 4
    keep = mask[:, :23].bool()
    assert rel_err(got[0][keep], reference[0][keep]) <= 1e-4
    assert rel_err(got[1], reference[1]) <= 1e-4
    assert rel_err(got[2], reference[2]) <= 1e-4
    assert set(got[3]) == set(reference[3])
    for key in reference[3]:
        assert rel_err(got[3][key], reference[3][key]) <= 1e-3, key


# ---------------------------------------------------------------- power1 on the SSD kernels

POWER1_CASES = [c for c in CASES if c[0] == "power1"]


@pytest.fixture
def power1_on_ssd(monkeypatch):
    """power1's chunked form on the SSD kernels (`_power1_ssd`) for CPU tensors: Triton's interpreter."""
    pytest.importorskip("triton")
    if CUDA:
        pytest.skip("on a GPU the compiled kernels are tested below")
    from attnlab.models.kernels.attention_family import chunk as chunk_module

    calls = []
    monkeypatch.setattr(chunk_module, "power1_on_ssd", lambda q: calls.append(q.shape) or True)
    return calls


@pytest.mark.parametrize("case", POWER1_CASES, ids=str)
@pytest.mark.parametrize("masked", [False, True], ids=["unpadded", "padded"])
def test_power1_on_the_ssd_kernels_matches_the_reference(case, masked, power1_on_ssd):
    """37 tokens in chunks of 16 (the last one short), every denominator, with and without decay: outputs and
    the gradients of q, k, v and the log-decays, in fp32 (the kernels multiply in IEEE fp32 then)."""
    q, k, v, log_decay, mask = case_inputs(case, 2, 37, 2, 8, masked=masked)
    reference, chunked = reference_and_chunked(case, q, k, v, log_decay, mask, chunk_size=16)
    assert power1_on_ssd
    assert_close(reference, chunked, 1e-5, case)


@pytest.mark.parametrize("case", [("power1", "sum", False), ("power1", "none", True)], ids=str)
def test_power1_on_the_ssd_kernels_in_bf16_stays_within_bf16_tolerance(case, power1_on_ssd):
    q, k, v, log_decay, mask = case_inputs(case, 2, 100, 2, 16, masked=True)
    reference, chunked = reference_and_chunked(case, q, k, v, log_decay, mask, dtype=torch.bfloat16, autocast=True,
                                               chunk_size=32)
    assert_close(reference, chunked, 2e-2, case, grad_tol=BF16_GRAD_TOLERANCE)


@pytest.mark.parametrize("case", [("power1", "sum", True), ("power1", "sum", False), ("power1", "count", False),
                                  ("power1", "none", True)], ids=str)
def test_power1_on_the_ssd_kernels_continues_a_state_and_differentiates_it(case, power1_on_ssd):
    """The state and normaliser of earlier tokens in, 27 tokens on: the outputs, the state and normaliser handed
    on, and every gradient (the earlier state's too) as the differentiable reference prefill gives them."""
    similarity, denominator, _ = case
    q, k, v, log_decay, _ = case_inputs(case, 2, 27, 2, 8)
    g = torch.Generator().manual_seed(4)
    state = torch.randn(2, 2, 8, 8, generator=g).abs()
    normalizer = torch.rand(2, 2, 8, generator=g) if denominator == "sum" else None
    weights = [torch.randn(2, 27, 2, 8, generator=g), torch.randn(2, 2, 8, 8, generator=g), torch.randn(2, 2, 8, generator=g)]
    kwargs = dict(similarity=similarity, scale=8**-0.5, denominator=denominator)
    names = [n for n, t in zip("q k v log_decay state normalizer".split(), (q, k, v, log_decay, state, normalizer))
             if t is not None]
    inputs = [t for t in (q, k, v, log_decay, state, normalizer) if t is not None]
    before = torch.full((2,), 5)

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in inputs]
        o, s, z = fn(dict(zip(names, leaves)))
        loss = (o * weights[0]).sum() + (s * weights[1]).sum() + (0 if z is None else (z * weights[2]).sum())
        return (o, s, z), torch.autograd.grad(loss, leaves)

    ref = run(lambda t: chunk_linear_attention(t["q"], t["k"], t["v"], t.get("log_decay"), t["state"], t.get("normalizer"),
                                               before, chunk_size=27, **kwargs))
    got = run(lambda t: chunk_attention(t["q"], t["k"], t["v"], t.get("log_decay"), state=t["state"],
                                        normalizer=t.get("normalizer"), count_before=before, chunk_size=16, **kwargs))
    assert power1_on_ssd
    for name, fast, slow in zip(("output", "state", "normalizer"), got[0], ref[0]):
        assert (fast is None) == (slow is None), name
        if fast is not None:
            assert fast.shape == slow.shape and rel_err(fast, slow) <= 1e-5, (name, rel_err(fast, slow))
    for name, fast, slow in zip(names, got[1], ref[1]):
        assert rel_err(fast, slow) <= 1e-5, (name, rel_err(fast, slow))


@pytest.mark.parametrize("decay", [True, False], ids=["decay", "no decay"])
def test_power1_on_the_ssd_kernels_is_causal(decay, power1_on_ssd):
    case = ("power1", "sum", True)
    q, k, v, log_decay, _ = case_inputs(case, 1, 40, 2, 8)
    if not decay:
        log_decay = None
    kwargs = dict(similarity="power1", scale=8**-0.5, denominator="sum", chunk_size=16)
    o = chunk_attention(q, k, v, log_decay, **kwargs)[0]
    cut = 21
    q2, k2, v2 = (t.clone() for t in (q, k, v))
    for t in (q2, k2, v2):
        t[:, cut:] = torch.randn_like(t[:, cut:]).abs()
    later = None if log_decay is None else torch.cat((log_decay[:, :cut], -torch.rand_like(log_decay[:, cut:])), 1)
    o2 = chunk_attention(q2, k2, v2, later, **kwargs)[0]
    assert torch.equal(o[:, :cut], o2[:, :cut])
    assert not torch.allclose(o[:, cut:], o2[:, cut:])


def test_power1_runs_on_the_ssd_kernels_on_cuda_only():
    from attnlab.models.kernels.attention_family.chunk import SSD_MAX_HEAD_DIM, power1_on_ssd

    assert not power1_on_ssd(torch.zeros(1, 4, 2, 8))
    assert not power1_on_ssd(torch.zeros(1, 4, 2, 8, device="meta"))
    if CUDA:
        assert power1_on_ssd(torch.zeros(1, 4, 2, 8, device="cuda", dtype=torch.bfloat16))
        with pytest.warns(UserWarning, match="power1 kernels cover head dims up to"):  # the fallback says so
            assert not power1_on_ssd(torch.zeros(1, 4, 2, SSD_MAX_HEAD_DIM * 2, device="cuda"))


# ---------------------------------------------------------------- power2's state on its kernels

POWER2_CASES = [c for c in CASES if c[0] == "power2"]


@pytest.fixture
def power2_on_kernels(monkeypatch):
    """power2's state across chunks on `power2_states`' kernels for CPU tensors: Triton's interpreter. Returns the
    chunk sizes of the calls that took them."""
    pytest.importorskip("triton")
    if CUDA:
        pytest.skip("on a GPU the compiled kernels are tested below")
    from attnlab.models.kernels.attention_family import chunk as chunk_module
    from attnlab.models.kernels.attention_family import power2_states

    calls = []

    def on_kernels(q, value_dim, chunk):
        calls.append(chunk)
        return power2_states.covers(q.shape[-1], value_dim, chunk)

    monkeypatch.setattr(chunk_module, "power2_on_kernels", on_kernels)
    return calls


@pytest.mark.parametrize("case, masked", [(c, True) for c in POWER2_CASES]
                         + [(("power2", "sum", True), False), (("power2", "none", False), False)], ids=str)
def test_power2_state_kernels_match_the_reference(case, masked, power2_on_kernels):
    """37 tokens in chunks of 16 (the last one short), every denominator, with and without decay: outputs and the
    gradients of q, k, v and the log-decays (theirs through the kernels' dq . q and dk . k), in fp32."""
    q, k, v, log_decay, mask = case_inputs(case, 2, 37, 2, 8, masked=masked)
    reference, chunked = reference_and_chunked(case, q, k, v, log_decay, mask, chunk_size=16)
    assert power2_on_kernels == [16]
    assert_close(reference, chunked, 1e-5, case)


@pytest.mark.parametrize("keep, banded, split_from, prefetch, stepped",
                         [(True, True, 32, True, False), (False, False, 32, True, False), (True, False, 16, False, False),
                          (True, False, 128, True, False), (True, False, 32, True, True)],
                         ids=["states kept, output banded", "states walked again, output on full rows",
                              "every band split, nothing read ahead", "no band split", "full rows stepped"])
@pytest.mark.parametrize("head_dim", [24, 64], ids=lambda d: f"heads of {d}")
def test_power2_state_kernels_take_wider_heads_in_bands(head_dim, keep, banded, split_from, prefetch, stepped,
                                                        power2_on_kernels, monkeypatch):
    """Heads of 24 and 64: the state's packed rows in two and three bands of second indices (`_bands`) in the chunk
    kernel (one product per first index, or one for all, per band: `SPLIT_MIN_WIDTH`), and in the output and dv
    kernels or their full rows read from the packed ones (`BANDED`); the states kept from the forward or walked again
    in the backward (`KEEP_STATES`); the next step's columns read ahead or not (`PREFETCH`); dq's and dkdv's full rows
    found from the last ones (`STEPPED_ROWS`); outputs and gradients against the fp32 reference."""
    from attnlab.models.kernels.attention_family import power2_states

    monkeypatch.setattr(power2_states, "KEEP_STATES", keep)
    monkeypatch.setattr(power2_states, "BANDED", banded)
    monkeypatch.setattr(power2_states, "SPLIT_MIN_WIDTH", split_from)
    monkeypatch.setattr(power2_states, "PREFETCH", prefetch)
    monkeypatch.setattr(power2_states, "STEPPED_ROWS", stepped)
    assert len(power2_states._bands(head_dim)) == {24: 2, 64: 3}[head_dim]
    case = ("power2", "sum", True)
    q, k, v, log_decay, mask = case_inputs(case, 1, 40, 1, head_dim, masked=True)
    reference, chunked = reference_and_chunked(case, q, k, v, log_decay, mask, chunk_size=16)
    assert power2_on_kernels == [16]
    assert_close(reference, chunked, 1e-5, case)


@pytest.mark.parametrize("firsts, split_from", [(1, 16), (2, 16), (4, 16), (4, 32)],
                         ids=["one first index a program", "two", "four", "four, side by side"])
@pytest.mark.parametrize("value_dim", [24, 80], ids=["values narrower than a block", "values in two blocks"])
def test_power2_state_kernels_take_long_chunks_and_other_value_widths(value_dim, firsts, split_from,
                                                                      power2_on_kernels, monkeypatch):
    """Chunks of 128 (the chunk kernel's walk in several steps, the token kernels in blocks of 64), values wider
    and narrower than the heads and not a power of two, the chunk kernel's first indices one, two or four a program
    (`CHUNK_FIRSTS`), each its own product or side by side in one (`SPLIT_MIN_WIDTH`), in blocks of 64 value columns
    (`CHUNK_COLUMNS`): outputs, normaliser and gradients against the reference."""
    from attnlab.models.kernels.attention_family import power2_states

    monkeypatch.setattr(power2_states, "CHUNK_FIRSTS", firsts)
    monkeypatch.setattr(power2_states, "SPLIT_MIN_WIDTH", split_from)
    g = torch.Generator().manual_seed(3)
    q, k = (torch.randn(1, 300, 2, 8, generator=g) for _ in range(2))
    v = torch.randn(1, 300, 2, value_dim, generator=g)
    log_decay = -F.softplus(torch.randn(1, 300, 2, generator=g)) * 0.1
    grad_out = torch.randn(1, 300, 2, value_dim, generator=g)
    kwargs = dict(similarity="power2", scale=8**-0.5, denominator="sum")

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, log_decay)]
        o = fn(*leaves)
        return o, torch.autograd.grad((o * grad_out).sum(), leaves)

    def reference(q, k, v, log_decay):
        c = log_decay_cumsum(log_decay)
        return parallel_attention(q, k, v, query_log_decay=c, key_log_decay=c, **kwargs)

    ref = run(reference)
    got = run(lambda q, k, v, log_decay: chunk_attention(q, k, v, log_decay, chunk_size=128, **kwargs)[0])
    assert power2_on_kernels == [128]
    assert_close(ref, got, 1e-5, value_dim)


@pytest.mark.parametrize("case", [("power2", "sum", True), ("power2", "none", False), ("power2", "count_power", True)],
                         ids=str)
@pytest.mark.parametrize("packed", [False, True], ids=["full", "packed"])
def test_power2_state_kernels_continue_a_cache_and_differentiate_it(case, packed, power2_on_kernels):
    """A prefill after cached tokens (the state and normaliser handed on in the decoding layout), and the gradients of
    q, k, v, the log-decays and the earlier state and normaliser from a loss on the outputs and the state handed on."""
    test_a_prefill_after_cached_tokens_continues_the_state_in_the_decoding_layout(case, packed, chunk_size=16)
    if packed and case != ("power2", "count_power", True):
        test_gradients_reach_the_earlier_state_and_flow_from_the_state_handed_on(case, chunk_size=16)
    assert power2_on_kernels and set(power2_on_kernels) == {16}


def test_power2_state_kernels_start_from_a_state_without_its_normaliser(power2_on_kernels):
    """A cache that hands on the state without the normaliser of a sum denominator (taken as zero, as the reference
    takes it): outputs, the state and normaliser handed on and the gradients against the reference, 21 tokens in
    chunks of 16."""
    case = ("power2", "sum", True)
    q, k, v, log_decay, _ = case_inputs(case, 2, 21, 2, 8)
    g = torch.Generator().manual_seed(6)
    state = torch.randn(2, 2, 36, 8, generator=g)
    weights = [torch.randn(2, 21, 2, 8, generator=g), torch.randn(2, 2, 36, 8, generator=g),
               torch.randn(2, 2, 36, generator=g)]
    kwargs = dict(similarity="power2", scale=8**-0.5, denominator="sum", packed=True)
    before = torch.full((2,), 5)

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, log_decay, state)]
        o, s, z = fn(*leaves)
        loss = (o * weights[0]).sum() + (s * weights[1]).sum() + (z * weights[2]).sum()
        return [o, s, z, *torch.autograd.grad(loss, leaves)]

    ref = run(lambda q, k, v, d, s: chunk_linear_attention(q, k, v, d, s, None, before, chunk_size=21, **kwargs))
    got = run(lambda q, k, v, d, s: chunk_attention(q, k, v, d, state=s, count_before=before, chunk_size=16, **kwargs))
    assert power2_on_kernels == [16]
    for name, fast, slow in zip("o state normalizer dq dk dv dlog_decay dstate".split(), got, ref):
        assert rel_err(fast, slow) <= 1e-5, (name, rel_err(fast, slow))


@pytest.mark.parametrize("case", [("power2", "sum", True), ("power2", "none", False)], ids=str)
def test_power2_state_kernels_differentiate_the_state_handed_on_alone(case, power2_on_kernels):
    """A loss on the state and normaliser handed on alone, the outputs unused (the kernels' sums get no gradient,
    autograd's None): the gradients of k, v, the log-decays and the earlier state as the reference prefill gives
    them, and none (zeros) for q; two rows of 21 tokens in chunks of 16."""
    similarity, denominator, _ = case
    q, k, v, log_decay, _ = case_inputs(case, 2, 21, 2, 8)
    g = torch.Generator().manual_seed(5)
    state = torch.randn(2, 2, 36, 8, generator=g)
    normalizer = torch.rand(2, 2, 36, generator=g) if denominator == "sum" else None
    weights = [torch.randn(2, 2, 36, 8, generator=g), torch.randn(2, 2, 36, generator=g)]
    kwargs = dict(similarity=similarity, scale=8**-0.5, denominator=denominator, packed=True)
    inputs = [t for t in (q, k, v, log_decay, state, normalizer) if t is not None]
    names = [n for n, t in zip("q k v log_decay state normalizer".split(), (q, k, v, log_decay, state, normalizer))
             if t is not None]

    def grads(fn):
        leaves = [t.clone().requires_grad_() for t in inputs]
        _, s, z = fn(dict(zip(names, leaves)))
        loss = (s * weights[0]).sum() + (0 if z is None else (z * weights[1]).sum())
        got = torch.autograd.grad(loss, leaves, allow_unused=True)
        return [torch.zeros_like(t) if d is None else d for t, d in zip(leaves, got)]

    before = torch.full((2,), 5)
    ref = grads(lambda t: chunk_linear_attention(t["q"], t["k"], t["v"], t.get("log_decay"), t["state"],
                                                 t.get("normalizer"), before, chunk_size=21, **kwargs))
    got = grads(lambda t: chunk_attention(t["q"], t["k"], t["v"], t.get("log_decay"), state=t["state"],
                                          normalizer=t.get("normalizer"), count_before=before, chunk_size=16, **kwargs))
    assert power2_on_kernels == [16]
    for name, fast, slow in zip(names, got, ref):
        assert rel_err(fast, slow) <= 1e-5, (name, rel_err(fast, slow))
    assert not got[0].any()


@pytest.mark.parametrize("case", [("power2", "sum", True)], ids=str)
def test_power2_state_kernels_in_bf16_and_causal(case, power2_on_kernels):
    """bf16 under autocast within bf16's tolerance of the fp32 reference, and the outputs through t unchanged by
    the tokens after it."""
    test_bf16_inputs_under_autocast_stay_within_bf16_tolerance_of_the_fp32_reference(case)
    test_chunked_outputs_are_causal(case, chunk_size=16)
    assert power2_on_kernels and set(power2_on_kernels) == {16}


def test_power2_state_kernels_take_what_they_cover_and_say_what_they_do_not():
    from attnlab.models.kernels.attention_family import chunk as chunk_module
    from attnlab.models.kernels.attention_family import power2_states

    assert power2_states.covers(64, 64, 512) and power2_states.covers(64, 65, 16) and power2_states.covers(8, 128, 64)
    assert not power2_states.covers(128, 64, 512)  # wider heads than a program's block of the state
    assert not power2_states.covers(64, 256, 512)
    assert not power2_states.covers(64, 64, 8) and not power2_states.covers(64, 64, 96)
    assert not chunk_module.power2_on_kernels(torch.zeros(1, 4, 2, 64), 64, 512)  # CPU: PyTorch's products
    if CUDA:
        assert chunk_module.power2_on_kernels(torch.zeros(1, 4, 2, 64, device="cuda", dtype=torch.bfloat16), 64, 512)
        with pytest.warns(UserWarning, match="power2 state kernels cover head dims up to"):
            assert not chunk_module.power2_on_kernels(torch.zeros(1, 4, 2, 128, device="cuda"), 128, 512)


# ---------------------------------------------------------------- CUDA, compiled, bf16

@pytest.mark.parametrize("case", [("power2", "sum", True), ("power2", "none", False)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_power2_state_kernels_on_cuda_match_the_products_in_memory(case, dtype, monkeypatch):
    """The compiled state kernels (4 heads of 64, chunks of 128 and 512) against the features formed in memory for
    cuBLAS, after 300 cached tokens: outputs, the state and normaliser handed on, and the gradients of q, k, v,
    the log-decays and the earlier state; fp32 within 1e-4 (both multiply in fp32), bf16 within bf16's tolerance."""
    from attnlab.models.kernels.attention_family import chunk as chunk_module
    from attnlab.models.kernels.attention_family.parallel import attention_terms as fused

    similarity, denominator, _ = case
    q, k, v, log_decay, _ = case_inputs(case, 2, 1300, 4, 64, device="cuda", seed=7)
    _, state, normalizer = chunk_linear_attention(q[:, :300], k[:, :300], v[:, :300], None if log_decay is None else
                                                  log_decay[:, :300], None, None, torch.zeros(2, dtype=torch.long, device="cuda"),
                                                  similarity=similarity, scale=0.125, denominator=denominator, chunk_size=300)
    inputs = [t for t in (q[:, 300:], k[:, 300:], v[:, 300:], None if log_decay is None else log_decay[:, 300:], state,
                          normalizer) if t is not None]
    g = torch.Generator(device="cuda").manual_seed(1)
    weights = [torch.randn(2, 1000, 4, 64, device="cuda", generator=g), torch.randn(state.shape, device="cuda", generator=g)]

    def run(on_kernels, chunk):
        monkeypatch.setattr(chunk_module, "POWER2_STATE_KERNELS", on_kernels)
        leaves = [t.clone().requires_grad_() for t in inputs]
        named = dict(zip([n for n, t in zip("q k v log_decay state normalizer".split(), (q, k, v, log_decay, state, normalizer))
                          if t is not None], leaves))
        low = [named[n].to(dtype) for n in "qkv"]
        o, s, z = chunk_attention(*low, named.get("log_decay"), state=named["state"], normalizer=named.get("normalizer"),
                                  similarity=similarity, scale=0.125, denominator=denominator, chunk_size=chunk,
                                  intra_terms=fused, packed=False)
        loss = (o.float() * weights[0]).sum() + (s * weights[1]).sum() + (0 if z is None else z.sum())
        return (o, s, z), torch.autograd.grad(loss, leaves)

    tol = 1e-4 if dtype == torch.float32 else BF16_GRAD_TOLERANCE
    for chunk in (128, 512):
        (outs, grads), (ref_outs, ref_grads) = run(True, chunk), run(False, chunk)
        for name, fast, slow in zip(("output", "state", "normalizer"), outs, ref_outs):
            if slow is not None:
                assert rel_err(fast, slow) <= tol, (chunk, name, rel_err(fast, slow))
        for fast, slow in zip(grads, ref_grads):
            assert rel_err(fast, slow) <= tol, (chunk, rel_err(fast, slow))


@pytest.mark.parametrize("case", [c for c in CASES if c[1] in ("sum", "none", "count_power")], ids=str)
@pytest.mark.parametrize("seq_len", [1000, 3001])
@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_chunked_in_bf16_matches_the_fp32_reference_on_cuda(case, seq_len):
    """bf16 inputs on the compiled kernels (tiled inside chunks, power2's features formed by their kernel) and cuBLAS, the
    default chunk sizes, against the fp32 reference: outputs and gradients of a padded batch of 2 x 4 heads of 64;
    the longer one in groups of two chunks (the state carried between groups)."""
    from attnlab.models.kernels.attention_family.parallel import attention_terms as fused

    q, k, v, log_decay, mask = case_inputs(case, 2, seq_len, 4, 64, device="cuda", seed=seq_len, masked=True)
    reference, chunked = reference_and_chunked(case, q, k, v, log_decay, mask, dtype=torch.bfloat16, autocast=True,
                                               intra_terms=fused, group_chunks=2 if seq_len > 2000 else None)
    assert_close(reference, chunked, 2e-2, (case, seq_len), grad_tol=BF16_GRAD_TOLERANCE)


@pytest.mark.parametrize("name", ["2mamba", "squared__output_norm__A_mask_type_neg_softplus__in_conv_k_2__dt_on_values",
                                  "linear__output_norm", "linear_elu", "linear_cosine",
                                  "linear__output_norm__A_mask_type_neg_softplus__in_conv_k_2__dt_on_values"])
@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_linearizable_presets_chunked_on_cuda_match_the_fp32_reference(name, monkeypatch):
    """The model under bf16 autocast with the chunked form chosen from 256 tokens on, against the fp32
    reference (kernels 'torch'): logits of a left-padded batch of 1100 tokens, every parameter's gradient,
    and a prefill of 600 tokens after 500 cached, decoded on by one step."""
    monkeypatch.setattr(kernels, "CHUNKED_MIN_TOKENS", {s: 256 for s in CHUNK_SIZES})
    torch.manual_seed(0)
    ref_model = AttnLabForCausalLM(family_config(name, 256, 4, kernels="torch")).cuda().train()
    model = AttnLabForCausalLM(family_config(name, 256, 4)).cuda().train()
    model.load_state_dict(ref_model.state_dict())
    ids = torch.randint(0, 97, (2, 1101), device="cuda")
    mask = torch.ones_like(ids)
    mask[0, :50] = 0
    results = []
    for lm, autocast in ((ref_model, False), (model, True)):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            out = lm(input_ids=ids[:, :1100], attention_mask=mask[:, :1100])
            (out.logits.float() * mask[:, :1100, None]).square().mean().backward()
            with torch.no_grad():
                first = lm(input_ids=ids[:, :500], attention_mask=mask[:, :500], use_cache=True)
                rest = lm(input_ids=ids[:, 500:1100], attention_mask=mask[:, :1100], cache=first.past_key_values, use_cache=True)
                step = lm(input_ids=ids[:, 1100:], attention_mask=mask, cache=rest.past_key_values, use_cache=True)
        results.append((out.logits.float(), rest.logits.float(), step.logits.float(),
                        {n: p.grad for n, p in lm.named_parameters() if p.grad is not None}))
    (ref_logits, ref_rest, ref_step, ref_grads), (logits, rest, step, grads) = results
    keep = mask[:, :1100].bool()
    assert rel_err(logits[keep], ref_logits[keep]) <= 2e-2
    assert rel_err(rest, ref_rest) <= 2e-2
    assert rel_err(step, ref_step) <= 2e-2
    floor = 1e-2 * max(float(g.norm()) for g in ref_grads.values())  # as the tiled kernels' preset test
    for key, ref in ref_grads.items():
        err = float((grads[key].double() - ref.double()).norm()) / max(float(ref.norm()), floor)
        assert err <= 5e-2, (key, err)
