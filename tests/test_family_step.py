"""The linearizable attention family's decoding: the fused step kernel and the chunked prefill
against the PyTorch reference, and a tiny model decoding with the engine.

On CPU the step kernel runs through Triton's interpreter (tests/conftest.py) on tiny shapes; the
CUDA tests at the end hold the captured engine to the reference path token for token.
"""

import pytest
import torch

from attnlab.models.kernels.attention_family.step import attention_family_step_
from attnlab.models.ops.attention_family import (
    DENOMINATORS,
    SUM_DENOMINATORS,
    chunk_linear_attention,
    linear_feature_count,
    linear_features,
    recurrent_step,
    unpack_power2_state,
)

B, H = 2, 2


def step_inputs(gen, d, dv, decay, denominator, similarity):
    """One step's q, k, v and log-decay; row 1 is padding (zero k, v and log-decay) on odd calls."""
    q = torch.randn(B, H, d, generator=gen)
    k = torch.randn(B, H, d, generator=gen)
    if similarity == "power1" and denominator in SUM_DENOMINATORS:  # non-negative features (elu + 1)
        q, k = torch.nn.functional.elu(q) + 1, torch.nn.functional.elu(k) + 1
    v = torch.randn(B, H, dv, generator=gen)
    log_decay = -torch.rand(B, H, generator=gen) if decay else None
    return q, k, v, log_decay


