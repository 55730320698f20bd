"""Behaviour of the attnlab models: exactness of the parallel, chunked and step forms,
padding, caching, generation, training and serialization."""

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from attnlab.models import MIXERS, AttnLabCache, AttnLabConfig, AttnLabForCausalLM
from attnlab.models.ops.gla import chunk_gla, fused_recurrent_gla_step, naive_recurrent_gla

pytestmark = pytest.mark.hf_interop  # CI runs these against the oldest transformers and peft it supports too

VOCAB = 64
# chunk_size=16 so that sequences of a few dozen tokens cross GLA chunk boundaries
MIXER_SETUPS = {
    "gla": dict(mixer="gla", mixer_options={"chunk_size": 16}),
    "softmax": dict(mixer="softmax"),
    "softmax-gqa": dict(mixer="softmax", mixer_options={"num_kv_heads": 2}),
}


def tiny_config(setup: str = "gla", **overrides) -> AttnLabConfig:
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=4, **MIXER_SETUPS[setup])
    kwargs.update(overrides)
    return AttnLabConfig(**kwargs)


def tiny_model(setup: str = "gla", seed: int = 0, **overrides) -> AttnLabForCausalLM:
    torch.manual_seed(seed)
    model = AttnLabForCausalLM(tiny_config(setup, **overrides)).eval()
    # larger gate/norm weights than the init so that every path visibly matters
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("weight") and p.dim() == 1:
                p.normal_(1.0, 0.2)
    return model


def random_tokens(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def assert_close_rel(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-5) -> None:
    err = (actual - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert err <= rel * scale, f"max abs error {err:.3g} exceeds {rel:g} x max |expected| {scale:.3g}"


all_mixers = pytest.mark.parametrize("setup", list(MIXER_SETUPS))


# ---------------------------------------------------------------- GLA kernels


def random_gla_inputs(batch, seq_len, heads, key_dim, value_dim, gate_scale=1.0, gate_shift=0.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq_len, heads, key_dim, generator=gen)
    k = torch.randn(batch, seq_len, heads, key_dim, generator=gen)
    v = torch.randn(batch, seq_len, heads, value_dim, generator=gen)
    logits = torch.randn(batch, seq_len, heads, key_dim, generator=gen) * gate_scale + gate_shift
    gk = F.logsigmoid(logits) / 16
    state = torch.randn(batch, heads, key_dim, value_dim, generator=gen)
    return q, k, v, gk, state


@pytest.mark.parametrize("seq_len", [1, 7, 16, 50, 64, 130])
def test_gla_chunk_form_matches_naive_recurrence(seq_len):
    q, k, v, gk, state = random_gla_inputs(2, seq_len, 3, 8, 12, gate_scale=3.0)
    o_ref, state_ref = naive_recurrent_gla(q, k, v, gk, initial_state=state)
    for chunk_size in (16, 64):
        o, final_state = chunk_gla(q, k, v, gk, chunk_size=chunk_size, initial_state=state)
        assert_close_rel(o, o_ref)
        assert_close_rel(final_state, state_ref)


def test_gla_chunk_form_without_initial_state_starts_from_zero():
    q, k, v, gk, _ = random_gla_inputs(1, 40, 2, 8, 8)
    o_ref, state_ref = naive_recurrent_gla(q, k, v, gk)
    o, state = chunk_gla(q, k, v, gk, chunk_size=16)
    assert_close_rel(o, o_ref)
    assert_close_rel(state, state_ref)


def test_gla_step_matches_one_token_of_the_recurrence():
    q, k, v, gk, state = random_gla_inputs(2, 1, 3, 8, 12)
    o_ref, state_ref = naive_recurrent_gla(q, k, v, gk, initial_state=state)
    o, new_state = fused_recurrent_gla_step(q[:, 0], k[:, 0], v[:, 0], gk[:, 0], state)
    assert_close_rel(o, o_ref[:, 0])
    assert_close_rel(new_state, state_ref)


def test_gla_chunk_form_stays_finite_on_long_sequences_with_strongly_negative_gates():
    # log-gates down to about -40 per step: exp of cumulative sums over a chunk would overflow fp32
    q, k, v, gk, _ = random_gla_inputs(1, 2048, 2, 16, 16, gate_scale=200.0, gate_shift=-300.0)
    assert gk.min() < -20
    q, k, v, gk = (x.requires_grad_() for x in (q, k, v, gk))
    o, state = chunk_gla(q, k, v, gk, chunk_size=64)
    assert torch.isfinite(o).all() and torch.isfinite(state).all()
    o.square().mean().backward()
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v, gk))
    o_ref, _ = naive_recurrent_gla(q.detach(), k.detach(), v.detach(), gk.detach())
    assert_close_rel(o.detach(), o_ref)


