"""One composable mixer for the attention variants of the 2Mamba study (linear, squared, exp and
softmax-like attention with gates, norms, decay and an input convolution).

Each variant is a choice of a few orthogonal options (`default_options`); the named variants
of the study are presets (see `attention_presets.py`). A layer computes, per head,

    q, k, v = split(conv(W_qkv x))                 optional causal depthwise conv (+ SiLU)
    q, k    = phi(rope(q)), phi(rope(k))           optional RoPE, then the feature map phi
    v       = sigma(W_in x) * dt * v               optional input gate, optional dt = softplus(W_dt x)
    v_j     = v_j / j^sigma(c)                     with the count power on the values (the first study's cosine)
    o_i     = sum_{j<=i} sim(scale q_i.k_j) exp(A_{j+1} + ... + A_i) v_j / den_i
    y       = norm(sigma(W_out x) * silu(W_z x) * (o + D v)), then sigma(W_out x) * y if gated after the norm

The parallel form is the quadratic one (training, prefill); a linearizable variant (power1 or power2
without a clamp) also has a chunked, linear-time form (`kernels/attention_family/chunk.py`: the quadratic
form inside chunks, a fixed-size state across them), which `kernels.attention_family_chunked` chooses on
CUDA from the lengths `kernels.CHUNKED_MIN_TOKENS` names (power1 and power2 from 8192 tokens: see there why).
Decoding keeps, per layer, a recurrent state of fixed size where the variant is linearizable and a KV
cache otherwise; the input convolution keeps its last inputs.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from attnlab.models import kernels
from attnlab.models.kernels.eager import outside_compile
from attnlab.models.mixers.registry import Mixer, register_mixer
from attnlab.models.mixers.softmax import SoftmaxAttention, static_kv_state, write_static_kv
from attnlab.models.modules import RMSNorm, slow_start_bias
from attnlab.models.ops.attention_family import (
    DENOMINATORS,
    EXP_SIMILARITIES,
    FEATURE_MAPS,
    LINEAR_SIMILARITIES,
    RECENT_BUFFERS,
    SIMILARITIES,
    SUM_DENOMINATORS,
    apply_feature_map,
    chunk_linear_attention,
    fold_recent,
    log_decay_cumsum,
    new_recent,
    parallel_attention,
    recurrent_step,
    windowed_step,
    _divide,
    _finish_denominator,
)
from attnlab.models.ops.common import rotary_inv_freq

OUTPUT_NORMS = ("none", "layernorm", "rmsnorm", "l2")
OUT_GATES = ("none", "before_norm", "after_norm")
DECAYS = ("none", "discretize", "neg_softplus", "neg_softplus_dt", "neg_softplus2", "neg_silu")
BIASED_DECAYS = ("neg_softplus", "neg_softplus_dt")  # the decays `decay_bias` starts slow
CONV_SIZES = (0, 2, 3, 4)
CONV_ACTIVATIONS = ("none", "silu")
COUNT_POWER_ON = ("output", "values")
NON_NEGATIVE_FEATURE_MAPS = ("relu", "elu1")


def is_linearizable(options: dict) -> bool:
    """True when decoding keeps a fixed-size recurrent state instead of a KV cache."""
    return options["similarity"] in LINEAR_SIMILARITIES and options["clamp_scores"] is None


STATE_DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}


def check_options(options: dict, name: str) -> None:
    """Raise ValueError, with the reason, for an option value or a combination that makes no sense."""

    def fail(reason: str):
        raise ValueError(f"mixer {name!r}: {reason}")

    choices = {
        "similarity": SIMILARITIES, "feature_map": FEATURE_MAPS, "denominator": DENOMINATORS,
        "output_norm": OUTPUT_NORMS, "out_gate": OUT_GATES, "decay": DECAYS,
        "conv_size": CONV_SIZES, "conv_activation": CONV_ACTIVATIONS, "count_power_on": COUNT_POWER_ON,
        "state_dtype": STATE_DTYPES,
    }
    for key, valid in choices.items():
        if options[key] not in valid:
            fail(f"{key}={options[key]!r} is not one of {list(valid)}")
    for key in ("output_norm_per_head", "in_gate", "z_gate", "value_dt", "rope", "d_residual", "decay_bias"):
        if not isinstance(options[key], bool):
            fail(f"{key} must be true or false, got {options[key]!r}")
    terms = options["taylor_terms"]
    if isinstance(terms, bool) or not isinstance(terms, int) or terms < 2:
        fail(f"taylor_terms must be an integer >= 2, got {terms!r}")
    for key in ("clamp_scores", "qk_scale"):
        value = options[key]
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            fail(f"{key} must be a number or null, got {value!r}")
    if options["qk_scale"] is not None and options["qk_scale"] <= 0:
        fail(f"qk_scale must be positive, got {options['qk_scale']!r}")
    eps = options["output_norm_eps"]
    if eps is not None and (isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps <= 0):
        fail(f"output_norm_eps must be a positive number or null (model.norm_eps), got {eps!r}")
    if options["count_power_on"] != "output" and options["denominator"] != "count_power":
        fail(f"count_power_on={options['count_power_on']!r} needs denominator 'count_power'")
    if options["decay_bias"] and options["decay"] not in BIASED_DECAYS:
        fail(f"decay_bias needs decay in {list(BIASED_DECAYS)}, got decay={options['decay']!r}")

    similarity, denominator = options["similarity"], options["denominator"]
    if similarity == "softmax" and denominator not in SUM_DENOMINATORS:
        fail(
            f"similarity 'softmax' divides by the sum of its weights, so denominator={denominator!r} contradicts it; "
            f"use denominator in {list(SUM_DENOMINATORS)}, or similarity 'exp' for exp without that sum"
        )
    if (
        similarity == "power1"
        and denominator in SUM_DENOMINATORS
        and options["feature_map"] not in NON_NEGATIVE_FEATURE_MAPS
    ):
        fail(
            f"denominator {denominator!r} needs non-negative similarities, but power1 with "
            f"feature_map={options['feature_map']!r} can be negative or zero-sum; use feature_map in "
            f"{list(NON_NEGATIVE_FEATURE_MAPS)}, similarity 'power2', or denominator 'count'/'none' with an output norm"
        )
    if (
        similarity == "exp"
        and options["clamp_scores"] is None
        and denominator not in SUM_DENOMINATORS
        and options["output_norm"] == "none"
    ):
        fail(
            "exp without a sum denominator, a clamp or an output norm grows without bound and overflows; "
            "set clamp_scores (the study uses 5), a sum denominator, or an output_norm"
        )
    if options["out_gate"] == "after_norm" and options["output_norm"] == "none":
        fail("out_gate 'after_norm' needs an output_norm; without one use out_gate 'before_norm'")
    if options["conv_activation"] != "none" and options["conv_size"] == 0:
        fail(f"conv_activation={options['conv_activation']!r} needs an input convolution (conv_size 2, 3 or 4)")


@register_mixer("attention_family")
class AttentionFamily(Mixer):
    train_graph_safe = True  # the training forward launches kernels only: no host synchronisation, no data-dependent shape
    # the tiled kernels traced into a compiled block (`_mix_kv`, `_mix_recurrent`; the chunked form is a break, see
    # `compiles_whole_at`)
    compiles_whole = True
    default_options = {
        "similarity": "softmax",  # softmax | exp | power1 | power2 | taylor
        "taylor_terms": 80,  # terms of the exp series for similarity 'taylor'
        "qk_scale": None,  # scale of q.k; None: 1 / sqrt(head_dim)
        "clamp_scores": None,  # clamp scale * q.k from above at this value (the study uses 5)
        # on q and k: none | relu | silu | elu1 (elu + 1) | l2 (cosine) | l2_heads (unit length across the heads)
        "feature_map": "none",
        # sum | sum_clamped (>= 1) | sum_detached (sg(max(sum, 1))) | sum_detached_eps (sg(sum) + 1e-4) | count (divide
        # by S) | count_power | none
        "denominator": "sum",
        "count_power_on": "output",  # count_power divides the output o_i by i^σ(c) | the values v_j by j^σ(c)
        "output_norm": "none",  # none | layernorm | rmsnorm | l2
        "output_norm_per_head": True,  # norm over each head's dim, else over all heads together
        "output_norm_eps": None,  # epsilon of the layernorm / rmsnorm; None: model.norm_eps
        "in_gate": False,  # sigmoid gate per head on the values
        "out_gate": "none",  # sigmoid gate per head on the mixed output: none | before_norm | after_norm
        "z_gate": False,  # silu(W_z x) gate on the mixed output (Mamba's z), before the norm
        "decay": "none",  # the 'A mask': none | discretize | neg_softplus | neg_softplus_dt | neg_softplus2 | neg_silu
        # a learnable bias per head inside the decay (neg_softplus, neg_softplus_dt: -softplus(W_A x + b)), starting where
        # the decay forgets slowly: -softplus(b) = -dt, dt log-uniform in [1e-3, 0.1] (Mamba-2's dt). Without it the decay
        # starts at -softplus(0) = -0.69 per token
        "decay_bias": False,
        "value_dt": False,  # multiply values by dt = softplus(W_dt x) (Mamba's discretisation)
        "conv_size": 0,  # causal depthwise conv on q, k, v: 0 (none), 2, 3 or 4
        "conv_activation": "none",  # after the conv: none | silu
        "rope": True,  # rotary positions on q and k; False: no positional encoding
        "d_residual": False,  # add D * v (D per head and channel) to the mixed output
        # the decoding state of a linearizable variant: auto | float32 | bfloat16. bf16 halves the bytes a
        # step of power2 reads; the steps sum in fp32 and round only what they store. Where the state is
        # rewritten every step the rounding adds up; power2's windowed step (CUDA) rewrites it once per
        # window, and its bf16 state strays no further from fp32 arithmetic than an fp32 one (docs/speed.md,
        # decoding). auto: bf16 where the windowed step runs on a 16-bit model, else fp32
        "state_dtype": "auto",
    }

    # options added after models were saved with every option resolved (their config.json): such a
    # config lacks them, and they take the family defaults, the function those models were trained with,
    # not a preset's newer default
    added_options = ("count_power_on", "output_norm_eps", "decay_bias")

    @classmethod
    def resolve_options(cls, options):
        options = dict(options or {})
        earlier = set(AttentionFamily.default_options) - set(cls.added_options)
        if earlier <= set(options):  # a full set of options, as a saved model's config holds them
            options = {**{key: AttentionFamily.default_options[key] for key in cls.added_options}, **options}
        resolved = super().resolve_options(options)
        check_options(resolved, cls.name)
        return resolved

    def __init__(self, config, layer_idx: int):
        super().__init__()
        opts = self.options_of(config)
        self.options = opts
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.head_dim = config.hidden_size // config.num_heads
        if opts["rope"] and self.head_dim % 2:
            raise ValueError(f"mixer {self.name!r}: rope needs an even head dim, got {self.head_dim}")
        self.rope_theta = config.rope_theta
        self.scale = opts["qk_scale"] if opts["qk_scale"] is not None else self.head_dim**-0.5
        self.linearizable = is_linearizable(opts)
        # a recurrent state of fixed size while decoding (and a step without host synchronisation):
        # the engine captures the one-token step as a CUDA graph; KV variants keep a cache that grows
        self.fixed_size_state = self.linearizable
        self.static_kv = not self.linearizable  # KV variants decode over static buffers (`static_state`)
        hidden, heads, inner = config.hidden_size, self.num_heads, self.num_heads * self.head_dim

        self.qkv_proj = nn.Linear(hidden, 3 * inner, bias=False)
        if opts["conv_size"]:
            self.conv1d = nn.Conv1d(3 * inner, 3 * inner, kernel_size=opts["conv_size"], groups=3 * inner, bias=True)
        if opts["value_dt"] or opts["decay"] in ("discretize", "neg_softplus_dt"):
            self.dt_proj = nn.Linear(hidden, heads, bias=False)
        if opts["decay"] == "discretize":
            # Mamba-2's init: A = -exp(A_log) with exp(A_log) uniform in [1, 16]
            self.A_log = nn.Parameter(torch.empty(heads).uniform_(1, 16).log())
        elif opts["decay"] != "none":
            self.decay_proj = nn.Linear(hidden, heads, bias=False)
        if opts["decay_bias"]:
            self.decay_bias = nn.Parameter(slow_start_bias(heads))  # -softplus(decay_bias) = -dt, as Mamba-2's dt
            self.decay_bias._no_weight_decay = True
        if opts["in_gate"]:
            self.in_gate_proj = nn.Linear(hidden, heads, bias=True)
        if opts["out_gate"] != "none":
            self.out_gate_proj = nn.Linear(hidden, heads, bias=True)
        if opts["z_gate"]:
            self.z_proj = nn.Linear(hidden, inner, bias=True)
        if opts["d_residual"]:
            self.D = nn.Parameter(torch.ones(heads, self.head_dim))
        if opts["denominator"] == "count_power":
            # divide by count ** sigmoid(logit) per head, starting at sigmoid(0.5)
            self.count_power_logit = nn.Parameter(torch.full((heads,), 0.5))
        norm_dim = self.head_dim if opts["output_norm_per_head"] else inner
        norm_eps = config.norm_eps if opts["output_norm_eps"] is None else float(opts["output_norm_eps"])
        if opts["output_norm"] == "layernorm":
            self.out_norm = nn.LayerNorm(norm_dim, eps=norm_eps)
        elif opts["output_norm"] == "rmsnorm":
            self.out_norm = RMSNorm(norm_dim, eps=norm_eps)
        self.o_proj = nn.Linear(inner, hidden, bias=False)
        self.kernels = config.kernels
        self.kernel_gap = kernels.attention_family_gap(self.head_dim)
        if self.kernel_gap and config.kernels != "torch" and layer_idx == 0:
            warnings.warn(f"mixer {self.name!r}: attnlab's CUDA kernels do not cover {self.kernel_gap}; on CUDA it runs the "
                          "PyTorch reference, which keeps [T, T] weights per head", stacklevel=2)

    # ------------------------------------------------------------------ pieces

    def _conv(self, qkv: torch.Tensor, conv_state: torch.Tensor | None):
        """Causal depthwise conv over time. qkv [B, T, C]; conv_state: the last K - 1 inputs [B, K-1, C]."""
        silu = self.options["conv_activation"] == "silu"
        conv = kernels.causal_conv1d_fn(self.kernels, qkv)  # conv sizes 2 to 4: the CUDA kernel covers them all
        if conv is not None and conv_state is not None and qkv.shape[1] == 1 and not torch.is_grad_enabled():
            from attnlab.models.kernels.common.conv import conv_step_

            return conv_step_(qkv, self.conv1d.weight[:, 0], self.conv1d.bias, conv_state, silu), conv_state  # in place
        if conv is not None:
            return conv(qkv, self.conv1d.weight[:, 0], self.conv1d.bias, conv_state, silu)
        width = self.options["conv_size"] - 1
        if conv_state is None:
            conv_state = qkv.new_zeros(qkv.shape[0], width, qkv.shape[2])
        padded = torch.cat((conv_state.to(qkv.dtype), qkv), dim=1)  # [B, K-1+T, C]
        out = F.conv1d(padded.transpose(1, 2), self.conv1d.weight, self.conv1d.bias, groups=qkv.shape[2])
        out = out.transpose(1, 2)  # [B, T, C]
        if silu:
            out = F.silu(out)
        return out, padded[:, -width:]

    def _log_decay(self, x: torch.Tensor, dt: torch.Tensor | None) -> torch.Tensor | None:
        """Per-token, per-head log-decay A [B, T, H] (<= 0 for the decaying kinds)."""
        kind = self.options["decay"]
        if kind == "none":
            return None
        if kind == "discretize":
            return -torch.exp(self.A_log.float()) * dt
        a = self.decay_proj(x).float()
        if self.options["decay_bias"]:
            a = a + self.decay_bias.float()
        if kind == "neg_softplus":
            return -F.softplus(a)
        if kind == "neg_softplus_dt":
            return -F.softplus(a) * dt
        if kind == "neg_softplus2":
            return -a * F.softplus(a)
        return -F.silu(a)  # neg_silu

    def _norm(self, y: torch.Tensor) -> torch.Tensor:
        """y [B, T, H, D]."""
        kind = self.options["output_norm"]
        if kind == "none":
            return y
        shape = y.shape
        if not self.options["output_norm_per_head"]:
            y = y.flatten(-2)
        y = F.normalize(y, dim=-1) if kind == "l2" else self.out_norm(y)
        return y.view(shape)

    def _attention_kwargs(self) -> dict:
        """The mixing's arguments; a count power on the values is applied to them before (`_count_power_values`)."""
        opts = self.options
        denominator = mixing_denominator(opts)
        count_power = torch.sigmoid(self.count_power_logit) if denominator == "count_power" else None
        return dict(similarity=opts["similarity"], scale=self.scale, denominator=denominator, count_power=count_power)

    # ------------------------------------------------------------------ forward

    def forward(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: dict | None = None,
        use_cache: bool = False,
    ) -> tuple[torch.Tensor, dict | None]:
        opts = self.options
        batch, seq_len, _ = x.shape
        heads, head_dim = self.num_heads, self.head_dim
        cache = cache or {}
        token_mask = None if attention_mask is None else attention_mask[:, -seq_len:].bool()  # [B, T]

        # positions count real tokens only, so left padding does not shift them
        tokens_before = cache.get("num_tokens")
        if tokens_before is None:
            tokens_before = torch.zeros(batch, dtype=torch.long, device=x.device)
        # a decoding step on the fused kernels (no gradient): the counter, the conv window, the state
        # and power2's window of recent tokens advance where they lie, and the decay is formed in the kernel
        fused_step = (self.linearizable and seq_len == 1 and "state" in cache and token_mask is None
                      and not torch.is_grad_enabled() and kernels.attention_family_step_fn(self.kernels, x) is not None)
        positions = None  # [B, T]: for rotary positions and a count power on the values
        if opts["rope"] or (opts["denominator"] == "count_power" and opts["count_power_on"] == "values"):
            if token_mask is None:
                positions = tokens_before[:, None] + torch.arange(seq_len, device=x.device)
            else:
                positions = (tokens_before[:, None] + token_mask.long().cumsum(-1) - 1).clamp(min=0)
        if fused_step:
            num_tokens = tokens_before.add_(1)  # after the positions were taken from it
        elif token_mask is None:
            num_tokens = tokens_before + seq_len
        else:
            num_tokens = tokens_before + token_mask.long().sum(-1)

        qkv = self.qkv_proj(x)  # [B, T, 3 * H * D]
        if token_mask is not None:
            qkv = qkv * token_mask[..., None]  # padding enters the conv as the zeros before a sequence
        conv_state = None
        if opts["conv_size"]:
            qkv, conv_state = self._conv(qkv, cache.get("conv_state"))
        q, k, v = qkv.view(batch, seq_len, 3, heads, head_dim).unbind(2)  # each [B, T, H, D]
        if opts["rope"] and seq_len == 1 and cache and token_mask is None and kernels.use_triton(self.kernels, x):
            # a decode step: q and k rotated in one kernel (the eager form takes about twenty)
            from attnlab.models.kernels.softmax.decode import rope_

            if getattr(self, "_inv_freq", None) is None or self._inv_freq.device != x.device:
                self._inv_freq = rotary_inv_freq(head_dim, self.rope_theta, x.device)
            q, k = (t[:, None] for t in rope_(q[:, 0], k[:, 0], self._inv_freq, positions[:, 0]))
            q, k = apply_feature_map(q, opts["feature_map"]), apply_feature_map(k, opts["feature_map"])
        elif opts["rope"]:
            q, k = kernels.rotate(self.kernels, x, q, k, positions, self.rope_theta, opts["feature_map"])
        else:
            q, k = apply_feature_map(q, opts["feature_map"]), apply_feature_map(k, opts["feature_map"])

        residual = v * self.D if opts["d_residual"] else None
        dt = F.softplus(self.dt_proj(x).float()) if hasattr(self, "dt_proj") else None  # [B, T, H]
        decay_fn = "neg_softplus" if fused_step and opts["decay"] == "neg_softplus" and not opts["decay_bias"] else None
        log_decay = self.decay_proj(x) if decay_fn else self._log_decay(x, dt)  # with `decay_fn`, the kernel's input
        if opts["value_dt"]:
            v = v * dt[..., None].to(v.dtype)
        if opts["in_gate"]:
            v = v * torch.sigmoid(self.in_gate_proj(x))[..., None]
        if opts["denominator"] == "count_power" and opts["count_power_on"] == "values":
            v = count_power_values(v, positions + 1, torch.sigmoid(self.count_power_logit))
        if token_mask is not None:  # padding writes nothing and decays nothing
            k, v = k * token_mask[..., None, None], v * token_mask[..., None, None]
            if log_decay is not None:
                log_decay = log_decay * token_mask[..., None]

        # the one choice between the reference and the CUDA kernels for the quadratic form
        terms = kernels.attention_family_terms(self.kernels, x, covered=not self.kernel_gap)
        if self.linearizable:
            o, state = self._mix_recurrent(q, k, v, log_decay, token_mask, cache, tokens_before, num_tokens, use_cache, terms,
                                           decay_fn)
        else:
            o, state = self._mix_kv(q, k, v, log_decay, attention_mask, cache, use_cache, terms)
        y = o.to(v.dtype)  # [B, T, H, D]: the values' dtype (under autocast the kernels write it directly)

        if residual is not None:
            y = y + residual
        if opts["z_gate"]:
            y = y * F.silu(self.z_proj(x)).view(batch, seq_len, heads, head_dim)
        if opts["out_gate"] != "none":
            out_gate = torch.sigmoid(self.out_gate_proj(x))[..., None]  # [B, T, H, 1]
        if opts["out_gate"] == "before_norm":
            y = y * out_gate
        y = self._norm(y)
        if opts["out_gate"] == "after_norm":
            y = y * out_gate
        y = self.o_proj(y.reshape(batch, seq_len, heads * head_dim))

        if not use_cache:
            return y, None
        state.update(num_tokens=num_tokens, conv_state=conv_state)
        if self.linearizable:  # only tensors: the engine keeps each one in a static buffer
            state = {name: t for name, t in state.items() if t is not None}
        return y, state

    def compiles_whole_at(self, seq_len: int) -> bool:
        """The linearizable variants' chunked form (long sequences on CUDA) runs outside torch.compile: a graph break."""
        weight = self.qkv_proj.weight
        return not (self.linearizable and kernels.attention_family_chunked(self.kernels, weight, seq_len,
                                                                           self.options["similarity"]) is not None)

    @outside_compile(traced=True)  # a compiled block traces the mixing and its tiled kernels (the chunked form breaks it)
    def _mix_recurrent(self, q, k, v, log_decay, token_mask, cache, tokens_before, num_tokens, use_cache, terms,
                       decay_fn=None):
        """Linearizable variants: the quadratic form for training, a fixed-size state for decoding.
        `decay_fn`: log_decay holds the decay projection's output, which the step kernel turns into the log-decay."""
        kwargs = self._attention_kwargs()
        state, normalizer = cache.get("state"), cache.get("normalizer")
        # the one choice between the quadratic form and the chunked, linear-time one (CUDA, long sequences; a prompt
        # that hands on its state, from past the quadratic form's one chunk)
        training = "state" not in cache and not use_cache
        chunked = kernels.attention_family_chunked(self.kernels, q, q.shape[1], self.options["similarity"], prompt=not training)
        if training and chunked is not None:  # training, chunked
            o, _, _ = chunked(q, k, v, log_decay, key_mask=token_mask, intra_terms=terms, out_dtype=v.dtype, **kwargs)
            return o, None
        if training:  # quadratic form only
            c = log_decay_cumsum(log_decay)
            o = parallel_attention(q, k, v, query_log_decay=c, key_log_decay=c, key_mask=token_mask, terms=terms,
                                   out_dtype=v.dtype, **kwargs)
            return o, None
        # the one choice between the reference and the fused kernels (CUDA): the step advances the state
        # where it lies, power2's state is packed (half the rows); the kernels have no backward, so with
        # a gradient to carry the reference runs, on the same layout
        step = kernels.attention_family_step_fn(self.kernels, q)
        packed = self._packed_state(state, fast=step is not None)
        needs_grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (q, k, v, log_decay, state, normalizer, kwargs["count_power"]))
        # power2's fast step reads its state without writing it: the latest tokens wait in a window of
        # recent tokens (`windowed_step`), folded in when it is full
        recent = {name: cache[name] for name in RECENT_BUFFERS} if "recent_key" in cache else None
        step_decay = None if log_decay is None else log_decay[:, 0]
        if "state" in cache and q.shape[1] == 1:  # step form
            if step is not None and not needs_grad:
                state = state.contiguous()  # a copy only if it is a view across rows
                if normalizer is not None:
                    normalizer = normalizer.contiguous()
                if recent is not None:
                    recent = {name: t.contiguous() for name, t in recent.items()}
                o = step(q[:, 0], k[:, 0], v[:, 0], step_decay, state, normalizer, num_tokens, packed=packed,
                         recent=recent, decay_fn=decay_fn, **kwargs)
                return o[:, None], {"state": state, "normalizer": normalizer, **(recent or {})}
            if recent is not None:
                o, state, normalizer, recent = windowed_step(q[:, 0], k[:, 0], v[:, 0], step_decay, state, normalizer,
                                                             recent, num_tokens, packed=packed, **kwargs)
                return o[:, None], {"state": state, "normalizer": normalizer, **recent}
            o, state, normalizer = recurrent_step(q[:, 0], k[:, 0], v[:, 0], step_decay, state, normalizer, num_tokens,
                                                  packed=packed, **kwargs)
            return o[:, None], {"state": state, "normalizer": normalizer}
        if recent is not None:  # more tokens after steps: the window's go into the state first
            state, normalizer, recent = fold_recent(state, normalizer, recent, similarity=kwargs["similarity"],
                                                    scale=self.scale, packed=packed)
        if chunked is not None:  # a long prompt: chunked, its state handed on in the decoding layout
            o, state, normalizer = chunked(q, k, v, log_decay, key_mask=token_mask, state=state, normalizer=normalizer,
                                           count_before=tokens_before, packed=packed, intra_terms=terms, **kwargs)
        else:
            o, state, normalizer = chunk_linear_attention(
                q, k, v, log_decay, state, normalizer, tokens_before, token_mask=token_mask, terms=terms, packed=packed,
                state_update=None if needs_grad else kernels.attention_family_state_update_fn(self.kernels, q), **kwargs
            )
        if not needs_grad:  # the state the steps carry on, in its decoding dtype
            if recent is None and step is not None and self.options["similarity"] == "power2":
                recent = new_recent(k, v)
            state = state.to(self._state_dtype(windowed=recent is not None, values=v.dtype))
        return o, {"state": state, "normalizer": normalizer, **(recent or {})}

    def _state_dtype(self, windowed: bool, values: torch.dtype) -> torch.dtype:
        """The decoding state's dtype (option `state_dtype`; "auto": bf16 for the windowed step of a 16-bit model)."""
        chosen = STATE_DTYPES[self.options["state_dtype"]]
        if chosen is None:
            return torch.bfloat16 if windowed and values in (torch.bfloat16, torch.float16) else torch.float32
        return chosen

    # the static cache's buffers whose prompt columns every beam of a prompt shares (each key's
    # log-decay through the latest token depends on the tokens generated since: not shared)
    static_columns = ("key", "value", "valid")

    def static_state(self, state: dict, capacity: int) -> dict:
        """A KV variant's cache after a prefill as the decode engine keeps it (see
        `SoftmaxAttention.static_state`): keys, values and each key's log-decay through the latest
        token in buffers of `capacity` columns, with the token counter and the conv window."""
        if self.linearizable:
            raise ValueError(f"mixer {self.name!r} keeps a fixed-size state, not a KV cache")
        static = static_kv_state(state, capacity)
        if state.get("key_log_decay") is not None:  # [B, T, H] -> [B, H, capacity]: each head's decays side by side
            decays = state["key_log_decay"]
            static["key_log_decay"] = decays.new_zeros(decays.shape[0], decays.shape[2], capacity)
            static["key_log_decay"][:, :, :decays.shape[1]] = decays.transpose(1, 2)
        for name in ("num_tokens", "conv_state"):
            if state.get(name) is not None:
                static[name] = state[name]
        return static

    def _mix_static(self, q, k, v, log_decay, attention_mask, cache):
        """One token per row over the static cache, written where it lies: each key's log-decay
        through the latest token is advanced by this token's and the new key's is 0."""
        if q.shape[1] != 1:
            raise ValueError("a static decode cache takes one token per row; prefill with a dynamic cache")
        if attention_mask is None and self.options["similarity"] in EXP_SIMILARITIES and kernels.use_triton(self.kernels, q):
            # the write in one kernel; the attention kernel advances each key's log-decay as it reads it
            from attnlab.models.kernels.softmax.decode import kv_write_

            kv_write_(k[:, 0], v[:, 0], cache["length"], cache["position"], cache["key"], cache["value"],
                      cache["valid"].view(torch.uint8))
            step = None if log_decay is None else log_decay[:, 0].float().contiguous()
            return self._static_kernel(q, cache, cache.get("key_log_decay"), step).to(v.dtype), cache
        is_token = None if attention_mask is None else attention_mask[:, -1]
        column = write_static_kv(cache, k, v, is_token)
        query_term = key_term = None
        if log_decay is not None:
            decays = cache["key_log_decay"]  # [B, H, capacity]
            decays.add_(log_decay[:, 0, :, None].to(decays.dtype))
            decays.scatter_(2, column.view(-1, 1, 1).expand(-1, decays.shape[1], 1), 0.0)
            query_term, key_term = torch.zeros_like(log_decay[:, :1]), -decays.transpose(1, 2)
        columns = torch.arange(cache["key"].shape[1], device=q.device)
        key_mask = cache["valid"] & (columns[None, :] < cache["length"][:, None])
        o = parallel_attention(
            q, cache["key"], cache["value"], clamp=self.options["clamp_scores"], taylor_terms=self.options["taylor_terms"],
            query_log_decay=query_term, key_log_decay=key_term, key_mask=key_mask, out_dtype=v.dtype,
            **self._attention_kwargs(),
        )
        return o, cache

    def _static_kernel(self, q, cache, decays, step_decay=None):
        """The exp similarities' step on attnlab's split-key kernel (`kernels/softmax/decode.py`):
        softmax weights and the raw sum of exp(scores) and count of keys, from which each denominator
        follows as `attention_terms` defines it. With `step_decay` [B, H] the kernel first advances
        `decays` by it (the newest key's to 0). Returns o [B, 1, H, Dv] fp32."""
        from attnlab.models.kernels.softmax.decode import decode_attention

        kwargs = self._attention_kwargs()
        o, stats = decode_attention(q[:, 0], cache["key"], cache["value"], cache["valid"].view(torch.uint8), cache["length"],
                                    self.scale, clamp=self.options["clamp_scores"], bias=decays, stats=True,
                                    out_dtype=torch.float32, step_bias=step_decay)
        denominator = kwargs["denominator"]
        if denominator != "sum":  # o is num / sum(w): scale back to num, then divide as the family does
            raw_sum = stats[..., 1] * torch.exp2(stats[..., 0])  # [B, H]
            o = o * raw_sum[..., None]
            if denominator != "none":
                den = raw_sum if denominator in SUM_DENOMINATORS else stats[..., 2]
                den = _finish_denominator(den[..., None, None], denominator, kwargs["count_power"])[..., 0, 0]
                o = _divide(o, den[..., None])
        return o[:, None]

    def _packed_state(self, state: torch.Tensor | None, fast: bool) -> bool:
        """Whether power2's recurrent state is (or, new, will be) in its packed layout of d (d + 1) / 2
        rows: that of a given state, else packed where the fused step runs."""
        if self.options["similarity"] != "power2":
            return False
        if state is not None:
            return state.shape[-2] != self.head_dim**2
        return fast

    @outside_compile(traced=True)  # a compiled block traces the mixing and its kernels
    def _mix_kv(self, q, k, v, log_decay, attention_mask, cache, use_cache, terms):
        """Other variants: attention over a cache of keys, values and each key's decay so far."""
        if "length" in cache:  # the decode engine's static cache (`static_state`)
            return self._mix_static(q, k, v, log_decay, attention_mask, cache)
        batch, seq_len = q.shape[:2]
        past_k = cache.get("key")  # [B, past, H, D]
        past_len = past_k.shape[1] if past_k is not None else 0
        mask = SoftmaxAttention._full_mask(attention_mask, cache, batch, past_len, seq_len, q.device)
        if past_k is not None:
            k = torch.cat((past_k, k), dim=1)  # [B, past + T, H, D]
            v = torch.cat((cache["value"], v), dim=1)
        c = query_term = key_term = key_log_decay = None
        if log_decay is not None:
            # key_log_decay[j]: the log-decay from after key j through the latest token
            c = log_decay_cumsum(log_decay)  # [B, T, H]
            past_decay = cache.get("key_log_decay")
            if past_decay is None:
                past_decay = c.new_zeros(batch, past_len, c.shape[-1])
            query_term = c
            key_term = torch.cat((-past_decay, c), dim=1)  # decay(i, j) = c_i - key_term_j
            key_log_decay = torch.cat((past_decay + c[:, -1:], c[:, -1:] - c), dim=1)
        o = parallel_attention(
            q, k, v, clamp=self.options["clamp_scores"], taylor_terms=self.options["taylor_terms"],
            query_log_decay=query_term, key_log_decay=key_term, key_mask=mask, terms=terms, out_dtype=v.dtype,
            **self._attention_kwargs(),
        )
        state = {"key": k, "value": v, "mask": mask, "key_log_decay": key_log_decay} if use_cache else None
        return o, state

    # ------------------------------------------------------------------ description

    @staticmethod
    def mixing_function(options: dict, head_dim: int, kernel_choice: str = "auto"):
        """The mixing alone, as a layer of these options computes it in training (for `attnlab bench zoo`):
        fn(q, k, v, log_decay) -> o [B, T, H, Dv], with q, k [B, T, H, head_dim], v [B, T, H, Dv] after
        the feature map, and log_decay [B, T, H] (<= 0) or None. count_power starts at its init."""
        scale = options["qk_scale"] if options["qk_scale"] is not None else head_dim**-0.5

        def mix(q, k, v, log_decay=None):
            count_power = None
            if options["denominator"] == "count_power":
                count_power = torch.sigmoid(torch.full((q.shape[2],), 0.5, device=q.device))
            denominator = mixing_denominator(options)
            if denominator != options["denominator"]:  # the count power on the values
                v = count_power_values(v, torch.arange(1, v.shape[1] + 1, device=v.device).expand(v.shape[0], -1), count_power)
                count_power = None
            terms = kernels.attention_family_terms(kernel_choice, q, covered=not kernels.attention_family_gap(head_dim))
            chunked = None
            if is_linearizable(options):  # the layer's own choice (`_mix_recurrent`)
                chunked = kernels.attention_family_chunked(kernel_choice, q, q.shape[1], options["similarity"])
            if chunked is not None:
                return chunked(q, k, v, log_decay, similarity=options["similarity"], scale=scale, denominator=denominator,
                               count_power=count_power, intra_terms=terms, out_dtype=v.dtype)[0]
            c = log_decay_cumsum(log_decay)
            return parallel_attention(
                q, k, v, similarity=options["similarity"], scale=scale, clamp=options["clamp_scores"],
                taylor_terms=options["taylor_terms"], denominator=denominator, count_power=count_power,
                query_log_decay=c, key_log_decay=c, out_dtype=v.dtype, terms=terms,
            )

        return mix

    @classmethod
    def decode_state_elements(cls, options: dict, hidden_size: int = 1024, num_heads: int = 16) -> tuple[int, int]:
        """(fixed, per_token): elements of one layer's decoding state for one sequence.

        fixed: recurrent state (+ normalizer), conv state and the token counter; per_token: what the
        KV cache grows by per token (keys, values and, with decay, one log-decay per head)."""
        head_dim = hidden_size // num_heads
        fixed = 1  # num_tokens
        if options["conv_size"]:
            fixed += (options["conv_size"] - 1) * 3 * hidden_size
        if is_linearizable(options):
            features = head_dim if options["similarity"] == "power1" else head_dim * head_dim
            fixed += num_heads * features * head_dim
            if options["denominator"] in SUM_DENOMINATORS:
                fixed += num_heads * features
            return fixed, 0
        per_token = 2 * hidden_size + (num_heads if options["decay"] != "none" else 0)
        return fixed, per_token

    @classmethod
    def formula(cls, options: dict) -> str:
        """One line of math for a resolved set of options."""
        o = options
        phi = {"none": "", "relu": "relu", "silu": "silu", "elu1": "(elu+1)", "l2": "l2n", "l2_heads": "l2n_H"}[o["feature_map"]]
        scale = "1/√d" if o["qk_scale"] is None else f"{o['qk_scale']:g}"
        s = f"{phi}(q_i)·{phi}(k_j)" if phi else "q_i·k_j"
        if o["rope"]:
            s = s.replace("q_i", "R q_i").replace("k_j", "R k_j")
        s = f"{scale}·{s}"
        if o["clamp_scores"] is not None:
            s = f"min({s}, {o['clamp_scores']:g})"
        sim = {
            "softmax": f"exp({s})", "exp": f"exp({s})", "power1": s, "power2": f"({s})²",
            "taylor": f"exp_{o['taylor_terms']}({s})",
        }[o["similarity"]]
        if o["decay"] != "none":
            sim += " e^(A_j+1..i)"
        den = {
            "sum": " / Σ_j w_ij", "sum_clamped": " / max(Σ_j w_ij, 1)", "sum_detached": " / sg(max(Σ_j w_ij, 1))",
            "sum_detached_eps": " / (sg(Σ_j w_ij) + 1e-4)", "count": " / i", "count_power": " / i^σ(c)", "none": "",
        }[mixing_denominator(o)]
        values = "v_j"
        if mixing_denominator(o) != o["denominator"]:
            values = "v_j / j^σ(c)"
        if o["value_dt"]:
            values = f"dt_j {values}"
        if o["in_gate"]:
            values = f"σ(u_j) {values}"
        y = f"Σ_j w_ij {values}{den}"
        if o["d_residual"]:
            y = f"{y} + D v_i"
        if o["z_gate"]:
            y = f"silu(z_i) ⊙ ({y})"
        if o["out_gate"] == "before_norm":
            y = f"σ(g_i) ({y})"
        if o["output_norm"] != "none":
            norm = {"layernorm": "LN", "rmsnorm": "RMS", "l2": "L2"}[o["output_norm"]]
            y = f"{norm}({y})"
        if o["out_gate"] == "after_norm":
            y = f"σ(g_i) {y}"
        conv = f"conv{o['conv_size']} " if o["conv_size"] else ""
        return f"{conv}w_ij = {sim}; y_i = {y}"


mixing_function = AttentionFamily.mixing_function


def mixing_denominator(options: dict) -> str:
    """The denominator the mixing itself divides by: none where the count power divides the values instead."""
    if options["denominator"] == "count_power" and options["count_power_on"] == "values":
        return "none"
    return options["denominator"]


def count_power_values(v: torch.Tensor, counts: torch.Tensor, power: torch.Tensor) -> torch.Tensor:
    """v_j / j^power, the first study's cosine attention: v [B, T, H, Dv]; counts [B, T] (j: real tokens
    through j, this one included); power [H]. In v's dtype."""
    divisor = counts.float()[..., None] ** power.float()  # [B, T, H]
    return (v.float() / divisor[..., None]).to(v.dtype)
