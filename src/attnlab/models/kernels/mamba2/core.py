"""Mamba-2 on CUDA: `ssd` (the one entry of Mamba-2's parallel form, which chooses between the kernels and the
PyTorch reference) runs its state-space recurrence (SSD) on attnlab's chunked kernels (`kernels/mamba2/ssd.py`); `chunk_ssd_gla` computes the same through fla's chunked GLA kernels (the path
those kernels replaced, 2.1-3.0x slower on an H100, kept as a second implementation to compare
against); the gated norm and the output projection run on fla's fused norm kernel.

The SSD is a GLA whose forget gate is one scalar per head and step, shared by every state channel:
per head h, with the group g = h // (heads / groups) that h reads B and C from,

    q = C[g],  k = B[g],  v = x * dt,  log forget gate = dt * A_h on each of the N channels,  scale 1

and attnlab's state [B, H, P, N] is fla's [B, H, K=N, V=P] transposed. `ssd_as_gla` and
`state_from_gla` write the mapping once; `_ChunkSSD` runs it through a GLA backend (fla's
`chunk_gla_fwd` / `chunk_gla_bwd` on CUDA) and keeps for the backward only what the layer already
holds: x and B, C (views of the convolution's output, in the compute dtype) and dt (fp32, one per
head and step). The expanded q, k, the product v = x * dt, the fp32 log gate [B, T, H, N] and the
kernel's intra-chunk scores are rebuilt in the backward; the D skip y + x * D is added inside, and
the backward's elementwise part is one Triton kernel (`kernels/mamba2/grads.py`), so no fp32
[B, T, H, P] tensor outlives the call. The tests run the same function on CPU with the PyTorch GLA
reference as backend (`ops.gla.ReferenceGLA`), which checks the mapping and its gradients in CI.

The gated norm rmsnorm(y * silu(z)) per group and the output projection run on fla's port of
mamba_ssm's gated norm kernels (`grouped_gated_rms_norm`, `gated_norm_linear`).
"""

from __future__ import annotations

import torch

import attnlab.models.kernels as dispatch  # use_triton looked up when called (tests replace it there)
from attnlab.models.kernels import triton_installed, use_fla
from attnlab.models.ops.mamba2 import ssd_skip_grads, ssd_with_skip
from attnlab.models.kernels.eager import compiling, outside_compile


