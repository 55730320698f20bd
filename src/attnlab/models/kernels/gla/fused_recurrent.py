"""GLA's fused recurrent form on fla's kernel (`fla.ops.gla.fused_recurrent_gla`: decoding and short prefills).
The PyTorch reference is `attnlab.models.ops.gla`; `attnlab.models.mixers.gla` chooses between them."""

from __future__ import annotations

from attnlab.models.kernels.eager import outside_compile


@outside_compile
def gla_recurrent(q, k, v, gk, scale, initial_state, output_final_state: bool):
    """fla's fused recurrent GLA (decoding and short prefills)."""
    from fla.ops.gla import fused_recurrent_gla

    return fused_recurrent_gla(q, k, v, gk=gk, scale=scale, initial_state=initial_state, output_final_state=output_final_state)