@pytest.mark.parametrize("similarity,packed", [("power1", False), ("power2", True), ("power2", False)])
@pytest.mark.parametrize("denominator", DENOMINATORS)
@pytest.mark.parametrize("decay", [False, True])
def test_step_kernel_matches_recurrent_step_over_several_steps(similarity, packed, denominator, decay):
    gen = torch.Generator().manual_seed(hash((similarity, packed, denominator, decay)) % 1000)
    d, dv, scale = (8, 8, 0.4) if similarity == "power1" else (4, 8, 0.6)
    count_power = torch.tensor([0.3, 0.8]) if denominator == "count_power" else None
    features = linear_feature_count(d, similarity, packed)
    state = torch.randn(B, H, features, dv, generator=gen) * 0.1
    normalizer = torch.rand(B, H, features, generator=gen) if denominator in SUM_DENOMINATORS else None
    if normalizer is not None and similarity == "power2":  # a normaliser that some keys summed to: phi(q) . z >= 0
        normalizer = linear_features(torch.randn(B, H, 3, d, generator=gen), "power2", packed).sum(2)
    full = (lambda t: unpack_power2_state(t, d, -2)) if packed else (lambda t: t)
    full_z = (lambda t: unpack_power2_state(t, d, -1)) if packed else (lambda t: t)
    ref_state = full(state).clone()
    ref_norm = None if normalizer is None else full_z(normalizer).clone()
    count = torch.tensor([5, 3])
    kwargs = {"similarity": similarity, "scale": scale, "denominator": denominator, "count_power": count_power}
    for i in range(3):
        q, k, v, log_decay = step_inputs(gen, d, dv, decay, denominator, similarity)
        padded = i == 1
        if padded:  # row 1 is padding: no write, no decay, no token counted
            k[1], v[1] = 0, 0
            if log_decay is not None:
                log_decay[1] = 0
        count = count + torch.tensor([1, 0 if padded else 1])
        o = attention_family_step_(q, k, v, log_decay, state, normalizer, count, packed=packed, **kwargs)
        ref_o, ref_state, ref_norm = recurrent_step(q, k, v, log_decay, ref_state, ref_norm, count, **kwargs)
        torch.testing.assert_close(o, ref_o, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(full(state), ref_state, rtol=1e-5, atol=1e-6)
        if normalizer is not None:
            torch.testing.assert_close(full_z(normalizer), ref_norm, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("d", [5, 6, 12])  # one, two and four first indices per program (of 5, 3 and 3 programs)
@pytest.mark.parametrize("packed", [True, False])
def test_power2_step_programs_split_the_first_indices_for_any_head_dim(d, packed):
    gen = torch.Generator().manual_seed(d)
    features = linear_feature_count(d, "power2", packed)
    state = torch.randn(B, H, features, 8, generator=gen) * 0.1
    normalizer = linear_features(torch.randn(B, H, 3, d, generator=gen), "power2", packed).sum(2)
    ref_state, ref_norm = state.clone(), normalizer.clone()
    q, k, v = (torch.randn(B, H, n, generator=gen) for n in (d, d, 8))
    log_decay = -torch.rand(B, H, generator=gen)
    kwargs = {"similarity": "power2", "scale": 0.6, "denominator": "sum", "count_power": None, "packed": packed}
    o = attention_family_step_(q, k, v, log_decay, state, normalizer, torch.tensor([1, 1]), **kwargs)
    ref_o, ref_state, ref_norm = recurrent_step(q, k, v, log_decay, ref_state, ref_norm, torch.tensor([1, 1]), **kwargs)
    torch.testing.assert_close(o, ref_o, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(state, ref_state, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(normalizer, ref_norm, rtol=1e-5, atol=1e-6)


def test_step_kernel_takes_strided_rows_and_writes_the_values_dtype():
    gen = torch.Generator().manual_seed(1)
    d = 4
    qkv = torch.randn(B, 1, 3, H, d, generator=gen)  # as the mixer splits its projection
    q, k, v = (t[:, 0] for t in qkv.unbind(2))
    state = torch.zeros(B, H, linear_feature_count(d, "power2", True), d)
    normalizer = torch.zeros(B, H, state.shape[2])
    o = attention_family_step_(q, k, v.to(torch.bfloat16), None, state, normalizer, torch.ones(B, dtype=torch.long),
                               similarity="power2", scale=0.5, packed=True)
    ref, _, _ = recurrent_step(q, k, v.to(torch.bfloat16), None, None, None, torch.ones(B), similarity="power2", scale=0.5)
    assert o.dtype == torch.bfloat16
    torch.testing.assert_close(o.float(), ref, rtol=8e-3, atol=1e-3)  # one rounding to bf16


def test_packed_power2_features_keep_the_dot_products_and_unpack_to_the_full_state():
    gen = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(5, 6, generator=gen), torch.randn(5, 6, generator=gen), torch.randn(5, 3, generator=gen)
    packed = linear_features(q, "power2", True, query=True) @ linear_features(k, "power2", True).T
    torch.testing.assert_close(packed, (q @ k.T) ** 2)
    state = linear_features(k, "power2", True).T @ v  # [21, 3]
    torch.testing.assert_close(unpack_power2_state(state, 6), linear_features(k, "power2").T @ v)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("denominator", ["sum", "count_power", "none"])
def test_chunked_power2_prefill_matches_the_whole_prompt_as_one_chunk_at_an_odd_length(packed, denominator):
    gen = torch.Generator().manual_seed(3)
    T, d = 13, 4
    q, k, v = (torch.randn(B, T, H, d, generator=gen) for _ in range(3))
    log_decay = -torch.rand(B, T, H, generator=gen)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, :4] = False  # left padding: zero k, v and log-decay there
    k, v, log_decay = k * mask[..., None, None], v * mask[..., None, None], log_decay * mask[..., None]
    state = torch.randn(B, H, linear_feature_count(d, "power2", packed), d, generator=gen) * 0.1
    normalizer = linear_features(torch.randn(B, H, 3, d, generator=gen), "power2", packed).sum(2)
    if denominator not in SUM_DENOMINATORS:
        normalizer = None
    full = (lambda t, dim: unpack_power2_state(t, d, dim)) if packed else (lambda t, dim: t)
    kwargs = {"similarity": "power2", "scale": 0.5, "denominator": denominator, "token_mask": mask,
              "count_power": torch.tensor([0.4, 0.9]) if denominator == "count_power" else None}
    before = torch.tensor([2, 7])
    o_ref, s_ref, z_ref = chunk_linear_attention(q, k, v, log_decay, full(state, -2),
                                                 None if normalizer is None else full(normalizer, -1), before,
                                                 chunk_size=T, **kwargs)
    o, s, z = chunk_linear_attention(q, k, v, log_decay, state, normalizer, before, chunk_size=4, packed=packed, **kwargs)
    assert s.shape == state.shape
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(full(s, -2), s_ref, rtol=1e-4, atol=1e-5)
    if normalizer is not None:
        torch.testing.assert_close(full(z, -1), z_ref, rtol=1e-4, atol=1e-5)
    else:
        assert z is None and z_ref is None


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("decay,carry_state", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("want_normalizer", [False, True])
def test_state_kernel_matches_the_reference_state_after_a_prompt(packed, decay, carry_state, want_normalizer):
    from attnlab.models.kernels.attention_family.step import (
        linear_state_update as fused,
    )
    from attnlab.models.ops.attention_family import (
        linear_state_update,
        log_decay_cumsum,
    )

    gen = torch.Generator().manual_seed(4)
    T, d, dv = 13, 4, 8
    k, v = torch.randn(B, T, H, d, generator=gen), torch.randn(B, T, H, dv, generator=gen)
    log_decay = -torch.rand(B, T, H, generator=gen)
    k[1, :5], v[1, :5], log_decay[1, :5] = 0, 0, 0  # left padding
    c = log_decay_cumsum(log_decay) if decay else None
    features = linear_feature_count(d, "power2", packed)
    state = torch.randn(B, H, features, dv, generator=gen) if carry_state else None
    normalizer = torch.rand(B, H, features, generator=gen) if carry_state else None
    kwargs = {"similarity": "power2", "scale": 0.5, "packed": packed, "want_normalizer": want_normalizer}
    s, z = fused(k.bfloat16(), v.bfloat16(), c, state, normalizer, **kwargs)
    s_ref, z_ref = linear_state_update(k.bfloat16(), v.bfloat16(), c, state, normalizer, **kwargs)
    torch.testing.assert_close(s, s_ref, rtol=1e-3, atol=1e-4)  # the interpreter multiplies in fp32
    if want_normalizer:
        torch.testing.assert_close(z, z_ref, rtol=1e-4, atol=1e-5)
    else:
        assert z is None and z_ref is None


@pytest.mark.parametrize("packed", [False, True])
def test_state_kernel_with_first_indices_over_several_programs_matches_the_reference(packed):
    """d = 20: 8 first indices a program (256 feature rows of 32), the last program's partly past d."""
    from attnlab.models.kernels.attention_family.step import linear_state_update as fused
    from attnlab.models.ops.attention_family import linear_state_update, log_decay_cumsum

    gen = torch.Generator().manual_seed(6)
    T, d, dv = 9, 20, 8
    k, v = torch.randn(B, T, H, d, generator=gen), torch.randn(B, T, H, dv, generator=gen)
    c = log_decay_cumsum(-torch.rand(B, T, H, generator=gen))
    kwargs = {"similarity": "power2", "scale": 0.5, "packed": packed, "want_normalizer": True}
    s, z = fused(k, v, c, None, None, **kwargs)
    s_ref, z_ref = linear_state_update(k, v, c, None, None, **kwargs)
    torch.testing.assert_close(s, s_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(z, z_ref, rtol=1e-4, atol=1e-5)


def test_a_prompt_with_the_fused_state_runs_as_one_chunk_and_matches_the_chunked_reference():
    from attnlab.models.kernels.attention_family.step import (
        linear_state_update as fused,
    )

    gen = torch.Generator().manual_seed(5)
    T, d = 11, 4
    q, k, v = (torch.randn(B, T, H, d, generator=gen) for _ in range(3))
    log_decay = -torch.rand(B, T, H, generator=gen)
    kwargs = {"similarity": "power2", "scale": 0.5, "denominator": "sum", "chunk_size": 4}
    before = torch.zeros(B, dtype=torch.long)
    o_ref, s_ref, z_ref = chunk_linear_attention(q, k, v, log_decay, None, None, before, **kwargs)
    o, s, z = chunk_linear_attention(q, k, v, log_decay, None, None, before, packed=True, state_update=fused, **kwargs)
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(unpack_power2_state(s, d), s_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(unpack_power2_state(z, d, -1), z_ref, rtol=1e-4, atol=1e-5)


def test_power2_prefill_chunks_bound_the_features_of_a_long_prompt():
    from attnlab.models.ops.attention_family import (
        POWER2_CHUNK_ELEMENTS,
        power2_chunk_size,
    )

    chunk = power2_chunk_size(8, 16, 64 * 65 // 2)  # the 2mamba benchmark's shape
    assert 16 <= chunk <= 256 and 8 * chunk * 16 * 64 * 65 // 2 <= POWER2_CHUNK_ELEMENTS


# ---------------------------------------------------------------- the mixer and the engine

FAMILY_FIXED = ["2mamba", "linear__output_norm", "linear_elu", "linear_cosine"]
PROMPTS = ["Hello there, friend", "A", "The quick brown fox"]


def family_model(mixer: str, kernels: str = "auto", hidden: int = 16, device: str = "cpu", layers: int = 2, **options):
    from attnlab.models import AttnLabConfig, AttnLabForCausalLM

    torch.manual_seed(0)
    config = AttnLabConfig(vocab_size=259, hidden_size=hidden, num_layers=layers, num_heads=2, mixer=mixer, kernels=kernels,
                           mixer_options=options)
    return AttnLabForCausalLM(config).to(device).eval()


def decode(model, prompts=PROMPTS, **settings):
    from attnlab.data import ByteTokenizer
    from attnlab.generation import generate

    out = generate(model, ByteTokenizer(), prompts, **{"max_new_tokens": 8, **settings})
    return [[c.token_ids for c in r.candidates] for r in out]


def test_linearizable_layers_decode_over_a_fixed_size_state_and_kv_variants_do_not():
    from attnlab.generation.graphs import fixed_size_decoding

    assert all(fixed_size_decoding(family_model(name)) for name in FAMILY_FIXED)
    assert not fixed_size_decoding(family_model("2mamba-e"))


@pytest.mark.parametrize("mixer", ["2mamba", "linear__output_norm"])
def test_static_buffers_decode_as_the_dynamic_engine(mixer, monkeypatch):
    from attnlab.generation import engine
    from attnlab.generation.graphs import StaticRunner

    model = family_model(mixer)
    monkeypatch.setattr(engine, "make_runner", lambda m, choice="auto": engine.ModelRunner(m))
    dynamic = decode(model, num_beams=2)
    monkeypatch.setattr(engine, "make_runner", lambda m, choice="auto": StaticRunner(m, capture=False))
    assert decode(model, num_beams=2) == dynamic


@pytest.mark.parametrize("mixer", ["2mamba", "linear_cosine"])
def test_the_fused_step_in_the_model_decodes_as_the_reference(mixer, monkeypatch):
    """The mixer's fast path (power2's packed state built by the state kernel, the step kernel
    advancing the engine's buffers in place) on CPU through the interpreter, against kernels="torch"."""
    from attnlab.generation import engine
    from attnlab.generation.graphs import StaticRunner
    from attnlab.models import kernels

    reference = decode(family_model(mixer, kernels="torch", layers=1), PROMPTS[1:], max_new_tokens=4)
    from attnlab.models.kernels.attention_family.step import linear_state_update

    monkeypatch.setattr(kernels, "attention_family_step_fn", lambda choice, x: None if choice == "torch" else attention_family_step_)
    monkeypatch.setattr(kernels, "attention_family_state_update_fn",
                        lambda choice, x: None if choice == "torch" else linear_state_update)
    monkeypatch.setattr(engine, "make_runner", lambda m, choice="auto": StaticRunner(m, capture=False))
    model = family_model(mixer, layers=1)
    assert decode(model, PROMPTS[1:], max_new_tokens=4) == reference
    layer = model.model.layers[0].attn
    cache = model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=True).past_key_values
    features = linear_feature_count(layer.head_dim, layer.options["similarity"], packed=True)
    assert cache.states[0]["state"].shape[2] == features


@pytest.mark.parametrize("decay", [False, True])
def test_a_bf16_state_is_advanced_in_fp32_and_rounded_only_where_stored(decay):
    """The step kernel on a 16-bit state against the reference on the same state: the same fp32
    sums, rounded once per step; the output from the unrounded sums."""
    gen = torch.Generator().manual_seed(3)
    d, dv, packed = 4, 8, True
    features = linear_feature_count(d, "power2", packed)
    state = (torch.randn(B, H, features, dv, generator=gen) * 0.1).bfloat16()
    normalizer = linear_features(torch.randn(B, H, 3, d, generator=gen), "power2", packed).sum(2)
    kwargs = {"similarity": "power2", "scale": 0.6, "denominator": "sum", "count_power": None, "packed": packed}
    for i in range(4):  # each step from the same state: the reference takes the kernel's last one
        q, k, v, log_decay = step_inputs(gen, d, dv, decay, "sum", "power2")
        count = torch.tensor([i + 1, i + 1])
        ref_state, ref_norm = state.clone(), normalizer.clone()
        o = attention_family_step_(q, k, v, log_decay, state, normalizer, count, **kwargs)
        ref_o, ref_state, ref_norm = recurrent_step(q, k, v, log_decay, ref_state, ref_norm, count, **kwargs)
        assert state.dtype == ref_state.dtype == torch.bfloat16
        torch.testing.assert_close(o, ref_o, rtol=1e-4, atol=1e-5)
        ulp = ref_state.float().abs() * 2.0**-7  # one bf16 rounding of an fp32 sum summed in another order
        assert ((state.float() - ref_state.float()).abs() <= ulp + 1e-30).all()
        torch.testing.assert_close(normalizer, ref_norm, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("similarity,packed", [("power1", False), ("power2", True), ("power2", False)])
@pytest.mark.parametrize("denominator", DENOMINATORS)
def test_the_windowed_step_reference_is_the_recurrence_across_folds(similarity, packed, denominator):
    """`windowed_step` (the state read only, a window of 4 recent tokens folded in when full) gives
    `recurrent_step`'s outputs step for step, and its state after a last fold is the recurrence's."""
    from attnlab.models.ops.attention_family import fold_recent, new_recent, windowed_step

    gen = torch.Generator().manual_seed(len(denominator))
    d, dv = 4, 3
    features = linear_feature_count(d, similarity, packed)
    state = torch.randn(B, H, features, dv, generator=gen) * 0.1
    normalizer = None
    if denominator in SUM_DENOMINATORS:
        normalizer = linear_features(torch.rand(B, H, 3, d, generator=gen), similarity, packed).sum(2)
    ref_state, ref_norm = state.clone(), None if normalizer is None else normalizer.clone()
    recent = new_recent(torch.zeros(B, 1, H, d), torch.zeros(B, 1, H, dv), window=4)
    kwargs = {"similarity": similarity, "scale": 0.6, "denominator": denominator, "packed": packed,
              "count_power": torch.tensor([0.3, 0.8]) if denominator == "count_power" else None}
    for t in range(11):
        q, k, v, log_decay = step_inputs(gen, d, dv, t % 3 > 0, denominator, similarity)
        if similarity == "power1":
            q, k = q.abs(), k.abs()
        count = torch.tensor([t + 1, t + 4])
        o, state, normalizer, recent = windowed_step(q, k, v, log_decay, state, normalizer, recent, count, **kwargs)
        ref, ref_state, ref_norm = recurrent_step(q, k, v, log_decay, ref_state, ref_norm, count, **kwargs)
        torch.testing.assert_close(o, ref, rtol=1e-4, atol=1e-5)
    assert recent["recent_count"].tolist() == [[3, 3], [3, 3]]  # 11 tokens: two folds, three waiting
    state, normalizer, recent = fold_recent(state, normalizer, recent, **{k: kwargs[k] for k in ("similarity", "scale", "packed")})
    torch.testing.assert_close(state, ref_state, rtol=1e-4, atol=1e-5)
    if normalizer is not None:
        torch.testing.assert_close(normalizer, ref_norm, rtol=1e-4, atol=1e-5)
    assert recent["recent_count"].eq(0).all()


@pytest.mark.parametrize("packed,denominator,decay,state_dtype", [
    (True, "sum", True, torch.float32), (False, "count_power", False, torch.float32), (True, "sum", True, torch.bfloat16)])
def test_the_windowed_step_kernel_matches_its_reference_across_folds(packed, denominator, decay, state_dtype):
    """The step kernel with a window of 16 tokens (folded into the state by the step kernel, the
    window's attention and this token's place in it by the finish kernel) over 35 steps, two folds."""
    from attnlab.models.ops.attention_family import new_recent, windowed_step

    gen = torch.Generator().manual_seed(7)
    d, dv = 4, 8
    features = linear_feature_count(d, "power2", packed)
    state = (torch.randn(B, H, features, dv, generator=gen) * 0.1).to(state_dtype)
    normalizer = linear_features(torch.randn(B, H, 3, d, generator=gen), "power2", packed).sum(2) if denominator == "sum" else None
    ref_state, ref_norm = state.clone(), None if normalizer is None else normalizer.clone()
    recent = new_recent(torch.zeros(B, 1, H, d), torch.zeros(B, 1, H, dv), window=16)
    ref_recent = {name: t.clone() for name, t in recent.items()}
    kwargs = {"similarity": "power2", "scale": 0.6, "denominator": denominator, "packed": packed,
              "count_power": torch.tensor([0.3, 0.8]) if denominator == "count_power" else None}
    for t in range(35):
        q, k, v, log_decay = step_inputs(gen, d, dv, decay, denominator, "power2")
        count = torch.tensor([t + 1, t + 1])
        o = attention_family_step_(q, k, v, log_decay, state, normalizer, count, recent=recent, **kwargs)
        ref, ref_state, ref_norm, ref_recent = windowed_step(q, k, v, log_decay, ref_state, ref_norm, ref_recent, count, **kwargs)
        if state_dtype == torch.float32:
            torch.testing.assert_close(o, ref, rtol=1e-4, atol=1e-5)
        else:  # a bf16 state's folds round sums taken in another order: an ulp apart here and there
            assert ((o - ref).norm() / ref.norm()).item() < 1e-2
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if state_dtype == torch.float32 else {"rtol": 2**-7, "atol": 1e-6}
    torch.testing.assert_close(state, ref_state, **tolerance)
    if normalizer is not None:
        torch.testing.assert_close(normalizer, ref_norm, rtol=1e-5, atol=1e-6)
    for name, t in recent.items():
        torch.testing.assert_close(t, ref_recent[name])
    assert recent["recent_count"].eq(3).all()
    with pytest.raises(ValueError, match="power of two"):
        attention_family_step_(q, k, v, log_decay, state, normalizer, count, **kwargs,
                               recent=new_recent(torch.zeros(B, 1, H, d), torch.zeros(B, 1, H, dv), window=12))


@pytest.mark.parametrize("num_beams", [1, 2])
def test_the_windowed_step_in_the_model_decodes_as_the_reference(num_beams, monkeypatch):
    """2mamba's fast path with a window of 16 tokens, folded twice in 36 new tokens (greedy) and
    with beams (the window's buffers reordered with the state), against kernels="torch"."""
    from attnlab.generation import engine
    from attnlab.generation.graphs import StaticRunner
    from attnlab.models import kernels
    from attnlab.models.kernels.attention_family.step import linear_state_update
    from attnlab.models.ops import attention_family

    new_tokens = 36 if num_beams == 1 else 20
    reference = decode(family_model("2mamba", kernels="torch", layers=1), PROMPTS[1:], max_new_tokens=new_tokens,
                       num_beams=num_beams, min_new_tokens=new_tokens)
    from attnlab.models.kernels.common.conv import causal_conv1d

    monkeypatch.setattr(attention_family, "RECENT_TOKENS", 16)
    monkeypatch.setattr(kernels, "attention_family_step_fn", lambda choice, x: None if choice == "torch" else attention_family_step_)
    # the conv's step kernel too: its window advanced in place
    monkeypatch.setattr(kernels, "causal_conv1d_fn", lambda choice, x, covered=True: None if choice == "torch" else causal_conv1d)
    monkeypatch.setattr(kernels, "attention_family_state_update_fn",
                        lambda choice, x: None if choice == "torch" else linear_state_update)
    monkeypatch.setattr(engine, "make_runner", lambda m, choice="auto": StaticRunner(m, capture=False))
    model = family_model("2mamba", layers=1)
    assert decode(model, PROMPTS[1:], max_new_tokens=new_tokens, num_beams=num_beams, min_new_tokens=new_tokens) == reference
    with torch.no_grad():
        cache = model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=True).past_key_values
    assert cache.states[0]["recent_key"].shape[2] == 16 and cache.states[0]["recent_count"].eq(0).all()


@torch.no_grad()
def test_more_tokens_after_windowed_steps_fold_the_window_first(monkeypatch):
    from attnlab.models import kernels
    from attnlab.models.kernels.attention_family.step import linear_state_update

    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13]])

    def run(model):
        cache = model(input_ids=ids[:, :4], use_cache=True).past_key_values
        for i in range(4, 7):
            cache = model(input_ids=ids[:, i:i + 1], cache=cache, use_cache=True).past_key_values
        return model(input_ids=ids[:, 7:], cache=cache, use_cache=True)

    reference = run(family_model("2mamba", kernels="torch", layers=1))
    monkeypatch.setattr(kernels, "attention_family_step_fn", lambda choice, x: attention_family_step_)
    monkeypatch.setattr(kernels, "attention_family_state_update_fn", lambda choice, x: linear_state_update)
    out = run(family_model("2mamba", layers=1))
    torch.testing.assert_close(out.logits, reference.logits, rtol=1e-4, atol=1e-5)
    assert out.past_key_values.states[0]["recent_count"].eq(0).all()


@torch.no_grad()
def test_decoding_states_are_bf16_only_for_the_windowed_step_of_a_16_bit_model_unless_told(monkeypatch):
    from attnlab.models import kernels

    ids = torch.tensor([[1, 2, 3]])

    def state_dtype(model):
        return model(input_ids=ids, use_cache=True).past_key_values.states[0]["state"].dtype

    half = family_model("2mamba").to(torch.bfloat16)
    assert half.model.layers[0].attn.options["state_dtype"] == "auto"
    assert state_dtype(half) == torch.float32  # rewritten every step (the reference): fp32
    told = family_model("2mamba", state_dtype="bfloat16").to(torch.bfloat16)
    cache = told(input_ids=ids, use_cache=True).past_key_values
    assert cache.states[0]["state"].dtype == torch.bfloat16 and cache.states[0]["normalizer"].dtype == torch.float32
    step = told(input_ids=torch.tensor([[4]]), cache=cache, use_cache=True).past_key_values
    assert step.states[0]["state"].dtype == torch.bfloat16
    monkeypatch.setattr(kernels, "attention_family_step_fn", lambda choice, x: attention_family_step_)  # windowed
    assert state_dtype(half) == torch.bfloat16
    assert state_dtype(family_model("2mamba")) == torch.float32  # an fp32 model
    assert state_dtype(family_model("2mamba", state_dtype="float32").to(torch.bfloat16)) == torch.float32
    with pytest.raises(ValueError, match="state_dtype"):
        family_model("2mamba", state_dtype="int8")


def test_with_a_gradient_to_carry_the_cached_forms_run_the_reference_on_the_packed_state(monkeypatch):
    from attnlab.models import kernels

    def fails(*args, **kwargs):
        raise AssertionError("a kernel without a backward ran where a gradient was wanted")

    fails.fused = True
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    grads = []
    for fast in (False, True):
        if fast:
            monkeypatch.setattr(kernels, "attention_family_step_fn", lambda choice, x: fails)
            monkeypatch.setattr(kernels, "attention_family_state_update_fn", lambda choice, x: fails)
        model = family_model("2mamba", layers=1).train()
        first = model(input_ids=ids[:, :5], use_cache=True)
        step = model(input_ids=ids[:, 5:], cache=first.past_key_values, use_cache=True)
        step.logits.square().sum().backward()
        grads.append(model.model.layers[0].attn.qkv_proj.weight.grad)
    assert first.past_key_values.states[0]["state"].shape[2] == 8 * 9 // 2  # packed, as where the kernels run
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------- CUDA

def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("similarity,denominator", [("power2", "sum"), ("power2", "none"), ("power1", "count_power")])
def test_bf16_step_kernel_on_cuda_matches_the_fp32_reference_over_many_steps(similarity, denominator):
    g = torch.Generator(device="cuda").manual_seed(0)
    batch, heads, d = 8, 16, 64
    packed = similarity == "power2"
    features = linear_feature_count(d, similarity, packed)
    state = torch.zeros(batch, heads, features, d, device="cuda")
    normalizer = torch.zeros(batch, heads, features, device="cuda") if denominator in SUM_DENOMINATORS else None
    ref_state = ref_norm = None
    count_power = torch.full((heads,), 0.6, device="cuda") if denominator == "count_power" else None
    kwargs = {"similarity": similarity, "scale": d**-0.5, "denominator": denominator, "count_power": count_power}
    for t in range(1, 65):
        q, k, v = (torch.randn(batch, heads, d, device="cuda", generator=g) for _ in range(3))
        if similarity == "power1":
            q, k = torch.nn.functional.elu(q) + 1, torch.nn.functional.elu(k) + 1
        log_decay = -torch.rand(batch, heads, device="cuda", generator=g) * 0.1
        count = torch.full((batch,), t, device="cuda")
        o = attention_family_step_(q.bfloat16(), k.bfloat16(), v.bfloat16(), log_decay, state, normalizer, count,
                                   packed=packed, **kwargs)
        ref, ref_state, ref_norm = recurrent_step(q.bfloat16().double(), k.bfloat16().double(), v.bfloat16().double(),
                                                  log_decay.double(), ref_state, ref_norm, count, **kwargs)
    assert o.dtype == torch.bfloat16
    assert rel_err(o, ref) < 1e-2
    full = unpack_power2_state(state, d) if packed else state
    assert rel_err(full, ref_state) < 1e-5


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_windowed_step_kernel_on_cuda_matches_the_fp64_recurrence_over_three_folds(state_dtype):
    """The decode benchmark's head shape (16 heads of 64, window 64): 200 bf16 steps against the
    recurrence in fp64; the state after the last fold against the recurrence's."""
    from attnlab.models.ops.attention_family import fold_recent, new_recent

    g = torch.Generator(device="cuda").manual_seed(0)
    batch, heads, d = 8, 16, 64
    features = linear_feature_count(d, "power2", True)
    state = torch.zeros(batch, heads, features, d, device="cuda", dtype=state_dtype)
    normalizer = torch.zeros(batch, heads, features, device="cuda")
    recent = new_recent(torch.zeros(batch, 1, heads, d, device="cuda", dtype=torch.bfloat16),
                        torch.zeros(batch, 1, heads, d, device="cuda", dtype=torch.bfloat16))
    ref_state = ref_norm = None
    kwargs = {"similarity": "power2", "scale": d**-0.5, "denominator": "sum", "count_power": None}
    errors = []
    for t in range(1, 201):
        q, k, v = (torch.randn(batch, heads, d, device="cuda", generator=g).bfloat16() for _ in range(3))
        log_decay = -torch.rand(batch, heads, device="cuda", generator=g) * 0.05
        count = torch.full((batch,), t, device="cuda")
        o = attention_family_step_(q, k, v, log_decay, state, normalizer, count, packed=True, recent=recent, **kwargs)
        ref, ref_state, ref_norm = recurrent_step(q.double(), k.double(), v.double(), log_decay.double(), ref_state,
                                                  ref_norm, count, packed=True, **kwargs)
        errors.append(rel_err(o, ref))
    assert max(errors) < (1e-2 if state_dtype == torch.float32 else 2e-2), max(errors)
    assert recent["recent_count"].eq(200 - 192).all()
    state, normalizer, _ = fold_recent(state, normalizer, recent, similarity="power2", scale=d**-0.5, packed=True)
    assert rel_err(state, ref_state) < (1e-5 if state_dtype == torch.float32 else 1e-2)
    assert rel_err(normalizer, ref_norm) < 1e-5


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_captured_windowed_decoding_on_cuda_folds_as_the_reference_token_for_token(monkeypatch):
    from attnlab.models.ops import attention_family

    monkeypatch.setattr(attention_family, "RECENT_TOKENS", 16)  # three folds in 56 tokens
    fast = family_model("2mamba", hidden=256, device="cuda")
    reference = family_model("2mamba", kernels="torch", hidden=256, device="cuda")
    assert decode(fast, max_new_tokens=56) == decode(reference, max_new_tokens=56, cuda_graphs="off")
    assert decode(fast, max_new_tokens=40, num_beams=3) == decode(reference, max_new_tokens=40, num_beams=3, cuda_graphs="off")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mixer", ["2mamba", "linear__output_norm"])
def test_captured_decoding_on_cuda_matches_the_reference_path_token_for_token(mixer):
    from attnlab.generation.graphs import make_runner

    fast = family_model(mixer, hidden=256, device="cuda")
    reference = family_model(mixer, kernels="torch", hidden=256, device="cuda")
    assert type(make_runner(fast)).__name__ == "StaticRunner"
    assert decode(fast, max_new_tokens=24) == decode(reference, max_new_tokens=24, cuda_graphs="off")
    assert decode(fast, max_new_tokens=12, num_beams=3) == decode(reference, max_new_tokens=12, num_beams=3, cuda_graphs="off")
    states = fast.model.layers[0].attn
    if states.options["similarity"] == "power2":  # the packed layout where the kernel runs
        cache = fast(input_ids=torch.tensor([[1, 2, 3]], device="cuda"), use_cache=True).past_key_values
        assert cache.states[0]["state"].shape[2] == states.head_dim * (states.head_dim + 1) // 2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@torch.no_grad()
def test_2mamba_prefill_on_cuda_never_holds_the_features_of_the_whole_prompt():
    """At 2 x 2048 tokens, 16 heads of dim 64, the whole prompt's power2 features are 1 GiB per
    copy in fp32; the chunked prefill holds one chunk's (and the packed states) at a time."""
    from attnlab.models import AttnLabConfig, AttnLabForCausalLM

    torch.manual_seed(0)
    config = AttnLabConfig(vocab_size=259, hidden_size=1024, num_layers=2, num_heads=16, mixer="2mamba")
    model = AttnLabForCausalLM(config).cuda().to(torch.bfloat16).eval()
    ids = torch.randint(0, 259, (2, 2048), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    cache = model(input_ids=ids, use_cache=True, logits_to_keep=1).past_key_values
    extra = torch.cuda.max_memory_allocated() - before
    assert cache.states[0]["state"].shape == (2, 16, 64 * 65 // 2, 64)
    assert extra < 0.5 * 2**30, f"prefill took {extra / 2**30:.2f} GiB beyond the weights"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("head_dim", [64, 128])
def test_bf16_state_kernel_on_cuda_matches_the_fp32_reference(head_dim):
    from attnlab.models.kernels.attention_family.step import (
        linear_state_update as fused,
    )
    from attnlab.models.ops.attention_family import (
        linear_state_update,
        log_decay_cumsum,
    )

    g = torch.Generator(device="cuda").manual_seed(0)
    batch, T, heads = 2, 1000, 4
    k = torch.randn(batch, T, heads, head_dim, device="cuda", generator=g).bfloat16()
    v = torch.randn(batch, T, heads, head_dim, device="cuda", generator=g).bfloat16()
    c = log_decay_cumsum(-torch.rand(batch, T, heads, device="cuda", generator=g) * 0.01)
    state = torch.randn(batch, heads, head_dim * (head_dim + 1) // 2, head_dim, device="cuda", generator=g)
    normalizer = torch.rand(batch, heads, state.shape[2], device="cuda", generator=g)
    kwargs = {"similarity": "power2", "scale": head_dim**-0.5, "packed": True, "want_normalizer": True}
    s, z = fused(k, v, c, state, normalizer, **kwargs)
    s_ref, z_ref = linear_state_update(k.float(), v.float(), c, state, normalizer, **kwargs)  # fp32 products
    assert rel_err(s, s_ref) < 4e-3  # products of 16-bit operands (the weighted features rounded), fp32 sums
    assert rel_err(z, z_ref) < 1e-5