# ---------------------------------------------------------------- forms of the whole model


@all_mixers
@torch.no_grad()
def test_prefill_then_one_token_steps_matches_parallel_forward(setup):
    model = tiny_model(setup)
    tokens = random_tokens(2, 40)
    full_logits = model(tokens).logits
    prefill = 21
    out = model(tokens[:, :prefill], use_cache=True)
    step_logits = [out.logits]
    cache = out.past_key_values
    for t in range(prefill, tokens.shape[1]):
        out = model(tokens[:, t : t + 1], cache=cache, use_cache=True)
        step_logits.append(out.logits)
    assert cache.get_seq_length() == tokens.shape[1]
    assert_close_rel(torch.cat(step_logits, dim=1), full_logits)


@all_mixers
@torch.no_grad()
def test_prefill_in_two_parallel_chunks_matches_one_parallel_pass(setup):
    model = tiny_model(setup)
    tokens = random_tokens(2, 45)
    full_logits = model(tokens).logits
    first = model(tokens[:, :19], use_cache=True)
    second = model(tokens[:, 19:], cache=first.past_key_values, use_cache=True)
    assert_close_rel(torch.cat([first.logits, second.logits], dim=1), full_logits)


@all_mixers
@torch.no_grad()
def test_future_tokens_never_change_past_logits(setup):
    model = tiny_model(setup)
    tokens = random_tokens(2, 40)
    logits = model(tokens).logits
    for t in (0, 15, 16, 30):
        perturbed = tokens.clone()
        perturbed[:, t + 1 :] = random_tokens(2, 40 - t - 1, seed=t + 7)
        perturbed_logits = model(perturbed).logits
        assert (perturbed_logits[:, : t + 1] - logits[:, : t + 1]).abs().max() <= 1e-6


@all_mixers
@torch.no_grad()
def test_left_padded_batch_matches_each_sequence_alone(setup):
    model = tiny_model(setup)
    lengths = [23, 9, 17]
    seqs = [random_tokens(1, n, seed=10 + i)[0] for i, n in enumerate(lengths)]
    width = max(lengths)
    tokens = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, seq in enumerate(seqs):
        tokens[i, width - len(seq) :] = seq
        mask[i, width - len(seq) :] = 1
    out = model(tokens, attention_mask=mask, use_cache=True)

    next_tokens = random_tokens(len(seqs), 1, seed=99)
    mask = torch.cat([mask, torch.ones_like(next_tokens)], dim=1)
    step = model(next_tokens, attention_mask=mask, cache=out.past_key_values, use_cache=True)

    for i, seq in enumerate(seqs):
        alone = model(torch.cat([seq, next_tokens[i]])[None]).logits
        assert_close_rel(out.logits[i, -1], alone[0, -2])
        assert_close_rel(step.logits[i, -1], alone[0, -1])


