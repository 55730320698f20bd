"""Gated linear attention (Yang et al., 2023), as `fla.layers.gla.GatedLinearAttention`
in its default configuration (no short conv, no feature map, swish output gate with a
per-head RMSNorm). Parameter names match fla so checkpoints map one to one."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from attnlab.models import kernels
from attnlab.models.kernels.gla.chunk import gla_chunk_gated
from attnlab.models.kernels.gla.fused_recurrent import gla_recurrent
from attnlab.models.mixers.registry import Mixer, register_mixer
from attnlab.models.modules import FusedProjections, GatedRMSNorm
from attnlab.models.ops.gla import chunk_gla, fused_recurrent_gla_step


@register_mixer("gla")
class GatedLinearAttention(FusedProjections, Mixer):
    fixed_size_state = True  # decodes over one [B, H, K, V] state: CUDA-graph decoding applies
    train_graph_safe = True
    default_options = {
        "expand_k": 0.5,
        "expand_v": 1.0,
        "gate_low_rank_dim": 16,
        "gate_logit_normalizer": 16,
        "chunk_size": 64,
    }

    def __init__(self, config, layer_idx: int):
        super().__init__()
        options = self.options_of(config)
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.key_dim = int(config.hidden_size * options["expand_k"])
        self.value_dim = int(config.hidden_size * options["expand_v"])
        if self.key_dim % self.num_heads or self.value_dim % self.num_heads:
            raise ValueError(
                f"key_dim ({self.key_dim}) and value_dim ({self.value_dim}) must be divisible by num_heads "
                f"({self.num_heads}); adjust expand_k / expand_v"
            )
        self.head_k_dim = self.key_dim // self.num_heads
        self.head_v_dim = self.value_dim // self.num_heads
        self.scale = self.head_k_dim ** -0.5
        self.gate_logit_normalizer = options["gate_logit_normalizer"]
        self.chunk_size = options["chunk_size"]

        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.key_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.key_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.value_dim, bias=False)
        self.g_proj = nn.Linear(hidden, self.value_dim, bias=False)  # output gate
        self.gk_proj = nn.Sequential(  # forget gate, low rank
            nn.Linear(hidden, options["gate_low_rank_dim"], bias=False),
            nn.Linear(options["gate_low_rank_dim"], self.key_dim, bias=True),
        )
        self.o_proj = nn.Linear(self.value_dim, hidden, bias=False)
        self.g_norm_swish_gate = GatedRMSNorm(self.head_v_dim, eps=config.norm_eps, kernels=config.kernels)
        self.kernels = config.kernels

    def projection_group(self) -> list[nn.Module]:
        return [self.q_proj, self.k_proj, self.v_proj, self.g_proj, self.gk_proj[0]]

    def fusion_weights(self) -> list[torch.Tensor] | None:
        # While decoding, the low-rank forget gate is one full [key_dim, hidden] product (its two
        # factors multiplied once per `generate` call), as wide as q and k: q|k|gate is one batched
        # product and v|g another, and the gate's bias is added in the step kernel.
        plain = super().fusion_weights()
        if plain is None or type(self.gk_proj[1]) is not nn.Linear:
            return None
        with torch.no_grad():
            gate = (self.gk_proj[1].weight.float() @ self.gk_proj[0].weight.float()).to(self.gk_proj[0].weight.dtype)
        return [self.q_proj.weight, self.k_proj.weight, gate, self.v_proj.weight, self.g_proj.weight]

    def forward(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: dict | None = None,
        use_cache: bool = False,
    ) -> tuple[torch.Tensor, dict | None]:
        batch, seq_len, _ = x.shape
        gate_bias = None  # added by the step kernel when the gate's product is fused
        if self.fused_weight is not None:
            q, k, gate_logits, v, g = self.project(x)  # the order of `fusion_weights`
            gate_bias = self.gk_proj[1].bias
        else:
            q, k, v, g, gk = self.project(x)
            gate_logits = self.gk_proj[1](gk)
        q = q.view(batch, seq_len, self.num_heads, self.head_k_dim)
        k = k.view(batch, seq_len, self.num_heads, self.head_k_dim)
        v = v.view(batch, seq_len, self.num_heads, self.head_v_dim)
        gate_logits = gate_logits.view(batch, seq_len, self.num_heads, self.head_k_dim)
        use_fla = kernels.use_fla(self.kernels, x)
        is_token = None
        if attention_mask is not None:
            # Padding must not touch the state: no write (k = v = 0) and no decay (log-gate 0).
            is_token = attention_mask[:, -seq_len:, None, None].to(torch.bool)  # [B, T, 1, 1]
            k, v = k * is_token, v * is_token

        state = cache["recurrent_state"] if cache is not None else None
        if use_fla and seq_len == 1 and self.fused_weight is not None and state is not None:
            # The engine's decode step (its fused projections are on): one kernel for the gate, the
            # recurrence and the output, the state advanced where it lies (the engine owns it), on
            # every path (padded or not, graphed or eager), so that all of them compute alike.
            state = state.contiguous()  # a copy only if it is a view across rows
            from attnlab.models.kernels.gla.step import gla_step_

            keep = None if is_token is None else is_token.reshape(batch).float()
            o = gla_step_(q[:, 0], k[:, 0], v[:, 0], gate_logits[:, 0], state, self.gate_logit_normalizer, self.scale,
                          bias=gate_bias, keep=keep)
            return self.output(o[:, None], g, batch, seq_len), ({"recurrent_state": state} if use_cache else None)
        if gate_bias is not None:
            gate_logits = gate_logits + gate_bias.view(self.num_heads, self.head_k_dim)
        if use_fla and seq_len > 64:
            # fla's chunked kernels, the fp32 log forget gate computed inside (not kept for the backward)
            keep = None if is_token is None else is_token.float()
            o, state = gla_chunk_gated(q, k, v, gate_logits, self.gate_logit_normalizer, self.scale, state,
                                       output_final_state=use_cache, keep=keep)
        else:
            gk = F.logsigmoid(gate_logits.float()) / self.gate_logit_normalizer  # log forget gate, <= 0, in fp32
            if is_token is not None:
                gk = gk * is_token
            if use_fla:  # fused recurrence for decoding and short prefills, as fla's layer
                o, state = gla_recurrent(q, k, v, gk, self.scale, state, output_final_state=use_cache)
            elif seq_len == 1:
                o, state = fused_recurrent_gla_step(q[:, 0], k[:, 0], v[:, 0], gk[:, 0], state, scale=self.scale)
                o = o[:, None]  # [B, 1, H, V]
            else:
                o, state = chunk_gla(q, k, v, gk, chunk_size=self.chunk_size, initial_state=state, scale=self.scale)
        return self.output(o, g, batch, seq_len), ({"recurrent_state": state} if use_cache else None)

    def output(self, o: torch.Tensor, g: torch.Tensor, batch: int, seq_len: int) -> torch.Tensor:
        """o_proj(norm(o) * swish(g)) for the heads' outputs o [B, T, H, V]."""
        o = self.g_norm_swish_gate(o, g.view(batch, seq_len, self.num_heads, self.head_v_dim))
        return self.o_proj(o.reshape(batch, seq_len, self.value_dim))
