"""Attention with a choice of similarity, decay and denominator (the family of the 2Mamba study).

For one head, query i attends to keys j <= i with weights

    s_ij = scale * q_i . k_j                       (optionally clamped from above before exp)
    w_ij = sim(s_ij) * exp(a_i - b_j)              a_i - b_j: the sum of log-decays after j through i
    o_i  = sum_j w_ij v_j / den_i

sim: exp (softmax-like), power1 (s), power2 (s^2) or taylor (the first N terms of the series of exp).
den: sum_j w_ij ("sum"), that clamped to >= 1 ("sum_clamped"), the same without gradient
("sum_detached"), the sum without gradient plus 1e-4 ("sum_detached_eps"), the number of attended
tokens ("count"), that to a learned power per head ("count_power"), or 1 ("none").

power1 and power2 are dot products of feature maps, phi(x) = x and phi(x) = x (x) x (size d^2),
so without a clamp they also have a recurrent form with a fixed-size state per head:

    S_i = exp(A_i) S_{i-1} + phi(k_i)^T v_i      z_i = exp(A_i) z_{i-1} + phi(k_i)
    o_i = phi(q_i) S_i / den_i                   ("sum": den_i = phi(q_i) . z_i)

For power2 the state is symmetric in its two key indices (row (a, b) equals row (b, a)), so it may
also be kept "packed": only the d (d + 1) / 2 rows a <= b, in the row-major order of
`torch.triu_indices`, with the query's features x_a x_b doubled off the diagonal. The fast
decoding step keeps that layout (half the bytes to stream per token); `packed=True` selects it.

Layout: q, k [batch, time, heads, key_dim]; v [batch, time, heads, value_dim]; log-decays
[batch, time, heads]; recurrent state [batch, heads, features, value_dim]. Computed in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SIMILARITIES = ("softmax", "exp", "power1", "power2", "taylor")
FEATURE_MAPS = ("none", "relu", "silu", "elu1", "l2", "l2_heads")
DENOMINATORS = ("sum", "sum_clamped", "sum_detached", "sum_detached_eps", "count", "count_power", "none")
SUM_DENOMINATORS = ("sum", "sum_clamped", "sum_detached", "sum_detached_eps")
DETACHED_EPS = 1e-4  # what "sum_detached_eps" adds to the detached sum (the first study's softmax_detach_denom_gate)
EXP_SIMILARITIES = ("softmax", "exp")
LINEAR_SIMILARITIES = ("power1", "power2")


def apply_feature_map(x: torch.Tensor, name: str) -> torch.Tensor:
    """The feature map applied to q and k [..., heads, dim] before their dot product. "l2" scales
    each head's vector to unit length; "l2_heads" scales, for each channel of the head dim, the
    vector across the heads to unit length (what the first study's `F.normalize` does with its
    default dim on [batch, heads, time, dim])."""
    if name == "none":
        return x
    if name == "relu":
        return F.relu(x)
    if name == "silu":
        return F.silu(x)
    if name == "elu1":
        return F.elu(x) + 1
    if name == "l2":
        return F.normalize(x, dim=-1)
    if name == "l2_heads":
        return F.normalize(x, dim=-2)
    raise ValueError(f"unknown feature map {name!r}; choose one of {FEATURE_MAPS}")


def taylor_series_exp(x: torch.Tensor, terms: int) -> torch.Tensor:
    """1 + x + x^2/2! + ... + x^(terms-1)/(terms-1)!, by Horner's rule in float64."""
    x64 = x.double()
    out = torch.ones_like(x64)
    for n in range(terms - 1, 0, -1):
        out = 1 + out * x64 / n
    return out.to(x.dtype)


class _TruncatedExp(torch.autograd.Function):
    """Truncated exp series; its derivative is the same series with one term fewer, so the
    backward pass keeps only x (not one tensor per term)."""

    @staticmethod
    def forward(ctx, x, terms):
        ctx.save_for_backward(x)
        ctx.terms = terms
        return taylor_series_exp(x, terms)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * taylor_series_exp(x, ctx.terms - 1), None


def truncated_exp(x: torch.Tensor, terms: int) -> torch.Tensor:
    return _TruncatedExp.apply(x, terms)


