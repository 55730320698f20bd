"""The attention family's linearizable variants (power1, power2 without a clamp) in linear time:
chunked, state-passing training and prefill. On CUDA power1 runs on the Mamba-2 SSD kernels instead (`_power1_ssd`,
below); what follows is power2's form, and power1's elsewhere.

Time is cut into chunks of C tokens. Inside a chunk the quadratic form runs (`intra_terms`: the tiled
kernels of `kernels/attention_family/parallel.py` on CUDA, the reference on CPU), on the chunks side by side as
rows of a batch, with each chunk's log-decays summed from its start. Across chunks a fixed-size state
carries the earlier tokens, one state per head:

    S_{n+1} = exp(G_n) S_n + sum_{t in n} exp(G_n - g_t) scale^p phi(k_t)^T [v_t, 1]     [F, Dv + 1]
    o_t     = intra_t + exp(g_t) phi(q_t) S_n                                           (t in chunk n)

g_t: the log-decays of chunk n summed from its start through t; G_n: their total. phi is k (power1,
F = d) or power2's packed symmetric features (F = d (d + 1) / 2: x_a x_b for a <= b, doubled off the
diagonal on the query side; the layout the decoding step keeps, `ops/attention_family.py`). The sum
denominators' normaliser z = sum phi(k) is the state's column Dv (a value column of ones), so
numerator and denominator come from the same products; the count denominators need no weights.

The states of a group of chunks follow from one product with the [chunks, chunks] matrix of decays
between chunk starts (no sequential loop over chunks); groups run one after the other, the state
carried between them in fp32. `_ChunkStates` keeps for its backward only its inputs and the state at
each group's start: the backward recomputes a group's features and states and differentiates them,
the last group first. Memory is linear in T: a group's features (bounded by `GROUP_ELEMENTS`) exist
only while it runs.

Products run in the inputs' dtype (bf16 under autocast), accumulating in fp32; a group's chunk states
are summed in fp32 and rounded to the inputs' dtype only as the operands of products, as the SSD kernels
do. Every product with power2's features runs on cuBLAS from the features formed in memory, once per use
(`_features_kernel`), and the gradients of q and k through phi read the features' gradient once
(`_features_backward_kernel`). On CUDA power2's state runs instead on the kernels of `power2_states.py`, which form the
features in registers and write none (`power2_on_kernels`, below); the products here serve
heads and values wider than those kernels take. Off CUDA (and
for power1, whose features are k itself) PyTorch computes the same. The reference is
`attnlab.models.ops.attention_family.parallel_attention`.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from attnlab.models.ops.attention_family import SUM_DENOMINATORS, finish_output, unpack_power2_state
from attnlab.models.ops.attention_family import attention_terms as reference_terms
from attnlab.models.kernels.eager import outside_compile
from attnlab.models.kernels.attention_family import power2_states
from attnlab.models.kernels.mamba2.ssd import linear_attention_ssd

# Tokens per chunk of the form below, measured on an H100 (`benchmarks/attention_family_chunk.py`, one layer's mixing forward and backward,
# 16 heads of 64: benchmarks/results/h100-chunk-crossover.txt). power1: 128 is the fastest from 1 x 16384 on
# (linear__output_norm 8.8 ms at 1 x 32768 against 16.3 with 64; linear_elu 14.0 against 25.7). power2: 512 is the
# fastest of 128-512 at every shape (its state part, 4 F (Dv + 8) flops per token and head at F = 2080, wants long chunks).
CHUNK_SIZES = {"power1": 128, "power2": 512}
GROUP_ELEMENTS = 2**28  # a group of chunks: its features [B, chunks, H, C, F] stay under this many elements (512 MB in bf16)
MAX_GROUP_CHUNKS = 64  # ... and it spans at most this many chunks (the matrix of decays between chunk starts is chunks^2)
VALUE_ALIGN = 8  # the value columns with the normaliser's padded to a multiple of this: cuBLAS's bf16 tensor-core kernels want it


@functools.cache
def _power2_indices(head_dim: int, device: torch.device):
    """(a, b) of the packed rows (a <= b, `torch.triu_indices`' order), the query's doubling (2 off the
    diagonal), and for each full row (c, e) of the d x d features the packed row of (min, max)."""
    a, b = torch.triu_indices(head_dim, head_dim, device=device)
    double = torch.where(a == b, 1.0, 2.0)
    full = torch.empty(head_dim, head_dim, dtype=torch.long, device=device)
    rows = torch.arange(a.numel(), device=device)
    full[a, b] = rows
    full[b, a] = rows
    return a, b, double, full.flatten()


class _Power2Features(torch.autograd.Function):
    """x [..., d] -> x_a x_b for a <= b ([..., d (d + 1) / 2]), doubled off the diagonal with `query`.
    The backward gathers the gradient into the symmetric d x d matrix M (M_ce: the gradient of the packed
    row (min(c, e), max(c, e)) times its doubling) and returns M x + diag(M) x: no scatter, no atomics."""

    @staticmethod
    def forward(ctx, x, query):
        ctx.save_for_backward(x)
        ctx.query = query
        return power2_features(x, query)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return power2_features_backward(x, grad, ctx.query), None


FEATURE_KERNEL_MAX_HEAD_DIM = 128  # the feature kernels hold [rows, FEATURE_FIRST * d] feature tiles


def _use_feature_kernels(x: torch.Tensor) -> bool:
    """The Triton kernels below for 5-dim CUDA tensors (the groups' [B, H, n, C, d] views), PyTorch elsewhere;
    wider heads than `FEATURE_KERNEL_MAX_HEAD_DIM` form the features in memory (said once)."""
    if not (x.is_cuda and x.dim() == 5 and x.dtype != torch.float64 and x.stride(-1) == 1):
        return False
    if x.shape[-1] > FEATURE_KERNEL_MAX_HEAD_DIM:
        _say_wide_heads(x.shape[-1], "power2", FEATURE_KERNEL_MAX_HEAD_DIM,
                        "its features are formed in memory and multiplied by cuBLAS")
        return False
    return True


@functools.cache
def _say_wide_heads(head_dim: int, similarity: str, limit: int, instead: str) -> None:
    import warnings

    warnings.warn(f"the chunked attention family's {similarity} kernels cover head dims up to {limit}; at {head_dim} "
                  f"{instead} (slower, same result)", stacklevel=4)


def power2_features(x: torch.Tensor, query: bool = False) -> torch.Tensor:
    """power2's packed features of x [..., d]: [..., d (d + 1) / 2] in x's dtype (`_Power2Features`)."""
    if _use_feature_kernels(x):
        return _features_triton(x, query)
    a, b, double, _ = _power2_indices(x.shape[-1], x.device)
    features = x[..., a]
    features.mul_(x[..., b])
    if query:
        features.mul_(double.to(features.dtype))
    return features


def power2_features_backward(x: torch.Tensor, grad: torch.Tensor, query: bool) -> torch.Tensor:
    """The gradient of x from that of its packed features (see `_Power2Features`), in x's dtype."""
    if _use_feature_kernels(x) and grad.is_contiguous():
        return _features_backward_triton(x, grad, query)
    d = x.shape[-1]
    _, _, double, full = _power2_indices(d, x.device)
    grad = grad.to(x.dtype)
    if query:
        grad = grad * double.to(grad.dtype)
    m = grad.index_select(-1, full).view(*grad.shape[:-1], d, d)
    return (m @ x[..., None])[..., 0] + torch.diagonal(m, dim1=-2, dim2=-1) * x


def linear_features(x: torch.Tensor, similarity: str, query: bool = False) -> torch.Tensor:
    """phi(x): x itself (power1) or power2's packed features (the query's doubled off the diagonal)."""
    return x if similarity == "power1" else power2_features(x, query)


def _features_backward(x: torch.Tensor, grad: torch.Tensor, similarity: str, query: bool = False) -> torch.Tensor:
    return grad.to(x.dtype) if similarity == "power1" else power2_features_backward(x, grad, query)


# ---------------------------------------------------------------- power2's features as Triton kernels
# One pass each way: the features written once (PyTorch's gathers write them three times), and x's gradient read
# from them without the d x d matrix in memory. A program holds FEATURE_ROWS rows of x in registers and walks over
# the first indices a: the features (a, b >= a) of its rows are the packed rows a d - a (a - 1) / 2 + b - a, one
# contiguous run per a, so every store and load is a run of whole rows' segments (no gather from memory). x is a
# [B, H, n, C, d] view (any strides, d contiguous); the features and their gradient are contiguous [B, H, n, C, F].

FEATURE_ROWS = 32  # rows (tokens) per program
FEATURE_FIRST = 4  # first indices a per step of the forward's loop: a [rows, 4 d] tile


@triton.jit
def _packed_row(a, b, D: tl.constexpr):
    """The packed row of power2's feature (a, b), a <= b: a d - a (a - 1) / 2 + b - a (`torch.triu_indices`' order)."""
    return a * D - a * (a - 1) // 2 + b - a


@triton.jit
def _through_first_index(dx, g, x, a, valid, offs_d, QUERY: tl.constexpr):
    """dx [BM, BD] plus the gradient through the features (a, b) of one first index a, given theirs g [BM, BD] (b along
    the columns, `valid` where b >= a): dx_b += m g_ab x_a and dx_a += sum_b m g_ab x_b (m: 2 off the diagonal for
    the query, else 1; the diagonal's two terms make its 2 g_aa x_a)."""
    if QUERY:
        g = tl.where((offs_d != a)[None, :], 2.0 * g, g)
    g = tl.where(valid[None, :], g, 0.0)
    is_a = (offs_d == a)[None, :]
    x_a = tl.sum(tl.where(is_a, x, 0.0), 1)  # [BM]: column a of x
    dx += g * x_a[:, None]  # into the second index b
    dx += tl.where(is_a, tl.sum(g * x, 1)[:, None], 0.0)  # into the first index a
    return dx


@triton.jit
def _features_kernel(X, OUT, C, sxb, sxh, sxl, sxc, H: tl.constexpr, L: tl.constexpr, D: tl.constexpr, F: tl.constexpr,
                     QUERY: tl.constexpr, BN: tl.constexpr, BA: tl.constexpr, BD: tl.constexpr):
    i_c, i_l, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    rows = i_c * BN + tl.arange(0, BN)
    ok = rows < C
    offs_d = tl.arange(0, BD)
    x_rows = X + i_b.to(tl.int64) * sxb + i_h * sxh + i_l * sxl + rows[:, None].to(tl.int64) * sxc
    x = tl.load(x_rows + offs_d[None, :], mask=ok[:, None] & (offs_d < D)[None, :], other=0.0).to(tl.float32)
    out_rows = OUT + ((i_bh.to(tl.int64) * L + i_l) * C + rows[:, None]) * F
    for a0 in range(0, D, BA):
        phi, valid, packed = _phi_tile(X, x, x_rows, ok, a0, offs_d, D, QUERY, BA, BD)
        tl.store(out_rows + packed[None, :], phi.to(OUT.dtype.element_ty), mask=ok[:, None] & valid[None, :])


@triton.jit
def _features_backward_kernel(X, G, DX, C, sxb, sxh, sxl, sxc, H: tl.constexpr, L: tl.constexpr,
                              D: tl.constexpr, F: tl.constexpr, QUERY: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):
    """x's gradient from its features' g, read one first index a at a time: the packed rows (a, b >= a), a contiguous
    run per row (`_through_first_index`)."""
    i_c, i_l, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    rows = i_c * BN + tl.arange(0, BN)
    ok = rows < C
    offs_d = tl.arange(0, BD)
    d_ok = offs_d < D
    x_rows = X + i_b.to(tl.int64) * sxb + i_h * sxh + i_l * sxl + rows[:, None].to(tl.int64) * sxc
    x = tl.load(x_rows + offs_d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)  # [BN, BD]
    row_index = (i_bh.to(tl.int64) * L + i_l) * C + rows[:, None]
    g_rows = G + row_index * F
    dx = tl.zeros([BN, BD], tl.float32)
    for a in range(D):
        valid = d_ok & (offs_d >= a)
        g = tl.load(g_rows + _packed_row(a, offs_d, D)[None, :], mask=ok[:, None] & valid[None, :], other=0.0)  # g_ab
        dx = _through_first_index(dx, g.to(tl.float32), x, a, valid, offs_d, QUERY)
    tl.store(DX + row_index * D + offs_d[None, :], dx.to(DX.dtype.element_ty), mask=ok[:, None] & d_ok[None, :])


@triton.jit
def _phi_tile(X, x, x_rows, ok, a0, offs_d, D: tl.constexpr, QUERY: tl.constexpr, BA: tl.constexpr, BD: tl.constexpr):
    """Features (a, b) for a in [a0, a0 + BA), every b: (tile [BM, BA * BD] fp32, valid [BA * BD], their packed rows)."""
    offs_a = a0 + tl.arange(0, BA)
    x_a = tl.load(x_rows + offs_a[None, :], mask=ok[:, None] & (offs_a < D)[None, :], other=0.0).to(tl.float32)
    flat = tl.arange(0, BA * BD)
    a = a0 + flat // BD
    b = flat % BD
    valid = (a < D) & (b < D) & (b >= a)
    phi = tl.reshape(x_a[:, :, None] * x[:, None, :], (x.shape[0], BA * BD))
    if QUERY:
        phi = tl.where((b != a)[None, :], 2.0 * phi, phi)
    phi = tl.where(valid[None, :], phi, 0.0)
    return phi, valid, _packed_row(a, b, D)


def _grid_args(x: torch.Tensor):
    batch, heads, chunks, chunk, _ = x.shape
    return (triton.cdiv(chunk, FEATURE_ROWS), chunks, batch * heads), (chunk, x.stride(0), x.stride(1), x.stride(2), x.stride(3))


def _features_triton(x: torch.Tensor, query: bool) -> torch.Tensor:
    batch, heads, chunks, chunk, d = x.shape
    features = d * (d + 1) // 2
    out = torch.empty(batch, heads, chunks, chunk, features, dtype=x.dtype, device=x.device)
    grid, args = _grid_args(x)
    _features_kernel[grid](x, out, *args, H=heads, L=chunks, D=d, F=features, QUERY=bool(query), BN=FEATURE_ROWS,
                           BA=FEATURE_FIRST, BD=max(16, triton.next_power_of_2(d)), num_warps=4)
    return out


def _features_backward_triton(x: torch.Tensor, grad: torch.Tensor, query: bool) -> torch.Tensor:
    batch, heads, chunks, chunk, d = x.shape
    dx = torch.empty(batch, heads, chunks, chunk, d, dtype=x.dtype, device=x.device)
    grid, args = _grid_args(x)
    _features_backward_kernel[grid](x, grad, dx, *args, H=heads, L=chunks, D=d, F=grad.shape[-1], QUERY=bool(query),
                                    BN=FEATURE_ROWS, BD=max(16, triton.next_power_of_2(d)), num_warps=4)
    return dx


def feature_count(head_dim: int, similarity: str) -> int:
    return head_dim if similarity == "power1" else head_dim * (head_dim + 1) // 2


def pack_power2_rows(state: torch.Tensor, head_dim: int, dim: int = -2) -> torch.Tensor:
    """power2's full state (d * d rows along `dim`) in its packed layout (the rows a <= b)."""
    a, b, _, _ = _power2_indices(head_dim, state.device)
    return state.index_select(dim % state.dim(), a * head_dim + b)


def _segment_sums(chunk_totals: torch.Tensor) -> torch.Tensor:
    """chunk_totals [..., n] (G_0..G_{n-1}) -> [..., n + 1, n + 1]: entry (i, j) is G_j + ... + G_{i-1}
    (0 on the diagonal, -inf above it), summed along the rows (no difference of large running sums)."""
    n = chunk_totals.shape[-1]
    x = torch.nn.functional.pad(chunk_totals, (1, 0))  # [..., n + 1]: x_i = G_{i-1}
    x = x[..., None].expand(*x.shape, n + 1)  # [..., i, j] = x_i
    strict = torch.ones(n + 1, n + 1, dtype=torch.bool, device=x.device).tril(-1)
    sums = x.masked_fill(~strict, 0).cumsum(-2)
    return sums.masked_fill(~strict.logical_or(torch.eye(n + 1, dtype=torch.bool, device=x.device)), float("-inf"))


def _group_forward(q, k, v, g, state, *, similarity, scale):
    """One group of chunks. q, k [B, n, C, H, D]; v [B, n, C, H, Dv'] (with the normaliser's column);
    g [B, n, H, C] fp32 (log-decays summed from each chunk's start) or None; state [B, H, F, Dv'] fp32
    (the state at the group's start) or None. Returns (y [B, H, n, C, Dv'] fp32: exp(g_t) phi(q_t) S_n,
    the state at the group's end [B, H, F, Dv'] fp32). Heads lead, so that every product reads its
    operands as they lie."""
    batch, chunks, _, heads, _ = q.shape
    dtype = v.dtype
    power = 1 if similarity == "power1" else 2
    qh, kh, vh = (t.permute(0, 3, 1, 2, 4) for t in (q, k, v))  # [B, H, n, C, *]
    gh = None if g is None else g.transpose(1, 2)  # [B, H, n, C]
    phi_k = linear_features(kh, similarity)  # [B, H, n, C, F]
    if gh is None:
        totals = torch.zeros(batch, heads, chunks, device=v.device)
        vw = vh * float(scale) ** power
    else:
        totals = gh[..., -1]  # [B, H, n]: each chunk's total log-decay
        weight = torch.exp(gh[..., -1:] - gh) * float(scale) ** power  # [B, H, n, C]: scale^p, decayed to the chunk's end
        vw = (vh.float() * weight[..., None]).to(dtype)
    chunk_states = (phi_k.transpose(-1, -2) @ vw).float()  # [B, H, n, F, Dv']: each chunk's own tokens
    del phi_k, vw
    features, width = chunk_states.shape[-2:]
    # the state at each chunk start (rows 0..n-1) and at the group's end (row n): one product with the decays between them
    decays = torch.exp(_segment_sums(totals))  # [B, H, n + 1, n + 1]: exp(G_j + .. + G_{i-1}), 0 for j > i
    states = decays[..., 1:] @ chunk_states.flatten(-2)  # [B, H, n + 1, F * Dv']
    if state is not None:
        states = states + decays[..., 0, None] * state.flatten(-2)[:, :, None]
    states = states.view(batch, heads, chunks + 1, features, width)
    del chunk_states
    y = _phi_times(qh, states[:, :, :chunks], similarity, query=True)  # [B, H, n, C, Dv']
    if gh is not None:
        y = y * torch.exp(gh)[..., None]
    # the end state as a tensor of its own: a view would keep the group's every chunk-start state alive while the
    # backward keeps it (`_ChunkStates` saves each group's starting state)
    return y, states[:, :, chunks].clone(memory_format=torch.contiguous_format)


def _phi_times(x, s, similarity, query):
    """phi(x) s: x [B, H, n, C, d] in the products' dtype, s [B, H, n, F, V] fp32 -> [B, H, n, C, V] fp32, s rounded
    to x's dtype as the operand."""
    return (linear_features(x, similarity, query=query) @ s.to(x.dtype)).float()


def _phi_grad(x, dy, s, similarity, query):
    """The gradient of x [B, H, n, C, d] through phi(x) from dphi = dy s^T (dy [B, H, n, C, V], s [B, H, n, F, V]),
    in x's dtype."""
    return _features_backward(x, dy.to(x.dtype) @ s.to(x.dtype).transpose(-1, -2), similarity, query=query)


def _segment_sums_backward(grad: torch.Tensor) -> torch.Tensor:
    """The gradient of the chunk totals G [..., n] from that of `_segment_sums` [..., n + 1, n + 1]: entry
    (i, j) sums G_l for j <= l < i, so G_l gets the entries with j <= l < i."""
    n = grad.shape[-1] - 1
    lower = torch.ones(n + 1, n + 1, dtype=torch.bool, device=grad.device).tril(-1)
    grad = grad.masked_fill(~lower, 0)
    below = grad.flip(-2).cumsum(-2).flip(-2)  # [i', j]: the sum over rows i >= i'
    return below[..., 1:, :].cumsum(-1).diagonal(dim1=-2, dim2=-1)  # l: rows i > l, columns j <= l


def _group_backward(q, k, v, g, state, dy, dstate, *, similarity, scale):
    """The gradients of `_group_forward`'s inputs (dq, dk, dv, dg or None, the starting state's or None) from
    those of its outputs: dy [B, H, n, C, Dv'] and dstate [B, H, F, Dv'] or None. Recomputes the group's
    features and states; written out rather than left to autograd, so that a captured backward (CUDA
    graphs) holds no nested autograd call and every intermediate is freed as soon as it is used."""
    batch, chunks, _, heads, _ = q.shape
    dtype = v.dtype
    power = 1 if similarity == "power1" else 2
    qh, kh, vh = (t.permute(0, 3, 1, 2, 4) for t in (q, k, v))  # [B, H, n, C, *]
    gh = None if g is None else g.transpose(1, 2)  # [B, H, n, C]
    scale_p = float(scale) ** power
    # the forward again: features, chunk states, states at chunk starts
    phi_k = linear_features(kh, similarity)
    if gh is None:
        totals = torch.zeros(batch, heads, chunks, device=v.device)
        weight = torch.full(vh.shape[:-1], scale_p, device=v.device)
    else:
        totals = gh[..., -1]
        weight = torch.exp(gh[..., -1:] - gh) * scale_p  # [B, H, n, C]
    vw = (vh.float() * weight[..., None]).to(dtype)
    chunk_states = (phi_k.transpose(-1, -2) @ vw).float().flatten(-2)  # [B, H, n, F * Dv']
    features, width = phi_k.shape[-1], v.shape[-1]
    del phi_k
    decays = torch.exp(_segment_sums(totals))  # [B, H, n + 1, n + 1]
    states = decays[..., 1:] @ chunk_states  # [B, H, n + 1, F * Dv']
    if state is not None:
        states = states + decays[..., 0, None] * state.flatten(-2)[:, :, None]
    starts = states[:, :, :chunks].view(batch, heads, chunks, features, width)  # fp32
    del states

    # y = exp(g) phi(q) S: through the chunk-start states and the query features
    dy = dy.float()
    if gh is not None:
        dy = dy * torch.exp(gh)[..., None]  # now the gradient of phi(q) S
    dy_low = dy.to(dtype)
    dg = None
    if gh is not None:  # d y / d g = y
        dg = (_phi_times(qh, starts, similarity, query=True) * dy).sum(-1)  # [B, H, n, C]
    dq = _phi_grad(qh, dy_low, starts, similarity, query=True)
    del starts, dy
    phi_q = linear_features(qh, similarity, query=True)  # [B, H, n, C, F]
    d_starts = (phi_q.transpose(-1, -2) @ dy_low).float()  # [B, H, n, F, Dv']
    del phi_q, dy_low

    # the states at chunk starts and the group's end, from the chunk states, the decays and the starting state
    d_states = d_starts.flatten(-2)
    end = dstate.float().flatten(-2)[:, :, None] if dstate is not None else d_states.new_zeros(batch, heads, 1, d_states.shape[-1])
    d_states = torch.cat((d_states, end), dim=2)  # [B, H, n + 1, F * Dv']
    del d_starts
    d_chunk_states = decays[..., 1:].transpose(-1, -2) @ d_states  # [B, H, n, F * Dv']
    d_decays = torch.zeros_like(decays)
    d_decays[..., 1:] = d_states @ chunk_states.transpose(-1, -2)
    d_state = None
    if state is not None:
        flat_state = state.float().flatten(-2)
        d_decays[..., 0] = (d_states @ flat_state[..., None])[..., 0]
        d_state = (decays[..., 0, None] * d_states).sum(2).view_as(state)
    d_totals = _segment_sums_backward(d_decays * decays)  # [B, H, n]
    del d_states, chunk_states, decays, d_decays

    # the chunk states from the key features and the weighted values
    d_chunk_states = d_chunk_states.view(batch, heads, chunks, features, width)  # fp32
    dvw = _phi_times(kh, d_chunk_states, similarity, query=False)  # [B, H, n, C, Dv']
    dk = _phi_grad(kh, vw, d_chunk_states, similarity, query=False)
    del d_chunk_states
    dv = (dvw * weight[..., None]).to(dtype)
    if gh is not None:  # weight = scale^p exp(G - g), G the chunk's total: g's last entry
        dlog_weight = (dvw * vh.float()).sum(-1) * weight  # [B, H, n, C]
        dg = dg - dlog_weight
        dg[..., -1] += dlog_weight.sum(-1) + d_totals
    back = lambda t: None if t is None else t.permute(0, 2, 3, 1, 4)  # noqa: E731  [B, H, n, C, *] -> [B, n, C, H, *]
    return back(dq), back(dk), back(dv), None if dg is None else dg.transpose(1, 2), d_state


def _with_columns(v: torch.Tensor, width: int, want_sum: bool) -> torch.Tensor:
    """v [..., Dv] -> [v, 1 (the sum denominators' normaliser, with `want_sum`), 0...] [..., width]."""
    if width == v.shape[-1]:
        return v
    extra = v.new_zeros(*v.shape[:-1], width - v.shape[-1])
    if want_sum:
        extra[..., 0] = 1
    return torch.cat((v, extra), dim=-1)


class _ChunkStates(torch.autograd.Function):
    """What the state carries into each chunk, y [B, H, L, C, width] fp32 (the values' columns, the
    normaliser's, padding: `_with_columns`, formed per group), and the final state, over groups of `group`
    chunks; see the module's doc. Saves the inputs and each group's starting state."""

    @staticmethod
    def forward(ctx, q, k, v, g, state, similarity, scale, group, width, want_sum):
        with torch.autocast(q.device.type, enabled=False):  # the products' dtypes are chosen here, as in the backward
            return _ChunkStates._forward(ctx, q, k, v, g, state, similarity, scale, group, width, want_sum)

    @staticmethod
    def _forward(ctx, q, k, v, g, state, similarity, scale, group, width, want_sum):
        chunks = q.shape[1]
        starts = []
        ys = []
        carry = state
        for first in range(0, chunks, group):
            part = slice(first, first + group)
            starts.append(carry)
            y, carry = _group_forward(q[:, part], k[:, part], _with_columns(v[:, part], width, want_sum),
                                      None if g is None else g[:, part], carry, similarity=similarity, scale=scale)
            ys.append(y)
        ctx.save_for_backward(q, k, v, g, *[s for s in starts if s is not None])
        ctx.first_is_none = state is None
        ctx.opts = (similarity, scale, group, width, want_sum)
        return torch.cat(ys, dim=2) if len(ys) > 1 else ys[0], carry

    @staticmethod
    def backward(ctx, dy, dstate):
        with torch.autocast(dy.device.type, enabled=False):
            return _ChunkStates._backward(ctx, dy, dstate)

    @staticmethod
    def _backward(ctx, dy, dstate):
        q, k, v, g, *starts = ctx.saved_tensors
        if ctx.first_is_none:
            starts = [None, *starts]
        similarity, scale, group, width, want_sum = ctx.opts
        chunks, value_dim = q.shape[1], v.shape[-1]
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dg = None if g is None else torch.empty_like(g)
        carry = dstate  # the gradient of the state at the current group's end
        firsts = list(range(0, chunks, group))
        for index in reversed(range(len(firsts))):
            part = slice(firsts[index], firsts[index] + group)
            start = starts[index]
            grads = _group_backward(q[:, part], k[:, part], _with_columns(v[:, part], width, want_sum),
                                    None if g is None else g[:, part], start, dy[:, :, part], carry, similarity=similarity,
                                    scale=scale)
            dq[:, part], dk[:, part], dv[:, part] = grads[0], grads[1], grads[2][..., :value_dim]
            if g is not None:
                dg[:, part] = grads[3]
            carry = grads[4]
        return dq, dk, dv, dg, carry, None, None, None, None, None


def _chunk_log_decays(log_decay: torch.Tensor, chunks: int, chunk: int) -> torch.Tensor:
    """log_decay [B, L * C, H] -> [B, L, H, C] fp32, summed from each chunk's start (a last-dim scan)."""
    batch, _, heads = log_decay.shape
    return log_decay.float().view(batch, chunks, chunk, heads).transpose(2, 3).cumsum(-1)


@outside_compile
def chunk_attention(
    q, k, v, log_decay=None, *, similarity, scale, denominator="sum", count_power=None, key_mask=None,
    state=None, normalizer=None, count_before=None, packed=True, chunk_size=None, group_chunks=None,
    intra_terms=None, out_dtype=None,
):
    """The linearizable variants' output in linear time, continuing from a recurrent state.

    q, k [B, T, H, D]; v [B, T, H, Dv]; log_decay [B, T, H] (per token, 0 at padding) or None; key_mask
    [B, T] (False: padding) or None; state [B, H, F, Dv] (power2: packed, d (d + 1) / 2 rows, or full, d^2)
    and normalizer [B, H, F] (sum denominators) from earlier tokens, or None; count_before [B]: tokens
    before (count denominators). Returns (o [B, T, H, Dv] in `out_dtype` (fp32 by default), state,
    normalizer): the state after these tokens in the decoding layout (power2: packed when `packed`, else
    full; fp32), the normaliser for the sum denominators, else None.

    As `ops.attention_family.chunk_linear_attention` (and, without a state, `parallel_attention` with
    the log-decays' running sums) computes; `intra_terms` (an `attention_terms`) runs the chunks'
    quadratic part, the reference by default. chunk_size (`CHUNK_SIZES`) and group_chunks (from
    `GROUP_ELEMENTS`) change the work's split, not the result."""
    if similarity not in CHUNK_SIZES:
        raise ValueError(f"chunked attention covers similarities {list(CHUNK_SIZES)} (without a clamp), not {similarity!r}")
    intra_terms = intra_terms or reference_terms
    batch, seq_len, heads, head_dim = q.shape
    value_dim = v.shape[-1]
    features = feature_count(head_dim, similarity)
    want_sum = denominator in SUM_DENOMINATORS
    chunk = chunk_size or CHUNK_SIZES[similarity]
    chunk = min(chunk, max(16, 1 << (seq_len - 1).bit_length()))  # a short prompt: one chunk of its own size
    chunks = -(-seq_len // chunk)
    padded = chunks * chunk
    if group_chunks is None:
        group_chunks = max(1, min(MAX_GROUP_CHUNKS, GROUP_ELEMENTS // (batch * heads * chunk * features)))

    dtypes = {q.dtype, k.dtype, v.dtype}
    if len(dtypes) > 1:  # autocast may leave a normalised q, k in fp32 beside a bf16 v: the products take the narrowest
        dtype = next(d for d in (torch.bfloat16, torch.float16, torch.float32, torch.float64) if d in dtypes)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if key_mask is not None:  # padding adds nothing to the state
        k = k * key_mask[..., None, None].to(k.dtype)
    if similarity == "power1" and power1_on_ssd(q):
        return _power1_ssd(q, k, v, log_decay, scale=scale, denominator=denominator, count_power=count_power,
                           key_mask=key_mask, state=state, normalizer=normalizer, count_before=count_before,
                           chunk_size=chunk_size, out_dtype=out_dtype, divide=getattr(intra_terms, "divide", None))
    if padded != seq_len:  # zeros after the last token: no weight, no decay, outputs dropped
        pad = padded - seq_len
        q, k, v = (torch.nn.functional.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
        if log_decay is not None:
            log_decay = torch.nn.functional.pad(log_decay, (0, 0, 0, pad))
        if key_mask is not None:
            key_mask = torch.nn.functional.pad(key_mask, (0, pad))
    # one contiguous copy that both parts keep for the backward: the tiled kernels save contiguous operands, and views
    # of the layer's projection would keep it all alive beside them
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    g = None if log_decay is None else _chunk_log_decays(log_decay, chunks, chunk)  # [B, L, H, C]

    # inside each chunk: the quadratic form, the chunks side by side as rows of a batch
    g_rows = None if g is None else g.transpose(2, 3).reshape(batch * chunks, chunk, heads)
    num, den = intra_terms(
        q.reshape(batch * chunks, chunk, heads, head_dim), k.reshape(batch * chunks, chunk, heads, head_dim),
        v.reshape(batch * chunks, chunk, heads, value_dim), similarity=similarity, scale=scale,
        denominator="sum" if want_sum else "none", query_log_decay=g_rows, key_log_decay=g_rows,
        key_mask=None if key_mask is None else key_mask.reshape(batch * chunks, chunk),
    )

    # across chunks: the state, with the normaliser as one more value column
    if similarity == "power2" and power2_on_kernels(q, value_dim, chunk):
        # the kernels add the state's part to the chunks' own: num [B, padded, H, Dv], den [B, padded, H]
        init, init_z = _earlier_state(state, normalizer, head_dim, similarity, want_sum)
        num, den, new_state, new_normalizer = _power2_states(q, k, v, g, init, init_z, num, den, float(scale), chunk,
                                                             want_sum)
        if padded != seq_len:  # (a slice, even of all of it, costs a zero-fill and a copy in the backward)
            num, den = num[:, :seq_len], None if den is None else den[:, :seq_len]
        num = num.transpose(1, 2)  # [B, H, T, Dv]
        den = None if den is None else den[..., None].transpose(1, 2)  # [B, H, T, 1]
    else:
        width = value_dim + 1 if want_sum else value_dim
        width = -(-width // VALUE_ALIGN) * VALUE_ALIGN
        start = _initial_state(state, normalizer, batch, heads, head_dim, features, value_dim, width, similarity,
                               want_sum, v.device)
        view5 = lambda t: t.view(batch, chunks, chunk, heads, t.shape[-1])  # noqa: E731
        y, end = _ChunkStates.apply(view5(q), view5(k), view5(v), g, start, similarity, float(scale), group_chunks, width,
                                    want_sum)
        y = y.transpose(1, 2)  # [B, L, H, C, Dv']
        num = num.view(batch, chunks, heads, chunk, value_dim) + y[..., :value_dim]  # [B, L, H, C, Dv]
        # [B, H, T, Dv]
        num = num.permute(0, 1, 3, 2, 4).reshape(batch, padded, heads, value_dim)[:, :seq_len].transpose(1, 2)
        if want_sum:
            den = den.view(batch, chunks, heads, chunk, 1) + y[..., value_dim:value_dim + 1]
            # [B, H, T, 1]
            den = den.permute(0, 1, 3, 2, 4).reshape(batch, padded, heads, 1)[:, :seq_len].transpose(1, 2)
        new_state = end[..., :value_dim].contiguous()  # the decoding step reads them as contiguous buffers
        new_normalizer = end[..., value_dim].contiguous() if want_sum else None
    if denominator in ("count", "count_power"):
        counts = _counts(key_mask, batch, seq_len, count_before, q.device)  # [B, T]
        den = counts[:, None, :, None].expand(batch, heads, seq_len, 1)
    elif not want_sum:
        den = None
    o = finish_output(num, den, denominator, count_power, getattr(intra_terms, "divide", None), out_dtype)

    if similarity == "power2" and not packed:
        new_state = unpack_power2_state(new_state, head_dim)
        new_normalizer = None if new_normalizer is None else unpack_power2_state(new_normalizer, head_dim, dim=-1)
    return o, new_state, new_normalizer


# ---------------------------------------------------------------- power2's state on the kernels of power2_states.py
# The features formed in registers, one first index at a time, inside ordinary tile products (`power2_states.py`):
# nothing of d * d per token is written, where the products above form each features tensor in memory for cuBLAS.
# CUDA only (and Triton's interpreter in the tests), heads and values as wide as `power2_states.covers` allows.
POWER2_STATE_KERNELS = True


def power2_on_kernels(q: torch.Tensor, value_dim: int, chunk: int) -> bool:
    """Whether power2's state across chunks runs on `power2_states.Power2States` for queries q [B, T, H, D]; wider
    heads or values than its kernels take run on PyTorch's products above (said once)."""
    if not (POWER2_STATE_KERNELS and q.is_cuda and q.dtype != torch.float64):
        return False
    if not power2_states.covers(q.shape[-1], value_dim, chunk):
        _say_wide_heads(q.shape[-1], "power2 state", power2_states.MAX_HEAD_DIM,
                        f"(values {value_dim} wide, chunks of {chunk}) its state runs on PyTorch's products")
        return False
    return True


def _power2_states(q, k, v, g, init, init_z, num, den, scale, chunk, want_sum):
    """`_ChunkStates` and the sum with the chunks' own parts for power2 on `Power2States`: (num [B, padded, H, Dv] and,
    with `want_sum`, den [B, padded, H] fp32 (else None), token-major; the end state [B, H, F, Dv] and its normaliser
    [B, H, F] (or None), packed, fp32). init [B, H, F, Dv] and init_z [B, H, F]: the packed state and normaliser before
    these tokens, fp32, or None (`_earlier_state`); num [B * L, H, C, Dv] and den [B * L, H, C, 1] (or None):
    `intra_terms`' results."""
    batch, padded, heads, head_dim = q.shape
    value_dim = v.shape[-1]
    if init is None and init_z is not None:  # the kernels start from both or neither: the missing one is zero
        init = init_z.new_zeros(*init_z.shape, value_dim)
    if want_sum and init_z is None and init is not None:
        init_z = init.new_zeros(init.shape[:-1])
    # token t = c C + j of the chunks' rows: the tiled kernels' output is token-major already (no copy)
    num = num.transpose(1, 2).reshape(batch, padded, heads, value_dim)
    if want_sum:
        den = den[..., 0].transpose(1, 2).reshape(batch, padded, heads)
    return power2_states.Power2States.apply(q, k, v, g, init, init_z, num, den if want_sum else None, scale * scale,
                                            chunk, want_sum)


# ---------------------------------------------------------------- power1 on the SSD kernels
# power1 with a scalar log-decay per token and head is Mamba-2's SSD with the decays given directly and the values
# unscaled (`kernels/mamba2/ssd.py`, `linear_attention_ssd`): x = v, B = scale k, C = q, a = the log-decays. Its
# kernels walk the chunks in one program per head and block of the state (the states in registers, no [chunks,
# chunks] matrix, nothing formed in PyTorch) and keep no states for the backward. A sum denominator's normaliser is
# one more value column (a column of ones). Heads up to `SSD_MAX_HEAD_DIM` wide (the kernels hold a chunk's keys
# and queries whole), on CUDA; elsewhere the chunks above (PyTorch's products).
POWER1_SSD_CHUNK = 64  # tokens per chunk on the SSD kernels (16 to 128): the fastest of 32, 64, 128 from 2 x 8192 to 1 x 16384
# (benchmarks/results/h100-chunk-crossover-power1-ssd.txt; 128 was 5-8% faster for linear__output_norm from 32768 tokens)
SSD_MAX_HEAD_DIM = 128


def power1_on_ssd(q: torch.Tensor) -> bool:
    """Whether power1's chunked form runs on the SSD kernels (`_power1_ssd`) for queries q [B, T, H, D]; wider heads
    than `SSD_MAX_HEAD_DIM` run on PyTorch's products (said once)."""
    if not (q.is_cuda and q.dtype != torch.float64):
        return False
    if q.shape[-1] > SSD_MAX_HEAD_DIM:
        _say_wide_heads(q.shape[-1], "power1", SSD_MAX_HEAD_DIM, "its chunks run on PyTorch's products")
        return False
    return True


def _power1_ssd(q, k, v, log_decay, *, scale, denominator, count_power, key_mask, state, normalizer, count_before,
                chunk_size, out_dtype, divide):
    """`chunk_attention` for power1 on `linear_attention_ssd`: the same result and state (k already zero at padding)."""
    batch, seq_len, heads, head_dim = q.shape
    value_dim = v.shape[-1]
    want_sum = denominator in SUM_DENOMINATORS
    x = torch.cat((v, v.new_ones(batch, seq_len, heads, 1)), dim=-1) if want_sum else v
    init = None
    if state is not None or (want_sum and normalizer is not None):  # [B, H, Dv (+ 1), D]: the SSD's layout, transposed
        init = q.new_zeros(batch, heads, x.shape[-1], head_dim, dtype=torch.float32)
        if state is not None:
            init[:, :, :value_dim] = state.float().transpose(-1, -2)
        if want_sum and normalizer is not None:
            init[:, :, value_dim] = normalizer.float()
    # no division to follow (denominator none): the output in its final dtype straight from the kernel
    undivided = denominator == "none"
    # the state holds scale k^T v, as the decoding step keeps it
    y, end = linear_attention_ssd(x, log_decay, k * scale, q, chunk_size or POWER1_SSD_CHUNK, init,
                                  out_dtype=(out_dtype or torch.float32) if undivided else torch.float32)
    new_state = end[:, :, :value_dim].transpose(-1, -2).contiguous()  # [B, H, D, Dv]
    new_normalizer = end[:, :, value_dim].contiguous() if want_sum else None
    if undivided:
        return y, new_state, new_normalizer
    num = y[..., :value_dim].transpose(1, 2)  # [B, H, T, Dv]
    if want_sum:
        den = y[..., value_dim:].transpose(1, 2)  # [B, H, T, 1]
    else:  # the count denominators
        den = _counts(key_mask, batch, seq_len, count_before, q.device)[:, None, :, None].expand(batch, heads, seq_len, 1)
    return finish_output(num, den, denominator, count_power, divide, out_dtype), new_state, new_normalizer


# True: a call with gradients keeps for its backward only its inputs and runs its forward again there
# (torch.utils.checkpoint around `chunk_attention`), at the cost of that second forward. Off until measured:
# `benchmarks/memory_peak.py` (model `attnlab-2mamba+chunked+recompute` beside `attnlab-2mamba+chunked`) compares the
# whole model's peak memory and tokens/s both ways.
RECOMPUTE_IN_BACKWARD = False


@outside_compile
def chunk_attention_recomputable(q, k, v, log_decay=None, **kwargs):
    """`chunk_attention`, its forward run again in the backward when `RECOMPUTE_IN_BACKWARD` is on."""
    if not (RECOMPUTE_IN_BACKWARD and torch.is_grad_enabled()):
        return chunk_attention(q, k, v, log_decay, **kwargs)
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    # no early stop: it ends the recomputation by raising from a saved-tensor hook, which the autograd functions
    # inside (the tiled kernels' division) turned into a SystemError on the H100
    with set_checkpoint_early_stop(False):
        return checkpoint(functools.partial(chunk_attention, **kwargs), q, k, v, log_decay, use_reentrant=False,
                          preserve_rng_state=False)  # the capturable form (`train.graphs.CHECKPOINT_KWARGS`)


def _counts(key_mask, batch, seq_len, count_before, device) -> torch.Tensor:
    """Tokens through each position, those before included: [B, T] fp32."""
    if key_mask is None:
        counts = torch.arange(1, seq_len + 1, device=device, dtype=torch.float32).expand(batch, -1)
    else:
        counts = key_mask[:, :seq_len].float().cumsum(-1)
    if count_before is not None:
        counts = counts + count_before.float()[:, None]
    return counts


def _earlier_state(state, normalizer, head_dim, similarity, want_sum):
    """The earlier tokens' state and (for a sum denominator) normaliser in fp32, power2's packed, or None each."""
    if state is not None:
        state = state.float()
        if similarity == "power2" and state.shape[-2] == head_dim * head_dim:
            state = pack_power2_rows(state, head_dim)
    if not want_sum:
        normalizer = None
    elif normalizer is not None:
        normalizer = normalizer.float()
        if similarity == "power2" and normalizer.shape[-1] == head_dim * head_dim:
            normalizer = pack_power2_rows(normalizer, head_dim, dim=-1)
    return state, normalizer


def _initial_state(state, normalizer, batch, heads, head_dim, features, value_dim, width, similarity, want_sum, device):
    """The earlier tokens' state and normaliser as one packed fp32 [B, H, F, width] (None: no earlier tokens)."""
    state, normalizer = _earlier_state(state, normalizer, head_dim, similarity, want_sum)
    if state is None and normalizer is None:
        return None
    start = torch.zeros(batch, heads, features, width, device=device)
    if state is not None:
        start[..., :value_dim] = state
    if normalizer is not None:
        start[..., value_dim] = normalizer
    return start
