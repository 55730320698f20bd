"""GLA's chunked form on fla's kernels (`fla.ops.gla.chunk`), with the log forget gate computed inside from its
logits. The PyTorch reference is `attnlab.models.ops.gla.chunk_gla`; `attnlab.models.mixers.gla` chooses between them.

The forward and the backward are torch custom ops (`attnlab::gla_chunk_fwd`, `attnlab::gla_chunk_bwd`), each with a
fake form that gives its outputs' shapes: torch.compile can keep them in a graph as opaque calls (fla's own entry points
carry `torch.compiler.disable`, a graph break). The entry point `gla_chunk_gated` stays a break in compiled blocks until
a GLA block compiled whole is verified through the trainer on the GPU (benchmarks/NOTES.md)."""

from __future__ import annotations

import torch

from attnlab.models.kernels.eager import outside_compile


def _log_forget_gate(logits: torch.Tensor, normalizer: float, keep: torch.Tensor | None) -> torch.Tensor:
    # fla's kernels read [B, T, H, K] in that order: an input a compiled graph hands over in another layout is copied
    # (the gate takes its layout from the logits)
    gate = torch.nn.functional.logsigmoid(logits.float().contiguous()).div_(normalizer)
    return gate if keep is None else gate.mul_(keep)


def _chunk_size(seq_len: int) -> int:
    """fla's chunk_gla's choice: the next power of two of the length, within 16..64."""
    return min(64, max(16, 1 << max(0, seq_len - 1).bit_length()))


_NONE = (0,)  # the shape of an optional output that is absent (a custom op returns tensors only)


@torch.library.custom_op("attnlab::gla_chunk_fwd", mutates_args=())
def _chunk_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, logits: torch.Tensor, normalizer: float,
               keep: torch.Tensor | None, scale: float, initial_state: torch.Tensor | None,
               output_final_state: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o [B, T, H, V] in v's dtype, the intra-chunk scores A [B, T, H, chunk] in fp32, the final state [B, H, K, V]
    in fp32 or an empty tensor where it is not asked for)."""
    from fla.ops.gla.chunk import chunk_gla_fwd

    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    initial_state = None if initial_state is None else initial_state.contiguous()
    gate = _log_forget_gate(logits, normalizer, keep)
    _, A, _, final_state, o = chunk_gla_fwd(q=q, k=k, v=v, g=gate, g_cumsum=None, scale=scale, initial_state=initial_state,
                                            output_final_state=output_final_state, chunk_size=_chunk_size(q.shape[1]))
    if final_state is None:
        final_state = q.new_empty(_NONE, dtype=torch.float32)
    return o.contiguous(), A.contiguous(), final_state.contiguous()


@_chunk_fwd.register_fake
def _(q, k, v, logits, normalizer, keep, scale, initial_state, output_final_state):
    batch, seq_len, heads, key_dim = q.shape
    o = v.new_empty(v.shape)
    A = q.new_empty((batch, seq_len, heads, _chunk_size(seq_len)), dtype=torch.float32)
    state_shape = (batch, heads, key_dim, v.shape[-1]) if output_final_state else _NONE
    return o, A, q.new_empty(state_shape, dtype=torch.float32)


@torch.library.custom_op("attnlab::gla_chunk_bwd", mutates_args=())
def _chunk_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, logits: torch.Tensor, normalizer: float,
               keep: torch.Tensor | None, scale: float, initial_state: torch.Tensor | None, A: torch.Tensor,
               do: torch.Tensor, dht: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                                   torch.Tensor]:
    """(dq, dk, dv, dlogits, dh0: an empty tensor without an initial state), each in its input's dtype."""
    from fla.ops.gla.chunk import chunk_gla_bwd

    q, k, v, logits = q.contiguous(), k.contiguous(), v.contiguous(), logits.contiguous()
    initial_state = None if initial_state is None else initial_state.contiguous()
    dht = None if dht is None else dht.contiguous()
    gate = _log_forget_gate(logits, normalizer, keep)
    dq, dk, dv, dg, dh0 = chunk_gla_bwd(q=q, k=k, v=v, g=gate, g_cumsum=None, scale=scale, initial_state=initial_state,
                                        h=None, A=A, do=do.contiguous(), dht=dht, chunk_size=_chunk_size(q.shape[1]))
    del gate
    # d logsigmoid(x) / dx = sigmoid(-x)
    dlogits = torch.sigmoid(-logits.float()).mul_(dg).div_(normalizer)  # not in place: fp32 logits are the input itself
    if keep is not None:
        dlogits.mul_(keep)
    if dh0 is None:
        dh0 = q.new_empty(_NONE, dtype=torch.float32)
    return (dq.to(q.dtype).contiguous(), dk.to(k.dtype).contiguous(), dv.to(v.dtype).contiguous(),
            dlogits.to(logits.dtype).contiguous(), dh0.contiguous())


@_chunk_bwd.register_fake
def _(q, k, v, logits, normalizer, keep, scale, initial_state, A, do, dht):
    dh0 = _NONE if initial_state is None else initial_state.shape
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), logits.new_empty(logits.shape),
            q.new_empty(dh0, dtype=torch.float32))


def _setup_context(ctx, inputs, output):
    q, k, v, logits, normalizer, keep, scale, initial_state, _ = inputs
    ctx.save_for_backward(q, k, v, logits, keep, initial_state, output[1])
    ctx.normalizer, ctx.scale = normalizer, scale


def _backward(ctx, do, dA, dht):
    """Keeps the gate's logits (bf16 under autocast) for the backward and recomputes the fp32 gate there, where applying
    the gate outside keeps two fp32 copies per layer (the logsigmoid's input and the kernel's cumulative sum). The
    values and gradients are those of the fp32 gate: the logits are the only input and are kept exactly."""
    q, k, v, logits, keep, initial_state, A = ctx.saved_tensors
    if dht is not None and dht.numel() == 0:
        dht = None
    dq, dk, dv, dlogits, dh0 = _chunk_bwd(q, k, v, logits, ctx.normalizer, keep, ctx.scale, initial_state, A, do, dht)
    return dq, dk, dv, dlogits, None, None, None, (dh0 if initial_state is not None else None), None


_chunk_fwd.register_autograd(_backward, setup_context=_setup_context)


@outside_compile
def gla_chunk_gated(q, k, v, logits, normalizer: float, scale: float, initial_state, output_final_state: bool, keep=None):
    """fla's chunked GLA on the log forget gate logsigmoid(`logits`) / `normalizer` (times `keep`, 0 at padding),
    computed in fp32 inside and recomputed in the backward. Returns (o, the final state or None)."""
    o, _, final_state = _chunk_fwd(q, k, v, logits, float(normalizer), keep, float(scale), initial_state,
                                   bool(output_final_state))
    return o, (final_state if output_final_state else None)
