"""Mamba-2 (Dao & Gu, 2024), as `fla.layers.mamba2.Mamba2` / mamba_ssm's `Mamba2Simple`:

    z, xBC, dt = in_proj(x)                       z: gate, xBC: SSM input and B, C; dt: one per head
    x, B, C    = split(silu(conv1d(xBC)))         causal depthwise conv over time
    dt         = softplus(dt + dt_bias);  A = -exp(A_log)
    y          = SSD(x, dt, A, B, C) + D * x       the recurrence of `attnlab.models.ops.mamba2`
    out        = out_proj(rmsnorm(y * silu(z)))   gated RMSNorm, one norm per group

Parameter names match fla so checkpoints map one to one. The cache holds
    conv_state:      [B, conv_dim, conv_kernel - 1]  the last inputs of the convolution
    recurrent_state: [B, num_heads, head_dim, state_size] fp32
Left padding neither writes the state (dt = 0) nor enters the convolution (input zeroed).
On CUDA (kernels not "torch") the parallel form runs on attnlab's Triton kernels: the convolution
(`kernels/common/conv.py`), the SSD (`kernels/mamba2/ssd.py`) and the gated norm with the output projection
(`kernels/common/gated_norm.py`); without a padding mask or a cache (training, scoring) all of it between the
two projections is one autograd node (`kernels.mamba2.core.mamba2_core`) whose backward writes each
projection's gradient pieces into one buffer; a decoding step (one token, a cache, no
gradient) runs between its two projections on two Triton kernels that advance the conv window and the
SSM state in place (`attnlab.models.kernels.mamba2.step`), and elsewhere on `ssd_step`.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from attnlab.models import kernels
from attnlab.models.kernels.mamba2.core import gated_norm_linear, grouped_gated_rms_norm, mamba2_core, ssd, use_fast_ssd
from attnlab.models.mixers.registry import Mixer, register_mixer
from attnlab.models.modules import RMSNorm, slow_start_bias
from attnlab.models.ops.mamba2 import ssd_step


class GroupedGatedRMSNorm(RMSNorm):
    """rmsnorm(x * silu(z)) over groups of `group_size` channels, times a weight (fla's RMSNormGated
    with norm_before_gate=False)."""

    def __init__(self, hidden_size: int, group_size: int, eps: float = 1e-6, kernels: str = "torch"):
        super().__init__(hidden_size, eps=eps, kernels=kernels)
        self.group_size = group_size

    def forward(self, x: torch.Tensor, z: torch.Tensor, fast: bool | None = None) -> torch.Tensor:
        """`fast`: the layer's choice of attnlab's kernels (`Mamba2.forward` makes it once); None: `use_fast_ssd`
        chooses here, for the norm on its own."""
        if use_fast_ssd(self.kernels, x) if fast is None else fast:  # attnlab's kernel, in x's dtype, no fp32 copy of x or z
            return grouped_gated_rms_norm(x, z, self.weight, self.group_size, self.eps)
        h = x.float() * F.silu(z.float())
        groups = h.unflatten(-1, (-1, self.group_size))
        groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
        return (groups.flatten(-2) * self.weight.float()).to(z.dtype)


@register_mixer("mamba2")
class Mamba2(Mixer):
    fixed_size_state = True  # conv window and SSM state of fixed size: CUDA-graph decoding applies
    train_graph_safe = True  # the training forward launches kernels only (no host synchronisation)
    compiles_whole = True  # its layer core (`mamba2_core`) traced
    default_options = {
        "state_size": 64,  # N, per head
        "expand": 2,  # inner width = expand * hidden_size
        "head_dim": None,  # P; None: inner width / num_heads (so model.num_heads sets the SSM heads)
        "n_groups": 1,  # groups of heads sharing B and C
        "conv_kernel": 4,
        "chunk_size": 64,
    }

    @classmethod
    def resolve_options(cls, options):
        options = super().resolve_options(options)
        for key in ("state_size", "expand", "n_groups", "conv_kernel", "chunk_size"):
            value = options[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"mixer 'mamba2': {key} must be a positive integer, got {value!r}")
        if options["head_dim"] is not None and (not isinstance(options["head_dim"], int) or options["head_dim"] < 1):
            raise ValueError(
                f"mixer 'mamba2': head_dim must be a positive integer or null, got {options['head_dim']!r}"
            )
        return options

    def __init__(self, config, layer_idx: int):
        super().__init__()
        options = self.options_of(config)
        self.layer_idx = layer_idx
        hidden = config.hidden_size
        self.intermediate_size = options["expand"] * hidden
        self.head_dim = options["head_dim"] or self.intermediate_size // config.num_heads
        if self.intermediate_size % self.head_dim:
            raise ValueError(
                f"mamba2: expand * hidden_size ({self.intermediate_size}) must be divisible by "
                f"head_dim ({self.head_dim})"
            )
        self.num_heads = self.intermediate_size // self.head_dim
        self.n_groups = options["n_groups"]
        if self.num_heads % self.n_groups:
            raise ValueError(f"mamba2: the {self.num_heads} heads must split into n_groups ({self.n_groups})")
        self.ssm_state_size = options["state_size"]
        self.conv_kernel_size = options["conv_kernel"]
        self.chunk_size = options["chunk_size"]
        self.conv_dim = self.intermediate_size + 2 * self.n_groups * self.ssm_state_size

        self.in_proj = nn.Linear(hidden, self.intermediate_size + self.conv_dim + self.num_heads, bias=False)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, kernel_size=self.conv_kernel_size, groups=self.conv_dim, bias=True
        )
        self.dt_bias = nn.Parameter(slow_start_bias(self.num_heads))  # dt starts log-uniform in [1e-3, 0.1]
        self.A_log = nn.Parameter(torch.log(torch.empty(self.num_heads).uniform_(1, 16)))
        self.D = nn.Parameter(torch.ones(self.num_heads))
        for p in (self.dt_bias, self.A_log, self.D):
            p._no_weight_decay = True  # as in mamba_ssm and fla, for optimizers that honour it
        self.kernels = config.kernels
        self.norm = GroupedGatedRMSNorm(
            self.intermediate_size, self.intermediate_size // self.n_groups, eps=config.norm_eps, kernels=config.kernels
        )
        self.out_proj = nn.Linear(self.intermediate_size, hidden, bias=False)
        self.conv_gap = kernels.causal_conv1d_gap(self.conv_kernel_size)
        if self.conv_gap and config.kernels != "torch" and layer_idx == 0:
            warnings.warn(f"mixer 'mamba2': attnlab's CUDA conv kernel does not cover {self.conv_gap}; on CUDA the "
                          "convolution and the decoding step run the PyTorch reference", stacklevel=2)

    def forward(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: dict | None = None,
        use_cache: bool = False,
    ) -> tuple[torch.Tensor, dict | None]:
        batch, seq_len, _ = x.shape
        conv_state = cache["conv_state"] if cache is not None else None
        ssm_state = cache["recurrent_state"] if cache is not None else None
        if seq_len == 1 and use_cache and self.fused_step_applies(x, conv_state, ssm_state):  # the caller takes the new state
            return self.fused_step(x, attention_mask, conv_state, ssm_state)  # the step's kernels, chosen by that check
        # the one choice of this forward: attnlab's kernels (SSD, gated norm, the one-node core) or the PyTorch reference
        fast = use_fast_ssd(self.kernels, x)
        plain_out_proj = type(self.out_proj) is nn.Linear and self.out_proj.bias is None
        if fast and plain_out_proj and seq_len > 1 and attention_mask is None and cache is None and not use_cache and not self.conv_gap:
            # training and scoring: the layer between its projections as one node on attnlab's kernels
            from attnlab.models.kernels.mamba2.ssd import kernel_chunk

            dims = (self.intermediate_size, self.conv_dim, self.num_heads, self.head_dim, self.n_groups, self.ssm_state_size,
                    self.norm.group_size)
            return mamba2_core(self.in_proj(x), self.conv1d.weight[:, 0], self.conv1d.bias, self.dt_bias, self.A_log, self.D,
                               self.norm.weight, self.out_proj.weight, dims, kernel_chunk(self.chunk_size), self.norm.eps), None
        z, xBC, dt = self.in_proj(x).split([self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias.float())  # [B, T, H]
        if attention_mask is not None:
            is_token = attention_mask[:, -seq_len:, None].to(torch.bool)  # [B, T, 1]
            xBC, dt = xBC * is_token, dt * is_token

        xBC, conv_state = self._conv(xBC, conv_state)
        xs, B, C = xBC.split(
            [self.intermediate_size, self.n_groups * self.ssm_state_size, self.n_groups * self.ssm_state_size], dim=-1
        )
        xs = xs.view(batch, seq_len, self.num_heads, self.head_dim)
        B = B.view(batch, seq_len, self.n_groups, self.ssm_state_size)
        C = C.view(batch, seq_len, self.n_groups, self.ssm_state_size)
        A = -torch.exp(self.A_log.float())

        if seq_len == 1 and cache is not None:
            y, ssm_state = ssd_step(xs[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], ssm_state)
            y = y[:, None] + xs.float() * self.D.float()[:, None]  # [B, 1, H, P]
        else:  # attnlab's chunked kernels on CUDA (y in the compute dtype), else the reference (y fp32)
            y, ssm_state = ssd(xs, dt, A, B, C, self.D, self.chunk_size, ssm_state, use_cache, fast=fast)
        y = y.reshape(batch, seq_len, self.intermediate_size)
        cached = {"conv_state": conv_state, "recurrent_state": ssm_state} if use_cache else None
        if fast and plain_out_proj and seq_len > 1:
            # the norm and the projection in one autograd node that does not keep the normed tensor
            return gated_norm_linear(y, z, self.norm.weight, self.out_proj.weight, self.norm.group_size, self.norm.eps), cached
        return self.out_proj(self.norm(y, z, fast).to(x.dtype)), cached

    def fused_step_applies(self, x: torch.Tensor, conv_state: torch.Tensor | None, ssm_state: torch.Tensor | None) -> bool:
        """Whether a one-token step that continues a cache runs `kernels/mamba2/step.py`: attnlab's kernels chosen
        (`use_fast_ssd`: CUDA tensors, kernels not "torch"), a conv kernel size they cover, both states there
        (ssm_state fp32), no float64, and no gradient wanted (the kernels advance the states in place and have no
        backward). The forward asks this first; its other paths make their one choice after it."""
        return (conv_state is not None and ssm_state is not None and ssm_state.dtype == torch.float32
                and x.dtype != torch.float64 and not torch.is_grad_enabled() and not self.conv_gap
                and use_fast_ssd(self.kernels, x))

    def fused_step(self, x: torch.Tensor, attention_mask: torch.Tensor | None, conv_state: torch.Tensor,
                   ssm_state: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """The decoding step on two Triton kernels between the two projections, the conv window and the
        SSM state advanced where they lie (the engine's buffers: nothing to copy back)."""
        from attnlab.models.kernels.mamba2.step import mamba2_step_

        z, xBC, dt = self.in_proj(x)[:, 0].split([self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
        keep = None if attention_mask is None else attention_mask[:, -1]  # [B]: 0 for a padding position
        conv_state, ssm_state = conv_state.contiguous(), ssm_state.contiguous()  # copies only if they are views across rows
        y = mamba2_step_(xBC, z, dt, conv_state, ssm_state, self.conv1d.weight[:, 0], self.conv1d.bias, self.dt_bias,
                         self.A_log, self.D, self.norm.weight, self.norm.group_size, self.norm.eps, self.n_groups, keep)
        return self.out_proj(y.to(x.dtype))[:, None], {"conv_state": conv_state, "recurrent_state": ssm_state}

    def _conv(self, xBC: torch.Tensor, conv_state: torch.Tensor | None):
        """Causal depthwise conv + SiLU over [B, T, conv_dim]; returns it and the last K - 1 inputs."""
        conv = kernels.causal_conv1d_fn(self.kernels, xBC, covered=not self.conv_gap)
        if conv is not None:  # the cache keeps its channel-major layout: the kernel reads and writes it in place of a copy
            state = None if conv_state is None else conv_state.transpose(1, 2)  # [B, K - 1, conv_dim] view
            out, new_state = conv(xBC, self.conv1d.weight[:, 0], self.conv1d.bias, state, True, channel_major_state=True)
            return out, new_state.transpose(1, 2)  # [B, conv_dim, K - 1], contiguous
        batch, seq_len, _ = xBC.shape
        inputs = xBC.transpose(1, 2)  # [B, conv_dim, T]
        if conv_state is None:
            conv_state = inputs.new_zeros(batch, self.conv_dim, self.conv_kernel_size - 1)
        inputs = torch.cat((conv_state.to(inputs.dtype), inputs), dim=-1)  # [B, conv_dim, K - 1 + T]
        if seq_len == 1:
            out = (inputs * self.conv1d.weight[:, 0]).sum(-1, keepdim=True) + self.conv1d.bias[:, None]
        else:
            out = F.conv1d(inputs, self.conv1d.weight, self.conv1d.bias, groups=self.conv_dim)
        new_state = inputs[..., inputs.shape[-1] - (self.conv_kernel_size - 1):]
        return F.silu(out).transpose(1, 2), new_state
