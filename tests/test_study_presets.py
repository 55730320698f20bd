"""Every preset named after the 2Mamba study computes the function of the study's published code.

Each study layer is written here again, in float64, from the formulas of the study's code
(`GPT_Trainer/LlamaDecoderLayer.py` for the first study, `LlamaDecoderLayerClean.py` for the later
one), in its own layout [batch, heads, time, dim], from the weights of an attnlab layer; attnlab's
layer (fp32, the PyTorch reference) must give the same output. The `_clean` presets are the
functions the names describe where the published code computes another; they are checked against
the clean formula, and the presets table of docs/mixers.md states what they change.
"""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import masked_logits_and_grads

from attnlab.models import MIXERS, AttnLabConfig
from attnlab.models.mixers.attention_family import AttentionFamily
from attnlab.models.mixers.attention_presets import ALIASES, CLEAN, FIRST_STUDY, LATER_STUDY
from attnlab.models.mixers.softmax import SoftmaxAttention, interleaved_rope_permutation, permute_heads_rows

HIDDEN, HEADS = 32, 4
HEAD_DIM = HIDDEN // HEADS
FP32_EPS = torch.finfo(torch.float32).eps


def study_layer(name: str, seed: int = 0) -> AttentionFamily:
    """An attnlab layer of the preset, every vector parameter moved off its init so that it matters."""
    torch.manual_seed(seed)
    config = AttnLabConfig(vocab_size=64, hidden_size=HIDDEN, num_layers=1, num_heads=HEADS, mixer=name)
    layer = MIXERS[name](config, 0).eval()
    with torch.no_grad():
        for param_name, p in layer.named_parameters():
            if p.dim() == 1 and param_name != "A_log" or param_name == "D":
                p.add_(0.3 * torch.randn_like(p))
    return layer


def inputs(seed: int = 1, batch: int = 2, seq_len: int = 9, scale: float = 2.0) -> torch.Tensor:
    return scale * torch.randn(batch, seq_len, HIDDEN, generator=torch.Generator().manual_seed(seed))


def weights(layer: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().double() for name, p in layer.named_parameters()}


