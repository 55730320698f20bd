"""RMSNorm on fla's norm kernels (`fla.modules.norm`): the plain norm, the norm fused with the residual add, and the
norm with a swish output gate. The PyTorch references are `attnlab.models.modules.RMSNorm` and `GatedRMSNorm`,
which choose between them."""

from __future__ import annotations

import torch


def rms_norm(x, weight, eps: float):
    from fla.modules.norm.layernorm import rms_norm as fla_rms_norm

    return fla_rms_norm(x, weight, None, eps=eps)


class _AddRMSNorm(torch.autograd.Function):
    """(residual + x, and its RMSNorm in `out_dtype`) in one pass of fla's norm kernels; the
    backward gets the gradients of x and of the residual from one pass too. Keeps the sum (the
    residual's dtype) and the fp32 inverse norms, as fla's own prenorm path does."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps, out_dtype):
        from fla.modules.norm.layernorm import layer_norm_fwd

        shape = x.shape
        rows = x.reshape(-1, shape[-1]).contiguous()
        res_rows = None if residual is None else residual.reshape(-1, shape[-1]).contiguous()
        y, _, rstd, summed = layer_norm_fwd(rows, weight, None, eps, residual=res_rows, out_dtype=out_dtype, is_rms_norm=True)
        ctx.save_for_backward(summed, weight, rstd)
        ctx.shape, ctx.x_dtype, ctx.has_residual = shape, x.dtype, residual is not None
        if residual is None:
            return y.view(shape)
        return y.view(shape), summed.view(shape)

    @staticmethod
    def backward(ctx, dy, dsummed=None):
        from fla.modules.norm.layernorm import layer_norm_bwd

        summed, weight, rstd = ctx.saved_tensors
        width = ctx.shape[-1]
        dy = torch.zeros(summed.shape, dtype=summed.dtype, device=summed.device) if dy is None else dy.reshape(-1, width).contiguous()
        dres = None if dsummed is None else dsummed.reshape(-1, width).contiguous()
        dx, dw, _, dres_in = layer_norm_bwd(dy, summed, weight, None, None, rstd, dres=dres, has_residual=ctx.has_residual,
                                            is_rms_norm=True, x_dtype=ctx.x_dtype)
        dresidual = dres_in.view(ctx.shape) if ctx.has_residual else None
        return dx.view(ctx.shape), dresidual, dw, None, None


def add_rms_norm(x, residual, weight, eps: float, out_dtype: torch.dtype):
    """RMSNorm of `x` (or of `residual + x`) with its output in `out_dtype`; with a residual,
    returns (normed, residual + x)."""
    return _AddRMSNorm.apply(x, residual, weight, eps, out_dtype)


def rms_norm_swish_gate(x, gate, weight, eps: float):
    from fla.modules.norm.fused_norm_gate import rms_norm_gated

    return rms_norm_gated(x, gate, weight, None, activation="swish", eps=eps)
