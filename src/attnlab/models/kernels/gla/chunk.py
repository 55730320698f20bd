"""GLA's chunked form on fla's kernels (`fla.ops.gla.chunk`), with the log forget gate computed inside from its
logits. The PyTorch reference is `attnlab.models.ops.gla.chunk_gla`; `attnlab.models.mixers.gla` chooses between them."""

from __future__ import annotations

import torch
from attnlab.models.kernels.eager import outside_compile


def _log_forget_gate(logits: torch.Tensor, normalizer: float, keep: torch.Tensor | None) -> torch.Tensor:
    gate = torch.nn.functional.logsigmoid(logits.float()).div_(normalizer)
    return gate if keep is None else gate.mul_(keep)


class _GatedChunkGLA(torch.autograd.Function):
    """fla's chunked GLA with the log forget gate logsigmoid(logits) / normalizer computed in fp32
    inside. It keeps the gate's logits (bf16 under autocast) for the backward and recomputes the
    fp32 gate there, where applying the gate outside keeps two fp32 copies per layer (the
    logsigmoid's input and the kernel's cumulative sum). The values and gradients are those of the
    fp32 gate: the logits are the only input and are kept exactly."""

    @staticmethod
    def forward(ctx, q, k, v, logits, normalizer, keep, scale, initial_state, output_final_state):
        import triton
        from fla.ops.gla.chunk import chunk_gla_fwd

        chunk_size = min(64, max(16, triton.next_power_of_2(q.shape[1])))  # as fla's chunk_gla
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        gate = _log_forget_gate(logits, normalizer, keep)
        _, A, _, final_state, o = chunk_gla_fwd(q=q, k=k, v=v, g=gate, g_cumsum=None, scale=scale, initial_state=initial_state,
                                                output_final_state=output_final_state, chunk_size=chunk_size)
        ctx.save_for_backward(q, k, v, logits, keep, initial_state, A)
        ctx.normalizer, ctx.scale, ctx.chunk_size = normalizer, scale, chunk_size
        return o, final_state

    @staticmethod
    def backward(ctx, do, dht):
        from fla.ops.gla.chunk import chunk_gla_bwd

        q, k, v, logits, keep, initial_state, A = ctx.saved_tensors
        gate = _log_forget_gate(logits, ctx.normalizer, keep)
        dq, dk, dv, dg, dh0 = chunk_gla_bwd(q=q, k=k, v=v, g=gate, g_cumsum=None, scale=ctx.scale, initial_state=initial_state,
                                            h=None, A=A, do=do.contiguous(), dht=dht, chunk_size=ctx.chunk_size)
        del gate
        # d logsigmoid(x) / dx = sigmoid(-x)
        dlogits = torch.sigmoid(logits.float().neg_()).mul_(dg).div_(ctx.normalizer)
        if keep is not None:
            dlogits.mul_(keep)
        return dq.to(q), dk.to(k), dv.to(v), dlogits.to(logits.dtype), None, None, None, dh0, None


@outside_compile
def gla_chunk_gated(q, k, v, logits, normalizer: float, scale, initial_state, output_final_state: bool, keep=None):
    """fla's chunked GLA on the log forget gate logsigmoid(`logits`) / `normalizer` (times `keep`,
    0 at padding), computed in fp32 inside; see `_GatedChunkGLA`."""
    return _GatedChunkGLA.apply(q, k, v, logits, normalizer, keep, scale, initial_state, output_final_state)
