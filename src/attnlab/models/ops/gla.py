"""Gated linear attention (GLA) recurrences in plain PyTorch.

For every head, with a per-key-channel forget gate exp(gk_t) in (0, 1]:

    S_t = diag(exp(gk_t)) S_{t-1} + k_t^T v_t        S: [key_dim, value_dim]
    o_t = (scale * q_t) S_t

Layout follows flash-linear-attention: q, k, gk are [batch, time, heads, key_dim],
v is [batch, time, heads, value_dim], the state is [batch, heads, key_dim, value_dim]
and is always kept in fp32. `gk` is the log of the forget gate (<= 0).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _exclusive_cumsum(x: torch.Tensor, dim: int, reverse: bool = False) -> torch.Tensor:
    """Sum of the elements strictly before (or, with `reverse`, strictly after) each position."""
    if reverse:
        x = x.flip(dim)
    summed = x.cumsum(dim).narrow(dim, 0, x.shape[dim] - 1)
    pad_shape = list(x.shape)
    pad_shape[dim] = 1
    summed = torch.cat((x.new_zeros(pad_shape), summed), dim=dim)
    return summed.flip(dim) if reverse else summed


def _zero_state(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    batch, heads, key_dim, value_dim = q.shape[0], q.shape[-2], q.shape[-1], v.shape[-1]
    return q.new_zeros(batch, heads, key_dim, value_dim, dtype=torch.float32)


def naive_recurrent_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gk: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference implementation: one token at a time. Returns (o [B,T,H,V], final state)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    state = _zero_state(q, v) if initial_state is None else initial_state.float().clone()
    outputs = []
    for t in range(q.shape[1]):
        q_t, k_t, v_t, gk_t = (x[:, t].float() for x in (q, k, v, gk))  # [B, H, D]
        state = state * gk_t.exp()[..., None] + k_t[..., :, None] * v_t[..., None, :]
        outputs.append(torch.einsum("bhk,bhkv->bhv", q_t * scale, state))
    o = torch.stack(outputs, dim=1)  # [B, T, H, V]
    return o.to(q.dtype), state


def fused_recurrent_gla_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gk: torch.Tensor,
    state: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoding step. q, k, gk: [B, H, K]; v: [B, H, V]. Returns (o [B, H, V], new state)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if state is None:
        state = _zero_state(q, v)
    q32, k32, v32, gk32 = (x.float() for x in (q, k, v, gk))
    state = state * gk32.exp()[..., None] + k32[..., :, None] * v32[..., None, :]
    o = torch.einsum("bhk,bhkv->bhv", q32 * scale, state)
    return o.to(q.dtype), state


def chunk_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gk: torch.Tensor,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    sub_chunk_size: int = 8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked parallel form; equals `naive_recurrent_gla` up to float rounding.

    The sequence is cut into chunks of `chunk_size`. Inside a chunk, outputs come from
    a masked [chunk, chunk] score matrix; across chunks, a state is carried (a loop over
    chunks, not tokens). Every exp() below is taken of a sum of log-gates over a span of
    tokens, so its argument is <= 0 and nothing can overflow:

    * within a sub-chunk (`sub_chunk_size` tokens) the decay from key j to query i is
      built pairwise for every key channel;
    * between sub-chunks of one chunk, it is split at the start of the query's sub-chunk:
      (key -> that boundary) * (boundary -> query);
    * between chunks, keys are decayed to the end of their chunk, queries from the start
      of theirs, and the state carries the rest.
    """
    batch, seq_len, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    out_dtype = q.dtype
    scale = key_dim ** -0.5 if scale is None else scale
    sub = min(sub_chunk_size, chunk_size)
    if chunk_size % sub != 0:
        raise ValueError(f"chunk_size ({chunk_size}) must be a multiple of sub_chunk_size ({sub})")
    chunk = min(chunk_size, _round_up(seq_len, sub))  # short inputs use one small chunk
    padded_len = _round_up(seq_len, chunk)
    num_chunks, num_sub = padded_len // chunk, chunk // sub

    def to_chunks(x: torch.Tensor) -> torch.Tensor:
        # [B, T, H, D] -> [B, H, N, C, D] in fp32; padding has k = v = 0 and log-gate 0,
        # so padded steps leave the state untouched.
        x = x.float().transpose(1, 2)
        x = F.pad(x, (0, 0, 0, padded_len - seq_len))
        return x.reshape(batch, heads, num_chunks, chunk, x.shape[-1])

    q, k, v, gk = to_chunks(q) * scale, to_chunks(k), to_chunks(v), to_chunks(gk)

    # Log-decays between two tokens are sums of log-gates over the tokens in between. They are
    # assembled from short partial sums (within a sub-chunk, then whole sub-chunks), never as a
    # difference of two long cumulative sums, which would lose precision when gates are large.
    sub_shape = (batch, heads, num_chunks, num_sub, sub, key_dim)
    q_sub, k_sub, g_sub = q.reshape(sub_shape), k.reshape(sub_shape), gk.reshape(sub_shape)
    c = g_sub.cumsum(-2)  # [B, H, N, S, sub, K] from the sub-chunk start through token i
    to_sub_end = _exclusive_cumsum(g_sub, dim=-2, reverse=True)  # after token j to the sub-chunk end
    sub_total = c[..., -1, :]  # [B, H, N, S, K] decay across a whole sub-chunk
    before_sub = _exclusive_cumsum(sub_total, dim=-2)  # chunk start to sub-chunk start
    after_sub = _exclusive_cumsum(sub_total, dim=-2, reverse=True)  # sub-chunk end to chunk end
    sub_idx = torch.arange(num_sub, device=q.device)
    # strictly_between[I, J, M] = J < M < I
    query_sub, key_sub, middle_sub = sub_idx[:, None, None], sub_idx[None, :, None], sub_idx[None, None, :]
    strictly_between = (key_sub < middle_sub) & (middle_sub < query_sub)
    between_subs = torch.einsum("bhnmk,ijm->bhnijk", sub_total, strictly_between.float())  # [B, H, N, S, S, K]

    # ---- intra-chunk scores A[i, j] = sum_d q_id k_jd exp(log-decay after j through i), j <= i ----
    # (a) key in an earlier sub-chunk J than the query's sub-chunk I: split at the start of I
    q_from_sub_start = q_sub * torch.exp(c)  # [B, H, N, S, sub, K]
    key_log_decay = to_sub_end[..., None, :, :, :] + between_subs[..., :, :, None, :]  # [B, H, N, S(I), S(J), sub, K]
    key_in_earlier_sub = (sub_idx[None, :] < sub_idx[:, None]).view(num_sub, num_sub, 1, 1)
    key_log_decay = key_log_decay.masked_fill(~key_in_earlier_sub, float("-inf"))
    k_to_sub_start = k_sub[..., None, :, :, :] * torch.exp(key_log_decay)
    k_to_sub_start = k_to_sub_start.reshape(batch, heads, num_chunks, num_sub, chunk, key_dim)
    scores = q_from_sub_start @ k_to_sub_start.transpose(-1, -2)  # [B, H, N, S, sub, C]

    # (b) key in the query's own sub-chunk: decay built pairwise per key channel
    causal = torch.ones(sub, sub, dtype=torch.bool, device=q.device).tril()
    pair_log_decay = c[..., :, None, :] - c[..., None, :, :]  # [B, H, N, S, sub, sub, K]
    pair_decay = torch.exp(pair_log_decay.masked_fill(~causal[..., None], float("-inf")))
    diag_scores = (q_sub[..., :, None, :] * k_sub[..., None, :, :] * pair_decay).sum(-1)  # [B, H, N, S, sub, sub]
    # place each sub-chunk's own block on the block diagonal of the chunk's score matrix
    block_eye = torch.eye(num_sub, device=q.device).view(num_sub, 1, num_sub, 1)
    scores = scores.view(*sub_shape[:-1], num_sub, sub) + diag_scores[..., :, None, :] * block_eye
    scores = scores.reshape(batch, heads, num_chunks, chunk, chunk)
    o_intra = scores @ v  # [B, H, N, C, V]

    # ---- inter-chunk: carry the state from chunk to chunk ----
    q_from_chunk_start = q_sub * torch.exp(before_sub[..., None, :] + c)  # [B, H, N, S, sub, K]
    k_to_chunk_end = k_sub * torch.exp(to_sub_end + after_sub[..., None, :])
    q_from_chunk_start = q_from_chunk_start.reshape(batch, heads, num_chunks, chunk, key_dim)
    k_to_chunk_end = k_to_chunk_end.reshape(batch, heads, num_chunks, chunk, key_dim)
    chunk_kv = k_to_chunk_end.transpose(-1, -2) @ v  # [B, H, N, K, V]
    chunk_decay = torch.exp(sub_total.sum(-2))  # [B, H, N, K]
    state = q.new_zeros(batch, heads, key_dim, value_dim) if initial_state is None else initial_state.float()
    states_before = []
    for n in range(num_chunks):
        states_before.append(state)
        state = state * chunk_decay[:, :, n, :, None] + chunk_kv[:, :, n]
    states_before = torch.stack(states_before, dim=2)  # [B, H, N, K, V]
    o_inter = q_from_chunk_start @ states_before  # [B, H, N, C, V]

    o = (o_intra + o_inter).reshape(batch, heads, padded_len, value_dim)[:, :, :seq_len]
    return o.transpose(1, 2).to(out_dtype), state