def ssd_as_gla(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    initial_state: torch.Tensor | None = None,
):
    """The GLA inputs that compute the SSD: (q, k, v, g, h0), contiguous, in fla's layout.

    x [b, T, H, P]; dt [b, T, H] fp32; A [H]; B, C [b, T, G, N]; initial_state [b, H, P, N] or None.
    q, k [b, T, H, N] and v [b, T, H, P] in x's dtype; g [b, T, H, N] fp32; h0 [b, H, N, P] fp32."""
    batch, seq_len, heads, _ = x.shape
    state_size = B.shape[-1]

    def per_head(bc: torch.Tensor) -> torch.Tensor:  # [b, T, G, N] -> [b, T, H, N], group g serving heads g*H/G..
        groups = bc.shape[2]
        bc = bc[:, :, :, None].expand(batch, seq_len, groups, heads // groups, state_size)
        return bc.reshape(batch, seq_len, heads, state_size).to(x.dtype).contiguous()

    dt = dt.float()
    v = torch.mul(x, dt[..., None], out=torch.empty(x.shape, dtype=x.dtype, device=x.device))  # one pass, in fp32
    g = (dt * A.float())[..., None].expand(batch, seq_len, heads, state_size).contiguous()
    h0 = None if initial_state is None else initial_state.float().transpose(-1, -2).contiguous()
    return per_head(C), per_head(B), v, g, h0


def state_from_gla(state: torch.Tensor | None) -> torch.Tensor | None:
    """fla's [b, H, N, P] state (or its gradient) as attnlab's [b, H, P, N]."""
    return None if state is None else state.transpose(-1, -2)


class FlaGLA:
    """fla's chunked GLA kernels (fla.ops.gla.chunk), with fla's own chunk size. The backward
    recomputes the intra-chunk scores (fp32 [B, T, H, chunk], as large as the layer's input) from
    q, k and the gate rather than keeping them, as it recomputes the chunk states."""

    @staticmethod
    def forward(q, k, v, g, h0, output_final_state: bool):
        import triton
        from fla.ops.gla.chunk import chunk_gla_fwd

        chunk_size = min(64, max(16, triton.next_power_of_2(q.shape[1])))  # as fla's chunk_gla
        _, _, _, final_state, o = chunk_gla_fwd(q=q, k=k, v=v, g=g, g_cumsum=None, scale=1.0, initial_state=h0,
                                                output_final_state=output_final_state, chunk_size=chunk_size)
        return o, final_state, chunk_size

    @staticmethod
    def backward(q, k, v, g, h0, chunk_size, do, dht):
        from fla.ops.gla.chunk import chunk_gla_bwd, chunk_gla_fwd_intra_gk
        from fla.ops.utils.constant import RCP_LN2
        from fla.ops.utils.cumsum import chunk_local_cumsum

        g_cumsum = chunk_local_cumsum(g, chunk_size, scale=RCP_LN2)  # as chunk_gla_fwd: log2 of the decays
        scores = chunk_gla_fwd_intra_gk(q=q, k=k, g=g_cumsum, scale=1.0, chunk_size=chunk_size)
        return chunk_gla_bwd(q=q, k=k, v=v, g=None, g_cumsum=g_cumsum, scale=1.0, initial_state=h0, h=None, A=scores,
                             do=do, dht=dht, chunk_size=chunk_size)


class _ChunkSSD(torch.autograd.Function):
    """y = SSD(x, dt, A, B, C) + x * D in x's dtype, and the final state (fp32) when asked for."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, D, initial_state, output_final_state, backend):
        q, k, v, g, h0 = ssd_as_gla(x, dt, A, B, C, initial_state)
        o, final_state, saved = backend.forward(q, k, v, g, h0, output_final_state)
        del q, k, v, g
        y = o if D is None else o.addcmul_(x, D.float()[:, None])  # in fp32, rounded once to o's dtype
        ctx.save_for_backward(x, dt, A, B, C, D, initial_state)
        ctx.saved, ctx.backend = saved, backend
        return y, (None if final_state is None else state_from_gla(final_state).contiguous())

    @staticmethod
    def backward(ctx, dy, dstate):
        x, dt, A, B, C, D, initial_state = ctx.saved_tensors
        batch, seq_len, heads, _ = x.shape
        groups, state_size = B.shape[2], B.shape[3]
        q, k, v, g, h0 = ssd_as_gla(x, dt, A, B, C, initial_state)
        dht = None if dstate is None else dstate.float().transpose(-1, -2).contiguous()
        dq, dk, dv, dg, dh0 = ctx.backend.backward(q, k, v, g, h0, ctx.saved, dy.to(v.dtype).contiguous(), dht)
        del q, k, v, g, h0

        def per_group(d: torch.Tensor, like: torch.Tensor) -> torch.Tensor:  # the heads of a group summed
            d = d.float().view(batch, seq_len, groups, heads // groups, state_size).sum(3)
            return d.to(like.dtype)

        dC, dB = per_group(dq, C), per_group(dk, B)
        if x.is_cuda and triton_installed():
            from attnlab.models.kernels.mamba2.grads import ssd_skip_grads as skip_grads
        else:
            skip_grads = ssd_skip_grads
        dx, ddt, dD = skip_grads(dv, dy, x, dt, D)  # through v = x * dt and y = o + x * D
        da = dg.float().sum(-1)  # [b, T, H]: the log gate dt * A is shared by the N channels
        ddt = ddt + da * A.float()
        dA = (da * dt.float()).sum((0, 1)).to(A.dtype)
        dD = None if D is None else dD.sum((0, 1)).to(D.dtype)
        dh0 = None if initial_state is None else state_from_gla(dh0).to(initial_state.dtype)
        return dx, ddt.to(dt.dtype), dA, dB, dC, dD, dh0, None, None


def chunk_ssd_gla(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None, output_final_state: bool = False, backend=FlaGLA,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The SSD (and the D skip) through a chunked GLA: (y [b, T, H, P] in x's dtype, final state
    [b, H, P, N] fp32 or None). Layouts as `attnlab.models.ops.mamba2`; dt fp32 after softplus,
    0 at padding (no decay, no write)."""
    return _ChunkSSD.apply(x, dt, A, B, C, D, initial_state, output_final_state, backend)


def use_fast_ssd(choice: str, x: torch.Tensor) -> bool:
    """Whether Mamba-2 runs on attnlab's kernels (the SSD, the gated norm, the layer as one node, the decoding step):
    a CUDA tensor, Triton installed, kernels not 'torch' (as `use_triton`; 'fla' insists on Triton). Mamba-2's one
    fast-or-reference decision: `Mamba2.forward` makes it once and passes it down (to `ssd`, the gated norm); `ssd`
    called on its own makes it itself. The convolution keeps its shared dispatch (`kernels.causal_conv1d_fn`)."""
    return dispatch.use_triton(choice, x)


def ssd(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
    chunk_size: int, initial_state: torch.Tensor | None, output_final_state: bool, choice: str = "auto", *,
    fast: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Mamba-2's parallel form with its D skip, y = SSD(x, dt, A, B, C) + x * D, the one entry every caller
    uses: attnlab's chunked SSD kernels where `fast` (the caller's choice: `Mamba2.forward` makes it once per
    forward) or, without it, `use_fast_ssd(choice, x)` says so (`kernels.mamba2.ssd.ssd_triton`, y in x's dtype;
    a chunk size the kernels do not take runs at 64, with a warning), else the PyTorch reference
    `ops.mamba2.ssd_with_skip` (y fp32). Returns (y [b, T, H, P], final state [b, H, P, N] fp32; None on the
    fast path unless asked for). `chunk_ssd_gla` computes the same through fla's GLA kernels."""
    if use_fast_ssd(choice, x) if fast is None else fast:
        from attnlab.models.kernels.mamba2.ssd import ssd_triton

        return ssd_triton(x, dt, A, B, C, D, chunk_size, initial_state, output_final_state)
    return ssd_with_skip(x, dt, A, B, C, D, chunk_size, initial_state)


def grouped_gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float) -> torch.Tensor:
    """rmsnorm(x * silu(z)) over groups of `group_size` channels, times `weight`, in x's dtype, on
    attnlab's gated-norm kernels (`kernels/common/gated_norm.py`): one pass each way, keeping x, z and the
    fp32 inverse norms (one per row and group) for the backward."""
    from attnlab.models.kernels.common.gated_norm import gated_rms_norm

    return gated_rms_norm(x, z, weight, group_size, eps)


