"""Native sparse attention and Mamba-2: the reference forms against brute force, the mixer battery
(causality, step = parallel, prefill, padding, cache, gradients, long inputs, training, generation)
and the NSA health statistics."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from attnlab.data import ByteTokenizer
from attnlab.generation import generate_ids
from attnlab.models import AttnLabConfig, AttnLabForCausalLM
from attnlab.models.ops.mamba2 import chunk_ssd, naive_recurrent_ssd, ssd_step
from attnlab.models.ops.common import apply_rotary, rotary_cos_sin
from attnlab.models.ops.nsa import mean_pool_blocks, naive_nsa, nsa_step, parallel_nsa

from conftest import random_nsa_inputs, run_cli, sets

VOCAB = 64
# small blocks and windows so that a few dozen tokens cross many block boundaries
SETUPS = {
    # the paper's selection (block 0 and the two local blocks forced) with one slot chosen by score
    "nsa": dict(mixer="nsa", mixer_options={"block_size": 8, "block_counts": 4, "window_size": 6, "num_kv_heads": 2}),
    # only the query's own block forced, two slots chosen by score
    "nsa-mlp": dict(
        mixer="nsa",
        mixer_options={
            "block_size": 8, "block_counts": 3, "window_size": 4, "compression": "mlp",
            "initial_blocks": 0, "local_blocks": 1,
        },
    ),
    "mamba2": dict(mixer="mamba2", mixer_options={"chunk_size": 16, "state_size": 16, "n_groups": 2}),
}
NSA_KEYS = {
    "nsa_gate_entropy_mean", "nsa_max_gate_mean", "nsa_collapse_fraction", "nsa_branch_share_cmp",
    "nsa_branch_share_slc", "nsa_branch_share_swa", "nsa_k_mean", "nsa_k_max", "nsa_pct_at_k_max",
}
all_setups = pytest.mark.parametrize("setup", list(SETUPS))


def make_model(setup: str, seed: int = 0, **overrides) -> AttnLabForCausalLM:
    torch.manual_seed(seed)
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=4, **SETUPS[setup])
    kwargs.update(overrides)
    model = AttnLabForCausalLM(AttnLabConfig(**kwargs)).eval()
    with torch.no_grad():  # norm weights away from 1 so that every path visibly matters
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.2)
    return model


@pytest.fixture(scope="module")
def models():
    return {setup: make_model(setup) for setup in SETUPS}


def random_tokens(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def assert_close_rel(actual, expected, rel: float = 1e-5) -> None:
    err = (actual - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert err <= rel * scale, f"max abs error {err:.3g} exceeds {rel:g} x max |expected| {scale:.3g}"


# ---------------------------------------------------------------- NSA reference forms

NSA_OPS = dict(block_size=4, block_counts=4, window_size=5)  # initial_blocks=1, local_blocks=2 by default
SELECTION_RULES = {
    "paper": dict(initial_blocks=1, local_blocks=2),
    "own-block-only": dict(initial_blocks=0, local_blocks=1),
    "two-initial-one-local": dict(initial_blocks=2, local_blocks=1),
}


@pytest.mark.parametrize("rule", list(SELECTION_RULES))
@pytest.mark.parametrize("seq_len", [1, 3, 4, 5, 16, 23])
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_nsa_parallel_form_matches_brute_force_per_query(seq_len, kv_heads, rule):
    ops = {**NSA_OPS, **SELECTION_RULES[rule]}
    q, k, v, gates = random_nsa_inputs(2, seq_len, 4, kv_heads, 8, seed=seq_len)
    k_cmp, v_cmp = mean_pool_blocks(k, 4), mean_pool_blocks(v, 4)
    o, block_indices = parallel_nsa(q, k, v, k_cmp, v_cmp, *gates, **ops)
    o_ref, selected_ref = naive_nsa(q, k, v, *gates, **ops)
    assert_close_rel(o, o_ref)
    for b in range(2):
        for t in range(seq_len):
            for h in range(kv_heads):
                chosen = sorted(i for i in block_indices[b, t, h].tolist() if i >= 0)
                assert chosen == selected_ref[b][t][h], (b, t, h)


@pytest.mark.parametrize("rule", list(SELECTION_RULES))
def test_nsa_step_form_reading_the_cache_matches_the_parallel_form(rule):
    ops = {**NSA_OPS, **SELECTION_RULES[rule]}
    q, k, v, gates = random_nsa_inputs(2, 23, 4, 2, 8)
    k_cmp, v_cmp = mean_pool_blocks(k, 4), mean_pool_blocks(v, 4)
    o, block_indices = parallel_nsa(q, k, v, k_cmp, v_cmp, *gates, **ops)
    for t in range(23):
        o_t, idx_t = nsa_step(
            q[:, t], k[:, : t + 1], v[:, : t + 1], k_cmp[:, : (t + 1) // 4], v_cmp[:, : (t + 1) // 4],
            *(g[:, t] for g in gates), q_pos=torch.full((2,), t), **ops,
        )
        assert_close_rel(o_t, o[:, t])
        assert torch.equal(idx_t.sort(-1).values, block_indices[:, t].sort(-1).values)


@pytest.mark.parametrize("t", [2, 3, 4, 7, 8, 11, 12, 18])  # around block boundaries (block_size 4)
def test_nsa_future_keys_queries_and_values_never_change_past_outputs_or_selection(t):
    q, k, v, gates = random_nsa_inputs(1, 21, 4, 2, 8)
    noise = random_nsa_inputs(1, 21, 4, 2, 8, seed=99)

    def run(q, k, v, gates):
        return parallel_nsa(q, k, v, mean_pool_blocks(k, 4), mean_pool_blocks(v, 4), *gates, **NSA_OPS)

    o, idx = run(q, k, v, gates)
    future = slice(t + 1, None)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    q2[:, future], k2[:, future], v2[:, future] = noise[0][:, future], noise[1][:, future], noise[2][:, future]
    gates2 = [g.clone() for g in gates]
    for g, g_noise in zip(gates2, noise[3]):
        g[:, future] = g_noise[:, future]
    o2, idx2 = run(q2, k2, v2, gates2)
    assert (o2[:, : t + 1] - o[:, : t + 1]).abs().max() <= 1e-6
    assert torch.equal(idx2[:, : t + 1], idx[:, : t + 1])


def test_nsa_selection_never_touches_a_future_block_and_k_never_exceeds_the_past_blocks():
    q, k, v, gates = random_nsa_inputs(2, 30, 4, 2, 8)
    _, block_indices = parallel_nsa(q, k, v, mean_pool_blocks(k, 4), mean_pool_blocks(v, 4), *gates, **NSA_OPS)
    for t in range(30):
        local = t // 4
        idx = block_indices[:, t]  # [B, Hkv, S]
        used = idx >= 0
        assert (idx[used] <= local).all(), f"query {t} selected a block after its own"
        k_selected = used.sum(-1)
        assert (k_selected <= local + 1).all(), f"query {t} selected more blocks than it has seen"
        assert (k_selected == min(NSA_OPS["block_counts"], local + 1)).all()
        assert (idx == local).any(-1).all(), f"query {t} lost its own block"
        assert (idx == max(local - 1, 0)).any(-1).all(), f"query {t} lost the block before its own"
        assert (idx == 0).any(-1).all(), f"query {t} lost the initial block"
        for row in idx.reshape(-1, idx.shape[-1]).tolist():
            chosen = [i for i in row if i >= 0]
            assert len(set(chosen)) == len(chosen), f"query {t} selected a block twice: {row}"


def test_nsa_mixer_matches_brute_force_with_its_own_projections_and_compression():
    for setup in ("nsa", "nsa-mlp"):
        mixer = make_model(setup).model.layers[0].attn
        x = torch.randn(2, 29, 64, generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            y, _ = mixer(x)
            batch, seq_len = 2, 29
            q = mixer.q_proj(x).view(batch, seq_len, mixer.num_heads, mixer.head_dim)
            k = mixer.k_proj(x).view(batch, seq_len, mixer.num_kv_heads, mixer.head_dim)
            v = mixer.v_proj(x).view(batch, seq_len, mixer.num_kv_heads, mixer.head_dim)
            gates = mixer.g_proj(x).view(batch, seq_len, mixer.num_heads, 3).sigmoid().unbind(-1)
            cos, sin = rotary_cos_sin(torch.arange(seq_len).expand(batch, -1), mixer.head_dim, mixer.rope_theta)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            k_cmp = v_cmp = None
            if mixer.compress_key is not None:
                blocks = (seq_len // 8) * 8
                k_cmp = mixer.compress_key(k[:, :blocks].reshape(batch, -1, 8, *k.shape[2:]))
                v_cmp = mixer.compress_value(v[:, :blocks].reshape(batch, -1, 8, *v.shape[2:]))
            o, _ = naive_nsa(
                q, k, v, *gates, mixer.block_size, mixer.block_counts, mixer.window_size, k_cmp, v_cmp,
                initial_blocks=mixer.initial_blocks, local_blocks=mixer.local_blocks,
            )
            y_ref = mixer.o_proj(o.reshape(batch, seq_len, -1))
        assert_close_rel(y, y_ref)


# ---------------------------------------------------------------- Mamba-2 reference forms


def random_ssd_inputs(batch, seq_len, heads, head_dim, groups, state_size, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq_len, heads, head_dim, generator=gen)
    dt = torch.nn.functional.softplus(torch.randn(batch, seq_len, heads, generator=gen) - 1)
    A = -torch.rand(heads, generator=gen) * 8 - 0.5
    B = torch.randn(batch, seq_len, groups, state_size, generator=gen)
    C = torch.randn(batch, seq_len, groups, state_size, generator=gen)
    state = torch.randn(batch, heads, head_dim, state_size, generator=gen)
    return x, dt, A, B, C, state


@pytest.mark.parametrize("seq_len", [1, 7, 16, 50, 130])
def test_mamba2_chunked_form_matches_the_recurrence(seq_len):
    x, dt, A, B, C, state = random_ssd_inputs(2, seq_len, 4, 8, 2, 6, seed=seq_len)
    y_ref, state_ref = naive_recurrent_ssd(x, dt, A, B, C, initial_state=state)
    for chunk_size in (16, 64):
        y, final_state = chunk_ssd(x, dt, A, B, C, chunk_size=chunk_size, initial_state=state)
        assert_close_rel(y, y_ref)
        assert_close_rel(final_state, state_ref)
    y, _ = chunk_ssd(x, dt, A, B, C, chunk_size=16)
    assert_close_rel(y, naive_recurrent_ssd(x, dt, A, B, C)[0])


def test_mamba2_step_is_one_token_of_the_recurrence_written_out():
    x, dt, A, B, C, state = random_ssd_inputs(2, 1, 4, 8, 2, 6)
    y, new_state = ssd_step(x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], state)
    B_h, C_h = B[:, 0].repeat_interleave(2, dim=1), C[:, 0].repeat_interleave(2, dim=1)  # [b, H, N]
    for h in range(4):
        expected = torch.exp(dt[:, 0, h] * A[h])[:, None, None] * state[:, h]
        expected = expected + (dt[:, 0, h, None] * x[:, 0, h])[:, :, None] * B_h[:, h, None, :]
        assert_close_rel(new_state[:, h], expected)
        assert_close_rel(y[:, h], (expected * C_h[:, h, None, :]).sum(-1))


# ---------------------------------------------------------------- the mixer battery, whole model


@all_setups
@torch.no_grad()
def test_future_tokens_never_change_past_logits(setup, models):
    model = models[setup]
    tokens = random_tokens(2, 40)
    logits = model(tokens).logits
    for t in (0, 6, 7, 8, 15, 16, 23, 31):  # block boundaries at multiples of 8
        perturbed = tokens.clone()
        perturbed[:, t + 1 :] = random_tokens(2, 40 - t - 1, seed=t + 7)
        assert (model(perturbed).logits[:, : t + 1] - logits[:, : t + 1]).abs().max() <= 1e-6


@all_setups
@torch.no_grad()
def test_prefill_then_one_token_steps_matches_parallel_forward(setup, models):
    model = models[setup]
    tokens = random_tokens(2, 43)  # not a multiple of the block size
    full_logits = model(tokens).logits
    out = model(tokens[:, :13], use_cache=True)
    step_logits, cache = [out.logits], out.past_key_values
    for t in range(13, tokens.shape[1]):
        out = model(tokens[:, t : t + 1], cache=cache, use_cache=True)
        step_logits.append(out.logits)
    assert_close_rel(torch.cat(step_logits, dim=1), full_logits)


@all_setups
@torch.no_grad()
def test_steps_from_the_first_token_match_parallel_forward(setup, models):
    model = models[setup]
    tokens = random_tokens(2, 20)
    full_logits = model(tokens).logits
    out = model(tokens[:, :1], use_cache=True)
    step_logits, cache = [out.logits], out.past_key_values
    for t in range(1, 20):
        out = model(tokens[:, t : t + 1], cache=cache, use_cache=True)
        step_logits.append(out.logits)
    assert_close_rel(torch.cat(step_logits, dim=1), full_logits)


@all_setups
@torch.no_grad()
def test_prefill_in_parallel_pieces_matches_one_parallel_pass(setup, models):
    model = models[setup]
    tokens = random_tokens(2, 45)
    full_logits = model(tokens).logits
    pieces, cache, start = [], None, 0
    for end in (5, 19, 24, 45):  # pieces ending inside and at block boundaries
        out = model(tokens[:, start:end], cache=cache, use_cache=True)
        pieces.append(out.logits)
        cache, start = out.past_key_values, end
    assert_close_rel(torch.cat(pieces, dim=1), full_logits)


@all_setups
@torch.no_grad()
def test_left_padded_batch_matches_each_sequence_alone(setup, models):
    model = models[setup]
    lengths = [23, 9, 17]
    seqs = [random_tokens(1, n, seed=10 + i)[0] for i, n in enumerate(lengths)]
    width = max(lengths)
    tokens = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, seq in enumerate(seqs):
        tokens[i, width - len(seq) :] = seq
        mask[i, width - len(seq) :] = 1
    out = model(tokens, attention_mask=mask, use_cache=True)
    cache = out.past_key_values
    next_tokens = random_tokens(len(seqs), 4, seed=99)
    steps = []
    for t in range(4):
        mask = torch.cat([mask, torch.ones(len(seqs), 1, dtype=torch.long)], dim=1)
        step = model(next_tokens[:, t : t + 1], attention_mask=mask, cache=cache, use_cache=True)
        steps.append(step.logits)
    steps = torch.cat(steps, dim=1)
    for i, seq in enumerate(seqs):
        alone = model(torch.cat([seq, next_tokens[i]])[None]).logits[0]
        assert_close_rel(out.logits[i, -len(seq) :], alone[: len(seq)])
        assert_close_rel(steps[i], alone[len(seq) :])


@all_setups
@torch.no_grad()
def test_cache_reorder_and_select_match_recomputation(setup, models):
    model = models[setup]
    tokens = random_tokens(3, 18)
    next_tokens = random_tokens(3, 1, seed=5)
    for edit, rows in [
        (lambda c: c.reorder(torch.tensor([2, 0, 0])), torch.tensor([2, 0, 0])),
        (lambda c: c.select([2, 0]), torch.tensor([2, 0])),
    ]:
        cache = model(tokens, use_cache=True).past_key_values
        edit(cache)
        logits = model(next_tokens[rows], cache=cache, use_cache=True).logits[:, -1]
        expected = model(torch.cat([tokens, next_tokens], dim=1)[rows]).logits[:, -1]
        assert_close_rel(logits, expected)


@all_setups
def test_gradients_reach_every_parameter(setup):
    model = make_model(setup).train()
    tokens = random_tokens(2, 37)
    model(tokens, labels=tokens).loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, f"no gradient for {name}"
        assert torch.isfinite(p.grad).all(), f"non-finite gradient for {name}"
        assert p.grad.abs().sum() > 0, f"zero gradient for {name}"


@pytest.mark.parametrize("setup", ["nsa", "mamba2"])
def test_no_nan_in_loss_or_gradients_at_2048_tokens(setup):
    model = make_model(setup, hidden_size=32, num_layers=1, num_heads=2).train()
    tokens = random_tokens(1, 2048)
    loss = model(tokens, labels=tokens).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


@all_setups
def test_save_and_auto_load_round_trip_gives_identical_logits(setup, models, tmp_path):
    model = models[setup]
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    tokens = random_tokens(2, 20)
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, model(tokens).logits)


@all_setups
@torch.no_grad()
def test_engine_greedy_and_beam_search_match_hf_generate_with_left_padding(setup):
    model = make_model(setup, vocab_size=259)
    tokenizer = ByteTokenizer()
    prompts = ["To be, or not to be", "O", "Now is the winter of"]
    enc = tokenizer(prompts, padding=True, return_tensors="pt")
    for settings in (dict(), dict(num_beams=3, length_penalty=1.2)):
        eos = [tokenizer.eos_token_id]
        ours = generate_ids(model, tokenizer, prompts, max_new_tokens=12, eos_token_id=eos, **settings)
        hf = model.generate(
            **enc, max_new_tokens=12, do_sample=False, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id, **settings,
        )[:, enc["input_ids"].shape[1] :].tolist()
        hf = [[t for t in row if t not in (tokenizer.eos_token_id, tokenizer.pad_token_id)] for row in hf]
        assert ours == hf, settings


@pytest.mark.parametrize("setup", ["nsa", "mamba2"])
def test_loss_decreases_over_30_steps_on_a_small_text(setup):
    text = ("ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet is the sun. " * 8)
    data = torch.tensor(list(text.encode())) % VOCAB
    model = make_model(setup, hidden_size=32, num_layers=2, num_heads=2).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(30):
        starts = torch.randint(0, len(data) - 65, (8,), generator=gen)
        batch = torch.stack([data[s : s + 64] for s in starts])
        loss = model(batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < 0.7 * losses[0], losses


# ---------------------------------------------------------------- health statistics


def test_health_stats_report_every_nsa_key_within_range():
    model = make_model("nsa").train()
    model.enable_health_stats(True)
    tokens = random_tokens(2, 40)
    model(tokens, labels=tokens)
    stats = model.health_stats()
    assert set(stats) == NSA_KEYS
    assert all(isinstance(value, float) for value in stats.values())
    assert 0 <= stats["nsa_gate_entropy_mean"] <= torch.log(torch.tensor(3.0)).item() + 1e-6
    assert 0 < stats["nsa_max_gate_mean"] < 1
    assert 0 <= stats["nsa_collapse_fraction"] <= 1
    shares = [stats[f"nsa_branch_share_{b}"] for b in ("cmp", "slc", "swa")]
    assert all(0 <= s <= 1 for s in shares) and abs(sum(shares) - 1) < 1e-5
    # block_counts 4, block_size 8: queries 0-7 select block 0, 8-15 blocks 0-1, 16-23 blocks 0-2,
    # 24-39 the forced 0, i - 1, i and one more
    assert stats["nsa_k_max"] == 4
    assert stats["nsa_k_mean"] == pytest.approx((8 * 1 + 8 * 2 + 8 * 3 + 16 * 4) / 40)
    assert stats["nsa_pct_at_k_max"] == pytest.approx(100 * 16 / 40)


def test_health_stats_stay_on_the_device_until_read():
    model = make_model("nsa").train()
    model.enable_health_stats(True)
    tokens = random_tokens(2, 24)
    model(tokens, labels=tokens)
    layer_stats = [m.last_stats for m in model.modules() if getattr(m, "last_stats", None)]
    assert len(layer_stats) == 2
    for stats in layer_stats:
        assert all(isinstance(value, torch.Tensor) and value.dim() == 0 for key, value in stats.items() if key != "nsa_k_max")
    before = model.health_stats()
    mask = torch.zeros(2, 24, dtype=torch.long)  # nothing real: the statistics keep their values
    model(tokens, attention_mask=mask)
    assert model.health_stats() == before


def test_health_stats_ignore_padding_and_evaluation_and_need_enabling():
    model = make_model("nsa").train()
    tokens = random_tokens(2, 16)
    model(tokens, labels=tokens)
    assert model.health_stats() == {}, "statistics are off until enabled"
    model.enable_health_stats()
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, :8] = 0
    model(tokens, attention_mask=mask)
    # 24 real queries: 16 + 8; the padded row's 8 real queries all sit in its first block
    assert model.health_stats()["nsa_k_mean"] == pytest.approx((8 * 1 + 8 * 2 + 8 * 1) / 24)
    before = model.health_stats()
    model.eval()
    model(random_tokens(2, 40))
    assert model.health_stats() == before, "evaluation forwards leave the statistics alone"
    model.enable_health_stats(False)
    assert model.health_stats() == {}
    assert make_model("mamba2").health_stats() == {}


def test_config_rejects_bad_nsa_and_mamba2_options():
    with pytest.raises(ValueError, match="compression"):
        AttnLabConfig(mixer="nsa", mixer_options={"compression": "max"})
    with pytest.raises(ValueError, match="block_size"):
        AttnLabConfig(mixer="nsa", mixer_options={"block_size": 0})
    with pytest.raises(ValueError, match="head_dim"):
        AttnLabForCausalLM(AttnLabConfig(mixer="mamba2", hidden_size=64, mixer_options={"head_dim": 48}))


def test_training_run_writes_nsa_statistics_into_the_heartbeat(tiny, tmp_path):
    run_dir = tmp_path / "run"
    assert run_cli("train", *sets(tiny + ["model.mixer=nsa", "train.save_every=0"]), "--run-dir", str(run_dir)) == 0
    records = [json.loads(line) for line in (run_dir / "heartbeat.jsonl").read_text().splitlines()]
    assert records and all(NSA_KEYS <= set(record) for record in records)
