"""The named variants of the 2Mamba study as presets of `attention_family`.

Two generations of names:

* the first study (`attention_type` of its README): softmax variants with clamped scores, gates,
  norms and division by the number of attended tokens ("divS"), with RoPE and per-head norms;
* the later study: a dictionary of orthogonal options (power, feature map, input conv, norm type,
  A mask, dt on values, D residual, z gate), without positional encoding and with one RMSNorm over
  all heads as its "output norm". 2Mamba and 2Mamba-E are two of these.

The study's plain `softmax` is the `softmax` mixer itself. Each preset lists only the options that
differ from the family defaults.
"""

from __future__ import annotations

from attnlab.models.mixers import register_preset
from attnlab.models.mixers.attention_family import AttentionFamily

CLAMP = 5.0  # the first study clamps scale * q.k at 5 before exp

# ---------------------------------------------------------------- the first study

_softmax_like = dict(similarity="softmax", clamp_scores=CLAMP)
_exp_divs = dict(similarity="exp", clamp_scores=CLAMP, denominator="count")
_gated = dict(_exp_divs, in_gate=True, out_gate="before_norm", output_norm="layernorm")

FIRST_STUDY = {
    "softmax_clamp_denom": dict(_softmax_like, denominator="sum_clamped"),
    "softmax_detach_denom": dict(_softmax_like, denominator="sum_detached"),
    "softmax_detach_denom_gate": dict(_softmax_like, denominator="sum_detached", out_gate="before_norm"),
    "softmax_divs": dict(_exp_divs),
    "softmax_gate": dict(_exp_divs, denominator="none", out_gate="before_norm"),
    "softmax_divS_gate": dict(_exp_divs, out_gate="before_norm"),
    # the gate scales the rows of the attention matrix: the same function as gating the output
    "softmax_divS_gatev2": dict(_exp_divs, out_gate="before_norm"),
    "softmax_divS_norm": dict(_exp_divs, output_norm="rmsnorm"),
    "softmax_taylor_80terms": dict(similarity="taylor", taylor_terms=80),
    "gated_softmax": dict(_gated),
    "gated_softmax_no_norm": dict(_gated, output_norm="none"),
    "gated_softmax_no_in_gate": dict(_gated, in_gate=False),
    "gated_softmax_no_out_gate": dict(_gated, out_gate="none"),
    "gated_softmax_no_out_gate_no_norm": dict(_gated, out_gate="none", output_norm="none"),
    "gated_softmax_no_in_gate_no_norm": dict(_gated, in_gate=False, output_norm="none"),
    "gated_relu_no_in_gate_no_norm": dict(
        _gated, similarity="power1", feature_map="relu", in_gate=False, output_norm="none"
    ),
    "gated_softmax_no_gate": dict(_exp_divs, output_norm="layernorm"),
    "gated_softmax_no_gate_rmsnorm": dict(_exp_divs, output_norm="rmsnorm"),
    "gated_softmax_no_gate_rmsnorm_nodivS": dict(_exp_divs, denominator="none", output_norm="rmsnorm"),
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
    # cosine features, no scale, values divided by S ** sigmoid(c) with c learned per head
    "linear_cosine": dict(similarity="power1", feature_map="l2", qk_scale=1.0, denominator="count_power"),
}

# ---------------------------------------------------------------- the later study

_later = dict(rope=False)
_linear = dict(_later, similarity="power1")
_output_norm = dict(_linear, denominator="none", output_norm="rmsnorm", output_norm_per_head=False)
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

for _name, _options in {**FIRST_STUDY, **LATER_STUDY}.items():
    register_preset(_name, AttentionFamily, _options)
for _alias, _target in ALIASES.items():
    register_preset(_alias, AttentionFamily, LATER_STUDY[_target])
