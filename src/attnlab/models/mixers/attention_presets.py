"""The named variants of the 2Mamba study as presets of `attention_family`.

Two generations of names:

* the first study (`attention_type` of its README): softmax variants with clamped scores, gates,
  norms and division by the number of attended tokens ("divS"), with RoPE and per-head norms;
* the later study: a dictionary of orthogonal options (power, feature map, input conv, norm type,
  A mask, dt on values, D residual, z gate), without positional encoding and with one RMSNorm over
  all heads as its "output norm". 2Mamba and 2Mamba-E are two of these.

The study's plain `softmax` is the `softmax` mixer itself. Each preset lists only the options that
differ from the family defaults.

Each study name computes the function of the study's published code (`LlamaDecoderLayer.py` for the
first study, `LlamaDecoderLayerClean.py` for the later one), as its runs were made, including what
looks like a slip there; the norms keep the study's epsilons (`torch.nn.LayerNorm`'s 1e-5,
`torch.nn.RMSNorm`'s default: the fp32 machine epsilon). Where the published function differs from
what its name describes, a `<name>_clean` preset is the described function (`CLEAN`, with the
difference stated). The later study's plain softmax rotates q and k with interleaved RoPE; attnlab's
`softmax` rotates halves: the same function after a fixed permutation of the q and k rows
(`attnlab.models.mixers.softmax.interleaved_rope_permutation`).
"""

from __future__ import annotations

import torch

from attnlab.models.mixers.registry import register_preset
from attnlab.models.mixers.attention_family import AttentionFamily

CLAMP = 5.0  # the first study clamps scale * q.k at 5 before exp
LAYERNORM_EPS = 1e-5  # torch.nn.LayerNorm's default, the study's layer norms
RMSNORM_EPS = torch.finfo(torch.float32).eps  # torch.nn.RMSNorm(eps=None): fp32's machine epsilon (also for bf16 inputs)

# ---------------------------------------------------------------- the first study

_softmax_like = dict(similarity="softmax", clamp_scores=CLAMP)
_exp_divs = dict(similarity="exp", clamp_scores=CLAMP, denominator="count")
_layernorm = dict(output_norm="layernorm", output_norm_eps=LAYERNORM_EPS)
_rmsnorm = dict(output_norm="rmsnorm", output_norm_eps=RMSNORM_EPS)
_gated = dict(_exp_divs, in_gate=True, out_gate="before_norm", **_layernorm)