def assert_same_function(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-5) -> None:
    err = (actual.double() - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert err <= rel * scale, f"max abs error {err:.3g} exceeds {rel:g} x max |expected| {scale:.3g}"


# ---------------------------------------------------------------- the study's pieces, [B, H, T, D], float64


def heads(t: torch.Tensor) -> torch.Tensor:  # [B, T, H * D] -> [B, H, T, D]
    return t.view(t.shape[0], t.shape[1], HEADS, -1).transpose(1, 2)


def merge(t: torch.Tensor) -> torch.Tensor:  # [B, H, T, D] -> [B, T, H * D]
    return t.transpose(1, 2).reshape(t.shape[0], t.shape[2], -1)


def gate(x: torch.Tensor, w: dict, name: str) -> torch.Tensor:  # sigmoid(W x + b) per head: [B, H, T, 1]
    return torch.sigmoid(x @ w[f"{name}.weight"].T + w[f"{name}.bias"]).transpose(1, 2)[..., None]


def rotate_half_rope(t: torch.Tensor, theta: float) -> torch.Tensor:
    """Hugging Face Llama's RoPE (the first study): pairs (i, i + D/2) rotated by position * theta^(-2i/D)."""
    d = t.shape[-1]
    inv_freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.arange(t.shape[2], dtype=torch.float64)[:, None] * inv_freq
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    half1, half2 = t[..., : d // 2], t[..., d // 2:]
    return t * cos + torch.cat((-half2, half1), -1) * sin


def interleaved_rope(t: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """`rotary_embedding_torch`'s RoPE (the later study's softmax): pairs (2i, 2i + 1), same angles."""
    d = t.shape[-1]
    inv_freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = (torch.arange(t.shape[2], dtype=torch.float64)[:, None] * inv_freq).repeat_interleave(2, -1)
    even, odd = t[..., 0::2], t[..., 1::2]
    rotated = torch.stack((-odd, even), -1).flatten(-2)
    return t * angles.cos() + rotated * angles.sin()


def causal(seq_len: int) -> torch.Tensor:
    return torch.tril(torch.ones(seq_len, seq_len, dtype=torch.float64))


def counts(seq_len: int) -> torch.Tensor:  # how many keys each query attends to: [T, 1]
    return torch.arange(1, seq_len + 1, dtype=torch.float64)[:, None]


def layernorm(t: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    mean = t.mean(-1, keepdim=True)
    var = ((t - mean) ** 2).mean(-1, keepdim=True)
    return (t - mean) / torch.sqrt(var + eps) * weight + bias


def rmsnorm(t: torch.Tensor, weight: torch.Tensor, eps: float = FP32_EPS) -> torch.Tensor:
    """torch.nn.RMSNorm with eps=None: the machine epsilon of fp32 (its compute type, also for 16-bit inputs)."""
    return t / torch.sqrt((t * t).mean(-1, keepdim=True) + eps) * weight


def l2norm(t: torch.Tensor) -> torch.Tensor:
    return t / t.norm(dim=-1, keepdim=True).clamp(min=1e-12)


def taylor_exp(s: torch.Tensor, terms: int = 80) -> torch.Tensor:
    out, term = torch.ones_like(s), torch.ones_like(s)
    for n in range(1, terms):
        term = term * s / n
        out = out + term
    return out


# ---------------------------------------------------------------- the first study


# its lists of which gated variants leave out the output gate, the input gate, the division by S
NO_OUT_GATE = {
    "gated_softmax_no_out_gate", "gated_softmax_no_out_gate_no_norm", "gated_softmax_no_gate",
    "gated_softmax_no_gate_rmsnorm", "gated_softmax_no_gate_L2norm_nodivS", "gated_softmax_no_gate_L2norm_nodivS_noclamp",
    "gated_ReLU_no_gate_L2norm_nodivS_noclamp", "gated_softmax_no_gate_rmsnorm_nodivS", "gated_softmax_no_gate_no_norm",
}
NO_IN_GATE = NO_OUT_GATE - {"gated_softmax_no_out_gate", "gated_softmax_no_out_gate_no_norm"} | {
    "gated_softmax_no_in_gate", "gated_softmax_no_in_gate_no_norm", "gated_relu_no_in_gate_no_norm",
    "gated_softmax_out_gate_L2norm_nodivS_noclamp", "gated_softmax_post_out_gate_L2norm_nodivS_noclamp",
}
NO_DIV_S = {
    "gated_softmax_no_gate_L2norm_nodivS", "gated_softmax_no_gate_rmsnorm_nodivS",
    "gated_softmax_no_gate_L2norm_nodivS_noclamp", "gated_ReLU_no_gate_L2norm_nodivS_noclamp",
}
NO_NORM = {
    "gated_softmax_no_out_gate_no_norm", "gated_softmax_no_in_gate_no_norm", "gated_relu_no_in_gate_no_norm",
    "gated_softmax_no_norm", "gated_softmax_no_gate_no_norm",
}
L2_NORM = {
    "gated_softmax_no_gate_L2norm_nodivS", "gated_softmax_no_gate_L2norm_nodivS_noclamp",
    "gated_ReLU_no_gate_L2norm_nodivS_noclamp", "gated_softmax_out_gate_L2norm_nodivS_noclamp",
    "gated_softmax_post_out_gate_L2norm_nodivS_noclamp",
}
RMS_NORM = {"gated_softmax_no_gate_rmsnorm", "gated_softmax_no_gate_rmsnorm_nodivS"}


def first_study(kind: str, x: torch.Tensor, w: dict, theta: float) -> torch.Tensor:
    """The first study's attention layer `kind` (its `attention_type`), x [B, T, C] float64."""
    x = x.double()
    w_q, w_k, w_v = w["qkv_proj.weight"].chunk(3, 0)
    q, k, v = heads(x @ w_q.T), heads(x @ w_k.T), heads(x @ w_v.T)
    q, k = rotate_half_rope(q, theta), rotate_half_rope(k, theta)
    seq_len = x.shape[1]
    mask, count = causal(seq_len), counts(seq_len)
    s = q @ k.mT / math.sqrt(HEAD_DIM)

    if kind in ("softmax_clamp_denom", "softmax_detach_denom", "softmax_divs"):
        a = s.clamp(max=5).exp() * mask
        den = count if kind == "softmax_divs" else a.sum(-1, keepdim=True).clamp(min=1)
        o = a / den @ v
    elif kind in ("softmax_detach_denom_gate", "softmax_gate", "softmax_divS_gate", "softmax_divS_gatev2"):
        g = gate(x, w, "out_gate_proj")
        a = s.clamp(max=5).exp() * mask
        if kind == "softmax_divS_gatev2":  # the gate on the weights' rows
            o = (a * g / count) @ v
        else:
            den = {"softmax_detach_denom_gate": a.sum(-1, keepdim=True) + 1e-4, "softmax_gate": 1.0,
                   "softmax_divS_gate": count}[kind]
            o = (a / den @ v) * g
    elif kind == "softmax_divS_norm":
        o = rmsnorm((s.clamp(max=5).exp() * mask) / count @ v, w["out_norm.weight"])
    elif kind == "softmax_taylor_80terms":  # the normalised weights are formed, then the series is used
        o = (taylor_exp(s) * mask) @ v
    elif kind.startswith("gated_"):
        g = torch.ones_like(v[..., :1]) if kind in NO_OUT_GATE else gate(x, w, "out_gate_proj")
        if kind not in NO_IN_GATE:
            v = v * gate(x, w, "in_gate_proj")
        if kind in ("gated_ReLU_no_gate_L2norm_nodivS_noclamp", "gated_relu_no_in_gate_no_norm"):
            s = F.relu(q) @ F.relu(k).mT / math.sqrt(HEAD_DIM)
        if kind.endswith("_noclamp") and "ReLU" not in kind:
            a = s.exp()
        elif kind == "gated_ReLU_no_gate_L2norm_nodivS_noclamp":
            a = s
        elif kind == "gated_relu_no_in_gate_no_norm":
            a = s.clamp(max=5)
        else:
            a = s.clamp(max=5).exp()
        o = g * ((a * mask) @ v)
        if kind not in NO_DIV_S:
            o = o / count
        if kind in L2_NORM:
            o = l2norm(o)
        elif kind in RMS_NORM:
            o = rmsnorm(o, w["out_norm.weight"])
        elif kind not in NO_NORM:
            o = layernorm(o, w["out_norm.weight"], w["out_norm.bias"])
        if kind == "gated_softmax_post_out_gate_L2norm_nodivS_noclamp":
            o = o * g
    elif kind == "linear_elu":
        a = (F.elu(q) + 1) @ (F.elu(k) + 1).mT * mask
        o = a / a.sum(-1, keepdim=True) @ v
    elif kind == "linear_relu":
        a = F.relu(q) @ F.relu(k).mT * mask
        o = a / (a.sum(-1, keepdim=True) + 1e-8) @ v
    elif kind == "linear_cosine":  # F.normalize's default dim on [B, H, T, D]: across the heads
        q, k = q / q.norm(dim=1, keepdim=True).clamp(min=1e-12), k / k.norm(dim=1, keepdim=True).clamp(min=1e-12)
        power = torch.sigmoid(w["count_power_logit"]).view(1, -1, 1, 1)
        v = v / count**power  # each value v_j by j^σ(c)
        o = ((q @ k.mT) * mask) @ v
    else:
        raise KeyError(kind)
    return merge(o) @ w["o_proj.weight"].T


def first_study_clean(kind: str, x: torch.Tensor, w: dict, theta: float) -> torch.Tensor:
    """The functions the `_clean` presets compute: what the first study's names describe."""
    x = x.double()
    w_q, w_k, w_v = w["qkv_proj.weight"].chunk(3, 0)
    q, k, v = heads(x @ w_q.T), heads(x @ w_k.T), heads(x @ w_v.T)
    q, k = rotate_half_rope(q, theta), rotate_half_rope(k, theta)
    seq_len = x.shape[1]
    mask, count = causal(seq_len), counts(seq_len)
    s = q @ k.mT / math.sqrt(HEAD_DIM)
    if kind == "softmax_detach_denom_gate_clean":
        a = s.clamp(max=5).exp() * mask
        o = (a / a.sum(-1, keepdim=True).clamp(min=1) @ v) * gate(x, w, "out_gate_proj")
    elif kind == "softmax_taylor_80terms_clean":
        a = taylor_exp(s) * mask
        o = a / a.sum(-1, keepdim=True) @ v
    elif kind == "linear_cosine_clean":  # unit length over each head's dim; the output row i divided by i^σ(c)
        power = torch.sigmoid(w["count_power_logit"]).view(1, -1, 1, 1)
        o = ((l2norm(q) @ l2norm(k).mT) * mask) @ v / count**power
    else:
        raise KeyError(kind)
    return merge(o) @ w["o_proj.weight"].T


# ---------------------------------------------------------------- the later study


def later_study_config(name: str) -> dict:
    """The later study's layer config for one of its names (power, q/k activation, input conv, norm
    type, A mask, dt on the values, D residual, z gate; no positional encoding, no dt bias)."""
    parts = name.split("__")
    config = {
        "power": {"linear": "1", "squared": "2", "exp": "exp"}[parts[0]],
        "qk_activation": "relu" if name == "linear" or "ReLU" in parts else "silu" if "silu" in parts else "none",
        "conv": next((int(p[len("in_conv_k_"):]) for p in parts if p.startswith("in_conv_k_")), 0),
        "norm": "sm_norm" if name == "linear" or "sm_norm" in parts else "output_norm",
        "A_mask": next((p[len("A_mask_type_"):] for p in parts if p.startswith("A_mask_type_")), "none"),
        "dt_on_values": "dt_on_values" in parts,
        "D_res": "D_res" in parts,
        "z_gate": "Z_out_gate" in parts,
    }
    return config


def later_study(name: str, x: torch.Tensor, w: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The later study's attention layer `name`, x [B, T, C] float64. Returns y and, per [B, T], whether
    a head's weights were all 0 there (the study then sums the values unweighted: see `linear`'s note)."""
    c = later_study_config(name)
    x = x.double()
    seq_len = x.shape[1]
    qkv = x @ w["qkv_proj.weight"].T  # [B, T, 3 H D]
    if c["conv"]:  # causal depthwise conv with bias, no activation
        width = c["conv"]
        padded = F.pad(qkv.transpose(1, 2), (width - 1, 0))
        qkv = F.conv1d(padded, w["conv1d.weight"], w["conv1d.bias"], groups=qkv.shape[-1]).transpose(1, 2)
    q, k, v = (heads(t) for t in qkv.chunk(3, -1))
    dt = F.softplus(x @ w["dt_proj.weight"].T) if "dt_proj.weight" in w else None  # [B, T, H]
    if c["A_mask"] == "discretize":
        a = -torch.exp(w["A_log"]) * dt
    elif c["A_mask"] == "neg_softplus":
        a = -F.softplus(x @ w["decay_proj.weight"].T)
    else:
        a = None
    d_res = v * w["D"][None, :, None, :] if c["D_res"] else None
    if c["dt_on_values"]:
        v = v * dt.transpose(1, 2)[..., None]
    act = {"relu": F.relu, "silu": F.silu, "none": lambda t: t}[c["qk_activation"]]
    q, k = act(q), act(k)
    s = q @ k.mT / math.sqrt(HEAD_DIM)
    weights_ = s.exp() if c["power"] == "exp" else s ** int(c["power"])
    mask = causal(seq_len).bool()
    if a is not None:
        cum = a.cumsum(1).transpose(1, 2)  # [B, H, T]
        weights_ = weights_ * (cum[..., :, None] - cum[..., None, :]).masked_fill(~mask, -math.inf).exp()
    else:
        weights_ = weights_.masked_fill(~mask, 0.0)
    zero_rows = torch.zeros(x.shape[:2], dtype=torch.bool)
    if c["norm"] == "sm_norm":
        den = weights_.sum(-1, keepdim=True)
        weights_ = torch.where(den > 0, weights_ / den, mask.double())  # no weight anywhere: every value, weight 1
        zero_rows = (den[..., 0] == 0).any(1)
    o = weights_ @ v
    if d_res is not None:
        o = o + d_res
    if c["z_gate"]:
        o = o * heads(F.silu(x @ w["z_proj.weight"].T + w["z_proj.bias"]))
    o = merge(o)
    if c["norm"] == "output_norm":
        o = rmsnorm(o, w["out_norm.weight"])  # one RMSNorm over all heads, nn.RMSNorm's eps
    return o @ w["o_proj.weight"].T, zero_rows


# ---------------------------------------------------------------- the tests


STUDY_PRESETS = {name for name in MIXERS if getattr(MIXERS[name], "family", None) is AttentionFamily}


def test_every_registered_family_preset_is_checked_here():
    """Each preset is a study name (checked against the published function) or a documented clean variant."""
    checked = set(FIRST_STUDY) | set(LATER_STUDY) | set(ALIASES) | set(CLEAN)
    assert STUDY_PRESETS == checked
    for name in CLEAN:
        note = MIXERS[name].preset_note
        assert note.startswith(f"clean `{name.removesuffix('_clean')}`") and "published code" in note
    for name in set(FIRST_STUDY) | set(LATER_STUDY) | set(ALIASES):
        assert MIXERS[name].preset_note.startswith("published code")


@pytest.mark.parametrize("name", sorted(FIRST_STUDY))
def test_first_study_preset_computes_the_published_function(name):
    layer = study_layer(name)
    x = inputs()
    with torch.no_grad():
        y, _ = layer(x)
    assert_same_function(y, first_study(name, x, weights(layer), layer.rope_theta))


@pytest.mark.parametrize("name", sorted(CLEAN))
def test_clean_preset_computes_the_function_its_name_describes(name):
    layer = study_layer(name)
    x = inputs()
    with torch.no_grad():
        y, _ = layer(x)
    assert_same_function(y, first_study_clean(name, x, weights(layer), layer.rope_theta))


@pytest.mark.parametrize("name", sorted(CLEAN))
def test_clean_preset_differs_from_the_published_function(name):
    published = name.removesuffix("_clean")
    clean, faithful = study_layer(name), study_layer(published)
    faithful.load_state_dict(clean.state_dict())
    x = inputs()
    with torch.no_grad():
        difference = (clean(x)[0] - faithful(x)[0]).norm() / faithful(x)[0].norm()
    assert difference > 1e-3


@pytest.mark.parametrize("name", sorted(LATER_STUDY) + sorted(ALIASES))
def test_later_study_preset_computes_the_published_function(name):
    layer = study_layer(name)
    x = inputs(scale=1.0)
    with torch.no_grad():
        y, _ = layer(x)
    expected, zero_rows = later_study(ALIASES.get(name, name), x, weights(layer))
    if name != "linear":
        assert not zero_rows.any()
    assert_same_function(y[~zero_rows], expected[~zero_rows])


def test_linear_differs_from_the_study_only_where_a_query_has_no_weight():
    """relu features with disjoint supports give a query all-zero weights: the study's `linear` then
    returns the unweighted sum of the values, attnlab 0 (the preset's note says so)."""
    layer = study_layer("linear")
    x = inputs(scale=1.0)
    expected, zero_rows = later_study("linear", x, weights(layer))
    assert zero_rows.any(), "these inputs should give some query no weight"
    assert "unweighted sum" in MIXERS["linear"].preset_note


def test_study_norms_keep_the_study_epsilons():
    """nn.LayerNorm's 1e-5 and nn.RMSNorm's fp32 machine epsilon, whatever model.norm_eps says."""

    def out_norm(name, **options):
        config = AttnLabConfig(vocab_size=64, hidden_size=HIDDEN, num_layers=1, num_heads=HEADS, mixer=name,
                               norm_eps=1e-3, mixer_options=options)
        return MIXERS[name](config, 0).out_norm

    assert out_norm("gated_softmax").eps == 1e-5
    for name in ("softmax_divS_norm", "gated_softmax_no_gate_rmsnorm", "linear__output_norm", "linear__output_norm__D_res"):
        assert out_norm(name).eps == FP32_EPS
    assert out_norm("gated_softmax", output_norm_eps=None).eps == 1e-3


def test_a_model_saved_before_the_published_functions_keeps_its_function(tmp_path):
    """A saved config holds every option; one written before `count_power_on` and `output_norm_eps` existed
    lacks them and reloads as the function it was trained with (the clean one), not the preset's new default."""
    from attnlab.models import AttnLabForCausalLM

    for name, clean in (("linear_cosine", "linear_cosine_clean"), ("gated_softmax", None)):
        torch.manual_seed(0)
        model = AttnLabForCausalLM(AttnLabConfig(vocab_size=64, hidden_size=HIDDEN, num_layers=1, num_heads=HEADS,
                                                 mixer=name, mixer_options=MIXERS[clean or name].preset_options))
        model.save_pretrained(tmp_path / name)
        config_file = tmp_path / name / "config.json"
        saved = json.loads(config_file.read_text())
        for key in AttentionFamily.added_options:
            del saved["mixer_options"][key]
        config_file.write_text(json.dumps(saved))
        options = AttnLabForCausalLM.from_pretrained(tmp_path / name).config.mixer_options
        assert options["count_power_on"] == "output" and options["output_norm_eps"] is None
    assert MIXERS["linear_cosine"].resolve_options({"feature_map": "l2"})["count_power_on"] == "values"


def test_linear_cosine_step_form_divides_each_value_by_its_own_count():
    """Decoding token by token gives the parallel form's outputs: each value keeps the divisor of its position."""
    layer = study_layer("linear_cosine")
    x = inputs(batch=1, seq_len=6)
    with torch.no_grad():
        full, _ = layer(x)
        _, cache = layer(x[:, :3], use_cache=True)
        steps = []
        for t in range(3, 6):
            y, cache = layer(x[:, t:t + 1], cache=cache, use_cache=True)
            steps.append(y)
    assert_same_function(torch.cat(steps, 1), full[:, 3:].double())


def test_interleaved_rope_softmax_is_attnlab_softmax_with_permuted_q_k_rows():
    """The later study's softmax (interleaved RoPE) equals attnlab's `softmax` (rotate-half) once the rows
    of each head of W_q and W_k are put in `interleaved_rope_permutation`'s order."""
    torch.manual_seed(0)
    config = AttnLabConfig(vocab_size=64, hidden_size=HIDDEN, num_layers=1, num_heads=HEADS, mixer="softmax")
    layer = SoftmaxAttention(config, 0).eval()
    w_q, w_k, w_v, w_o = (torch.randn_like(p.weight) * HIDDEN**-0.5 for p in (layer.q_proj, layer.k_proj, layer.v_proj,
                                                                              layer.o_proj))
    perm = interleaved_rope_permutation(HEAD_DIM)
    with torch.no_grad():
        layer.q_proj.weight.copy_(permute_heads_rows(w_q, HEAD_DIM, perm))
        layer.k_proj.weight.copy_(permute_heads_rows(w_k, HEAD_DIM, perm))
        layer.v_proj.weight.copy_(w_v)
        layer.o_proj.weight.copy_(w_o)
    x = inputs(scale=1.0)
    with torch.no_grad():
        y, _ = layer(x)
    xd = x.double()
    q, k, v = (heads(xd @ m.double().T) for m in (w_q, w_k, w_v))
    q, k = interleaved_rope(q, config.rope_theta), interleaved_rope(k, config.rope_theta)
    s = (q @ k.mT / math.sqrt(HEAD_DIM)).masked_fill(~causal(x.shape[1]).bool(), -math.inf)
    expected = merge(torch.softmax(s, -1) @ v) @ w_o.double().T
    assert_same_function(y, expected)


# ---------------------------------------------------------------- on the GPU: the kernels against the reference

CHANGED = ["linear_cosine", "softmax_taylor_80terms", "softmax_detach_denom_gate", "gated_softmax", "softmax_divS_norm",
           "linear__output_norm"]


def gpu_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", CHANGED)
def test_study_preset_on_the_kernels_in_bf16_matches_the_fp32_reference(name):
    """attnlab's kernels (bf16 autocast) against the fp32 PyTorch reference on the same GPU: logits of a
    left-padded batch, every gradient, and a prefill continued token by token."""
    from attnlab.models import AttnLabForCausalLM

    def model_with(kernels_choice):
        torch.manual_seed(0)
        config = AttnLabConfig(vocab_size=256, hidden_size=256, num_layers=2, num_heads=4, mixer=name,
                               kernels=kernels_choice)
        return AttnLabForCausalLM(config).cuda()

    fast, reference = model_with("auto"), model_with("torch")
    reference.load_state_dict(fast.state_dict())
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, 256, (2, 200), device="cuda", generator=g)
    mask = torch.ones_like(ids)
    mask[0, :37] = 0

    fast_logits, fast_grads = masked_logits_and_grads(fast, ids, mask, autocast=True)
    ref_logits, ref_grads = masked_logits_and_grads(reference, ids, mask)
    keep = mask.bool()
    assert gpu_rel_err(fast_logits[keep], ref_logits[keep]) < 2e-2
    assert set(fast_grads) == set(ref_grads)
    floor = 1e-2 * max(float(gr.norm()) for gr in ref_grads.values())
    for key, ref in ref_grads.items():
        err = float((fast_grads[key].double() - ref.double()).norm()) / max(float(ref.norm()), floor)
        assert err < 5e-2, (key, err)

    with torch.no_grad():  # the step form on the GPU's decode path, fp32: equal to the parallel form
        fast.eval()
        full = fast(input_ids=ids, attention_mask=mask).logits
        out = fast(input_ids=ids[:, :190], attention_mask=mask[:, :190], use_cache=True)
        cache, steps = out.past_key_values, []
        for t in range(190, 200):
            out = fast(input_ids=ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=cache, use_cache=True)
            cache = out.past_key_values
            steps.append(out.logits)
        assert gpu_rel_err(torch.cat(steps, 1), full[:, 190:]) < 1e-4