@all_mixers
@torch.no_grad()
def test_logits_to_keep_returns_only_the_last_positions(setup):
    model = tiny_model(setup)
    tokens = random_tokens(3, 20)
    full_logits = model(tokens).logits
    last = model(tokens, logits_to_keep=1).logits
    assert last.shape == (3, 1, VOCAB)
    assert_close_rel(last, full_logits[:, -1:])
    assert model(tokens, logits_to_keep=4).logits.shape == (3, 4, VOCAB)


# ---------------------------------------------------------------- training


@all_mixers
def test_gradients_reach_every_parameter(setup):
    model = tiny_model(setup).train()
    tokens = random_tokens(2, 37)
    model(tokens, labels=tokens).loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, f"no gradient for {name}"
        assert torch.isfinite(p.grad).all(), f"non-finite gradient for {name}"
        assert p.grad.abs().sum() > 0, f"zero gradient for {name}"


def test_prenorm_with_a_residual_adds_then_norms_and_keeps_the_sum_in_the_residual_dtype():
    from attnlab.models.modules import PreNorm

    norm = PreNorm(64, kernels="torch")
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.2)
    branch, residual = torch.randn(2, 5, 64).bfloat16(), torch.randn(2, 5, 64)
    normed, summed = norm(branch, residual=residual)
    assert summed.dtype == torch.float32 and torch.equal(summed, residual + branch)
    assert torch.equal(normed, norm(summed))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        normed_bf16, summed_again = norm(branch, residual=residual)
    assert normed_bf16.dtype == torch.bfloat16 and summed_again.dtype == torch.float32
    assert torch.equal(normed_bf16, normed.bfloat16())


@pytest.mark.parametrize("setup", ["gla", "softmax"])
def test_under_autocast_a_branchs_input_projections_keep_one_shared_copy_of_their_input(setup):
    # The norm emits autocast's dtype, so q/k/v/gates (and the MLP's gate/up) do not each cast
    # the fp32 stream and keep their own copy for the backward.
    model = tiny_model(setup).train()
    block = model.model.layers[0]
    current: list[str] = []
    saved: dict[str, set[int]] = {}
    for name, module in block.named_modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(lambda m, a, name=name: current.append(name))
            module.register_forward_hook(lambda m, a, o: current.pop() and None)

    tokens = random_tokens(2, 37)

    def pack(t):
        if current and t.dtype == torch.bfloat16 and t.numel() == tokens.numel() * 64:  # a [tokens, hidden] input
            saved.setdefault(current[-1], set()).add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        model(tokens, labels=tokens).loss.backward()
    groups = [[n for n in saved if n.startswith("attn.") and n != "attn.o_proj" and not n.startswith("attn.gk_proj.1")],
              ["mlp.gate_proj", "mlp.up_proj"]]
    for group in groups:
        assert len(group) >= 2
        assert len(set().union(*(saved[n] for n in group))) == 1, group


@all_mixers
def test_gradient_checkpointing_gives_same_loss_and_gradients(setup):
    tokens = random_tokens(2, 37)

    def loss_and_grads(model):
        loss = model(tokens, labels=tokens).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    plain = tiny_model(setup).train()
    loss_ref, grads_ref = loss_and_grads(plain)

    checkpointed = tiny_model(setup).train()
    checkpointed.activation_checkpointing_enable()
    mixer_calls = []
    checkpointed.model.layers[0].attn.register_forward_hook(lambda *args: mixer_calls.append(1))
    loss, grads = loss_and_grads(checkpointed)

    assert len(mixer_calls) == 2, "the block should be recomputed in the backward pass"
    assert_close_rel(loss, loss_ref)
    for name, grad in grads.items():
        assert_close_rel(grad, grads_ref[name], rel=1e-4)


