"""Pure functions implementing the token-mixing recurrences."""

from attnlab.models.ops.gla import chunk_gla, fused_recurrent_gla_step, naive_recurrent_gla

__all__ = ["chunk_gla", "fused_recurrent_gla_step", "naive_recurrent_gla"]
