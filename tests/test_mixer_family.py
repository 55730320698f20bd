"""The attention family of the 2Mamba study: every registered preset is causal, its step form equals
its parallel form, it trains, and it generates like Hugging Face `generate`."""

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from attnlab.models import MIXERS, AttnLabConfig, AttnLabForCausalLM
from attnlab.models.mixers import presets_markdown
from attnlab.models.mixers.attention_family import AttentionFamily, is_linearizable
from attnlab.models.ops.attention_family import (
    chunk_linear_attention,
    parallel_attention,
    recurrent_step,
    taylor_series_exp,
    truncated_exp,
)

VOCAB = 64
# every mixer of the family: the family itself and each preset, found in the registry
FAMILY = [name for name, cls in MIXERS.items() if issubclass(cls, AttentionFamily)]
every_preset = pytest.mark.parametrize("name", FAMILY)

SEED_003_NAMES = [
    "softmax", "softmax_clamp_denom", "softmax_detach_denom", "softmax_detach_denom_gate", "softmax_divs",
    "softmax_gate", "softmax_divS_gate", "softmax_divS_gatev2", "softmax_divS_norm", "softmax_taylor_80terms",
    "gated_softmax", "gated_softmax_no_norm", "gated_softmax_no_in_gate", "gated_softmax_no_out_gate",
    "gated_softmax_no_out_gate_no_norm", "gated_softmax_no_in_gate_no_norm", "gated_relu_no_in_gate_no_norm",
    "gated_softmax_no_gate", "gated_softmax_no_gate_rmsnorm", "gated_softmax_no_gate_L2norm_nodivS",
    "gated_softmax_no_gate_L2norm_nodivS_noclamp", "gated_ReLU_no_gate_L2norm_nodivS_noclamp",
    "gated_softmax_out_gate_L2norm_nodivS_noclamp", "gated_softmax_post_out_gate_L2norm_nodivS_noclamp",
    "gated_softmax_no_gate_rmsnorm_nodivS", "gated_softmax_no_gate_no_norm", "linear_elu", "linear_relu",
    "linear_cosine",
]
LATER_STUDY_NAMES = [
    "linear", "linear__output_norm", "linear__output_norm__ReLU", "linear__output_norm__in_conv_k_2",
    "linear__output_norm__in_conv_k_3", "linear__output_norm__in_conv_k_2__silu",
    "linear__output_norm__in_conv_k_3__silu", "2mamba", "2mamba-e",
    "squared__sm_norm__A_mask_type_neg_softplus__in_conv_k_2", "exp__sm_norm__A_mask_type_neg_softplus__in_conv_k_2",
]


def tiny_config(name: str, **overrides) -> AttnLabConfig:
    kwargs = dict(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=2, mixer=name)
    kwargs.update(overrides)
    return AttnLabConfig(**kwargs)


def make_model(name: str, seed: int = 0, **overrides) -> AttnLabForCausalLM:
    torch.manual_seed(seed)
    model = AttnLabForCausalLM(tiny_config(name, **overrides)).eval()
    with torch.no_grad():  # norm weights away from 1 so that every path visibly matters
        for param_name, p in model.named_parameters():
            if param_name.endswith("weight") and p.dim() == 1:
                p.normal_(1.0, 0.2)
    return model


_models: dict[str, AttnLabForCausalLM] = {}


@pytest.fixture(scope="module")
def models():
    """One eval-mode model per preset, shared by the tests that do not change it."""
    return _models


def shared_model(models, name: str) -> AttnLabForCausalLM:
    if name not in models:
        models[name] = make_model(name)
    return models[name]


