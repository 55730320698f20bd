"""NSA block selection as the paper defines it (arXiv 2502.11089, section 3.3.2; fla's
`naive_nsa_topk`): the first `initial_blocks` blocks and the `local_blocks` blocks ending at the
query's own block are always selected, the other slots (up to `block_counts` in all) go to the
best-scored other complete past blocks. The oracle below writes that rule out in plain Python
loops over queries, heads and blocks, from the compressed keys alone; the parallel form, the step
form and the naive reference must all select exactly what it selects."""

import math

import pytest
import torch

from attnlab.models import AttnLabConfig, AttnLabForCausalLM
from attnlab.models.mixers import MIXERS
from attnlab.models.ops.nsa import naive_nsa, nsa_step, parallel_nsa
from conftest import random_nsa_inputs

BLOCK_SIZE = 4
RULES = {  # (initial_blocks, local_blocks, block_counts)
    "paper": (1, 2, 4),
    "paper-more-slots": (1, 2, 6),
    "own-block-only": (0, 1, 3),
    "two-initial-three-local": (2, 3, 6),
    "nothing-forced": (0, 0, 2),
}
GROUPS = {"group-1": (2, 2), "group-2": (4, 2), "group-16": (16, 1)}  # (num_heads, num_kv_heads)


def paper_selection(q, k, q_pos, block_size, block_counts, initial_blocks, local_blocks):
    """The rule written out: selected[b][t][kv_head] = sorted block list ([] for a padding query).

    q [B, T, H, D] with query t at position q_pos[b][t] (-1: padding); k [B, L, Hkv, D] left-aligned
    (key index = position). Scores: each head's softmax over the visible compressed keys (means of
    complete blocks), summed over the heads of the kv-head group."""
    batch, seq_len, heads, dim = q.shape
    kv_heads = k.shape[2]
    groups = heads // kv_heads
    q, k = q.double().tolist(), k.double().tolist()
    selected = [[[[] for _ in range(kv_heads)] for _ in range(seq_len)] for _ in range(batch)]
    for b in range(batch):
        for t in range(seq_len):
            p = q_pos[b][t]
            if p < 0:
                continue
            own = p // block_size
            visible = [c for c in range(own + 1) if (c + 1) * block_size - 1 <= p]
            forced = [c for c in range(own + 1) if c < initial_blocks or own - local_blocks < c]
            for kh in range(kv_heads):
                k_cmp = {
                    c: [sum(k[b][j][kh][d] for j in range(c * block_size, (c + 1) * block_size)) / block_size
                        for d in range(dim)]
                    for c in visible
                }
                score = {c: 0.0 for c in visible}
                for h in range(kh * groups, (kh + 1) * groups):
                    logits = {c: sum(a * x for a, x in zip(q[b][t][h], k_cmp[c])) / math.sqrt(dim) for c in visible}
                    top = max(logits.values(), default=0.0)
                    total = sum(math.exp(x - top) for x in logits.values())
                    for c in visible:
                        score[c] += math.exp(logits[c] - top) / total
                others = sorted((c for c in visible if c not in forced), key=lambda c: (-score[c], c))
                selected[b][t][kh] = sorted(forced + others[: block_counts - len(forced)])
    return selected


def as_lists(block_indices):
    """[B, T, Hkv, S] (-1 unused) -> nested lists of sorted block lists."""
    return [[[sorted(i for i in row if i >= 0) for row in query] for query in seq] for seq in block_indices.tolist()]


