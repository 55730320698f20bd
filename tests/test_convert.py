"""`attnlab convert`: peers' checkpoints become attnlab models with identical outputs (every tensor accounted
for, every unsupported option refused), and attnlab models go back to fla."""

import importlib.util
import json
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import run_cli
from safetensors.torch import save_file

from attnlab.errors import CheckpointError
from attnlab.models.convert import export_fla, load_converted, load_fla_gla

pytestmark = pytest.mark.hf_interop  # CI runs these against the oldest transformers and peft it supports too

FLA_CONFIG = {"model_type": "gla", "hidden_size": 64, "num_hidden_layers": 2, "num_heads": 4, "vocab_size": 300,
              "expand_k": 0.5, "expand_v": 1.0, "hidden_ratio": 4, "intermediate_size": None, "norm_eps": 1e-6,
              "use_short_conv": False, "feature_map": None, "use_output_gate": True, "tie_word_embeddings": False,
              "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None}


def fla_gla_tensors(hidden=64, layers=2, heads=4, vocab=300, low_rank=16):
    """The parameter names and shapes of fla 0.6.0's GLAForCausalLM (default options), written out by hand."""
    key, value, mlp = hidden // 2, hidden, 256  # expand_k 0.5, expand_v 1, GatedMLP width rounded up to 256
    shapes = {"model.embeddings.weight": (vocab, hidden), "model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "attn_norm.weight": (hidden,), p + "mlp_norm.weight": (hidden,),
            p + "attn.q_proj.weight": (key, hidden), p + "attn.k_proj.weight": (key, hidden),
            p + "attn.v_proj.weight": (value, hidden), p + "attn.g_proj.weight": (value, hidden),
            p + "attn.gk_proj.0.weight": (low_rank, hidden), p + "attn.gk_proj.1.weight": (key, low_rank),
            p + "attn.gk_proj.1.bias": (key,), p + "attn.g_norm_swish_gate.weight": (value // heads,),
            p + "attn.o_proj.weight": (hidden, value),
            p + "mlp.gate_proj.weight": (mlp, hidden), p + "mlp.up_proj.weight": (mlp, hidden), p + "mlp.down_proj.weight": (hidden, mlp),
        })
    g = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}


def write_checkpoint(path, tensors, config=FLA_CONFIG):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"))


def test_every_fla_gla_tensor_lands_in_exactly_one_attnlab_parameter(tmp_path):
    tensors = fla_gla_tensors()
    write_checkpoint(tmp_path / "gla", tensors)
    model = load_fla_gla(tmp_path / "gla")
    state = model.state_dict()
    assert set(state) == set(tensors)
    for name, tensor in tensors.items():
        assert torch.equal(state[name], tensor), name


def test_a_checkpoint_with_a_missing_tensor_is_refused_naming_it(tmp_path):
    tensors = fla_gla_tensors()
    del tensors["model.layers.1.attn.gk_proj.1.bias"]
    write_checkpoint(tmp_path / "gla", tensors)
    with pytest.raises(CheckpointError, match=r"missing: model\.layers\.1\.attn\.gk_proj\.1\.bias"):
        load_fla_gla(tmp_path / "gla")


def test_a_checkpoint_with_an_extra_tensor_is_refused_naming_it(tmp_path):
    tensors = fla_gla_tensors()
    tensors["model.layers.0.attn.conv1d.weight"] = torch.zeros(4)
    write_checkpoint(tmp_path / "gla", tensors)
    with pytest.raises(CheckpointError, match="not used: model.layers.0.attn.conv1d.weight"):
        load_fla_gla(tmp_path / "gla")


def test_unsupported_gla_options_are_refused_with_the_reason(tmp_path):
    write_checkpoint(tmp_path / "gla", fla_gla_tensors(), {**FLA_CONFIG, "use_short_conv": True})
    with pytest.raises(CheckpointError, match="use_short_conv=True"):
        load_fla_gla(tmp_path / "gla")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("fla") is None, reason="needs CUDA and fla")
