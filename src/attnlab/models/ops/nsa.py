"""Native sparse attention (NSA, Yuan et al., 2025, arXiv 2502.11089) in plain PyTorch.

Every query head attends three ways and mixes the results with its own sigmoid gates:

    o_t = g_cmp * attn(q_t, compressed blocks)            cmp: one key/value per complete past block
        + g_slc * attn(q_t, tokens of the selected blocks)  slc: forced blocks, then the best-scored
        + g_swa * attn(q_t, the last `window_size` tokens)  swa: sliding window

Keys are cut into blocks of `block_size` tokens. Block c holds positions [c * bs, (c + 1) * bs).
For a query at position p:

* a compressed block is visible only when complete and in the past: (c + 1) * bs - 1 <= p;
* the selection (section 3.3.2 of the paper; fla's `naive_nsa_topk` and `parallel_nsa_topk`) always
  takes the forced blocks: the first `initial_blocks` blocks and the `local_blocks` blocks ending
  at the query's own block i = p // bs, i.e. {c : c < initial_blocks} | {c : i - local_blocks < c},
  both clipped to 0 <= c <= i. The remaining slots, up to `block_counts` in all (the forced blocks
  count toward `block_counts`, as in fla and in the paper's n = 16 "including fixed activating the
  1 initial block and 2 local blocks"), go to the other visible blocks with the highest attention
  probability summed over the query heads of one key/value head (so a query group shares its
  blocks). A block that contains a token after p is never ranked; inside the query's own block
  only tokens <= p are attended;
* so a query selects k = min(block_counts, |forced| + |other visible blocks|) blocks, never a
  block after its own. The defaults (1 initial, 2 local) are the paper's and fla's;
  initial_blocks=0, local_blocks=1 forces the own block only (attnlab's earlier rule).

Layout: q [batch, time, heads, dim]; k, v [batch, keys, kv_heads, dim], where key index =
position (the mixer stores keys left-aligned, padding removed); k_cmp, v_cmp [batch, blocks,
kv_heads, dim]; gates [batch, time, heads]. Query positions `q_pos` [batch, time] say where each
query sits among the keys (-1: a padding query, whose output is 0). Computed in fp32.
"""

from __future__ import annotations