@all_mixers
def test_loss_ignores_masked_labels_and_equals_manual_cross_entropy(setup):
    model = tiny_model(setup)
    tokens = random_tokens(2, 20)
    labels = tokens.clone()
    labels[0, :8] = -100
    labels[1, 15:] = -100
    out = model(tokens, labels=labels)
    shifted_logits, shifted_labels = out.logits[:, :-1], labels[:, 1:]
    keep = shifted_labels != -100
    log_probs = shifted_logits.float().log_softmax(-1)
    manual = -log_probs[keep].gather(-1, shifted_labels[keep][:, None]).mean()
    assert torch.allclose(out.loss, manual, rtol=1e-6, atol=1e-6)

    # the tokens at ignored positions play no part in the loss
    assert torch.allclose(F.cross_entropy(shifted_logits[keep].float(), shifted_labels[keep]), out.loss)


# ---------------------------------------------------------------- cache, generation


@all_mixers
@torch.no_grad()
def test_cache_reorder_and_select_match_recomputation(setup):
    model = tiny_model(setup)
    tokens = random_tokens(3, 18)
    next_tokens = random_tokens(3, 1, seed=5)

    def step_after(cache_edit, rows):
        cache = model(tokens, use_cache=True).past_key_values
        cache_edit(cache)
        logits = model(next_tokens[rows], cache=cache, use_cache=True).logits[:, -1]
        expected = model(torch.cat([tokens, next_tokens], dim=1)[rows]).logits[:, -1]
        assert_close_rel(logits, expected)

    beam_idx = torch.tensor([2, 0, 0])
    step_after(lambda cache: cache.reorder(beam_idx), beam_idx)
    step_after(lambda cache: cache.select(torch.tensor([1])), torch.tensor([1]))
    step_after(lambda cache: cache.select([2, 0]), torch.tensor([2, 0]))


@all_mixers
@torch.no_grad()
def test_generate_matches_manual_greedy_loop(setup):
    model = tiny_model(setup)
    prompt = random_tokens(2, 11)
    generated = model.generate(prompt, max_new_tokens=8, do_sample=False)

    out = model(prompt, use_cache=True)
    cache = out.past_key_values
    assert isinstance(cache, AttnLabCache)
    new_tokens = []
    for _ in range(8):
        next_token = out.logits[:, -1].argmax(-1, keepdim=True)
        new_tokens.append(next_token)
        out = model(next_token, cache=cache, use_cache=True)
    assert torch.equal(generated, torch.cat([prompt, *new_tokens], dim=1))


@all_mixers
@torch.no_grad()
def test_generate_with_left_padding_matches_each_prompt_alone(setup):
    model = tiny_model(setup)
    prompts = [random_tokens(1, 12, seed=3)[0], random_tokens(1, 7, seed=4)[0]]
    tokens = torch.zeros(2, 12, dtype=torch.long)
    mask = torch.zeros(2, 12, dtype=torch.long)
    for i, prompt in enumerate(prompts):
        tokens[i, 12 - len(prompt) :] = prompt
        mask[i, 12 - len(prompt) :] = 1
    batched = model.generate(tokens, attention_mask=mask, max_new_tokens=6, do_sample=False)
    for i, prompt in enumerate(prompts):
        alone = model.generate(prompt[None], max_new_tokens=6, do_sample=False)
        assert torch.equal(batched[i, 12:], alone[0, len(prompt) :])


@all_mixers
@torch.no_grad()
def test_beam_search_generate_runs(setup):
    model = tiny_model(setup)
    prompt = random_tokens(2, 9)
    generated = model.generate(prompt, max_new_tokens=6, do_sample=False, num_beams=2)
    assert generated.shape == (2, 15)
    assert torch.equal(generated[:, :9], prompt)


# ---------------------------------------------------------------- serialization, config