def linear_features(x: torch.Tensor, similarity: str, packed: bool = False, query: bool = False) -> torch.Tensor:
    """phi with phi(q) . phi(k) = sim(q . k): x for power1, the flattened outer product x x^T for power2.

    packed (power2): only the products x_a x_b with a <= b ([..., d (d + 1) / 2]), those with a < b
    doubled for the query side (`query`), so that phi(q) . phi(k) is unchanged."""
    if similarity == "power1":
        return x
    if similarity != "power2":
        raise ValueError(f"similarity {similarity!r} has no finite feature map")
    if not packed:
        return (x[..., :, None] * x[..., None, :]).flatten(-2)  # [..., d * d]
    a, b = torch.triu_indices(x.shape[-1], x.shape[-1], device=x.device)
    in_place = not (torch.is_grad_enabled() and x.requires_grad)  # a fresh tensor: no second copy
    features = x[..., a]
    features = features.mul_(x[..., b]) if in_place else features * x[..., b]  # [..., d (d + 1) / 2]
    if query:
        doubled = torch.where(a == b, 1.0, 2.0).to(features.dtype)
        features = features.mul_(doubled) if in_place else features * doubled
    return features


def linear_feature_count(head_dim: int, similarity: str, packed: bool = False) -> int:
    """The number of features of `linear_features` (the rows of one head's recurrent state)."""
    if similarity == "power1":
        return head_dim
    return head_dim * (head_dim + 1) // 2 if packed else head_dim * head_dim


def unpack_power2_state(state: torch.Tensor, head_dim: int, dim: int = -2) -> torch.Tensor:
    """A packed power2 state, whose dim `dim` holds the d (d + 1) / 2 rows a <= b (-2 for the state
    [..., F, Dv], -1 for the normaliser [..., F]), in the full layout of d * d rows: rows (a, b)
    and (b, a) both hold packed row (min(a, b), max(a, b))."""
    a, b = torch.triu_indices(head_dim, head_dim, device=state.device)
    index = torch.empty(head_dim, head_dim, dtype=torch.long, device=state.device)
    rows = torch.arange(a.numel(), device=state.device)
    index[a, b] = rows
    index[b, a] = rows
    return state.index_select(dim % state.dim(), index.flatten())


def log_decay_cumsum(log_decay: torch.Tensor | None) -> torch.Tensor | None:
    """The running sum of per-token log-decays over time, [B, T, H] fp32, summed along the last dim:
    torch scans a middle dim with one sequential thread per (batch, head) on a GPU, milliseconds
    per layer at a few thousand tokens, where a last-dim scan takes microseconds."""
    if log_decay is None:
        return None
    return log_decay.float().transpose(1, 2).cumsum(-1).transpose(1, 2)


def _finish_denominator(den, denominator: str, count_power: torch.Tensor | None):
    """den: the row sums of the weights (sum denominators) or the counts of attended tokens."""
    if denominator == "sum":
        return den
    if denominator == "sum_clamped":
        return den.clamp(min=1)
    if denominator == "sum_detached":
        return den.clamp(min=1).detach()
    if denominator == "sum_detached_eps":
        return den.detach() + DETACHED_EPS
    if denominator == "count":
        return den
    if denominator == "count_power":  # count_power: [H], den: [B, H, T, 1]
        return den ** count_power.float().view(1, -1, 1, 1)
    raise ValueError(f"unknown denominator {denominator!r}")


def _divide(num: torch.Tensor, den: torch.Tensor | None) -> torch.Tensor:
    """num / den, with 0 where den is 0 (a query that attends to nothing, or only to zero weights)."""
    if den is None:
        return num
    return num / torch.where(den == 0, torch.ones_like(den), den)