def test_imported_model_matches_fla_gla_logits_in_bf16(tmp_path):
    from fla.models import GLAConfig, GLAForCausalLM

    torch.manual_seed(0)
    fla_model = GLAForCausalLM(GLAConfig(**{k: v for k, v in FLA_CONFIG.items() if k != "model_type"})).cuda().bfloat16()
    fla_model.save_pretrained(tmp_path / "gla")
    ours = load_fla_gla(tmp_path / "gla", dtype=torch.bfloat16).cuda()
    x = torch.randint(0, 300, (2, 60), device="cuda")  # both use the fused recurrent kernel at this length
    with torch.no_grad():
        a, b = ours(input_ids=x).logits.float(), fla_model(input_ids=x).logits.float()
    assert float((a - b).norm() / b.norm()) <= 1e-2


# ------------------------------------------------------------------------ shared: an independent reference LM


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def reference_lm(t, ids, layers, names, eps, attention):
    """A pre-norm decoder LM (RMSNorm, SwiGLU MLP) in fp64 from a state dict `t` in the peer's names; `attention(i, h)`
    is layer i's token mixer. Written from the peers' code, without attnlab."""
    t = {k: v.double() for k, v in t.items()}
    x = t[names["embed"]][ids]
    for i in range(layers):
        p = names["layer"].format(i)
        x = x + attention(t, i, rms(x, t[p + names["attn_norm"]], eps))
        h = rms(x, t[p + names["mlp_norm"]], eps)
        x = x + (F.silu(h @ t[p + "mlp.gate_proj.weight"].T) * (h @ t[p + "mlp.up_proj.weight"].T)) @ t[p + "mlp.down_proj.weight"].T
    return rms(x, t[names["norm"]], eps) @ t["lm_head.weight"].T


def causal_mix(weights, v):
    """weights [B, H, T, T] (anything above the diagonal ignored), v [B, T, H, D] -> [B, T, H * D]."""
    T = weights.shape[-1]
    weights = weights.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), 0.0)
    return (weights @ v.transpose(1, 2)).transpose(1, 2).flatten(2)


def small(shape, g, scale=0.3):
    return torch.randn(shape, generator=g) * scale


def norm_weight(n, g):
    return 1 + 0.1 * torch.randn(n, generator=g)


def close(a, b, tol=1e-5):
    return float((a.double() - b).abs().max()) <= tol * max(1.0, float(b.abs().max()))


# ------------------------------------------------------------------------ HF Mamba2 (transformers builds the peer)

MAMBA2 = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, head_dim=8, num_heads=8, expand=2, n_groups=2,
              state_size=16, conv_kernel=4, chunk_size=8, tie_word_embeddings=False)


def test_hf_mamba2_converts_with_identical_logits_with_left_padding(tmp_path):
    from transformers import AutoModelForCausalLM, Mamba2Config, Mamba2ForCausalLM

    torch.manual_seed(0)
    peer = Mamba2ForCausalLM(Mamba2Config(**MAMBA2)).eval()
    peer.save_pretrained(tmp_path / "hf")
    assert run_cli("convert", str(tmp_path / "hf"), str(tmp_path / "ours")) == 0
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    assert ours.config.mixer == "mamba2" and ours.config.intermediate_size == 0
    ids = torch.randint(0, 100, (2, 20), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, :6] = 0  # left padding
    with torch.no_grad():
        a, b = ours(input_ids=ids, attention_mask=mask).logits, peer(input_ids=ids, attention_mask=mask).logits
    assert float((a[0] - b[0]).abs().max()) <= 1e-5
    assert float((a[1, 6:] - b[1, 6:]).abs().max()) <= 1e-5


def test_fla_mamba2_config_maps_onto_the_same_model(tmp_path):
    """fla's Mamba2 has transformers' parameter names and function; only its config keys differ."""
    from transformers import Mamba2Config, Mamba2ForCausalLM

    torch.manual_seed(0)
    peer = Mamba2ForCausalLM(Mamba2Config(**MAMBA2)).eval()
    fla = {"model_type": "mamba2", **{k: v for k, v in MAMBA2.items() if k != "num_heads"}, "norm_eps": 1e-5,
           "rmsnorm": True, "norm_before_gate": False, "D_has_hdim": False, "dt_limit": [0.0, float("inf")],
           "use_bias": False, "use_conv_bias": True, "hidden_act": "silu", "residual_in_fp32": True}
    write_checkpoint(tmp_path / "fla", dict(peer.state_dict()), fla)
    ours = load_converted(tmp_path / "fla").eval()
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert float((ours(input_ids=ids).logits - peer(input_ids=ids).logits).abs().max()) <= 1e-5


