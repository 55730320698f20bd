"""The Mamba-2 state-space recurrence (state-space duality, Dao & Gu, 2024) in plain PyTorch.

For every head h, with a scalar decay per step a_t = dt_t * A_h (A_h < 0, dt_t > 0):

    S_t = exp(a_t) S_{t-1} + dt_t x_t^T B_t        S: [head_dim, state_size]
    y_t = S_t C_t                                  (the D skip is added by the layer)

Layout: x [batch, time, heads, head_dim]; dt [batch, time, heads] (after softplus);
A [heads]; B, C [batch, time, groups, state_size], head h reading group h // (heads / groups);
the state is [batch, heads, head_dim, state_size], always fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _per_head(bc: torch.Tensor, heads: int) -> torch.Tensor:
    """[..., groups, N] -> [..., heads, N]: each group serves heads / groups consecutive heads."""
    return bc.repeat_interleave(heads // bc.shape[-2], dim=-2)


def _zero_state(x: torch.Tensor, state_size: int) -> torch.Tensor:
    batch, heads, head_dim = x.shape[0], x.shape[-2], x.shape[-1]
    return x.new_zeros(batch, heads, head_dim, state_size, dtype=torch.float32)


def ssd_step(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step. x [b, H, P]; dt [b, H]; B, C [b, G, N]. Returns (y [b, H, P], new state)."""
    heads = x.shape[1]
    x, dt, B, C = x.float(), dt.float(), _per_head(B.float(), heads), _per_head(C.float(), heads)
    if state is None:
        state = _zero_state(x, B.shape[-1])
    decay = torch.exp(dt * A.float())[..., None, None]  # [b, H, 1, 1]
    state = state * decay + (dt[..., None] * x)[..., :, None] * B[..., None, :]
    y = torch.einsum("bhpn,bhn->bhp", state, C)
    return y, state


def naive_recurrent_ssd(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: one token at a time. Returns (y [b, T, H, P] fp32, final state)."""
    state = initial_state
    ys = []
    for t in range(x.shape[1]):
        y, state = ssd_step(x[:, t], dt[:, t], A, B[:, t], C[:, t], state)
        ys.append(y)
    if state is None:
        state = _zero_state(x, B.shape[-1])
    return torch.stack(ys, dim=1), state


def segment_sum(a: torch.Tensor) -> torch.Tensor:
    """out[..., i, j] = a[..., j + 1] + ... + a[..., i] for j <= i, -inf above the diagonal.

    Each entry is summed from its own terms (not as a difference of two long cumulative sums)."""
    length = a.shape[-1]
    strictly_lower = torch.ones(length, length, dtype=torch.bool, device=a.device).tril(-1)
    terms = a[..., :, None].expand(*a.shape, length).masked_fill(~strictly_lower, 0.0)  # [..., m, j]: a_m if m > j
    sums = terms.cumsum(dim=-2)  # [..., i, j] = sum over j < m <= i
    lower = torch.ones(length, length, dtype=torch.bool, device=a.device).tril()
    return sums.masked_fill(~lower, float("-inf"))


def chunk_ssd(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    chunk_size: int = 64, initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked parallel form; equals `naive_recurrent_ssd` up to float rounding.

    Inside a chunk the output is a masked [chunk, chunk] product (C_i . B_j) exp(a_{j+1} + ... + a_i);
    across chunks a state is carried (a loop over chunks, not tokens). Returns (y [b, T, H, P] fp32, state).
    """
    batch, seq_len, heads, head_dim = x.shape
    state_size = B.shape[-1]
    chunk = min(chunk_size, seq_len)
    padded = -(-seq_len // chunk) * chunk
    num_chunks = padded // chunk

    def to_chunks(t: torch.Tensor) -> torch.Tensor:  # [b, T, ...] -> [b, n, c, ...], zero-padded (no-op steps)
        t = F.pad(t.float(), (0, 0) * (t.dim() - 2) + (0, padded - seq_len))
        return t.reshape(batch, num_chunks, chunk, *t.shape[2:])

    a = to_chunks(dt * A.float()[None, None]).permute(0, 3, 1, 2)  # [b, H, n, c] log-decays <= 0
    xdt = to_chunks(x.float() * dt.float()[..., None])  # [b, n, c, H, P]
    B, C = to_chunks(_per_head(B.float(), heads)), to_chunks(_per_head(C.float(), heads))  # [b, n, c, H, N]

    seg = segment_sum(a)  # [b, H, n, c, c]
    # within each chunk
    scores = torch.einsum("bnihs,bnjhs->bhnij", C, B) * torch.exp(seg)
    y = torch.einsum("bhnij,bnjhp->bnihp", scores, xdt)

    # each chunk's contribution to the state at its end, and the decay across a whole chunk
    to_end = torch.exp(seg[..., -1, :])  # [b, H, n, c]: from after token j to the chunk end
    chunk_states = torch.einsum("bhnj,bnjhs,bnjhp->bnhps", to_end, B, xdt)
    chunk_decay = torch.exp(a.sum(-1))  # [b, H, n]
    state = _zero_state(x, state_size) if initial_state is None else initial_state.float()
    states_before = []
    for n in range(num_chunks):
        states_before.append(state)
        state = state * chunk_decay[:, :, n, None, None] + chunk_states[:, n]
    states_before = torch.stack(states_before, dim=1)  # [b, n, H, P, N]

    # from the carried state: decay from the chunk start through token i
    from_start = torch.exp(a.cumsum(-1))  # [b, H, n, c]
    y = y + torch.einsum("bnihs,bnhps,bhni->bnihp", C, states_before, from_start)
    y = y.reshape(batch, padded, heads, head_dim)[:, :seq_len]
    return y, state


def ssd_with_skip(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
    chunk_size: int = 64, initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba-2's parallel form with its D skip, y = SSD(x, dt, A, B, C) + x * D: (y [b, T, H, P] fp32, the
    final state). The reference of `kernels.mamba2.core.ssd`."""
    y, state = chunk_ssd(x, dt, A, B, C, chunk_size=chunk_size, initial_state=initial_state)
    return y + x.float() * D.float()[:, None], state


def ssd_skip_grads(dv, dy, x, dt, D):
    """(dx, sum_p dv * x, sum_p dy * x) through v = x * dt and y = o + x * D, from dv and dy [b, T, H, P] (dv is
    overwritten): the backward's elementwise part of the SSD through a GLA (`kernels.mamba2.core`), the oracle of
    `kernels/mamba2/grads.py`."""
    dv, x32 = dv.float(), x.float()
    ddt = (dv * x32).sum(-1)
    dx = dv.mul_(dt.float()[..., None])
    dD = None
    if D is not None:
        dy = dy.float()
        dD = (dy * x32).sum(-1)
        dx.addcmul_(dy, D.float()[:, None])
    return dx.to(x.dtype), ddt, dD