def random_tokens(batch: int, length: int, seed: int = 1, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def assert_close_rel(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-5) -> None:
    err = (actual - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert err <= rel * scale, f"max abs error {err:.3g} exceeds {rel:g} x max |expected| {scale:.3g}"


# ---------------------------------------------------------------- registry and config


def test_every_study_name_is_a_registered_mixer():
    missing = [name for name in SEED_003_NAMES + LATER_STUDY_NAMES if name not in MIXERS]
    assert not missing
    assert MIXERS["2mamba"].preset_options == MIXERS["squared__sm_norm__A_mask_type_neg_softplus__in_conv_k_2"].preset_options


def test_preset_expands_to_options_and_accepts_single_overrides():
    config = AttnLabConfig(mixer="2mamba", mixer_options={"conv_size": 3})
    assert config.mixer_options["similarity"] == "power2"
    assert config.mixer_options["decay"] == "neg_softplus"
    assert config.mixer_options["conv_size"] == 3
    assert AttnLabConfig(mixer="2mamba").mixer_options["conv_size"] == 2


@pytest.mark.parametrize(
    "options,reason",
    [
        ({"similarity": "softmax", "denominator": "count"}, "divides by the sum"),
        ({"similarity": "power1", "feature_map": "silu", "denominator": "sum"}, "non-negative"),
        ({"similarity": "exp", "denominator": "none"}, "overflows"),
        ({"out_gate": "after_norm"}, "needs an output_norm"),
        ({"conv_activation": "silu"}, "needs an input convolution"),
        ({"conv_size": 5}, "conv_size"),
        ({"decay": "positive"}, "decay"),
        ({"taylor_terms": 1}, "taylor_terms"),
        ({"rope": "yes"}, "true or false"),
        ({"count_power_on": "values"}, "needs denominator 'count_power'"),
        ({"count_power_on": "keys", "denominator": "count_power"}, "count_power_on"),
        ({"output_norm": "rmsnorm", "output_norm_eps": 0}, "output_norm_eps must be a positive number"),
        ({"feature_map": "l2_head"}, "feature_map"),
        ({"decay_bias": True}, "decay_bias needs decay in"),
        ({"decay": "neg_silu", "decay_bias": True}, "decay_bias needs decay in"),
    ],
)
def test_config_rejects_a_combination_that_makes_no_sense_with_a_reason(options, reason):
    with pytest.raises(ValueError, match=reason):
        AttnLabConfig(mixer="attention_family", mixer_options=options)


def test_config_rejects_an_override_that_breaks_the_preset():
    with pytest.raises(ValueError, match="'linear'.*non-negative"):
        AttnLabConfig(mixer="linear", mixer_options={"feature_map": "none"})


def test_the_preset_table_in_the_docs_is_generated_from_the_registry():
    doc = (Path(__file__).resolve().parents[1] / "docs" / "mixers.md").read_text(encoding="utf-8")
    block = re.search(r"<!-- mixer-presets -->\n(.*?)\n<!-- /mixer-presets -->", doc, re.S)
    assert block, "docs/mixers.md lacks the <!-- mixer-presets --> block"
    assert block.group(1).strip() == presets_markdown().strip(), "regenerate it with presets_markdown()"


def test_decode_state_of_2mamba_is_constant_and_of_2mamba_e_grows():
    fixed, per_token = AttentionFamily.decode_state_elements(MIXERS["2mamba"].resolve_options(None))
    assert per_token == 0
    # 16 heads x (64^2 x 64 state + 64^2 normalizer) + conv (3 x 1024) + counter
    assert fixed == 16 * (4096 * 64 + 4096) + 3 * 1024 + 1
    assert AttentionFamily.decode_state_elements(MIXERS["2mamba-e"].resolve_options(None))[1] == 2 * 1024 + 16


@torch.no_grad()
def test_family_with_softmax_options_equals_the_softmax_mixer():
    family = make_model("attention_family")
    reference = make_model("softmax")
    reference.load_state_dict(family.state_dict(), strict=False)  # shared: embeddings, norms, MLPs, o_proj
    for fam_layer, ref_layer in zip(family.model.layers, reference.model.layers):
        q, k, v = fam_layer.attn.qkv_proj.weight.chunk(3, dim=0)
        ref_layer.attn.q_proj.weight.copy_(q)
        ref_layer.attn.k_proj.weight.copy_(k)
        ref_layer.attn.v_proj.weight.copy_(v)
    tokens = random_tokens(2, 20)
    assert_close_rel(family(tokens).logits, reference(tokens).logits)


# ---------------------------------------------------------------- ops


def test_truncated_exp_backward_is_the_series_with_one_term_fewer():
    x = torch.linspace(-3, 3, 13, dtype=torch.float64, requires_grad=True)
    truncated_exp(x, 12).sum().backward()
    assert torch.allclose(x.grad, taylor_series_exp(x.detach(), 11))
    assert torch.allclose(taylor_series_exp(x.detach(), 40), x.detach().exp())


@pytest.mark.parametrize("similarity", ["power1", "power2"])
@pytest.mark.parametrize("denominator", ["sum", "count", "none"])
def test_linear_chunk_and_step_forms_match_the_quadratic_form(similarity, denominator):
    gen = torch.Generator().manual_seed(0)
    batch, seq_len, heads, dim = 2, 13, 2, 4
    q, k, v = (torch.randn(batch, seq_len, heads, dim, generator=gen) for _ in range(3))
    if denominator == "sum":
        q, k = q.relu(), k.relu()
    log_decay = -F.softplus(torch.randn(batch, seq_len, heads, generator=gen))
    kwargs = dict(similarity=similarity, scale=0.5, denominator=denominator)
    c = log_decay.cumsum(1)
    expected = parallel_attention(q, k, v, query_log_decay=c, key_log_decay=c, **kwargs)

    split = 6
    o1, state, normalizer = chunk_linear_attention(
        q[:, :split], k[:, :split], v[:, :split], log_decay[:, :split], None, None, torch.zeros(batch), **kwargs
    )
    outputs = [o1]
    for t in range(split, seq_len):
        o, state, normalizer = recurrent_step(
            q[:, t], k[:, t], v[:, t], log_decay[:, t], state, normalizer, torch.full((batch,), t + 1), **kwargs
        )
        outputs.append(o[:, None])
    assert_close_rel(torch.cat(outputs, dim=1), expected)


# ---------------------------------------------------------------- forms of every preset


@every_preset
@torch.no_grad()
def test_future_tokens_never_change_past_outputs(models, name):
    model = shared_model(models, name)
    tokens = random_tokens(2, 24)
    logits = model(tokens).logits
    for t in (0, 11):
        perturbed = tokens.clone()
        perturbed[:, t + 1 :] = random_tokens(2, 24 - t - 1, seed=t + 7)
        assert (model(perturbed).logits[:, : t + 1] - logits[:, : t + 1]).abs().max() <= 1e-6


@every_preset
@torch.no_grad()
def test_step_form_token_by_token_equals_parallel_form(models, name):
    model = shared_model(models, name)
    tokens = random_tokens(2, 20)
    full_logits = model(tokens).logits
    cache, step_logits = None, []
    for t in range(tokens.shape[1]):
        out = model(tokens[:, t : t + 1], cache=cache, use_cache=True)
        cache = out.past_key_values
        step_logits.append(out.logits)
    assert_close_rel(torch.cat(step_logits, dim=1), full_logits)


@every_preset
@torch.no_grad()
def test_prefill_then_steps_and_two_prefill_chunks_equal_parallel_form(models, name):
    model = shared_model(models, name)
    tokens = random_tokens(2, 24, seed=2)
    full_logits = model(tokens).logits
    out = model(tokens[:, :9], use_cache=True)
    out = model(tokens[:, 9:16], cache=out.past_key_values, use_cache=True)  # a second chunk
    logits = [full_logits[:, :9], out.logits]
    for t in range(16, tokens.shape[1]):
        out = model(tokens[:, t : t + 1], cache=out.past_key_values, use_cache=True)
        logits.append(out.logits)
    assert_close_rel(torch.cat(logits, dim=1), full_logits)
    first = model(tokens[:, :9], use_cache=True).logits
    assert_close_rel(first, full_logits[:, :9])


@every_preset
@torch.no_grad()
def test_left_padded_batch_matches_each_sequence_alone(models, name):
    model = shared_model(models, name)
    seqs = [random_tokens(1, n, seed=10 + i)[0] for i, n in enumerate((14, 6))]
    tokens = torch.zeros(2, 14, dtype=torch.long)
    mask = torch.zeros(2, 14, dtype=torch.long)
    for i, seq in enumerate(seqs):
        tokens[i, 14 - len(seq) :], mask[i, 14 - len(seq) :] = seq, 1
    out = model(tokens, attention_mask=mask, use_cache=True)
    next_tokens = random_tokens(2, 1, seed=99)
    mask = torch.cat([mask, torch.ones_like(next_tokens)], dim=1)
    step = model(next_tokens, attention_mask=mask, cache=out.past_key_values, use_cache=True)
    for i, seq in enumerate(seqs):
        alone = model(torch.cat([seq, next_tokens[i]])[None]).logits
        assert_close_rel(out.logits[i, -1], alone[0, -2])
        assert_close_rel(step.logits[i, -1], alone[0, -1])


@every_preset
@torch.no_grad()
def test_cache_reorder_and_select_match_recomputation(models, name):
    model = shared_model(models, name)
    tokens, next_tokens = random_tokens(3, 10), random_tokens(3, 1, seed=5)
    for rows, edit in [
        (torch.tensor([2, 0, 0]), lambda cache: cache.reorder(torch.tensor([2, 0, 0]))),
        (torch.tensor([1]), lambda cache: cache.select([1])),
    ]:
        cache = model(tokens, use_cache=True).past_key_values
        edit(cache)
        logits = model(next_tokens[rows], cache=cache, use_cache=True).logits[:, -1]
        assert_close_rel(logits, model(torch.cat([tokens, next_tokens], dim=1)[rows]).logits[:, -1])


# option values that no preset of the study uses, run through the same checks
EXTRA_SETUPS = {
    "neg_softplus_dt-decay": dict(similarity="power1", feature_map="relu", decay="neg_softplus_dt", value_dt=True),
    "neg_softplus2-decay": dict(similarity="power2", decay="neg_softplus2", output_norm="rmsnorm", denominator="none"),
    "neg_silu-decay-exp": dict(similarity="exp", decay="neg_silu", clamp_scores=5.0, denominator="sum_clamped"),
    "conv-silu-taylor": dict(similarity="taylor", taylor_terms=12, conv_size=3, conv_activation="silu"),
    "power2-elu-count-z": dict(similarity="power2", feature_map="elu1", denominator="count", z_gate=True, rope=False),
    "power1-clamped-kv": dict(similarity="power1", feature_map="relu", clamp_scores=0.5, in_gate=True),
    "power1-detached-eps": dict(similarity="power1", feature_map="elu1", denominator="sum_detached_eps", decay="neg_softplus"),
    "power2-heads-l2-count-on-values": dict(similarity="power2", feature_map="l2_heads", denominator="count_power",
                                            count_power_on="values", output_norm="layernorm", output_norm_eps=1e-3),
    "exp-count-on-values-kv": dict(similarity="exp", clamp_scores=5.0, denominator="count_power", count_power_on="values"),
    "power2-decay-bias": dict(similarity="power2", denominator="sum", output_norm="rmsnorm", decay="neg_softplus", decay_bias=True,
                              conv_size=2),
    "exp-decay-bias-dt-kv": dict(similarity="exp", decay="neg_softplus_dt", decay_bias=True, value_dt=True),
}


def test_decay_bias_starts_the_decay_slow_and_learns():
    model = make_model("2mamba", num_layers=1, mixer_options={"decay_bias": True}).train()
    mixer = model.model.layers[0].attn
    start = -torch.nn.functional.softplus(mixer.decay_bias)  # the log-decay per token at init, decay_proj(x) ~ 0
    assert (start <= -1e-3 * 0.999).all() and (start >= -0.1 * 1.001).all()
    tokens = random_tokens(2, 17)
    model(tokens, labels=tokens).loss.backward()
    assert mixer.decay_bias.grad is not None and mixer.decay_bias.grad.abs().sum() > 0
    assert AttnLabConfig(mixer="2mamba").mixer_options["decay_bias"] is False  # the preset as the study wrote it


@pytest.mark.parametrize("setup", list(EXTRA_SETUPS))
@torch.no_grad()
def test_option_values_outside_the_presets_decode_like_the_parallel_form(setup):
    model = make_model("attention_family", mixer_options=EXTRA_SETUPS[setup])
    tokens = random_tokens(2, 20, seed=6)
    full_logits = model(tokens).logits
    out = model(tokens[:, :8], use_cache=True)
    logits = [out.logits]
    for t in range(8, tokens.shape[1]):
        out = model(tokens[:, t : t + 1], cache=out.past_key_values, use_cache=True)
        logits.append(out.logits)
    assert_close_rel(torch.cat(logits, dim=1), full_logits)
    mask = torch.ones_like(tokens)
    mask[1, :5] = 0
    padded = model(tokens, attention_mask=mask).logits
    assert_close_rel(padded[1, 5:], model(tokens[1:, 5:]).logits[0])


# ---------------------------------------------------------------- training


@every_preset
def test_gradients_reach_every_parameter(name):
    model = make_model(name, num_layers=1).train()
    tokens = random_tokens(2, 17)
    model(tokens, labels=tokens).loss.backward()
    for param_name, p in model.named_parameters():
        assert p.grad is not None, f"no gradient for {param_name}"
        assert torch.isfinite(p.grad).all(), f"non-finite gradient for {param_name}"
        assert p.grad.abs().sum() > 0, f"zero gradient for {param_name}"


@every_preset
def test_length_2048_with_random_inputs_stays_finite(name):
    torch.manual_seed(0)
    model = AttnLabForCausalLM(tiny_config(name, hidden_size=8, num_heads=1, num_layers=1, intermediate_size=16)).train()
    tokens = random_tokens(1, 2048, seed=3)
    loss = model(tokens, labels=tokens).loss
    assert torch.isfinite(loss)
    loss.backward()
    for param_name, p in model.named_parameters():
        assert torch.isfinite(p.grad).all(), f"non-finite gradient for {param_name} at length 2048"


@pytest.fixture(scope="module")
def text_batches(small_corpus):
    data = torch.tensor(list(small_corpus.read_bytes()[:20_000]), dtype=torch.long)
    gen = torch.Generator().manual_seed(0)
    starts = torch.randint(0, len(data) - 33, (30, 8), generator=gen)
    return [torch.stack([data[s : s + 32] for s in row]) for row in starts]


@every_preset
def test_thirty_optimisation_steps_reduce_the_loss(name, text_batches):
    torch.manual_seed(0)
    model = AttnLabForCausalLM(tiny_config(name, vocab_size=256, num_layers=1)).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    held_out = text_batches[0]
    with torch.no_grad():
        before = model(held_out, labels=held_out).loss.item()
    for batch in text_batches:
        loss = model(batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    with torch.no_grad():
        after = model(held_out, labels=held_out).loss.item()
    assert after < before - 0.5, f"loss {before:.3f} -> {after:.3f}"


# ---------------------------------------------------------------- generation


@every_preset
@torch.no_grad()
def test_greedy_generate_matches_a_manual_greedy_loop(models, name):
    model = shared_model(models, name)
    prompt = random_tokens(2, 7)
    generated = model.generate(prompt, max_new_tokens=6, do_sample=False)
    out = model(prompt, use_cache=True)
    new_tokens = []
    for _ in range(6):
        next_token = out.logits[:, -1].argmax(-1, keepdim=True)
        new_tokens.append(next_token)
        out = model(next_token, cache=out.past_key_values, use_cache=True)
    assert torch.equal(generated, torch.cat([prompt, *new_tokens], dim=1))


@every_preset
@torch.no_grad()
def test_beam_search_with_cache_matches_beam_search_recomputing_everything(models, name):
    model = shared_model(models, name)
    prompt = random_tokens(2, 6, seed=4)
    kwargs = dict(max_new_tokens=5, do_sample=False, num_beams=3, num_return_sequences=2)
    cached = model.generate(prompt, use_cache=True, **kwargs)
    recomputed = model.generate(prompt, use_cache=False, **kwargs)
    assert torch.equal(cached, recomputed)


@pytest.mark.parametrize("name", ["2mamba", "gated_softmax"])
@torch.no_grad()
def test_preset_model_saves_and_reloads_with_identical_logits(name, tmp_path):
    from transformers import AutoModelForCausalLM

    model = make_model(name)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.mixer == name and loaded.config.mixer_options == model.config.mixer_options
    tokens = random_tokens(2, 12)
    assert torch.equal(loaded(tokens).logits, model(tokens).logits)