def test_fla_mamba2_options_attnlab_lacks_are_refused_in_one_message(tmp_path):
    fla = {"model_type": "mamba2", **{k: v for k, v in MAMBA2.items() if k != "num_heads"}, "norm_eps": 1e-5,
           "D_has_hdim": True, "norm_before_gate": True, "dt_limit": [0.0, 6.0]}
    write_checkpoint(tmp_path / "fla", {"lm_head.weight": torch.zeros(1)}, fla)
    with pytest.raises(CheckpointError, match=r"norm_before_gate=True.*D_has_hdim=True.*dt_limit=\[0\.0, 6\.0\]"):
        load_converted(tmp_path / "fla")


# ------------------------------------------------------------------------ fla NSA (hand-built)

NSA = {"model_type": "nsa", "hidden_size": 32, "num_hidden_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 8,
       "block_size": 4, "block_counts": 3, "window_size": 8, "rope_theta": 10000.0, "hidden_ratio": 4,
       "intermediate_size": 64, "vocab_size": 50, "norm_eps": 1e-6, "qkv_bias": False, "tie_word_embeddings": False}


def fla_nsa_tensors(c=NSA):
    h, heads, kv, d, mlp = c["hidden_size"], c["num_heads"], c["num_kv_heads"], c["head_dim"], c["intermediate_size"]
    shapes = {"model.embeddings.weight": (c["vocab_size"], h), "model.norm.weight": (h,), "lm_head.weight": (c["vocab_size"], h)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "attn_norm.weight": (h,), p + "mlp_norm.weight": (h,), p + "attn.q_proj.weight": (heads * d, h),
                       p + "attn.k_proj.weight": (kv * d, h), p + "attn.v_proj.weight": (kv * d, h),
                       p + "attn.g_proj.weight": (heads * 3, h), p + "attn.o_proj.weight": (h, heads * d),
                       p + "mlp.gate_proj.weight": (mlp, h), p + "mlp.up_proj.weight": (mlp, h), p + "mlp.down_proj.weight": (h, mlp)})
    g = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}


def test_every_fla_nsa_tensor_lands_in_exactly_one_attnlab_parameter_with_the_papers_selection(tmp_path):
    tensors = fla_nsa_tensors()
    write_checkpoint(tmp_path / "nsa", tensors, NSA)
    model = load_converted(tmp_path / "nsa")
    options = model.config.mixer_options
    assert (options["num_kv_heads"], options["block_size"], options["block_counts"], options["window_size"]) == (2, 4, 3, 8)
    assert (options["initial_blocks"], options["local_blocks"], options["compression"]) == (1, 2, "mean")
    state = model.state_dict()
    assert set(state) == set(tensors) and all(torch.equal(state[k], v) for k, v in tensors.items())


def test_fla_nsa_with_a_head_dim_attnlab_cannot_take_is_refused(tmp_path):
    write_checkpoint(tmp_path / "nsa", fla_nsa_tensors(), {**NSA, "head_dim": 16, "qkv_bias": True})
    with pytest.raises(CheckpointError, match=r"qkv_bias=True.*head_dim=16"):
        load_converted(tmp_path / "nsa")


# ------------------------------------------------------------------------ fla forgetting transformer (hand-built)

FOX = {"model_type": "forgetting_transformer", "hidden_size": 16, "num_hidden_layers": 2, "num_heads": 2, "num_kv_heads": None,
       "intermediate_size": 32, "vocab_size": 50, "norm_eps": 1e-6, "qkv_bias": False, "qk_norm": False,
       "window_size": None, "use_output_gate": False, "tie_word_embeddings": False}