def compress(x):
    return x[:, : x.shape[1] // BLOCK_SIZE * BLOCK_SIZE].unflatten(1, (-1, BLOCK_SIZE)).mean(2)


def options(rule):
    initial_blocks, local_blocks, block_counts = RULES[rule]
    return dict(block_size=BLOCK_SIZE, block_counts=block_counts, window_size=3,
                initial_blocks=initial_blocks, local_blocks=local_blocks)


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("group", list(GROUPS))
def test_parallel_step_and_naive_forms_select_the_papers_blocks(rule, group):
    heads, kv_heads = GROUPS[group]
    seq_len = 37  # 10 blocks of 4, more than any block_counts here
    ops = options(rule)
    q, k, v, gates = random_nsa_inputs(2, seq_len, heads, kv_heads, dim=8, seed=len(rule) + heads)
    expected = paper_selection(q, k, [list(range(seq_len))] * 2, BLOCK_SIZE, ops["block_counts"],
                               ops["initial_blocks"], ops["local_blocks"])
    assert any(len(sel) == ops["block_counts"] for seq in expected for query in seq for sel in query)

    k_cmp, v_cmp = compress(k), compress(v)
    o, block_indices = parallel_nsa(q, k, v, k_cmp, v_cmp, *gates, **ops)
    assert as_lists(block_indices) == expected

    _, naive_selected = naive_nsa(q, k, v, *gates, **ops)
    assert naive_selected == expected

    for t in range(seq_len):
        o_t, idx_t = nsa_step(
            q[:, t], k[:, : t + 1], v[:, : t + 1], k_cmp[:, : (t + 1) // BLOCK_SIZE],
            v_cmp[:, : (t + 1) // BLOCK_SIZE], *(g[:, t] for g in gates), q_pos=torch.full((2,), t), **ops,
        )
        assert as_lists(idx_t[:, None]) == [[expected[b][t]] for b in range(2)], f"step at query {t}"
        torch.testing.assert_close(o_t, o[:, t], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rule", ["paper", "two-initial-three-local"])
def test_left_padded_queries_select_what_each_sequence_selects_alone(rule):
    ops = options(rule)
    lengths, width = [33, 21], 33
    q, k, v, gates = random_nsa_inputs(2, width, 4, 2, seed=7, dim=8)
    # keys left-aligned (index = position), queries right-aligned after left padding, as the mixer keeps them
    q_pos = torch.tensor([list(range(n - width, n)) for n in lengths]).clamp(min=-1)  # -1: padding
    k_cmp, v_cmp = compress(k), compress(v)
    _, block_indices = parallel_nsa(q, k, v, k_cmp, v_cmp, *gates, q_pos=q_pos, **ops)
    selected = as_lists(block_indices)
    expected = paper_selection(q, k, q_pos.tolist(), BLOCK_SIZE, ops["block_counts"],
                               ops["initial_blocks"], ops["local_blocks"])
    assert selected == expected
    assert all(sel == [] for query in selected[1][: width - lengths[1]] for sel in query), "padding selects nothing"
    for t in range(width - lengths[1], width):  # the step form reads only the row's keys
        _, idx_t = nsa_step(
            q[1:, t], k[1:, : lengths[1]], v[1:, : lengths[1]], k_cmp[1:, : lengths[1] // BLOCK_SIZE],
            v_cmp[1:, : lengths[1] // BLOCK_SIZE], *(g[1:, t] for g in gates), q_pos=q_pos[1:, t], **ops,
        )
        assert as_lists(idx_t[:, None])[0][0] == expected[1][t]


@pytest.mark.parametrize("t", [3, 4, 11, 12, 22])  # around block boundaries (block size 4)
def test_future_tokens_never_change_the_selection_or_outputs_with_forced_blocks(t):
    ops = options("two-initial-three-local")
    q, k, v, gates = random_nsa_inputs(1, 29, 4, 2, dim=8)
    noise = random_nsa_inputs(1, 29, 4, 2, seed=99, dim=8)
    o, idx = parallel_nsa(q, k, v, compress(k), compress(v), *gates, **ops)
    future = slice(t + 1, None)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    q2[:, future], k2[:, future], v2[:, future] = noise[0][:, future], noise[1][:, future], noise[2][:, future]
    o2, idx2 = parallel_nsa(q2, k2, v2, compress(k2), compress(v2), *gates, **ops)
    assert (o2[:, : t + 1] - o[:, : t + 1]).abs().max() <= 1e-6
    assert torch.equal(idx2[:, : t + 1], idx[:, : t + 1])


@pytest.mark.parametrize("rule", ["paper", "two-initial-three-local"])
@torch.no_grad()
def test_mixer_decoding_with_left_padding_matches_its_parallel_forward(rule):
    initial_blocks, local_blocks, block_counts = RULES[rule]
    torch.manual_seed(0)
    config = AttnLabConfig(
        vocab_size=64, hidden_size=64, num_layers=1, num_heads=16, mixer="nsa",
        mixer_options=dict(block_size=BLOCK_SIZE, block_counts=block_counts, window_size=3, num_kv_heads=1,
                           initial_blocks=initial_blocks, local_blocks=local_blocks),
    )
    model = AttnLabForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (2, 34), generator=gen)
    mask = torch.ones_like(tokens)
    mask[1, :9] = 0  # the second row is left-padded
    full = model(tokens, attention_mask=mask).logits
    out = model(tokens[:, :10], attention_mask=mask[:, :10], use_cache=True)
    steps, cache = [out.logits], out.past_key_values
    for t in range(10, tokens.shape[1]):
        out = model(tokens[:, t : t + 1], attention_mask=mask[:, : t + 1], cache=cache, use_cache=True)
        steps.append(out.logits)
    steps = torch.cat(steps, dim=1)
    torch.testing.assert_close(steps[0], full[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(steps[1, 9:], full[1, 9:], rtol=1e-4, atol=1e-5)
    alone = model(tokens[1:, 9:]).logits[0]
    torch.testing.assert_close(full[1, 9:], alone, rtol=1e-4, atol=1e-5)


def test_default_options_are_the_papers_one_initial_and_two_local_blocks():
    options = MIXERS["nsa"].resolve_options(None)
    assert (options["initial_blocks"], options["local_blocks"]) == (1, 2)
    assert options["initial_blocks"] + options["local_blocks"] <= options["block_counts"]


@pytest.mark.parametrize("bad, message", [
    ({"initial_blocks": -1}, "initial_blocks must be a non-negative integer"),
    ({"local_blocks": 1.5}, "local_blocks must be a non-negative integer"),
    ({"local_blocks": True}, "local_blocks must be a non-negative integer"),
    ({"block_counts": 2}, r"initial_blocks \+ local_blocks \(1 \+ 2\) exceeds block_counts \(2\)"),
    ({"block_counts": 4, "initial_blocks": 2, "local_blocks": 3}, r"\(2 \+ 3\) exceeds block_counts \(4\)"),
])
def test_config_rejects_bad_selection_counts(bad, message):
    with pytest.raises(ValueError, match=f"mixer 'nsa': .*{message}"):
        AttnLabConfig(mixer="nsa", mixer_options=bad)
    forms = {"block_counts": 4, "initial_blocks": 1, "local_blocks": 2, **bad}
    q, k, v, gates = random_nsa_inputs(1, 8, 2, 1, dim=8)
    with pytest.raises(ValueError, match=message):
        parallel_nsa(q, k, v, compress(k), compress(v), *gates, block_size=4, window_size=2, **forms)