def attention_terms(
    q, k, v, *, similarity, scale, clamp=None, taylor_terms=80, denominator="sum",
    query_log_decay=None, key_log_decay=None, key_mask=None,
):
    """Numerator and raw denominator of the quadratic (parallel) form.

    The Tq queries are the last Tq of the Tk key positions (the earlier Tk - Tq come from a cache).
    query_log_decay [B, Tq, H] and key_log_decay [B, Tk, H] give the log-decay a_i - b_j.
    key_mask [B, Tk]: False for padding. Returns num [B, H, Tq, Dv] and den [B, H, Tq, 1]
    (row sums of w, or counts of attended tokens) or None.
    """
    num_queries, num_keys = q.shape[1], k.shape[1]
    past = num_keys - num_queries
    query_pos = torch.arange(past, num_keys, device=q.device)[:, None]
    key_pos = torch.arange(num_keys, device=q.device)[None, :]
    allowed = (key_pos <= query_pos)[None, None]  # [1, 1, Tq, Tk]
    if key_mask is not None:
        allowed = allowed & key_mask[:, None, None, :].bool()  # [B, 1, Tq, Tk]

    s = torch.einsum("bihd,bjhd->bhij", q.float(), k.float()) * scale  # [B, H, Tq, Tk]
    if clamp is not None:
        s = s.clamp(max=clamp)
    log_decay = None
    if query_log_decay is not None:
        log_decay = query_log_decay.float().transpose(1, 2)[..., :, None] - key_log_decay.float().transpose(1, 2)[..., None, :]

    if similarity in EXP_SIMILARITIES:
        logits = s if log_decay is None else s + log_decay
        logits = logits.masked_fill(~allowed, float("-inf"))
        if denominator == "sum":
            # softmax: the row max cancels between numerator and denominator
            row_max = logits.amax(-1, keepdim=True).detach()
            row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
            logits = logits - row_max
        w = torch.exp(logits)
    else:
        if similarity == "power1":
            w = s
        elif similarity == "power2":
            w = s * s
        else:
            w = truncated_exp(s, taylor_terms)
        if log_decay is not None:
            w = w * torch.exp(log_decay.masked_fill(~allowed, float("-inf")))
        w = w.masked_fill(~allowed, 0.0)

    num = w @ v.float().transpose(1, 2)  # [B, H, Tq, Dv]
    if denominator in SUM_DENOMINATORS:
        den = w.sum(-1, keepdim=True)
    elif denominator in ("count", "count_power"):
        den = allowed.sum(-1, keepdim=True).float().expand(q.shape[0], q.shape[2], -1, -1)
    else:
        den = None
    return num, den


def parallel_attention(
    q, k, v, *, denominator="sum", count_power=None, terms=attention_terms, out_dtype=None, **kwargs
) -> torch.Tensor:
    """The quadratic form; see `attention_terms`. Returns o [B, Tq, H, Dv] in fp32 (or `out_dtype`).
    `terms` computes the numerator and raw denominator: this reference or a kernel with the same
    contract; a kernel's `terms.divide(num, den, denominator, dtype)` may finish the division too,
    and one with `writes_output` writes the output itself where there is nothing to divide by."""
    if denominator == "none" and getattr(terms, "writes_output", False):
        num, _ = terms(q, k, v, denominator=denominator, out_dtype=out_dtype or torch.float32, **kwargs)
        return num.transpose(1, 2)
    num, den = terms(q, k, v, denominator=denominator, **kwargs)
    return finish_output(num, den, denominator, count_power, getattr(terms, "divide", None), out_dtype)


def finish_output(num, den, denominator, count_power, divide=None, out_dtype=None) -> torch.Tensor:
    """o [B, Tq, H, Dv] = num / the finished denominator, from num [B, H, Tq, Dv] and den [B, H, Tq, 1]
    (row sums or counts) or None; `divide`: a kernel's fused division (`attention_terms.divide`), or None."""
    if divide is not None:
        o = divide(num, den, denominator, out_dtype or torch.float32)
        if o is not None:
            return o
    if den is not None:
        den = _finish_denominator(den, denominator, count_power)
    o = _divide(num, den).transpose(1, 2)
    return o if out_dtype is None else o.to(out_dtype)


POWER2_CHUNK_ELEMENTS = 2**25  # a prefill chunk's power2 features [B, C, H, F] stay under this many elements


def power2_chunk_size(batch: int, heads: int, features: int) -> int:
    """Tokens per chunk of a power2 prefill: the largest power of two (16 to 256) whose features
    [batch, chunk, heads, features] fit in `POWER2_CHUNK_ELEMENTS` (128 MB in fp32)."""
    chunk = 256
    while chunk > 16 and batch * chunk * heads * features > POWER2_CHUNK_ELEMENTS:
        chunk //= 2
    return chunk