FLA_NAMES = {"embed": "model.embeddings.weight", "layer": "model.layers.{}.", "attn_norm": "attn_norm.weight",
             "mlp_norm": "mlp_norm.weight", "norm": "model.norm.weight"}


def fla_fox_tensors(c=FOX, seed=0):
    g = torch.Generator().manual_seed(seed)
    h, heads, mlp, vocab = c["hidden_size"], c["num_heads"], c["intermediate_size"], c["vocab_size"]
    t = {"model.embeddings.weight": small((vocab, h), g, 1.0), "model.norm.weight": norm_weight(h, g), "lm_head.weight": small((vocab, h), g)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t.update({p + "attn_norm.weight": norm_weight(h, g), p + "mlp_norm.weight": norm_weight(h, g),
                  p + "attn.q_proj.weight": small((h, h), g), p + "attn.k_proj.weight": small((h, h), g),
                  p + "attn.v_proj.weight": small((h, h), g), p + "attn.o_proj.weight": small((h, h), g),
                  p + "attn.f_proj.weight": small((heads, h), g), p + "attn.f_proj.bias": torch.zeros(heads),
                  p + "mlp.gate_proj.weight": small((mlp, h), g), p + "mlp.up_proj.weight": small((mlp, h), g),
                  p + "mlp.down_proj.weight": small((h, mlp), g)})
    return t


def fox_attention(c):
    heads, d = c["num_heads"], c["hidden_size"] // c["num_heads"]

    def attention(t, i, h):  # softmax(q.k / sqrt(d) + sum_{l=j+1..i} log sigmoid(f_l)) v, no positional encoding
        p = f"model.layers.{i}.attn."
        B, T, _ = h.shape
        q, k, v = ((h @ t[p + f"{n}_proj.weight"].T).view(B, T, heads, d) for n in "qkv")
        logf = F.logsigmoid(h @ t[p + "f_proj.weight"].T + t[p + "f_proj.bias"]).cumsum(1)  # [B, T, H]
        scores = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(d)
        scores = scores + (logf.transpose(1, 2)[..., :, None] - logf.transpose(1, 2)[..., None, :])
        scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        return causal_mix(scores.softmax(-1), v) @ t[p + "o_proj.weight"].T

    return attention


def test_fla_forgetting_transformer_converts_with_identical_logits(tmp_path):
    tensors = fla_fox_tensors()
    write_checkpoint(tmp_path / "fox", tensors, FOX)
    model = load_converted(tmp_path / "fox").eval()
    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(input_ids=ids).logits
    assert close(ours, reference_lm(tensors, ids, 2, FLA_NAMES, 1e-6, fox_attention(FOX)))


def test_a_forget_gate_with_a_bias_is_refused_since_no_preset_computes_it(tmp_path):
    tensors = fla_fox_tensors()
    tensors["model.layers.1.attn.f_proj.bias"] += 1.0
    write_checkpoint(tmp_path / "fox", tensors, FOX)
    with pytest.raises(CheckpointError, match=r"layer 1's forget gate has a bias"):
        load_converted(tmp_path / "fox")


# ------------------------------------------------------------------------ the 2Mamba study (hand-built)

STUDY = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 16, "intermediate_size": 32,
         "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-5,
         "vocab_size": 50, "max_position_embeddings": 32, "tie_word_embeddings": False, "hidden_act": "silu",
         "attention_bias": False, "mlp_bias": False, "pretraining_tp": 1, "rope_scaling": None, "bos_token_id": 1, "eos_token_id": 2}
STUDY_NAMES = {"embed": "model.embed_tokens.weight", "layer": "model.layers.{}.", "attn_norm": "input_layernorm.weight",
               "mlp_norm": "post_attention_layernorm.weight", "norm": "model.norm.weight"}