import torch


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def mean_pool_blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Mean of each complete block of `block_size` positions: [B, L, H, D] -> [B, L // bs, H, D]."""
    batch, length, heads, dim = x.shape
    num_blocks = length // block_size
    return x[:, : num_blocks * block_size].reshape(batch, num_blocks, block_size, heads, dim).mean(2)


def _masked_softmax(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim restricted to `allowed`; rows with nothing allowed give all zeros
    (with finite gradients)."""
    none_allowed = ~allowed.any(-1, keepdim=True)
    scores = scores.masked_fill(~allowed, float("-inf")).masked_fill(none_allowed, 0.0)
    return scores.softmax(-1) * allowed


def check_selection_counts(block_counts: int, initial_blocks: int, local_blocks: int) -> None:
    """Raise ValueError unless the counts are integers (block_counts >= 1, the others >= 0) and the
    forced blocks fit: initial_blocks + local_blocks <= block_counts."""
    for name, value, least in (
        ("block_counts", block_counts, 1), ("initial_blocks", initial_blocks, 0), ("local_blocks", local_blocks, 0)
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            kind = "a positive" if least else "a non-negative"
            raise ValueError(f"{name} must be {kind} integer, got {value!r}")
    if initial_blocks + local_blocks > block_counts:
        raise ValueError(
            f"initial_blocks + local_blocks ({initial_blocks} + {local_blocks}) exceeds block_counts "
            f"({block_counts}): the forced blocks count toward block_counts, so raise block_counts or "
            "force fewer blocks"
        )


def select_blocks(
    importance: torch.Tensor,
    q_pos: torch.Tensor,
    block_size: int,
    block_counts: int,
    num_blocks: int,
    initial_blocks: int,
    local_blocks: int,
) -> torch.Tensor:
    """Block indices per query and key/value head: the forced blocks (the first `initial_blocks`
    and the `local_blocks` ending at the query's own block, none after it), then the best-scored
    other visible blocks, `block_counts` in all (see the module docstring).

    importance: [B, Hkv, T, C] scores of the complete blocks (only visible ones are read);
    q_pos: [B, T]. Returns [B, T, Hkv, block_counts] block indices, -1 in unused slots.
    """
    check_selection_counts(block_counts, initial_blocks, local_blocks)
    batch, kv_heads, seq_len, num_cmp = importance.shape
    blocks = torch.arange(num_blocks, device=importance.device)
    pos = q_pos[:, None, :, None]  # [B, 1, T, 1]
    current = torch.div(pos, block_size, rounding_mode="floor")  # the query's own block (-1 for padding)
    visible = (blocks + 1) * block_size - 1 <= pos  # complete blocks entirely at or before p
    forced = ((blocks < initial_blocks) | (blocks > current - local_blocks)) & (blocks <= current)  # [B, 1, T, N]
    scores = importance.new_full((batch, kv_heads, seq_len, num_blocks), float("-inf"))
    scores[..., :num_cmp] = importance.float()
    scores = scores.masked_fill(~visible, float("-inf"))
    scores = scores.masked_fill(forced, float("inf"))  # at most block_counts of them, so all are kept
    k = min(block_counts, num_blocks)
    values, indices = scores.topk(k, dim=-1)  # [B, Hkv, T, k]
    indices = indices.masked_fill(values == float("-inf"), -1)
    if k < block_counts:
        indices = torch.cat((indices, indices.new_full((*indices.shape[:-1], block_counts - k), -1)), dim=-1)
    return indices.permute(0, 2, 1, 3)  # [B, T, Hkv, S]


def _attend(qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """qg [B, T, Hkv, G, D] (scaled) over k, v [B, L, Hkv, D] where allowed [B, Hkv or 1, 1, T, L]."""
    scores = torch.einsum("bthgd,blhd->bhgtl", qg, k)
    probs = _masked_softmax(scores, allowed)
    return torch.einsum("bhgtl,blhd->bthgd", probs, v)


def parallel_nsa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cmp: torch.Tensor,
    v_cmp: torch.Tensor,
    g_cmp: torch.Tensor,
    g_slc: torch.Tensor,
    g_swa: torch.Tensor,
    block_size: int,
    block_counts: int,
    window_size: int,
    q_pos: torch.Tensor | None = None,
    scale: float | None = None,
    initial_blocks: int = 1,
    local_blocks: int = 2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """All queries at once, with dense masks. Returns (o [B, T, H, D], block_indices [B, T, Hkv, S])."""
    batch, seq_len, heads, dim = q.shape
    length, kv_heads = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    scale = dim ** -0.5 if scale is None else scale
    if q_pos is None:
        q_pos = torch.arange(length - seq_len, length, device=q.device).expand(batch, seq_len)
    qg = q.float().view(batch, seq_len, kv_heads, groups, dim) * scale
    k, v, k_cmp, v_cmp = k.float(), v.float(), k_cmp.float(), v_cmp.float()
    pos = q_pos[:, :, None]  # [B, T, 1]

    # compressed branch: complete blocks at or before the query
    blocks = torch.arange(k_cmp.shape[1], device=q.device)
    cmp_visible = ((blocks + 1) * block_size - 1 <= pos)[:, None, None]  # [B, 1, 1, T, C]
    cmp_probs = _masked_softmax(torch.einsum("bthgd,bchd->bhgtc", qg, k_cmp), cmp_visible)
    o_cmp = torch.einsum("bhgtc,bchd->bthgd", cmp_probs, v_cmp)

    # selected branch: the forced blocks, then the best by the group's summed compressed probabilities
    num_blocks = cdiv(length, block_size)
    block_indices = select_blocks(
        cmp_probs.detach().sum(2), q_pos, block_size, block_counts, num_blocks, initial_blocks, local_blocks
    )
    selected = torch.zeros(batch, seq_len, kv_heads, num_blocks + 1, device=q.device)
    selected.scatter_add_(-1, block_indices + 1, torch.ones_like(block_indices, dtype=selected.dtype))
    selected = selected[..., 1:] > 0  # [B, T, Hkv, num_blocks]; slot 0 collected the unused (-1) entries
    key_pos = torch.arange(length, device=q.device)
    causal = key_pos <= pos  # [B, T, L]
    token_selected = selected.repeat_interleave(block_size, dim=-1)[..., :length] & causal[:, :, None]
    o_slc = _attend(qg, k, v, token_selected.permute(0, 2, 1, 3)[:, :, None])

    # sliding window branch
    in_window = causal & (key_pos > pos - window_size)
    o_swa = _attend(qg, k, v, in_window[:, None, None])

    def gated(o, g):
        return o.reshape(batch, seq_len, heads, dim) * g.float()[..., None]

    o = gated(o_cmp, g_cmp) + gated(o_slc, g_slc) + gated(o_swa, g_swa)
    return o.to(q.dtype), block_indices


def nsa_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cmp: torch.Tensor,
    v_cmp: torch.Tensor,
    g_cmp: torch.Tensor,
    g_slc: torch.Tensor,
    g_swa: torch.Tensor,
    block_size: int,
    block_counts: int,
    window_size: int,
    q_pos: torch.Tensor,
    scale: float | None = None,
    initial_blocks: int = 1,
    local_blocks: int = 2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One query per row (decoding), reading only what it attends: the compressed keys, the tokens
    of its selected blocks and its window, gathered from the cache.

    q [B, H, D]; gates [B, H]; q_pos [B] (-1: padding). Returns (o [B, H, D], block_indices [B, Hkv, S])."""
    batch, heads, dim = q.shape
    length, kv_heads = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    scale = dim ** -0.5 if scale is None else scale
    qg = q.float().view(batch, kv_heads, groups, dim) * scale
    k_cmp, v_cmp = (x.float().transpose(1, 2) for x in (k_cmp, v_cmp))  # [B, Hkv, C, D]
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hkv, L, D] views: only the gathered tokens are made fp32
    pos = q_pos[:, None, None]  # [B, 1, 1]

    def attend(keys, values, allowed):  # keys, values [B, Hkv, N, D]; allowed [B, Hkv or 1, N]
        probs = _masked_softmax(torch.einsum("bhgd,bhnd->bhgn", qg, keys), allowed[:, :, None])
        return torch.einsum("bhgn,bhnd->bhgd", probs, values)

    blocks = torch.arange(k_cmp.shape[2], device=q.device)
    cmp_visible = (blocks + 1) * block_size - 1 <= pos  # [B, 1, C]
    cmp_probs = _masked_softmax(torch.einsum("bhgd,bhcd->bhgc", qg, k_cmp), cmp_visible[:, :, None])
    o_cmp = torch.einsum("bhgc,bhcd->bhgd", cmp_probs, v_cmp)

    importance = cmp_probs.detach().sum(2)[:, :, None]  # [B, Hkv, 1, C]
    block_indices = select_blocks(
        importance, q_pos[:, None], block_size, block_counts, cdiv(length, block_size), initial_blocks, local_blocks
    )
    block_indices = block_indices[:, 0]  # [B, Hkv, S]
    token_idx = (block_indices[..., None] * block_size + torch.arange(block_size, device=q.device)).flatten(-2)
    token_ok = (block_indices[..., None] >= 0).expand(-1, -1, -1, block_size).flatten(-2) & (token_idx <= pos)
    gather_idx = token_idx.clamp(0, length - 1)[..., None].expand(-1, -1, -1, dim)
    o_slc = attend(k.gather(2, gather_idx).float(), v.gather(2, gather_idx).float(), token_ok)

    window_idx = pos - torch.arange(window_size - 1, -1, -1, device=q.device)  # [B, 1, W], oldest first
    window_ok = window_idx >= 0
    gather_idx = window_idx.clamp(0, length - 1)[..., None].expand(-1, kv_heads, -1, dim)
    o_swa = attend(k.gather(2, gather_idx).float(), v.gather(2, gather_idx).float(), window_ok)

    def gated(o, g):
        return o.reshape(batch, heads, dim) * g.float()[..., None]

    o = gated(o_cmp, g_cmp) + gated(o_slc, g_slc) + gated(o_swa, g_swa)
    return o.to(q.dtype), block_indices


def naive_nsa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g_cmp: torch.Tensor,
    g_slc: torch.Tensor,
    g_swa: torch.Tensor,
    block_size: int,
    block_counts: int,
    window_size: int,
    k_cmp: torch.Tensor | None = None,
    v_cmp: torch.Tensor | None = None,
    scale: float | None = None,
    initial_blocks: int = 1,
    local_blocks: int = 2,
) -> tuple[torch.Tensor, list]:
    """Brute-force reference: one query, one head at a time, blocks chosen by sorting in Python
    (the selection rule written out again, not `select_blocks`).

    q [B, T, H, D], k, v [B, T, Hkv, D] with query t at position t; k_cmp, v_cmp default to the
    mean of each complete block. Returns (o [B, T, H, D], selected[b][t][kv_head] = sorted block list).
    """
    check_selection_counts(block_counts, initial_blocks, local_blocks)
    batch, seq_len, heads, dim = q.shape
    kv_heads = k.shape[2]
    groups = heads // kv_heads
    scale = dim ** -0.5 if scale is None else scale
    in_dtype = q.dtype
    q, k, v = q.double(), k.double(), v.double()
    g_cmp, g_slc, g_swa = g_cmp.double(), g_slc.double(), g_swa.double()
    if k_cmp is None:
        k_cmp, v_cmp = mean_pool_blocks(k, block_size), mean_pool_blocks(v, block_size)
    k_cmp, v_cmp = k_cmp.double(), v_cmp.double()

    def softmax_attend(query, keys, values):  # query [D], keys/values [N, D]
        if keys.shape[0] == 0:
            return torch.zeros(dim, dtype=torch.float64), torch.zeros(0, dtype=torch.float64)
        probs = torch.softmax(keys @ query * scale, dim=0)
        return probs @ values, probs

    o = torch.zeros(batch, seq_len, heads, dim, dtype=torch.float64)
    selected = [[[None] * kv_heads for _ in range(seq_len)] for _ in range(batch)]
    for b in range(batch):
        for t in range(seq_len):
            complete = [c for c in range(k_cmp.shape[1]) if (c + 1) * block_size - 1 <= t]
            own = t // block_size
            forced = [c for c in range(own + 1) if c < initial_blocks or c > own - local_blocks]
            for kh in range(kv_heads):
                group = range(kh * groups, (kh + 1) * groups)
                outs_cmp, importance = {}, torch.zeros(len(complete), dtype=torch.float64)
                for h in group:
                    outs_cmp[h], probs = softmax_attend(q[b, t, h], k_cmp[b, complete, kh], v_cmp[b, complete, kh])
                    importance += probs
                ranked = sorted(range(len(complete)), key=lambda i: -importance[i].item())
                chosen = forced + [complete[i] for i in ranked if complete[i] not in forced]
                chosen = sorted(chosen[:block_counts])
                selected[b][t][kh] = chosen
                slc_tokens = [j for c in chosen for j in range(c * block_size, (c + 1) * block_size) if j <= t]
                win_tokens = list(range(max(0, t - window_size + 1), t + 1))
                for h in group:
                    o_slc, _ = softmax_attend(q[b, t, h], k[b, slc_tokens, kh], v[b, slc_tokens, kh])
                    o_swa, _ = softmax_attend(q[b, t, h], k[b, win_tokens, kh], v[b, win_tokens, kh])
                    o[b, t, h] = g_cmp[b, t, h] * outs_cmp[h] + g_slc[b, t, h] * o_slc + g_swa[b, t, h] * o_swa
    return o.to(in_dtype), selected


BRANCHES = ("cmp", "slc", "swa")
STAT_NAMES = [f"nsa_{name}" for name in ("gate_entropy_mean", "max_gate_mean", "collapse_fraction",
                                         *(f"branch_share_{b}" for b in BRANCHES), "k_mean", "pct_at_k_max")]


def stats_values(g: torch.Tensor, block_indices: torch.Tensor, pos: torch.Tensor, block_counts: int):
    """The statistics of `NativeSparseAttention._record_stats` (`mixers/nsa.py`) in PyTorch, the oracle of
    `kernels/nsa/stats.py`: (values [8] fp32 in `STAT_NAMES` order, real
    tokens as a 0-d tensor). g [B, T, H, 3]; block_indices [B, T, Hkv, S]; pos [B, T] (< 0: padding)."""
    heads, kv_heads = g.shape[2], block_indices.shape[2]
    real = (pos >= 0).float()[..., None]  # [B, T, 1]
    tokens = real.sum()
    count = tokens.clamp_min(1)
    gates = g.float()  # [B, T, H, 3]
    share = gates / gates.sum(-1, keepdim=True)
    entropy = (-(share * share.clamp_min(1e-12).log()).sum(-1) * real).sum() / (count * heads)
    max_gate = (gates.max(-1).values * real).sum() / (count * heads)
    head_means = (gates * real[..., None]).sum((0, 1)) / count  # [H, 3]
    collapse = (head_means.max(-1).values > 0.99).float().mean()
    branch_share = (share * real[..., None]).sum((0, 1, 2)) / (count * heads)  # [3]
    k_selected = (block_indices >= 0).sum(-1).float()  # [B, T, Hkv]
    k_mean = (k_selected * real).sum() / (count * kv_heads)
    at_max = ((k_selected == block_counts).float() * real).sum() / (count * kv_heads) * 100
    return torch.stack((entropy, max_gate, collapse, *branch_share, k_mean, at_max)), tokens