class _GatedNormLinear(torch.autograd.Function):
    """out_proj(rmsnorm(x * silu(z)) per group * norm_weight) on attnlab's gated-norm kernels, keeping
    x, z and the fp32 inverse norms but not the normed tensor (as large as x) that the projection
    would keep: the backward's norm kernel recomputes it. The matmuls follow autocast as
    nn.Linear does (custom_fwd / custom_bwd)."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x, z, norm_weight, weight, group_size, eps):
        from attnlab.models.kernels.common.gated_norm import gated_rms_norm_fwd

        shape = x.shape
        normed, rstd = gated_rms_norm_fwd(x, z, norm_weight, group_size, eps)
        out = torch.nn.functional.linear(normed, weight)
        ctx.save_for_backward(x, z, norm_weight, weight, rstd)
        ctx.shape, ctx.group_size = shape, group_size
        return out.view(*shape[:-1], out.shape[-1])

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, dout):
        x, z, norm_weight, weight, rstd = ctx.saved_tensors
        dx, dz, dnorm_weight, dweight = _norm_linear_backward(dout, x, z, norm_weight, weight, rstd, ctx.group_size)
        return dx.view(ctx.shape), dz.view(ctx.shape), dnorm_weight, dweight, None, None


def _norm_linear_backward(dout, x, z, norm_weight, weight, rstd, group_size, dz_out=None):
    """(dx, dz, d norm_weight, d weight) of linear(gated_rms_norm(x, z) * norm_weight, weight): the normed
    tensor is recomputed by the norm's backward kernel, for the projection's weight gradient. dz_out: where
    to write dz (see `gated_rms_norm_bwd`)."""
    from attnlab.models.kernels.common.gated_norm import gated_rms_norm_bwd

    dout = dout.reshape(-1, dout.shape[-1])
    dnormed = torch.nn.functional.linear(dout, weight.t())
    dx, dz, dnorm_weight, normed = gated_rms_norm_bwd(dnormed, x, z, norm_weight, rstd, group_size, dz_out=dz_out, want_y=True)
    dweight = torch.matmul(dout.t(), normed.to(dout.dtype)).to(weight.dtype)
    return dx, dz, dnorm_weight.to(norm_weight.dtype), dweight


@outside_compile
def gated_norm_linear(x: torch.Tensor, z: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
                      group_size: int, eps: float) -> torch.Tensor:
    """linear(rmsnorm(x * silu(z)) over groups of `group_size`, times `norm_weight`; `weight`) on attnlab's
    gated-norm kernels, without keeping the normed tensor for the backward (see `_GatedNormLinear`)."""
    return _GatedNormLinear.apply(x, z, norm_weight, weight, group_size, eps)


class _Mamba2Core(torch.autograd.Function):
    """Everything of a Mamba-2 layer between its two projections, and the output projection:

        z, xBC, dt = split(u);  dt = softplus(dt + dt_bias);  x, B, C = split(silu(conv1d(xBC)))
        y = SSD(x, dt, -exp(A_log), B, C) + D * x;  out = out_proj(rmsnorm(y * silu(z)) * norm_weight)

    on attnlab's kernels (`conv.py`, `ssd.py`, `gated_norm.py`) as one autograd node, so that the
    backward writes the gradients of z, xBC and dt into one buffer shaped as u, and those of x, B and C
    into one shaped as the convolution's output: no concatenation of the pieces (autograd's backward of
    a split), no copy of z. It keeps u, the convolution's output, y, the norm's fp32 inverse norms and dt
    (fp32, one per head and step), not the normed tensor. The matmul follows autocast as nn.Linear does."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, u, conv_weight, conv_bias, dt_bias, A_log, D, norm_weight, out_weight, dims, chunk, eps):
        from attnlab.models.kernels.common.conv import conv_forward
        from attnlab.models.kernels.common.gated_norm import gated_rms_norm_fwd
        from attnlab.models.kernels.mamba2.ssd import ssd_forward

        inner, conv_dim, heads, group_size = dims[0], dims[1], dims[2], dims[6]
        batch, seq_len, _ = u.shape
        z, xBC, dt = u.split([inner, conv_dim, heads], dim=-1)
        dt = torch.nn.functional.softplus(dt.float() + dt_bias.float())  # [B, T, H] fp32
        conv_out, _ = conv_forward(xBC, conv_weight, conv_bias, None, True, False, want_final=False)
        xs, B, C = _conv_pieces(conv_out, dims)
        A = -torch.exp(A_log.float())
        y, _, _ = ssd_forward(xs, dt, A, B, C, D, chunk, None)
        y = y.view(batch, seq_len, inner)
        normed, rstd = gated_rms_norm_fwd(y, z, norm_weight, group_size, eps)
        out = torch.nn.functional.linear(normed, out_weight)
        ctx.save_for_backward(u, conv_weight, conv_bias, dt_bias, A_log, D, norm_weight, out_weight, conv_out, y, rstd, dt)
        ctx.dims, ctx.chunk = dims, chunk
        return out.view(batch, seq_len, out.shape[-1])

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, dout):
        from attnlab.models.kernels.common.conv import conv_backward
        from attnlab.models.kernels.mamba2.ssd import ssd_backward

        u, conv_weight, conv_bias, dt_bias, A_log, D, norm_weight, out_weight, conv_out, y, rstd, dt = ctx.saved_tensors
        inner, conv_dim, heads, group_size = ctx.dims[0], ctx.dims[1], ctx.dims[2], ctx.dims[6]
        # Eagerly the kernels write the gradients of z, xBC, dt (and of x, B, C) into views of one buffer each; under
        # torch.compile, which traces the kernels, each gets a tensor of its own and torch.cat joins them: Inductor's
        # tracing of a kernel that writes through a view into a wider buffer is what an illegal memory access of the
        # compiled step was traced to.
        apart = compiling()
        du = None if apart else torch.empty(u.shape, dtype=u.dtype, device=u.device)
        du_z, du_xBC, du_dt = (None, None, None) if apart else du.split([inner, conv_dim, heads], dim=-1)
        rows = u.shape[0] * u.shape[1]
        dy, dz, dnorm_weight, dout_weight = _norm_linear_backward(dout, y, u[..., :inner], norm_weight, out_weight, rstd,
                                                                  group_size, dz_out=None if apart else du_z.view(rows, inner))

        A = -torch.exp(A_log.float())
        xs, B, C = _conv_pieces(conv_out, ctx.dims)
        dconv = None if apart else torch.empty(conv_out.shape, dtype=conv_out.dtype, device=conv_out.device)
        dxs, dB, dC = (None, None, None) if apart else _conv_pieces(dconv, ctx.dims)
        saved = (xs, dt, A, B, C, D, None)
        dxs, ddt, dA, dB, dC, dD, _ = ssd_backward(saved, ctx.chunk, dy.view(xs.shape), None, dx_out=dxs, dB_out=dB, dC_out=dC)
        del dy
        if apart:
            batch, seq_len = u.shape[:2]
            dconv = torch.cat([dxs.reshape(batch, seq_len, -1), dB.reshape(batch, seq_len, -1), dC.reshape(batch, seq_len, -1)], -1)
        dxBC, dconv_weight, dconv_bias, _ = conv_backward(u[..., inner:inner + conv_dim], conv_weight, conv_bias, None, True,
                                                          dconv, None, False, dx_out=du_xBC)
        del dconv
        # through dt = softplus(raw + dt_bias): d raw = ddt * sigmoid(raw + dt_bias)
        draw = ddt * torch.sigmoid(u[..., inner + conv_dim:].float() + dt_bias.float())
        if apart:
            du = torch.cat([dz.view(u.shape[0], u.shape[1], inner), dxBC, draw.to(u.dtype)], -1)
        else:
            du_dt.copy_(draw)
        ddt_bias = draw.sum((0, 1)).to(dt_bias.dtype)
        dA_log = (dA.float() * A).to(A_log.dtype)  # A = -exp(A_log): dA / dA_log = A
        return du, dconv_weight, dconv_bias, ddt_bias, dA_log, dD, dnorm_weight, dout_weight, None, None, None