def study_tensors(attention_type, c=STUDY, seed=0):
    """The state dict of the study's LlamaForCausalLM with its LlamaDecoderLayerClean layers (names from its code)."""
    g = torch.Generator().manual_seed(seed)
    h, heads, mlp, vocab = c["hidden_size"], c["num_attention_heads"], c["intermediate_size"], c["vocab_size"]
    d = h // heads
    t = {"model.embed_tokens.weight": small((vocab, h), g, 1.0), "model.norm.weight": norm_weight(h, g),
         "lm_head.weight": small((vocab, h), g)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t.update({p + "input_layernorm.weight": norm_weight(h, g), p + "post_attention_layernorm.weight": norm_weight(h, g),
                  p + "self_attn.qkv_proj.weight": small((3 * h, h), g), p + "self_attn.o_proj.weight": small((h, h), g),
                  p + "mlp.gate_proj.weight": small((mlp, h), g), p + "mlp.up_proj.weight": small((mlp, h), g),
                  p + "mlp.down_proj.weight": small((h, mlp), g)})
        if attention_type == "softmax":  # rotary_embedding_torch keeps its frequencies as a parameter
            t[p + "self_attn.rotary_emb.freqs"] = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
        else:  # 2Mamba (squared, sm_norm) or linear with the output norm; both with the A mask and the input conv
            t.update({p + "self_attn.A_mask_proj.weight": small((heads, h), g),
                      p + "self_attn.conv1d.weight": small((3 * h, 1, 2), g, 1.0), p + "self_attn.conv1d.bias": small((3 * h,), g),
                      p + "self_attn.attn_mask": ~torch.ones(32, 32, dtype=torch.bool).tril()[None, None]})
            if "output_norm" in attention_type:
                t[p + "self_attn.out_norm.weight"] = norm_weight(h, g)
    return t


def study_attention(attention_type, c=STUDY):
    heads, d = c["num_attention_heads"], c["hidden_size"] // c["num_attention_heads"]

    def interleaved_rope(x):  # rotary_embedding_torch: pairs (2i, 2i + 1) turn by t * 10000^(-2i / d)
        T = x.shape[1]
        angle = torch.arange(T, dtype=torch.float64)[:, None] * (1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        cos, sin = angle.cos()[None, :, None], angle.sin()[None, :, None]
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)

    def attention(t, i, h):
        p = f"model.layers.{i}.self_attn."
        B, T, _ = h.shape
        qkv = h @ t[p + "qkv_proj.weight"].T
        if attention_type == "softmax":
            q, k, v = (x.view(B, T, heads, d) for x in qkv.chunk(3, -1))
            q, k = interleaved_rope(q), interleaved_rope(k)
            scores = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(d)
            scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
            return causal_mix(scores.softmax(-1), v) @ t[p + "o_proj.weight"].T
        w, b = t[p + "conv1d.weight"][:, 0], t[p + "conv1d.bias"]  # causal depthwise conv, kernel 2, no activation
        qkv = qkv * w[:, 1] + F.pad(qkv, (0, 0, 1, 0))[:, :-1] * w[:, 0] + b
        q, k, v = (x.view(B, T, heads, d) for x in qkv.chunk(3, -1))
        A = -F.softplus(h @ t[p + "A_mask_proj.weight"].T).cumsum(1).transpose(1, 2)  # [B, H, T]
        power = 2 if attention_type.startswith("squared") else 1
        weights = (torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(d)) ** power
        weights = weights * (A[..., :, None] - A[..., None, :]).masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")).exp()
        if "output_norm" in attention_type:  # nn.RMSNorm(eps=None) over all heads: fp32's machine epsilon
            o = rms(causal_mix(weights, v), t[p + "out_norm.weight"], torch.finfo(torch.float32).eps)
        else:  # sm_norm
            o = causal_mix(weights / weights.sum(-1, keepdim=True), v)
        return o @ t[p + "o_proj.weight"].T

    return attention


@pytest.mark.parametrize("attention_type", ["softmax", "squared__sm_norm__A_mask_type_neg_softplus__in_conv_k_2"])
def test_a_2mamba_study_checkpoint_converts_with_identical_logits(tmp_path, attention_type):
    tensors = study_tensors(attention_type)
    write_checkpoint(tmp_path / "study", tensors, {**STUDY, "attention_type": attention_type})
    model = load_converted(tmp_path / "study").eval()
    assert model.config.mixer == attention_type and model.config.norm_eps == 1e-5
    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(input_ids=ids).logits
    assert close(ours, reference_lm(tensors, ids, 2, STUDY_NAMES, 1e-5, study_attention(attention_type)))


OUTPUT_NORM_PRESET = "linear__output_norm__A_mask_type_neg_softplus__in_conv_k_2"


def output_norm_eps_option() -> bool:
    from attnlab.models.mixers.attention_family import AttentionFamily

    return "output_norm_eps" in AttentionFamily.default_options


@pytest.mark.skipif(not output_norm_eps_option(), reason="the attention family has no output_norm_eps option here")
def test_a_study_checkpoint_with_an_output_norm_converts_with_the_studys_epsilon(tmp_path):
    tensors = study_tensors(OUTPUT_NORM_PRESET)
    write_checkpoint(tmp_path / "study", tensors, {**STUDY, "attention_type": OUTPUT_NORM_PRESET})
    model = load_converted(tmp_path / "study").eval()
    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(input_ids=ids).logits
    assert close(ours, reference_lm(tensors, ids, 2, STUDY_NAMES, 1e-5, study_attention(OUTPUT_NORM_PRESET)))


@pytest.mark.skipif(output_norm_eps_option(), reason="the attention family has an output_norm_eps option here")
def test_a_study_checkpoint_with_an_output_norm_is_refused_without_a_per_norm_epsilon(tmp_path):
    write_checkpoint(tmp_path / "study", study_tensors(OUTPUT_NORM_PRESET), {**STUDY, "attention_type": OUTPUT_NORM_PRESET})
    with pytest.raises(CheckpointError, match="one model.norm_eps for every norm"):
        load_converted(tmp_path / "study")


def test_study_models_attnlab_cannot_compute_exactly_are_refused(tmp_path):
    write_checkpoint(tmp_path / "mamba", study_tensors("softmax"), {**STUDY, "attention_type": "mamba", "num_key_value_heads": 1})
    with pytest.raises(CheckpointError, match=r"num_key_value_heads=1.*attention_type 'mamba'"):
        load_converted(tmp_path / "mamba")
    tensors = study_tensors("softmax")
    tensors["model.layers.0.self_attn.rotary_emb.freqs"] *= 2
    write_checkpoint(tmp_path / "freqs", tensors, {**STUDY, "attention_type": "softmax"})
    with pytest.raises(CheckpointError, match="rotary frequencies"):
        load_converted(tmp_path / "freqs")


# ------------------------------------------------------------------------ export to fla (round trips)


def attnlab_model(mixer, **kw):
    from attnlab.models import AttnLabConfig, AttnLabForCausalLM

    torch.manual_seed(0)
    base = dict(vocab_size=50, hidden_size=32, num_layers=2, num_heads=4, tie_word_embeddings=False, norm_eps=1e-5)
    return AttnLabForCausalLM(AttnLabConfig(**{**base, "mixer": mixer, **kw})).eval()


EXPORTABLE = {
    "gla": (dict(mixer="gla", intermediate_size=256), "gla"),
    "mamba2": (dict(mixer="mamba2", intermediate_size=0, mixer_options={"head_dim": 8, "n_groups": 2, "state_size": 16}), "mamba2"),
    "nsa": (dict(mixer="nsa", intermediate_size=64, mixer_options={"num_kv_heads": 2, "block_size": 4, "block_counts": 3,
                                                                   "window_size": 8}), "nsa"),
    "fox": (dict(mixer="attention_family", intermediate_size=64, mixer_options={"decay": "neg_softplus", "rope": False}),
            "forgetting_transformer"),
}


@pytest.mark.parametrize("name", list(EXPORTABLE))
def test_an_attnlab_model_exports_to_fla_and_converts_back_unchanged(tmp_path, name):
    kwargs, model_type = EXPORTABLE[name]
    model = attnlab_model(**kwargs)
    model.save_pretrained(tmp_path / "ours")
    assert run_cli("convert", str(tmp_path / "ours"), str(tmp_path / "fla"), "--to", "fla") == 0
    fla = json.loads((tmp_path / "fla" / "config.json").read_text())
    assert fla["model_type"] == model_type
    back = load_converted(tmp_path / "fla").eval()
    assert back.config.mixer_options == model.config.mixer_options and back.config.intermediate_size == model.config.intermediate_size
    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(back(input_ids=ids).logits, model(input_ids=ids).logits)


def test_an_exported_gla_model_has_fla_gla_names_and_shapes(tmp_path):
    attnlab_model("gla", hidden_size=64, num_layers=2, num_heads=4, vocab_size=300, intermediate_size=256).save_pretrained(tmp_path / "ours")
    assert run_cli("convert", str(tmp_path / "ours"), str(tmp_path / "fla"), "--to", "fla") == 0
    from safetensors.torch import load_file

    exported = load_file(str(tmp_path / "fla" / "model.safetensors"))
    expected = fla_gla_tensors()
    assert {k: tuple(v.shape) for k, v in exported.items()} == {k: tuple(v.shape) for k, v in expected.items()}


def test_an_exported_mamba2_model_has_the_hf_and_fla_names(tmp_path):
    from transformers import Mamba2Config, Mamba2ForCausalLM

    kwargs, _ = EXPORTABLE["mamba2"]
    attnlab_model(**kwargs, vocab_size=100).save_pretrained(tmp_path / "ours")
    assert run_cli("convert", str(tmp_path / "ours"), str(tmp_path / "fla"), "--to", "fla") == 0
    from safetensors.torch import load_file

    exported = load_file(str(tmp_path / "fla" / "model.safetensors"))
    peer = Mamba2ForCausalLM(Mamba2Config(**MAMBA2)).state_dict()
    assert {k: tuple(v.shape) for k, v in exported.items()} == {k: tuple(v.shape) for k, v in peer.items()}


@pytest.mark.parametrize("kwargs, reason", [
    (dict(mixer="softmax"), "no fla architecture"),
    (dict(mixer="nsa", mixer_options={"initial_blocks": 0, "local_blocks": 1}), "initial_blocks=0"),
    (dict(mixer="mamba2"), "blocks with an MLP"),
    (dict(mixer="2mamba"), "not fla's forgetting attention"),
])
def test_a_model_without_an_fla_twin_is_refused_and_nothing_is_written(tmp_path, capsys, kwargs, reason):
    attnlab_model(**kwargs).save_pretrained(tmp_path / "ours")
    assert run_cli("convert", str(tmp_path / "ours"), str(tmp_path / "fla"), "--to", "fla") != 0
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and reason in err
    assert not (tmp_path / "fla").exists() and not list(tmp_path.glob(".fla*"))


def test_convert_refuses_an_existing_output_and_an_unsupported_checkpoint_without_writing(tmp_path, capsys):
    write_checkpoint(tmp_path / "gla", fla_gla_tensors(), {**FLA_CONFIG, "use_short_conv": True})
    (tmp_path / "out").mkdir()
    assert run_cli("convert", str(tmp_path / "gla"), str(tmp_path / "out")) != 0
    assert "already exists" in capsys.readouterr().err
    assert run_cli("convert", str(tmp_path / "gla"), str(tmp_path / "new")) != 0
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "use_short_conv=True" in err
    assert not (tmp_path / "new").exists()


# ------------------------------------------------------------------------ against fla itself (GPU)

NO_FLA = not torch.cuda.is_available() or importlib.util.find_spec("fla") is None


def fla_model(name):
    import fla.models as fm

    torch.manual_seed(0)
    if name == "mamba2":
        return fm.Mamba2ForCausalLM(fm.Mamba2Config(vocab_size=300, hidden_size=256, num_hidden_layers=2, head_dim=64,
                                                    state_size=64, expand=2, n_groups=2, chunk_size=64))
    if name == "nsa":  # 16 query heads per key/value head, as fla's kernels want
        return fm.NSAForCausalLM(fm.NSAConfig(vocab_size=300, hidden_size=1024, num_hidden_layers=2, num_heads=16, num_kv_heads=1,
                                              head_dim=64, block_size=64, block_counts=4, window_size=64))
    model = fm.ForgettingTransformerForCausalLM(fm.ForgettingTransformerConfig(vocab_size=300, hidden_size=256, num_hidden_layers=2,
                                                                               num_heads=4))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.attn.f_proj.bias.zero_()  # attnlab's decay projection has no bias
    return model


def windowed_attention(q, k, v, causal=True, window_size=(-1, 0)):
    """flash_attn_func's causal sliding window ([B, T, H, D] layout, grouped key/value heads) in PyTorch."""
    assert causal and window_size[1] == 0
    t, group = q.shape[1], q.shape[2] // k.shape[2]
    k, v = (x.repeat_interleave(group, dim=2) for x in (k, v))
    i = torch.arange(t, device=q.device)
    allowed = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] <= window_size[0])
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=allowed)
    return out.transpose(1, 2)