class ReferenceGLA:
    """`chunk_gla` behind the interface of a GLA backend of the SSD (`kernels.mamba2.core.FlaGLA`): scale 1, the
    backward differentiates the reference again. For tests of the SSD's mapping onto a GLA on CPU."""

    @staticmethod
    def _run(q, k, v, g, h0):
        return chunk_gla(q, k, v, g, initial_state=h0, scale=1.0)

    @classmethod
    def forward(cls, q, k, v, g, h0, output_final_state: bool):
        o, final_state = cls._run(q, k, v, g, h0)
        return o, (final_state if output_final_state else None), None

    @classmethod
    def backward(cls, q, k, v, g, h0, saved, do, dht):
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in (q, k, v, g)]
            h0_leaf = None if h0 is None else h0.detach().requires_grad_()
            o, final_state = cls._run(*leaves, h0_leaf)
            outputs, grads = [o], [do]
            if dht is not None:
                outputs.append(final_state)
                grads.append(dht)
            inputs = leaves + ([] if h0_leaf is None else [h0_leaf])
            found = torch.autograd.grad(outputs, inputs, grads, allow_unused=True)
        found = [torch.zeros_like(t) if d is None else d for t, d in zip(inputs, found)]
        return (*found[:4], found[4] if h0 is not None else None)