FIRST_STUDY = {
    "softmax_clamp_denom": dict(_softmax_like, denominator="sum_clamped"),
    "softmax_detach_denom": dict(_softmax_like, denominator="sum_detached"),
    # the published code divides by the detached sum plus 1e-4 (no clamp at 1, unlike softmax_detach_denom)
    "softmax_detach_denom_gate": dict(_softmax_like, denominator="sum_detached_eps", out_gate="before_norm"),
    "softmax_divs": dict(_exp_divs),
    "softmax_gate": dict(_exp_divs, denominator="none", out_gate="before_norm"),
    "softmax_divS_gate": dict(_exp_divs, out_gate="before_norm"),
    # the gate scales the rows of the attention matrix: the same function as gating the output
    "softmax_divS_gatev2": dict(_exp_divs, out_gate="before_norm"),
    "softmax_divS_norm": dict(_exp_divs, **_rmsnorm),
    # the published code forms the normalised weights but multiplies the values by the un-normalised series
    "softmax_taylor_80terms": dict(similarity="taylor", taylor_terms=80, denominator="none"),
    "gated_softmax": dict(_gated),
    "gated_softmax_no_norm": dict(_gated, output_norm="none", output_norm_eps=None),
    "gated_softmax_no_in_gate": dict(_gated, in_gate=False),
    "gated_softmax_no_out_gate": dict(_gated, out_gate="none"),
    "gated_softmax_no_out_gate_no_norm": dict(_gated, out_gate="none", output_norm="none", output_norm_eps=None),
    "gated_softmax_no_in_gate_no_norm": dict(_gated, in_gate=False, output_norm="none", output_norm_eps=None),
    "gated_relu_no_in_gate_no_norm": dict(
        _gated, similarity="power1", feature_map="relu", in_gate=False, output_norm="none", output_norm_eps=None
    ),
    "gated_softmax_no_gate": dict(_exp_divs, **_layernorm),
    "gated_softmax_no_gate_rmsnorm": dict(_exp_divs, **_rmsnorm),
    "gated_softmax_no_gate_rmsnorm_nodivS": dict(_exp_divs, denominator="none", **_rmsnorm),
    "gated_softmax_no_gate_L2norm_nodivS": dict(_exp_divs, denominator="none", output_norm="l2"),
    "gated_softmax_no_gate_L2norm_nodivS_noclamp": dict(
        similarity="exp", denominator="none", output_norm="l2"
    ),
    "gated_ReLU_no_gate_L2norm_nodivS_noclamp": dict(
        similarity="power1", feature_map="relu", denominator="none", output_norm="l2"
    ),
    "gated_softmax_out_gate_L2norm_nodivS_noclamp": dict(
        similarity="exp", denominator="none", output_norm="l2", out_gate="before_norm"
    ),
    "gated_softmax_post_out_gate_L2norm_nodivS_noclamp": dict(
        similarity="exp", denominator="none", output_norm="l2", out_gate="after_norm"
    ),
    "gated_softmax_no_gate_no_norm": dict(_exp_divs),
    "linear_elu": dict(similarity="power1", feature_map="elu1"),
    "linear_relu": dict(similarity="power1", feature_map="relu"),
    # cosine features, no scale, each value v_j divided by j ** sigmoid(c) with c learned per head; the
    # published code normalises q and k with F.normalize's default dim, which on [B, H, T, D] is the heads axis
    "linear_cosine": dict(
        similarity="power1", feature_map="l2_heads", qk_scale=1.0, denominator="count_power", count_power_on="values"
    ),
}

# the functions the first study's names describe, where its published code computes another (see FIRST_STUDY)
CLEAN = {
    "softmax_detach_denom_gate_clean": (
        dict(_softmax_like, denominator="sum_detached", out_gate="before_norm"),
        "clean `softmax_detach_denom_gate`: divides by sg(max(Σw, 1)) as `softmax_detach_denom` does, "
        "where the published code divides by sg(Σw) + 1e-4",
    ),
    "softmax_taylor_80terms_clean": (
        dict(similarity="taylor", taylor_terms=80),
        "clean `softmax_taylor_80terms`: the series normalised by its row sum (softmax with a truncated exp), "
        "where the published code returns the un-normalised series",
    ),
    "linear_cosine_clean": (
        dict(similarity="power1", feature_map="l2", qk_scale=1.0, denominator="count_power"),
        "clean `linear_cosine`: q and k unit length over each head's dim and the output row i divided by i^σ(c), "
        "where the published code normalises across the heads and divides each value v_j by j^σ(c)",
    ),
}

# ---------------------------------------------------------------- the later study

_later = dict(rope=False)
_linear = dict(_later, similarity="power1")
_output_norm = dict(_linear, denominator="none", output_norm_per_head=False, **_rmsnorm)
_softplus_conv2 = dict(_output_norm, decay="neg_softplus", conv_size=2)
_softplus_conv2_dt = dict(_softplus_conv2, value_dt=True)
_sm_norm_softplus_conv2 = dict(_later, denominator="sum", decay="neg_softplus", conv_size=2)