def stand_in_for_flash_attn(monkeypatch):
    """fla's NSA computes its sliding-window branch with flash_attn's kernel and has no fallback: where
    flash_attn is not installed, the same window in PyTorch stands in for it."""
    if importlib.util.find_spec("flash_attn") is None:
        import fla.ops.nsa.parallel as fla_nsa

        monkeypatch.setattr(fla_nsa, "flash_attn_func", windowed_attention)


def relative(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.cuda
@pytest.mark.skipif(NO_FLA, reason="needs CUDA and fla")
@pytest.mark.parametrize("name", ["mamba2", "nsa", "fox"])
def test_imported_fla_models_match_fla_logits_in_bf16(tmp_path, name, monkeypatch):
    if name == "nsa":
        stand_in_for_flash_attn(monkeypatch)
    peer = fla_model(name)
    peer.save_pretrained(tmp_path / "fla")
    peer = peer.cuda().bfloat16().eval()
    ours = load_converted(tmp_path / "fla", dtype=torch.bfloat16).cuda().eval()
    x = torch.randint(0, 300, (2, 512), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    with torch.no_grad():
        assert relative(ours(input_ids=x).logits, peer(input_ids=x).logits) <= 2e-2


@pytest.mark.cuda
@pytest.mark.skipif(NO_FLA, reason="needs CUDA and fla")
@pytest.mark.parametrize("name", ["gla", "mamba2", "nsa", "fox"])
def test_exported_models_load_in_fla_with_the_same_logits(tmp_path, name, monkeypatch):
    import fla  # noqa: F401  (registers fla's Auto classes)
    from transformers import AutoModelForCausalLM

    if name == "nsa":
        stand_in_for_flash_attn(monkeypatch)
        ours = attnlab_model("nsa", hidden_size=1024, num_heads=16, intermediate_size=512, vocab_size=300,
                             mixer_options={"num_kv_heads": 1, "block_size": 64, "block_counts": 4, "window_size": 64})
    else:
        kwargs, _ = EXPORTABLE[name]
        ours = attnlab_model(**{**kwargs, "hidden_size": 256, "vocab_size": 300})
    ours.save_pretrained(tmp_path / "ours")
    export_fla(tmp_path / "ours", tmp_path / "fla")
    # cast as the import test above casts fla's own model: loaded with from_pretrained(dtype=bfloat16), fla's
    # Mamba-2 on its torch path (no mamba_ssm installed) feeds fp32 activations to bf16 weights and fails
    peer = AutoModelForCausalLM.from_pretrained(tmp_path / "fla").cuda().bfloat16().eval()
    ours = ours.cuda().bfloat16()
    length = 60 if name == "gla" else 512  # gla: both on the fused recurrent kernel, as the import test above
    x = torch.randint(0, 300, (2, length), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    with torch.no_grad():
        assert relative(ours(input_ids=x).logits, peer(input_ids=x).logits) <= 2e-2


def test_a_study_softmax_layer_without_the_fused_projection_is_refused(tmp_path):
    tensors = study_tensors("softmax")
    qkv = tensors.pop("model.layers.0.self_attn.qkv_proj.weight")
    for name, part in zip("qkv", qkv.chunk(3)):
        tensors[f"model.layers.0.self_attn.{name}_proj.weight"] = part
    write_checkpoint(tmp_path / "first", tensors, {**STUDY, "attention_type": "softmax"})
    with pytest.raises(CheckpointError, match="layer 0 has no fused qkv_proj"):
        load_converted(tmp_path / "first")