def chunk_linear_attention(
    q, k, v, log_decay, state, normalizer, count_before, *, similarity, scale, denominator="sum",
    count_power=None, token_mask=None, terms=attention_terms, packed=False, chunk_size=None, state_update=None,
):
    """Linearizable variants (power1, power2; no clamp): T tokens continuing from a recurrent state.

    Inside a chunk the quadratic form is used; the state enters through phi(q). Padded tokens
    (token_mask False) must come with zero k, v and log-decay. log_decay [B, T, H] or None;
    state [B, H, F, Dv] or None; normalizer [B, H, F] or None; count_before [B] tokens before the chunk.
    packed: power2's state in its packed layout (see the module's doc). Returns (o [B, T, H, Dv], state, normalizer).

    power2 runs over chunks of `chunk_size` tokens (default `power2_chunk_size`), one after the
    other, so that its features (d^2 per token) exist for one chunk at a time; power1 takes all T
    tokens as one chunk. `state_update`: `linear_state_update` (default) or a kernel with its
    contract; a kernel that forms no features (`fused`) lets a prompt without a state before it
    run as one chunk of up to `FUSED_FIRST_CHUNK` tokens (the quadratic form alone, no features at all).
    """
    batch, seq_len, heads, head_dim = q.shape
    state_update = state_update or linear_state_update
    if state is not None:
        state = state.float()  # a 16-bit decoding state (the mixer's `state_dtype`): fp32 sums
    if chunk_size is None:
        chunk_size = seq_len
        if similarity == "power2":
            chunk_size = power2_chunk_size(batch, heads, linear_feature_count(head_dim, similarity, packed))
    first = chunk_size
    if state is None and getattr(state_update, "fused", False):
        first = max(chunk_size, FUSED_FIRST_CHUNK)
    kwargs = {"similarity": similarity, "scale": scale, "denominator": denominator, "count_power": count_power,
              "terms": terms, "packed": packed, "state_update": state_update}
    if seq_len <= first:
        return _linear_attention_chunk(q, k, v, log_decay, state, normalizer, count_before, token_mask=token_mask, **kwargs)
    outputs = []
    count = count_before
    start = 0
    while start < seq_len:
        part = slice(start, start + (first if start == 0 else chunk_size))
        mask = None if token_mask is None else token_mask[:, part]
        o, state, normalizer = _linear_attention_chunk(
            q[:, part], k[:, part], v[:, part], None if log_decay is None else log_decay[:, part], state, normalizer,
            count, token_mask=mask, **kwargs,
        )
        outputs.append(o)
        count = count + (o.shape[1] if mask is None else mask.long().sum(-1))
        start += o.shape[1]
    return torch.cat(outputs, dim=1), state, normalizer


FUSED_FIRST_CHUNK = 8192  # tokens of a prompt's first chunk when no features are formed (the quadratic form's cost grows as T^2)


def _linear_attention_chunk(
    q, k, v, log_decay, state, normalizer, count_before, *, similarity, scale, denominator, count_power,
    token_mask, terms, packed, state_update,
):
    """`chunk_linear_attention` for one chunk: the quadratic form inside, the state through phi(q)."""
    c = log_decay_cumsum(log_decay)  # [B, T, H]
    num, den = terms(
        q, k, v, similarity=similarity, scale=scale, denominator=denominator,
        query_log_decay=c, key_log_decay=c, key_mask=token_mask,
    )
    want_normalizer = denominator in SUM_DENOMINATORS
    if state is not None:  # what the state carries in: decayed from the chunk start to each query
        # features in [B, H, T, F], so that the products read them as they lie
        phi_q = linear_features(q.float().transpose(1, 2), similarity, packed, query=True)  # [B, H, T, F]
        if c is not None:
            phi_q = phi_q * c.exp().transpose(1, 2)[..., None]
        num = num + phi_q @ state  # [B, H, T, Dv]
        if want_normalizer and normalizer is not None:
            den = den + phi_q @ normalizer[..., None]
        del phi_q
    if den is not None and not want_normalizer:  # counts
        den = den + count_before.float().view(-1, 1, 1, 1)
    if den is not None:
        den = _finish_denominator(den, denominator, count_power)
    o = _divide(num, den).transpose(1, 2)
    state, normalizer = state_update(k, v, c, state, normalizer, similarity=similarity, scale=scale, packed=packed,
                                     want_normalizer=want_normalizer)
    return o, state, normalizer


def linear_state_update(k, v, c, state, normalizer, *, similarity, scale, packed=False, want_normalizer=True):
    """The state (and normaliser) after T more tokens: S exp(c_T) + sum_t exp(c_T - c_t) phi(k_t)^T v_t.

    k [B, T, H, K], v [B, T, H, Dv]; c [B, T, H]: the running sum of the log-decays over these
    tokens, or None; state [B, H, F, Dv] or None (zeros); normalizer [B, H, F] or None (zeros).
    Returns (state, normalizer or None), fp32."""
    power = 1 if similarity == "power1" else 2
    weight = torch.full(k.shape[:3], float(scale) ** power, device=k.device)  # [B, T, H]: scale^p, decay to the end
    if c is not None:
        weight = weight * (c[:, -1:] - c).exp()
    weight = weight.transpose(1, 2)[..., None]  # [B, H, T, 1]
    phi_k = linear_features(k.float().transpose(1, 2), similarity, packed)  # [B, H, T, F]
    new_state = phi_k.transpose(-1, -2) @ (v.float().transpose(1, 2) * weight)  # [B, H, F, Dv]
    new_normalizer = (phi_k.transpose(-1, -2) @ weight)[..., 0] if want_normalizer else None  # [B, H, F]
    del phi_k
    chunk_decay = None if c is None else c[:, -1].exp()  # [B, H]
    if state is not None:
        new_state = new_state + (state if chunk_decay is None else state * chunk_decay[..., None, None])
    if want_normalizer and normalizer is not None:
        new_normalizer = new_normalizer + (normalizer if chunk_decay is None else normalizer * chunk_decay[..., None])
    return new_state, new_normalizer


