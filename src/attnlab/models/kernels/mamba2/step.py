"""One Mamba-2 decoding step as two Triton kernels, the decoding state advanced where it lies.

From the input projection's one-token outputs xBC [B, conv_dim], z [B, inner] and the raw dt [B, H]
(views of one projected row are fine), for every batch row:

    xBC        = silu(bias + sum_k weight[:, k] window[k])   window = (conv_state, xBC): the causal conv
    conv_state = window[1:]                                   [B, conv_dim, K-1], shifted in place
    dt         = softplus(dt + dt_bias),  A = -exp(A_log)     fp32
    S          = exp(dt A) S + (dt x) B^T                     per head; S fp32 [B, H, P, N], in place
    y          = S C + D x                                    head h reads B, C of group h // (H / G)
    out        = rmsnorm(y * silu(z)) * weight                over groups of `group_size` channels

`_step_kernel` (one program per batch row, head and block of head channels) does the convolution of
its own channels and of its group's B and C, the recurrence and y * silu(z) (fp32, to a scratch
row); `_norm_kernel` (one program per batch row and group) normalises that row and writes the
output in z's dtype. B and C are read by every head of a group, so their convolution window is only
shifted by the second kernel, after every head has read it; each x channel's window is shifted by
the one program that reads it. A padding position (keep 0) enters as the mixer's reference does:
xBC and dt zeroed, so the SSM state does not move and the window takes in a zero.

Rounding follows the CUDA path of the eager step: the convolution accumulates in fp32 and its output
is rounded to xBC's dtype (as `kernels/common/conv.py` stores it) before the recurrence, which runs in fp32.

The eager step launches about 30 kernels a layer between the two projections (the split's casts,
softplus, the masking, the conv, A, `ssd_step`'s broadcasts and einsum, the D skip, the gated norm,
and the copies of the new states into the engine's buffers); this is two. The PyTorch reference is
the mixer's own step (`Mamba2.forward` on `kernels="torch"`, with `attnlab.models.ops.mamba2.ssd_step`).
Under TRITON_INTERPRET=1 the same kernels run on CPU tensors (the tests use that in CI).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _conv_silu(row, state, weight, bias, c, c_ok, keep, stride_wc, stride_wk,
               K: tl.constexpr, KP: tl.constexpr, HAS_KEEP: tl.constexpr):
    """The convolution's output for channels `c` of one batch row, in fp32 after rounding to xBC's
    dtype, and the new input (0 at padding). `row` and `state` point at this batch row."""
    j = tl.arange(0, KP)
    m = c_ok[:, None] & (j < K - 1)[None, :]
    x_new = tl.load(row + c, mask=c_ok, other=0.0)
    if HAS_KEEP:
        x_new = (x_new.to(tl.float32) * keep).to(x_new.dtype)  # exact: keep is 0 or 1
    window = tl.load(state + c[:, None] * (K - 1) + j[None, :], mask=m, other=0.0)
    window = window.to(row.dtype.element_ty).to(tl.float32)  # the state enters in xBC's dtype, as in the reference
    w = tl.load(weight + c[:, None] * stride_wc + j[None, :] * stride_wk, mask=m, other=0.0).to(tl.float32)
    w_last = tl.load(weight + c * stride_wc + (K - 1) * stride_wk, mask=c_ok, other=0.0).to(tl.float32)
    acc = tl.load(bias + c, mask=c_ok, other=0.0).to(tl.float32) + tl.sum(w * window, axis=1) + w_last * x_new.to(tl.float32)
    out = acc * tl.sigmoid(acc)
    return out.to(row.dtype.element_ty).to(tl.float32), x_new


@triton.jit
def _shifted_window(state, c, c_ok, x_new, K: tl.constexpr, KP: tl.constexpr):
    """The window's next contents for channels `c`: its last K - 2 inputs, then x_new (loaded now,
    stored by `_store_window` after a barrier)."""
    j = tl.arange(0, KP)
    later = tl.load(state + c[:, None] * (K - 1) + j[None, :] + 1, mask=c_ok[:, None] & (j < K - 2)[None, :], other=0.0)
    return tl.where((j == K - 2)[None, :], x_new.to(state.dtype.element_ty)[:, None], later)


@triton.jit
def _store_window(state, c, c_ok, window, K: tl.constexpr, KP: tl.constexpr):
    j = tl.arange(0, KP)
    tl.store(state + c[:, None] * (K - 1) + j[None, :], window, mask=c_ok[:, None] & (j < K - 1)[None, :])


@triton.jit
def _softplus(x):
    """F.softplus (threshold 20): log1p(exp(x)), with log1p accurate for small arguments."""
    t = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + t
    log1p = tl.where(u == 1.0, t, tl.log(u) * (t / (u - 1.0)))
    return tl.where(x > 20.0, x, log1p)


@triton.jit
def _step_kernel(xbc, z, dt_raw, keep_ptr, conv_weight, conv_bias, dt_bias, A_log, D, conv_state, ssm_state, gated,
                 stride_xbc, stride_z, stride_dt, stride_keep, stride_wc, stride_wk, P, N, INNER, CONV_DIM,
                 H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                 BP: tl.constexpr, BN: tl.constexpr, HAS_KEEP: tl.constexpr):
    i_p, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    i_g = i_h // (H // G)
    o_p = i_p * BP + tl.arange(0, BP)
    o_n = tl.arange(0, BN)
    m_p, m_n = o_p < P, o_n < N

    keep = 1.0
    if HAS_KEEP:
        keep = (tl.load(keep_ptr + i_b * stride_keep) != 0).to(tl.float32)
    row = xbc + i_b * stride_xbc
    window = conv_state + i_b.to(tl.int64) * CONV_DIM * (K - 1)
    c_x = i_h * P + o_p
    x, x_new = _conv_silu(row, window, conv_weight, conv_bias, c_x, m_p, keep, stride_wc, stride_wk, K, KP, HAS_KEEP)
    b, _ = _conv_silu(row, window, conv_weight, conv_bias, INNER + i_g * N + o_n, m_n, keep, stride_wc, stride_wk,
                      K, KP, HAS_KEEP)
    c, _ = _conv_silu(row, window, conv_weight, conv_bias, INNER + (G + i_g) * N + o_n, m_n, keep, stride_wc, stride_wk,
                      K, KP, HAS_KEEP)
    x_window = _shifted_window(window, c_x, m_p, x_new, K, KP)

    dt = _softplus(tl.load(dt_raw + i_b * stride_dt + i_h).to(tl.float32) + tl.load(dt_bias + i_h).to(tl.float32))
    if HAS_KEEP:
        dt = dt * keep
    decay = tl.exp(dt * -tl.exp(tl.load(A_log + i_h).to(tl.float32)))

    p_s = ssm_state + i_bh.to(tl.int64) * P * N + o_p[:, None] * N + o_n[None, :]
    m_s = m_p[:, None] & m_n[None, :]
    s = tl.load(p_s, mask=m_s, other=0.0)
    gate = tl.load(z + i_b * stride_z + c_x, mask=m_p, other=0.0).to(tl.float32)
    # every load of what is written in place is done (by every thread of the program) before any store
    tl.debug_barrier()
    _store_window(window, c_x, m_p, x_window, K, KP)
    s = s * decay + (dt * x)[:, None] * b[None, :]
    tl.store(p_s, s, mask=m_s)
    y = tl.sum(s * c[None, :], axis=1) + x * tl.load(D + i_h).to(tl.float32)
    tl.store(gated + i_b * INNER + c_x, y * (gate * tl.sigmoid(gate)), mask=m_p)


@triton.jit
def _norm_kernel(gated, norm_weight, out, xbc, keep_ptr, conv_state, stride_xbc, stride_keep, eps, N, INNER, CONV_DIM,
                 G: tl.constexpr, GROUP: tl.constexpr, BLOCK: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                 BN: tl.constexpr, HAS_KEEP: tl.constexpr):
    i_b, i_g = tl.program_id(0), tl.program_id(1)
    first = i_g * GROUP
    src = gated + i_b * INNER + first
    o = tl.arange(0, BLOCK)
    squares = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, GROUP, BLOCK):
        h = tl.load(src + start + o, mask=start + o < GROUP, other=0.0)
        squares += h * h
    rstd = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / GROUP + eps)
    dst = out + i_b * INNER + first
    for start in range(0, GROUP, BLOCK):
        m = start + o < GROUP
        h = tl.load(src + start + o, mask=m, other=0.0)
        w = tl.load(norm_weight + first + start + o, mask=m, other=0.0).to(tl.float32)
        tl.store(dst + start + o, (h * rstd * w).to(out.dtype.element_ty), mask=m)

    # B and C of group i_g: every head has read their window (the previous kernel): shift it now
    row = xbc + i_b * stride_xbc
    window = conv_state + i_b.to(tl.int64) * CONV_DIM * (K - 1)
    o_n = tl.arange(0, BN)
    m_n = o_n < N
    c_b = INNER + i_g * N + o_n
    c_c = INNER + (G + i_g) * N + o_n
    b_new = tl.load(row + c_b, mask=m_n, other=0.0)
    c_new = tl.load(row + c_c, mask=m_n, other=0.0)
    if HAS_KEEP:
        keep = (tl.load(keep_ptr + i_b * stride_keep) != 0).to(tl.float32)
        b_new = (b_new.to(tl.float32) * keep).to(b_new.dtype)
        c_new = (c_new.to(tl.float32) * keep).to(c_new.dtype)
    b_window = _shifted_window(window, c_b, m_n, b_new, K, KP)
    c_window = _shifted_window(window, c_c, m_n, c_new, K, KP)
    tl.debug_barrier()
    _store_window(window, c_b, m_n, b_window, K, KP)
    _store_window(window, c_c, m_n, c_window, K, KP)


def _rows(t: torch.Tensor, name: str, shape: tuple[int, int]) -> int:
    """The batch stride of a [B, D] tensor with unit channel stride (a view of a wider row is fine)."""
    if tuple(t.shape) != shape or t.stride(1) != 1:
        raise ValueError(f"{name} must be {list(shape)} with unit channel stride, got shape {tuple(t.shape)} strides {t.stride()}")
    return t.stride(0)


def mamba2_step_(
    xBC: torch.Tensor, z: torch.Tensor, dt: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
    conv_weight: torch.Tensor, conv_bias: torch.Tensor, dt_bias: torch.Tensor, A_log: torch.Tensor, D: torch.Tensor,
    norm_weight: torch.Tensor, group_size: int, eps: float, n_groups: int, keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """One Mamba-2 decoding step from the projected row, before the output projection.

    xBC [B, conv_dim], z [B, inner], dt [B, H] (raw, before dt_bias and softplus): the input
    projection's outputs; conv_state [B, conv_dim, K-1] (xBC's dtype or any other), contiguous;
    ssm_state fp32 [B, H, P, N], contiguous; both advanced in place. conv_weight [conv_dim, K]
    (any strides), conv_bias [conv_dim]; dt_bias, A_log, D [H]; norm_weight [inner], normalised over
    groups of `group_size` channels (inner = group_size * n_groups); keep [B] (nonzero for a token,
    0 for padding; any dtype and stride) or None. Returns rmsnorm(y * silu(z)) * norm_weight
    [B, inner] in z's dtype."""
    batch, heads, head_dim, state_size = ssm_state.shape
    conv_dim, width = conv_weight.shape
    inner = heads * head_dim
    if conv_dim != inner + 2 * n_groups * state_size or heads % n_groups or inner != group_size * n_groups:
        raise ValueError(f"mamba2_step_: inconsistent sizes: conv_dim {conv_dim}, heads {heads}, head_dim {head_dim}, "
                         f"state_size {state_size}, n_groups {n_groups}, group_size {group_size}")
    if ssm_state.dtype != torch.float32 or not ssm_state.is_contiguous():
        raise ValueError("mamba2_step_: ssm_state must be a contiguous fp32 tensor")
    if tuple(conv_state.shape) != (batch, conv_dim, width - 1) or not conv_state.is_contiguous():
        raise ValueError(f"mamba2_step_: conv_state must be a contiguous {[batch, conv_dim, width - 1]} tensor, "
                         f"got {tuple(conv_state.shape)}")
    stride_xbc = _rows(xBC, "xBC", (batch, conv_dim))
    stride_z = _rows(z, "z", (batch, inner))
    stride_dt = _rows(dt, "dt", (batch, heads))
    if keep is not None and tuple(keep.shape) != (batch,):
        raise ValueError(f"mamba2_step_: keep must be [{batch}], got {tuple(keep.shape)}")
    gated = torch.empty(batch, inner, dtype=torch.float32, device=xBC.device)
    out = torch.empty(batch, inner, dtype=z.dtype, device=xBC.device)
    block_n = triton.next_power_of_2(state_size)
    block_p = min(triton.next_power_of_2(head_dim), 32, max(1, 2048 // block_n))
    block_k = max(2, triton.next_power_of_2(width - 1))
    has_keep = keep is not None
    keep_arg = keep if has_keep else dt
    stride_keep = keep.stride(0) if has_keep else 0
    _step_kernel[(triton.cdiv(head_dim, block_p), batch * heads)](
        xBC, z, dt, keep_arg, conv_weight, conv_bias, dt_bias, A_log, D, conv_state, ssm_state, gated,
        stride_xbc, stride_z, stride_dt, stride_keep, conv_weight.stride(0), conv_weight.stride(1),
        head_dim, state_size, inner, conv_dim,
        H=heads, G=n_groups, K=width, KP=block_k, BP=block_p, BN=block_n, HAS_KEEP=has_keep, num_warps=4,
    )
    _norm_kernel[(batch, n_groups)](
        gated, norm_weight, out, xBC, keep_arg, conv_state, stride_xbc, stride_keep, eps, state_size, inner, conv_dim,
        G=n_groups, GROUP=group_size, BLOCK=min(1024, triton.next_power_of_2(group_size)), K=width, KP=block_k,
        BN=block_n, HAS_KEEP=has_keep, num_warps=4,
    )
    return out