@pytest.mark.parametrize("setup,tied", [("gla", True), ("softmax-gqa", True), ("gla", False)])
@torch.no_grad()
def test_save_and_auto_load_round_trip_gives_identical_logits(setup, tied, tmp_path):
    model = tiny_model(setup, tie_word_embeddings=tied)
    if not tied:
        model.lm_head.weight.normal_()
    model.save_pretrained(tmp_path)
    files = {p.name for p in tmp_path.iterdir()}
    assert "model.safetensors" in files
    assert not [f for f in files if f.endswith((".bin", ".pt", ".pth", ".pkl", ".pickle"))]

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, AttnLabForCausalLM)
    assert loaded.config.mixer_options == model.config.mixer_options
    assert (loaded.lm_head.weight.data_ptr() == loaded.model.embeddings.weight.data_ptr()) == tied
    tokens = random_tokens(2, 20)
    assert torch.equal(loaded(tokens).logits, model(tokens).logits)


def test_mixer_registry_lists_both_families():
    assert {"gla", "softmax"} <= set(MIXERS)


CAPABILITIES = ("train_graph_safe", "reports_stats", "collect_stats", "stats_graph_safe", "fixed_size_state", "static_kv",
                "static_columns", "left_aligned", "static_state")


def test_every_capability_the_engine_and_trainer_ask_a_mixer_about_is_declared_on_the_base_class_and_never_probed():
    import re
    from pathlib import Path

    import attnlab
    from attnlab.models.mixers import Mixer

    for name in CAPABILITIES:
        assert hasattr(Mixer, name), name
    probed = re.compile(r"(getattr|hasattr)\([^)]*[\"'](" + "|".join(CAPABILITIES) + r")[\"']")
    for path in Path(attnlab.__file__).parent.rglob("*.py"):
        assert not probed.search(path.read_text()), f"{path.name} probes a mixer capability with getattr/hasattr"


@pytest.mark.parametrize("name", sorted(MIXERS))
def test_a_mixer_that_keeps_static_kv_buffers_says_how_and_one_that_reports_statistics_can_record_them(name):
    from attnlab.models.mixers import Mixer

    cfg = AttnLabConfig(vocab_size=32, hidden_size=32, num_layers=1, num_heads=2, mixer=name, intermediate_size=64)
    mixer = AttnLabForCausalLM(cfg).model.layers[0].attn
    assert isinstance(mixer, Mixer)
    if mixer.static_kv:
        assert type(mixer).static_state is not Mixer.static_state
    assert not (mixer.fixed_size_state and mixer.static_kv)
    if mixer.reports_stats:
        assert mixer.collect_stats is False and hasattr(mixer, "last_stats")


def test_config_rejects_unknown_mixer_naming_the_closest_registered_ones():
    with pytest.raises(ValueError, match=r"unknown mixer 'mamba9'; did you mean 'mamba2'"):
        AttnLabConfig(mixer="mamba9")
    with pytest.raises(ValueError, match=r"the families are attention_family, gla, mamba2, nsa, softmax"):
        AttnLabConfig(mixer="zzzz")


@pytest.mark.parametrize("mixer,valid", [("gla", "gate_logit_normalizer"), ("softmax", "num_kv_heads")])
def test_config_rejects_unknown_mixer_option_naming_the_valid_ones(mixer, valid):
    with pytest.raises(ValueError, match=f"valid options: .*{valid}"):
        AttnLabConfig(mixer=mixer, mixer_options={"not_an_option": 1})


def test_config_rejects_hidden_size_not_divisible_by_heads():
    with pytest.raises(ValueError, match="divisible"):
        AttnLabConfig(hidden_size=66, num_heads=4)


def test_config_fills_defaults():
    config = AttnLabConfig()
    assert config.hidden_size == 128  # the run config's model.hidden_size (tests/test_model_config.py)
    assert config.intermediate_size == 352  # round_up(8 / 3 * 128, 32)
    assert config.mixer_options == {
        "expand_k": 0.5, "expand_v": 1.0, "gate_low_rank_dim": 16, "gate_logit_normalizer": 16, "chunk_size": 64,
    }
    assert math.isclose(AttnLabConfig(mixer="softmax").rope_theta, 10000.0)


# --- the cache's names in the HF convention (transformers 5.24 renamed `past_key_values` to `cache`) ---