def recurrent_step(
    q, k, v, log_decay, state, normalizer, count, *, similarity, scale, denominator="sum", count_power=None,
    packed=False,
):
    """One decoding step of a linearizable variant. q, k [B, H, K]; v [B, H, Dv]; log_decay [B, H] or None;
    count [B]: tokens so far, this one included. packed: power2's state in its packed layout.
    Returns (o [B, H, Dv], state, normalizer)."""
    power = 1 if similarity == "power1" else 2
    phi_q = linear_features(q.float(), similarity, packed, query=True)  # [B, H, F]
    phi_k = linear_features(k.float(), similarity, packed) * scale**power
    batch, heads, features = phi_q.shape
    want_normalizer = denominator in SUM_DENOMINATORS
    state_dtype = torch.float32 if state is None else state.dtype  # a 16-bit state: fp32 sums, rounded where stored
    if state is None:
        state = q.new_zeros(batch, heads, features, v.shape[-1], dtype=torch.float32)
    state = state.float()
    if want_normalizer and normalizer is None:
        normalizer = q.new_zeros(batch, heads, features, dtype=torch.float32)
    if log_decay is not None:
        decay = log_decay.float().exp()  # [B, H]
        state = state * decay[..., None, None]
        if want_normalizer:
            normalizer = normalizer * decay[..., None]
    state = state + phi_k[..., :, None] * v.float()[..., None, :]
    num = torch.einsum("bhf,bhfv->bhv", phi_q, state)  # [B, H, Dv]
    weight_sum = None
    if want_normalizer:
        normalizer = normalizer + phi_k
        weight_sum = (phi_q * normalizer).sum(-1)  # [B, H]
    o = _step_output(num, weight_sum, count, denominator, count_power)
    return o, state.to(state_dtype), (normalizer if want_normalizer else None)


def _step_output(num, weight_sum, count, denominator, count_power):
    """A step's output [B, H, Dv] from its numerator [B, H, Dv] and, for the sum denominators, the sum of
    its weights [B, H]; the count denominators divide by count [B] (tokens so far)."""
    batch, heads = num.shape[:2]
    if denominator in SUM_DENOMINATORS:
        den = weight_sum[..., None, None]  # [B, H, 1, 1]
    elif denominator in ("count", "count_power"):
        den = count.float().view(-1, 1, 1, 1).expand(batch, heads, 1, 1)
    else:
        den = None
    if den is not None:
        den = _finish_denominator(den, denominator, count_power)
    return _divide(num[:, :, None], den)[:, :, 0]


# ---------------------------------------------------------------- decoding with a window of recent tokens

RECENT_TOKENS = 64  # tokens the windowed step keeps beside power2's state before it folds them in
RECENT_BUFFERS = ("recent_key", "recent_value", "recent_log_decay", "recent_count")


def new_recent(k: torch.Tensor, v: torch.Tensor, window: int | None = None) -> dict[str, torch.Tensor]:
    """An empty window of recent tokens for the step of `windowed_step`, for k [B, T, H, K] and v [B, T, H, Dv]:
    keys [B, H, W, K] and values [B, H, W, Dv] in their dtypes, each token's log-decay since the state's
    last fold [B, H, W] (fp32) and the tokens held [B, H] (int32)."""
    batch, _, heads, head_dim = k.shape
    window = RECENT_TOKENS if window is None else window
    return {
        "recent_key": k.new_zeros(batch, heads, window, head_dim),
        "recent_value": v.new_zeros(batch, heads, window, v.shape[-1]),
        "recent_log_decay": k.new_zeros(batch, heads, window, dtype=torch.float32),
        "recent_count": torch.zeros(batch, heads, dtype=torch.int32, device=k.device),
    }