def _conv_pieces(conv_out: torch.Tensor, dims) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [B, T, H, P], B and C [B, T, G, N]: views of the convolution's output [B, T, conv_dim] (or of its gradient)."""
    inner, _, heads, head_dim, groups, state_size, _ = dims
    batch, seq_len, _ = conv_out.shape
    xs, B, C = conv_out.split([inner, groups * state_size, groups * state_size], dim=-1)
    return (xs.view(batch, seq_len, heads, head_dim), B.view(batch, seq_len, groups, state_size),
            C.view(batch, seq_len, groups, state_size))


@outside_compile(traced=True)
def mamba2_core(u: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None, dt_bias: torch.Tensor,
                A_log: torch.Tensor, D: torch.Tensor, norm_weight: torch.Tensor, out_weight: torch.Tensor,
                dims: tuple[int, int, int, int, int, int, int], chunk: int, eps: float) -> torch.Tensor:
    """A Mamba-2 layer from its input projection's output u [B, T, inner + conv_dim + heads] to its output
    projection's (see `_Mamba2Core`). dims: (inner, conv_dim, heads, head_dim, groups, state_size, norm
    group size); conv_weight [conv_dim, K]; chunk: the SSD kernels' chunk (a power of two from 16 to 128).
    No padding mask, cache or initial state: the layer takes its other path for those."""
    return _Mamba2Core.apply(u, conv_weight, conv_bias, dt_bias, A_log, D, norm_weight, out_weight, tuple(dims), chunk, float(eps))