def test_the_cache_is_taken_under_both_names_and_returned_under_the_installed_ones():
    from attnlab.models.hf_names import CACHE_KEY, cache_of

    model, tokens = tiny_model(), random_tokens(2, 12)
    with torch.no_grad():
        first = model(tokens[:, :8], use_cache=True)
        new = model(tokens[:, 8:], cache=cache_of(first), use_cache=True).logits
        first = model(tokens[:, :8], use_cache=True)
        old = model(tokens[:, 8:], past_key_values=cache_of(first), use_cache=True).logits
        whole = model(tokens).logits[:, 8:]
    assert CACHE_KEY in type(first).__dataclass_fields__
    torch.testing.assert_close(new, whole, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(old, whole, rtol=1e-4, atol=1e-5)


def test_both_cache_names_at_once_are_refused():
    model, tokens = tiny_model(), random_tokens(1, 4)
    cache = model(tokens, use_cache=True).past_key_values
    with pytest.raises(TypeError, match="not both"):
        model(tokens, cache=cache, past_key_values=cache, use_cache=True)


@pytest.mark.parametrize("keyword", ["cache_params", "position_ids", "past_key_value", "num_logits_to_keep"])
def test_a_keyword_the_model_does_not_take_raises_naming_it(keyword):
    model, tokens = tiny_model(), random_tokens(1, 4)
    with pytest.raises(TypeError, match=keyword):
        model(tokens, **{keyword: None})


def test_hidden_states_are_returned_on_request_and_attentions_refused():
    model, tokens = tiny_model(), random_tokens(1, 5)
    out = model(tokens, output_hidden_states=True)
    assert len(out.hidden_states) == model.config.num_layers + 1
    assert all(h.shape == (1, 5, model.config.hidden_size) for h in out.hidden_states)
    with pytest.raises(ValueError, match="output_attentions"):
        model(tokens, output_attentions=True)


def test_generation_and_decoding_paths_print_no_transformers_deprecation():
    """attnlab's own calls use the installed version's name: no "deprecated" line from transformers."""
    import logging

    from transformers.utils import logging as hf_logging

    from attnlab.data import ByteTokenizer
    from attnlab.generation import generate
    from attnlab.train.sampling import sample_continuation

    hf_logging.warning_once.cache_clear()  # a warning printed by an earlier test prints again
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    hf_logging.get_logger("transformers").addHandler(handler)
    model, tokenizer = tiny_model(vocab_size=259), ByteTokenizer()
    generate(model, tokenizer, ["To be", "or"], max_new_tokens=4)
    generate(model, tokenizer, ["To be", "or"], max_new_tokens=4, num_beams=2)
    model.generate(**tokenizer(["To be", "or"], padding=True, return_tensors="pt"), max_new_tokens=3,
                   pad_token_id=tokenizer.pad_token_id)
    from transformers import LlamaConfig, LlamaForCausalLM  # an HF model through the engine: its cache argument

    llama = LlamaForCausalLM(LlamaConfig(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2)).eval()
    generate(llama, tokenizer, ["To be", "or"], max_new_tokens=3, num_beams=2)
    try:
        sample_continuation(model, tokenizer, "To be", max_new_tokens=3)
    finally:
        hf_logging.get_logger("transformers").removeHandler(handler)
    assert not [line for line in lines if "deprecated" in line]


@pytest.mark.parametrize("mixer", sorted(MIXERS))
def test_every_parameter_of_every_mixer_gets_a_gradient(mixer):
    """`attnlab train` runs DDP without its search for unused parameters (train/loop.py): it holds
    only because a training forward uses every parameter."""
    torch.manual_seed(0)
    model = AttnLabForCausalLM(AttnLabConfig(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=2, mixer=mixer)).train()
    tokens = random_tokens(2, 24)
    model(tokens, labels=tokens).loss.backward()
    assert [name for name, p in model.named_parameters() if p.grad is None] == []