def fold_recent(state, normalizer, recent, *, similarity, scale, packed=False, full_only=False):
    """The state and normaliser with the window's tokens folded in (`windowed_step`), and the window
    emptied where they were: S exp(L_n) + sum_{w < n} exp(L_n - L_w) phi(k_w)^T v_w, L_w the log-decay
    of token w since the last fold. `full_only`: only the (row, head)s whose window is full.
    Returns (state in its dtype, normalizer or None, recent) as new tensors."""
    keys, values, log_decay, count = (recent[name] for name in RECENT_BUFFERS)
    window = keys.shape[2]
    count = count.long()
    valid = torch.arange(window, device=keys.device) < count[..., None]  # [B, H, W]
    last = log_decay.gather(2, (count - 1).clamp(min=0)[..., None])[..., 0]
    last = torch.where(count > 0, last, torch.zeros_like(last))  # [B, H]
    power = 1 if similarity == "power1" else 2
    weight = torch.where(valid, (last[..., None] - log_decay).exp(), torch.zeros_like(log_decay)) * float(scale) ** power
    phi_k = linear_features(keys.float(), similarity, packed)  # [B, H, W, F]
    fold = count == window if full_only else count > 0
    decay = last.exp()
    folded = state.float() * decay[..., None, None] + phi_k.transpose(-1, -2) @ (values.float() * weight[..., None])
    new_state = torch.where(fold[..., None, None], folded, state.float()).to(state.dtype)
    if normalizer is not None:
        folded_z = normalizer * decay[..., None] + (phi_k * weight[..., None]).sum(2)
        normalizer = torch.where(fold[..., None], folded_z, normalizer)
    recent = dict(recent, recent_count=torch.where(fold, 0, count).to(torch.int32))
    return new_state, normalizer, recent


def windowed_step(q, k, v, log_decay, state, normalizer, recent, count, *, similarity, scale, denominator="sum",
                  count_power=None, packed=False):
    """`recurrent_step` with the state read only: the latest tokens wait in a window (`new_recent`)
    and the step attends to them, S_t = exp(L_t) S + sum_w exp(L_t - L_w) phi(k_w)^T v_w, L_t the
    log-decay since the state's last fold; the step whose token fills the window folds it into the state
    (`fold_recent`). A step reads the state, and rewrites it once per window instead of every step.
    Returns (o [B, H, Dv], state, normalizer, recent)."""
    keys, values, logs, held = (recent[name] for name in RECENT_BUFFERS)
    held = held.long()  # [B, H]
    previous = logs.gather(2, (held - 1).clamp(min=0)[..., None])[..., 0]
    log_t = torch.where(held > 0, previous, torch.zeros_like(previous))
    if log_decay is not None:
        log_t = log_t + log_decay.float()
    slot = held[..., None]  # this token's place in the window
    keys = keys.scatter(2, slot[..., None].expand(-1, -1, 1, keys.shape[-1]), k[:, :, None].to(keys.dtype))
    values = values.scatter(2, slot[..., None].expand(-1, -1, 1, values.shape[-1]), v[:, :, None].to(values.dtype))
    logs = logs.scatter(2, slot, log_t[..., None])
    held = held + 1
    power = 1 if similarity == "power1" else 2
    scores = torch.einsum("bhd,bhwd->bhw", q.float(), keys.float()) ** power * float(scale) ** power
    valid = torch.arange(keys.shape[2], device=q.device) < held[..., None]
    weight = torch.where(valid, scores * (log_t[..., None] - logs).exp(), torch.zeros_like(scores))  # [B, H, W]
    phi_q = linear_features(q.float(), similarity, packed, query=True)  # [B, H, F]
    decay = log_t.exp()
    num = decay[..., None] * torch.einsum("bhf,bhfv->bhv", phi_q, state.float())
    num = num + torch.einsum("bhw,bhwv->bhv", weight, values.float())  # [B, H, Dv]
    weight_sum = None
    if denominator in SUM_DENOMINATORS:
        weight_sum = decay * (phi_q * normalizer).sum(-1) + weight.sum(-1)
    o = _step_output(num, weight_sum, count, denominator, count_power)
    recent = {"recent_key": keys, "recent_value": values, "recent_log_decay": logs, "recent_count": held.to(torch.int32)}
    state, normalizer, recent = fold_recent(state, normalizer, recent, similarity=similarity, scale=scale,
                                            packed=packed, full_only=True)
    return o, state, normalizer, recent