LATER_STUDY = {
    "linear": dict(_linear, feature_map="relu"),
    "linear__output_norm": dict(_output_norm),
    "linear__output_norm__ReLU": dict(_output_norm, feature_map="relu"),
    "linear__output_norm__in_conv_k_2": dict(_output_norm, conv_size=2),
    "linear__output_norm__in_conv_k_3": dict(_output_norm, conv_size=3),
    "linear__output_norm__in_conv_k_4": dict(_output_norm, conv_size=4),
    "linear__output_norm__in_conv_k_2__silu": dict(_output_norm, conv_size=2, feature_map="silu"),
    "linear__output_norm__in_conv_k_3__silu": dict(_output_norm, conv_size=3, feature_map="silu"),
    "linear__output_norm__in_conv_k_4__silu": dict(_output_norm, conv_size=4, feature_map="silu"),
    "linear__output_norm__D_res": dict(_output_norm, d_residual=True),
    "linear__output_norm__Z_out_gate": dict(_output_norm, z_gate=True),
    "linear__output_norm__dt_on_values": dict(_output_norm, value_dt=True),
    "linear__output_norm__A_mask_type_discretize": dict(_output_norm, decay="discretize"),
    "linear__output_norm__A_mask_type_neg_softplus": dict(_output_norm, decay="neg_softplus"),
    "linear__output_norm__A_mask_type_discretize__in_conv_k_2": dict(_output_norm, decay="discretize", conv_size=2),
    "linear__output_norm__A_mask_type_neg_softplus__in_conv_k_2": dict(_softplus_conv2),
    "linear__out_norm__A_mask_type_neg_softplus__in_conv_k_2": dict(_softplus_conv2),
    "linear__output_norm__A_mask_type_neg_softplus__in_conv_k_2__dt_on_values": dict(_softplus_conv2_dt),
    "linear__output_norm__A_mask_type_neg_softplus__in_conv_k_2__dt_on_values__silu": dict(
        _softplus_conv2_dt, feature_map="silu"
    ),
    "linear__output_norm__A_mask_type_neg_softplus__in_conv_k_2__dt_on_values__D_res": dict(
        _softplus_conv2_dt, d_residual=True
    ),
    "linear__output_norm__A_mask_type_neg_softplus__in_conv_k_2__dt_on_values__Z_out_gate": dict(
        _softplus_conv2_dt, z_gate=True
    ),
    "squared__output_norm__A_mask_type_neg_softplus__in_conv_k_2__dt_on_values": dict(
        _softplus_conv2_dt, similarity="power2"
    ),
    "squared__sm_norm__A_mask_type_neg_softplus__in_conv_k_2__dt_on_values": dict(
        _sm_norm_softplus_conv2, similarity="power2", value_dt=True
    ),
    "squared__sm_norm__A_mask_type_neg_softplus__in_conv_k_2": dict(_sm_norm_softplus_conv2, similarity="power2"),
    "exp__sm_norm__A_mask_type_neg_softplus__in_conv_k_2__dt_on_values": dict(
        _sm_norm_softplus_conv2, similarity="exp", value_dt=True
    ),
    "exp__sm_norm__A_mask_type_neg_softplus__in_conv_k_2": dict(_sm_norm_softplus_conv2, similarity="exp"),
}

# the paper's names for its two main models
ALIASES = {
    "2mamba": "squared__sm_norm__A_mask_type_neg_softplus__in_conv_k_2",
    "2mamba-e": "exp__sm_norm__A_mask_type_neg_softplus__in_conv_k_2",
}

PUBLISHED = "published code"
for _name, _options in FIRST_STUDY.items():
    register_preset(_name, AttentionFamily, _options, note=PUBLISHED)
for _name, (_options, _note) in CLEAN.items():
    register_preset(_name, AttentionFamily, _options, note=_note)
# where the published function and attnlab's differ on inputs of measure > 0, stated beside the preset
NOTES = {
    "linear": f"{PUBLISHED}, except where relu(q_i) · relu(k_j) = 0 for every j <= i: the study returns the unweighted "
              "sum of the values there, attnlab 0",
}
for _name, _options in LATER_STUDY.items():
    register_preset(_name, AttentionFamily, _options, note=NOTES.get(_name, PUBLISHED))
for _alias, _target in ALIASES.items():
    register_preset(_alias, AttentionFamily, LATER_STUDY[_target], note=f"{PUBLISHED} (`{_target}`)")
