"""Import peers' checkpoints into attnlab models with identical outputs, and export attnlab models to fla.

A source directory is told apart by its config.json:

    attnlab            model_type attnlab: loads as it is
    fla GLA            model_type gla                                   -> mixer gla
    fla Mamba2         model_type mamba2, fla's keys (norm_eps)          -> mixer mamba2, blocks without MLP
    HF Mamba2          model_type mamba2, transformers' keys             -> mixer mamba2, blocks without MLP
    fla NSA            model_type nsa                                   -> mixer nsa (the paper's selection)
    fla FoX            model_type forgetting_transformer                -> attention_family, softmax + forget gate
    the 2Mamba study   model_type llama with the study's attention_type  -> the preset of that name, or softmax

Every converter checks the options first and refuses, in one message listing each option it cannot
map, whatever attnlab does not implement exactly; then every tensor of the checkpoint must land in
exactly one parameter of the model (nothing left over, nothing missing, every shape equal). Other HF
causal LMs (Llama, Qwen3, ...) are not converted: `train.init_from` trains them as they are.

`export_fla` is the way back: an attnlab model whose mixer and options match an fla architecture
(gla, mamba2, nsa, forgetting attention) is written as that fla model's config and weights.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from attnlab.errors import CheckpointError
from attnlab.models import AttnLabConfig, AttnLabForCausalLM  # the package import registers the attnlab Auto classes
from attnlab.models.files import ATTNLAB_REQUIRED, check_model_config, check_safetensors, read_json_object
from attnlab.models.mixers import MIXERS
from attnlab.models.mixers.attention_family import AttentionFamily
from attnlab.models.mixers.attention_presets import LATER_STUDY
from attnlab.models.references import resolve_model_dir
from attnlab.outputs import publishing

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")


# ---------------------------------------------------------------------------------------- helpers


def fla_mlp_width(hidden: int, ratio: int | None) -> int:
    """fla's GatedMLP width when `intermediate_size` is null: 2/3 of hidden * ratio, rounded up to 256."""
    width = int(hidden * (ratio or 4) * 2 / 3)
    return 256 * ((width + 255) // 256)


def read_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index, "safetensors index").get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) and f and Path(f).name == f for f in weight_map.values()):
            raise CheckpointError(f"{index}: weight_map is not an object of tensor names to file names in {path}; "
                                  "restore it from the original checkpoint")
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path} holds no *.safetensors weights; attnlab converts checkpoints only from safetensors")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        check_safetensors(path / name)  # the header fits the file, before safetensors maps it
        state.update(load_file(str(path / name)))
    return state


def _number(value: Any) -> float:
    if isinstance(value, dict) and "__float__" in value:  # transformers 5 writes inf and nan as {"__float__": "Infinity"}
        value = value["__float__"]
    return float(value)


def _same(value: Any, supported: Any) -> bool:
    if isinstance(supported, tuple):
        try:
            return isinstance(value, (list, tuple)) and len(value) == len(supported) and all(
                _number(a) == _number(b) for a, b in zip(value, supported))
        except (TypeError, ValueError):
            return False
    return value == supported


class _Options:
    """Collects every option of a source config that attnlab cannot map, to refuse them in one message."""

    def __init__(self, what: str, config: dict):
        self.what, self.config, self.wrong = what, config, []

    def expect(self, key: str, supported: Any, default: Any = None) -> None:
        value = self.config.get(key, default)
        if not _same(value, supported):
            self.wrong.append(f"{key}={value!r} (attnlab supports {supported!r})")

    def need(self, *keys: str) -> None:
        missing = [k for k in keys if self.config.get(k) is None]
        if missing:
            self.wrong.append(f"config.json does not give {', '.join(missing)}")

    def fail(self, reason: str) -> None:
        self.wrong.append(reason)

    def check(self) -> None:
        if self.wrong:
            raise CheckpointError(f"{self.what} uses options attnlab does not implement exactly, so it is not converted: "
                                  + "; ".join(self.wrong))


def _rename(state: dict[str, torch.Tensor], rules: list[tuple[str, str]]) -> dict[str, torch.Tensor]:
    """Each name rewritten by the first rule (regex, replacement) that matches it; others kept."""
    out = {}
    for name, tensor in state.items():
        for pattern, repl in rules:
            new, n = re.subn(pattern, repl, name)
            if n:
                name = new
                break
        out[name] = tensor
    return out


def _common(c: dict) -> dict:
    """The AttnLabConfig fields every source gives the same way."""
    return {"vocab_size": c["vocab_size"], "hidden_size": c["hidden_size"], "num_layers": c["num_hidden_layers"],
            "tie_word_embeddings": c.get("tie_word_embeddings", False), "initializer_range": c.get("initializer_range", 0.02),
            "bos_token_id": c.get("bos_token_id"), "eos_token_id": c.get("eos_token_id"), "pad_token_id": c.get("pad_token_id")}


def _load_strict(model, state: dict[str, torch.Tensor], where: str) -> None:
    """Load `state` into `model`, requiring every parameter and nothing else, every shape equal."""
    tied = model.config.tie_word_embeddings
    if tied:
        state.pop("lm_head.weight", None)
    expected = model.state_dict()
    if tied:
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    mis_shaped = sorted(k for k in set(state) & set(expected) if state[k].shape != expected[k].shape)
    if missing or unexpected or mis_shaped:
        parts = [f"{label}: {', '.join(names[:8])}{' ...' if len(names) > 8 else ''}"
                 for label, names in (("missing", missing), ("not used", unexpected), ("wrong shape", mis_shaped)) if names]
        raise CheckpointError(f"the checkpoint in {where} does not map onto attnlab's {model.config.mixer} model ({'; '.join(parts)})")
    model.load_state_dict(state, strict=not tied)


# ---------------------------------------------------------------------------------------- fla GLA

# fla GLAConfig options attnlab's gla mixer does not implement, with the value that is supported.
_GLA_FIXED = {
    "use_short_conv": False, "feature_map": None, "clamp_min": None, "use_gv": False, "attn": None,
    "attnres_block_size": None, "use_output_gate": True, "use_gk": True, "hidden_act": "swish", "elementwise_affine": True,
}


def attnlab_config_from_fla_gla(fla: dict):
    options = _Options("this fla GLA checkpoint", fla)
    for key, value in _GLA_FIXED.items():
        if key in fla:
            options.expect(key, value)
    if fla.get("num_kv_heads") not in (None, fla.get("num_heads")):
        options.fail(f"num_kv_heads={fla['num_kv_heads']} (attnlab's gla has one key/value head per query head)")
    options.check()
    hidden = fla.get("hidden_size", 2048)
    return AttnLabConfig(
        vocab_size=fla.get("vocab_size", 32000), hidden_size=hidden, num_layers=fla.get("num_hidden_layers", 24),
        num_heads=fla.get("num_heads", 4), mixer="gla",
        mixer_options={"expand_k": fla.get("expand_k", 0.5), "expand_v": fla.get("expand_v", 1.0),
                       "gate_low_rank_dim": fla.get("gate_low_rank_dim", 16),
                       "gate_logit_normalizer": fla.get("gate_logit_normalizer", 16)},
        intermediate_size=fla.get("intermediate_size") or fla_mlp_width(hidden, fla.get("hidden_ratio")),
        max_position_embeddings=fla.get("max_position_embeddings", 2048), norm_eps=fla.get("norm_eps", 1e-6),
        tie_word_embeddings=fla.get("tie_word_embeddings", False), initializer_range=fla.get("initializer_range", 0.02),
        bos_token_id=fla.get("bos_token_id"), eos_token_id=fla.get("eos_token_id"), pad_token_id=fla.get("pad_token_id"),
    )


def _gla_state(config: dict, state: dict) -> dict:
    return state  # attnlab's gla uses fla's names


# ---------------------------------------------------------------------------------------- Mamba-2 (fla and HF)


def _is_hf_mamba2(c: dict) -> bool:
    return "layer_norm_epsilon" in c or "time_step_limit" in c


def attnlab_config_from_mamba2(c: dict):
    hf = _is_hf_mamba2(c)
    options = _Options(f"this {'HF' if hf else 'fla'} Mamba2 checkpoint", c)
    options.need("vocab_size", "hidden_size", "num_hidden_layers", "head_dim", "state_size", "expand", "n_groups", "conv_kernel")
    options.expect("use_bias", False, False)
    options.expect("use_conv_bias", True, True)
    options.expect("hidden_act", "silu", "silu")
    if hf:
        options.expect("rms_norm", True, True)
        options.expect("time_step_limit", (0.0, math.inf), (0.0, math.inf))
        eps = c.get("layer_norm_epsilon", 1e-5)
    else:
        options.expect("rmsnorm", True, True)
        options.expect("norm_before_gate", False, False)
        options.expect("D_has_hdim", False, False)
        options.expect("dt_limit", (0.0, math.inf), (0.0, math.inf))
        eps = c.get("norm_eps", 1e-5)
    hidden, head_dim, expand = c.get("hidden_size"), c.get("head_dim"), c.get("expand")
    heads = None
    if hidden and head_dim and expand:
        if (expand * hidden) % head_dim:
            options.fail(f"expand * hidden_size ({expand * hidden}) is not a multiple of head_dim ({head_dim})")
        else:
            heads = expand * hidden // head_dim
            if hf and c.get("num_heads") not in (None, heads):
                options.fail(f"num_heads={c['num_heads']} (attnlab's mamba2 has expand * hidden_size / head_dim = {heads} heads)")
    options.check()
    return AttnLabConfig(
        **_common(c), num_heads=heads if hidden % heads == 0 else 1, mixer="mamba2", intermediate_size=0, norm_eps=eps,
        mixer_options={"state_size": c["state_size"], "expand": expand, "head_dim": head_dim,
                       "n_groups": c["n_groups"], "conv_kernel": c["conv_kernel"],
                       "chunk_size": c.get("chunk_size", 256)},
    )


_MAMBA2_RULES = [
    (r"^backbone\.embeddings\.", "model.embeddings."),
    (r"^backbone\.layers\.(\d+)\.norm\.", r"model.layers.\1.attn_norm."),
    (r"^backbone\.layers\.(\d+)\.mixer\.", r"model.layers.\1.attn."),
    (r"^backbone\.norm_f\.", "model.norm."),
]


def _mamba2_state(config: dict, state: dict) -> dict:
    return _rename(state, _MAMBA2_RULES)


# ---------------------------------------------------------------------------------------- fla NSA


def attnlab_config_from_fla_nsa(c: dict):
    options = _Options("this fla NSA checkpoint", c)
    options.need("vocab_size", "hidden_size", "num_hidden_layers", "num_heads", "head_dim", "block_size", "block_counts", "window_size")
    for key, value in {"qkv_bias": False, "hidden_act": "swish", "elementwise_affine": True, "attnres_block_size": None}.items():
        options.expect(key, value, value)
    hidden, heads = c.get("hidden_size"), c.get("num_heads")
    if hidden and heads and c.get("head_dim") and c["head_dim"] * heads != hidden:
        options.fail(f"head_dim={c['head_dim']} with {heads} heads on hidden_size {hidden} (attnlab's nsa has head_dim = hidden_size / num_heads)")
    if c.get("block_counts") is not None and not isinstance(c["block_counts"], int):
        options.fail(f"block_counts={c['block_counts']!r} (attnlab selects one fixed number of blocks)")
    options.check()
    return AttnLabConfig(
        **_common(c), num_heads=heads, mixer="nsa", norm_eps=c.get("norm_eps", 1e-6),
        intermediate_size=c.get("intermediate_size") or fla_mlp_width(hidden, c.get("hidden_ratio")),
        max_position_embeddings=c.get("max_position_embeddings", 2048), rope_theta=c.get("rope_theta") or 10000.0,
        mixer_options={"num_kv_heads": c.get("num_kv_heads") or heads, "block_size": c["block_size"],
                       "block_counts": c["block_counts"], "initial_blocks": 1, "local_blocks": 2,
                       "window_size": c["window_size"], "compression": "mean"},
    )


def _nsa_state(config: dict, state: dict) -> dict:
    return state  # attnlab's nsa uses fla's names


# ---------------------------------------------------------------------------------------- fla forgetting transformer

# softmax attention whose logits add sum_{l=j+1..i} log f_l, f = sigmoid(W_f x): the attention family with the
# decay -softplus(-W_f x) = log sigmoid(W_f x), no positional encoding (FoX has none)
FOX_OPTIONS = {"similarity": "softmax", "decay": "neg_softplus", "rope": False}


def _fox_mixer() -> tuple[str, dict]:
    """The registered preset whose options are FoX's, else the family with those options."""

    wanted = AttentionFamily.resolve_options(FOX_OPTIONS)
    for name, cls in MIXERS.items():
        if getattr(cls, "family", None) is AttentionFamily and cls.resolve_options(None) == wanted:
            return name, {}
    return AttentionFamily.name, dict(FOX_OPTIONS)


def attnlab_config_from_fla_fox(c: dict):
    options = _Options("this fla forgetting-transformer checkpoint", c)
    options.need("vocab_size", "hidden_size", "num_hidden_layers", "num_heads")
    for key, value in {"qkv_bias": False, "qk_norm": False, "window_size": None, "use_output_gate": False,
                       "hidden_act": "swish", "elementwise_affine": True, "attnres_block_size": None}.items():
        options.expect(key, value, value)
    if c.get("num_kv_heads") not in (None, c.get("num_heads")):
        options.fail(f"num_kv_heads={c['num_kv_heads']} (attnlab's attention family has one key/value head per query head)")
    options.check()
    mixer, mixer_options = _fox_mixer()
    return AttnLabConfig(
        **_common(c), num_heads=c["num_heads"], mixer=mixer, mixer_options=mixer_options, norm_eps=c.get("norm_eps", 1e-6),
        intermediate_size=c.get("intermediate_size") or fla_mlp_width(c["hidden_size"], c.get("hidden_ratio")),
        max_position_embeddings=c.get("max_position_embeddings", 2048),
    )


def _fox_state(config: dict, state: dict) -> dict:
    out = {}
    layers = sorted({int(m.group(1)) for k in state if (m := re.match(r"model\.layers\.(\d+)\.attn\.", k))})
    for i in layers:
        p = f"model.layers.{i}.attn."
        bias = state.pop(p + "f_proj.bias", None)
        if bias is not None and bool(bias.any()):
            raise CheckpointError(
                f"layer {i}'s forget gate has a bias (f_proj.bias), which attnlab's decay projection does not have: "
                "no attnlab preset computes this checkpoint's function, so it is not converted")
        if all(p + f"{n}_proj.weight" in state for n in "qkv"):
            out[p + "qkv_proj.weight"] = torch.cat([state.pop(p + f"{n}_proj.weight") for n in "qkv"])
        if p + "f_proj.weight" in state:
            out[p + "decay_proj.weight"] = -state.pop(p + "f_proj.weight")  # log sigmoid(a) = -softplus(-a)
    out.update(state)
    return out


# ---------------------------------------------------------------------------------------- the 2Mamba study

STUDY_REPO = "gmongaras/2Mamba2Furious"


def _study_rope_perm(head_dim: int) -> torch.Tensor:
    """Rows of one head, interleaved RoPE (pairs 2i, 2i + 1, as rotary_embedding_torch) -> rotate-half
    (pairs i, i + D/2): the same function once q and k rows are permuted alike."""
    return torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])


def attnlab_config_from_study(c: dict):
    name = c.get("attention_type")
    options = _Options(f"this 2Mamba study checkpoint (attention_type {name!r})", c)
    options.need("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "rms_norm_eps", "intermediate_size")
    for key, value in {"attention_bias": False, "mlp_bias": False, "hidden_act": "silu", "pretraining_tp": 1,
                       "rope_scaling": None}.items():
        options.expect(key, value, value)
    heads = c.get("num_attention_heads")
    if c.get("num_key_value_heads") not in (None, heads):
        options.fail(f"num_key_value_heads={c['num_key_value_heads']} (the study's layers have one key/value head per query head)")
    mixer_options: dict = {}
    if name == "softmax":
        mixer = "softmax"
    elif name in LATER_STUDY:
        mixer = name
        preset = MIXERS[name].resolve_options(None)
        if preset["output_norm"] != "none":
            # the study's output norm is nn.RMSNorm(eps=None) over all heads: fp32's machine epsilon, not rms_norm_eps
            eps = float(torch.finfo(torch.float32).eps)
            if "output_norm_eps" not in MIXERS[name].family.default_options:
                options.fail("an output norm with the study's epsilon (fp32's machine epsilon, not rms_norm_eps): this "
                             "attnlab's attention family has one model.norm_eps for every norm")
            elif (preset["output_norm"], preset["output_norm_per_head"]) != ("rmsnorm", False) or preset["output_norm_eps"] not in (None, eps):
                options.fail(f"preset {name!r} has output norm {preset['output_norm']} (per head: {preset['output_norm_per_head']}) "
                             f"with epsilon {preset['output_norm_eps']}, the study's layer one RMSNorm over all heads with "
                             f"epsilon {eps:g}")
            else:
                mixer_options["output_norm_eps"] = eps
    elif name == "mamba":
        options.fail("attention_type 'mamba' (the study runs mamba_ssm's Mamba2 layer with D per channel and a "
                     "one-head SSM per attention head; attnlab's mamba2 mixer does not take these shapes)")
    else:
        options.fail(f"attention_type {name!r} is not a configuration of the study's LlamaDecoderLayerClean "
                     f"(known: softmax, {', '.join(sorted(LATER_STUDY))})")
    options.check()
    return AttnLabConfig(
        **_common(c), num_heads=heads, mixer=mixer, mixer_options=mixer_options, norm_eps=c["rms_norm_eps"],
        intermediate_size=c["intermediate_size"], max_position_embeddings=c.get("max_position_embeddings", 2048),
        rope_theta=10000.0,  # the study's rotary_embedding_torch base, whatever the Llama config says (checked on the weights)
    )


_STUDY_RULES = [
    (r"^model\.embed_tokens\.", "model.embeddings."),
    (r"^model\.layers\.(\d+)\.input_layernorm\.", r"model.layers.\1.attn_norm."),
    (r"^model\.layers\.(\d+)\.post_attention_layernorm\.", r"model.layers.\1.mlp_norm."),
    (r"^model\.layers\.(\d+)\.self_attn\.A_mask_proj\.", r"model.layers.\1.attn.decay_proj."),
    (r"^model\.layers\.(\d+)\.self_attn\.z_gate_proj\.", r"model.layers.\1.attn.z_proj."),
    (r"^model\.layers\.(\d+)\.self_attn\.", r"model.layers.\1.attn."),
]


def _study_state(c: dict, state: dict) -> dict:
    state = _rename(state, _STUDY_RULES)
    heads, hidden = c["num_attention_heads"], c["hidden_size"]
    head_dim = hidden // heads
    out = {}
    for name, tensor in state.items():
        if name.endswith(".attn.attn_mask") or name == "model.rotary_emb.inv_freq":
            continue  # the causal mask buffer and HF Llama's unused RoPE table
        if name.endswith(".attn.rotary_emb.freqs"):
            standard = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
            if tensor.shape != standard.shape or not torch.allclose(tensor.float(), standard, rtol=1e-6, atol=0):
                raise CheckpointError(f"{name} holds rotary frequencies other than base 10000's: attnlab's RoPE cannot "
                                      "compute them, so this checkpoint is not converted")
            continue
        out[name] = tensor
    if c.get("attention_type") == "softmax":  # one fused qkv_proj, interleaved RoPE -> q/k/v_proj, rotate-half
        perm = _study_rope_perm(head_dim)
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}.attn."
            qkv = out.pop(p + "qkv_proj.weight", None)
            if qkv is None:
                raise CheckpointError(
                    f"layer {i} has no fused qkv_proj: this is not the study's LlamaDecoderLayerClean softmax layer (the "
                    "first study's layers keep separate projections with another RoPE layout), so it is not converted")
            q, k, v = qkv.split(hidden, dim=0)
            out[p + "q_proj.weight"] = q.view(heads, head_dim, hidden)[:, perm].reshape(hidden, hidden)
            out[p + "k_proj.weight"] = k.view(heads, head_dim, hidden)[:, perm].reshape(hidden, hidden)
            out[p + "v_proj.weight"] = v
    return out


# ---------------------------------------------------------------------------------------- sources


@dataclass(frozen=True)
class Source:
    """A checkpoint format attnlab converts: its name, its config and its tensors' mapping."""

    name: str
    config: Callable[[dict], Any]
    state: Callable[[dict, dict], dict]


SOURCES = {
    "fla-gla": Source("fla GLA", attnlab_config_from_fla_gla, _gla_state),
    "fla-mamba2": Source("fla Mamba2", attnlab_config_from_mamba2, _mamba2_state),
    "hf-mamba2": Source("HF Mamba2", attnlab_config_from_mamba2, _mamba2_state),
    "fla-nsa": Source("fla NSA", attnlab_config_from_fla_nsa, _nsa_state),
    "fla-forgetting": Source("fla forgetting transformer", attnlab_config_from_fla_fox, _fox_state),
    "study": Source("2Mamba study", attnlab_config_from_study, _study_state),
}


def read_config(path: str | Path) -> dict:
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path}. Pass a model directory (config.json and *.safetensors).")
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path} holds no config.json: pass a model directory (an attnlab, fla or HF checkpoint)")
    config = read_json_object(path / "config.json")
    check_model_config(config, path / "config.json")
    return config


def source_kind(config: dict) -> str:
    """'attnlab', a key of SOURCES, or 'hf' (any other causal LM, trained as it is)."""
    model_type = config.get("model_type")
    if model_type == "attnlab":
        return "attnlab"
    if model_type == "gla":
        return "fla-gla"
    if model_type == "mamba2":
        return "hf-mamba2" if _is_hf_mamba2(config) else "fla-mamba2"
    if model_type == "nsa":
        return "fla-nsa"
    if model_type == "forgetting_transformer":
        return "fla-forgetting"
    if model_type == "llama" and "attention_type" in config:
        return "study"
    return "hf"


def converted_config(path: str | Path):
    """(kind, config) of the checkpoint in `path`, without reading its weights: an AttnLabConfig for attnlab
    models and convertible checkpoints (CheckpointError, naming every unsupported option, when it does not
    map), the HF config for other causal LMs."""
    raw = read_config(path)
    kind = source_kind(raw)
    if kind == "attnlab":
        try:
            return kind, AttnLabConfig.from_pretrained(str(path))
        except (ValueError, TypeError, OSError) as e:
            raise CheckpointError(f"cannot read the attnlab model config in {path}: {e}") from None
    if kind == "hf":
        from transformers import AutoConfig

        try:
            return kind, AutoConfig.from_pretrained(str(path), local_files_only=True)
        except (ValueError, KeyError, OSError) as e:
            raise CheckpointError(f"{path} is neither an attnlab model nor a checkpoint attnlab converts, and transformers "
                                  f"cannot read it as a causal LM: {e}") from None
    try:
        config = SOURCES[kind].config(raw)
        check_model_config(config.to_dict(), path / "config.json", required=ATTNLAB_REQUIRED)  # sizes the source left null
        return kind, config
    except CheckpointError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError) as e:  # a field of the wrong type, or one missing
        what = f"field {e.args[0]!r} is missing" if isinstance(e, KeyError) else str(e)
        raise CheckpointError(f"{path / 'config.json'} does not describe a {SOURCES[kind].name} model attnlab can build: "
                              f"{what}; restore the file from the original checkpoint") from None


def load_converted(path: str | Path, dtype: torch.dtype = torch.float32, kernels: str | None = None):
    """An `AttnLabForCausalLM` with the weights of the attnlab model or convertible checkpoint in `path`
    (`kernels`: the model's kernel choice, if not the checkpoint's)."""

    path = Path(path).expanduser()
    kind, config = converted_config(path)
    if kind == "hf":
        raise CheckpointError(f"{path} holds an HF {config.model_type} model, which attnlab does not convert; "
                              "train.init_from trains it as it is")
    if kernels is not None:
        config.kernels = kernels
    model = AttnLabForCausalLM(config)
    state = read_safetensors_dir(path)
    if kind != "attnlab":
        state = SOURCES[kind].state(read_config(path), state)
    _load_strict(model, state, str(path))
    return model.to(dtype)


def load_fla_gla(path: str | Path, dtype: torch.dtype = torch.float32):
    """An `AttnLabForCausalLM` holding the weights of the fla GLA checkpoint in `path`."""
    raw = read_config(path)
    if raw.get("model_type") != "gla":
        raise CheckpointError(f"{path} is not an fla GLA checkpoint (model_type {raw.get('model_type')!r})")
    return load_converted(path, dtype)


def copy_tokenizer(src: Path, out: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)


def _check_free(out: Path) -> None:
    if out.exists():
        raise CheckpointError(f"{out} already exists: choose another output directory, or remove it first")


def convert(src: str | Path, out: str | Path) -> str:
    """Write the checkpoint in `src` as an attnlab model directory `out` (config.json, model.safetensors,
    the tokenizer files if `src` has them). Returns what was converted, for the CLI to say."""
    src, out = resolve_model_dir(src), Path(out).expanduser()  # a run directory: its final model
    _check_free(out)
    kind = source_kind(read_config(src))
    model = load_converted(src)
    _check_free(out)  # again: something may have been put there while the model loaded
    with publishing(out, replace=False) as tmp:  # nothing half-written is left behind
        model.save_pretrained(tmp)
        copy_tokenizer(src, tmp)
    what = "attnlab model" if kind == "attnlab" else SOURCES[kind].name + " checkpoint"
    return f"{what} -> attnlab {model.config.mixer} model ({model.num_parameters():,} parameters)"


# ---------------------------------------------------------------------------------------- export to fla


def _fla_common(config) -> dict:
    return {"vocab_size": config.vocab_size, "hidden_size": config.hidden_size, "num_hidden_layers": config.num_layers,
            "norm_eps": config.norm_eps, "tie_word_embeddings": config.tie_word_embeddings,
            "initializer_range": config.initializer_range, "bos_token_id": config.bos_token_id,
            "eos_token_id": config.eos_token_id, "pad_token_id": config.pad_token_id,
            "hidden_act": "swish", "elementwise_affine": True, "fuse_norm": True}


def fla_export(config, state: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
    """(fla config.json, fla state dict) of an attnlab model; CheckpointError when no fla architecture matches."""
    o = config.mixer_options
    why: list[str] = []
    if config.mixer == "gla":
        fla = {**_fla_common(config), "model_type": "gla", "architectures": ["GLAForCausalLM"], "num_heads": config.num_heads,
               "expand_k": o["expand_k"], "expand_v": o["expand_v"], "gate_low_rank_dim": o["gate_low_rank_dim"],
               "gate_logit_normalizer": o["gate_logit_normalizer"], "intermediate_size": config.intermediate_size,
               "max_position_embeddings": config.max_position_embeddings, "use_short_conv": False, "use_output_gate": True,
               "use_gk": True, "use_gv": False, "feature_map": None, "clamp_min": None, "attn_mode": "chunk"}
        if not config.intermediate_size:
            why.append("blocks without an MLP (fla's GLA blocks have one)")
        out = dict(state)
    elif config.mixer == "mamba2":
        if config.intermediate_size:
            why.append("blocks with an MLP (fla's Mamba2 blocks have none)")
        heads = o["expand"] * config.hidden_size // (o["head_dim"] or o["expand"] * config.hidden_size // config.num_heads)
        fla = {**{k: v for k, v in _fla_common(config).items() if k not in ("elementwise_affine", "fuse_norm")},
               "model_type": "mamba2", "architectures": ["Mamba2ForCausalLM"], "hidden_act": "silu",
               "head_dim": o["expand"] * config.hidden_size // heads, "num_heads": heads, "state_size": o["state_size"],
               "expand": o["expand"], "n_groups": o["n_groups"], "conv_kernel": o["conv_kernel"], "chunk_size": o["chunk_size"],
               "use_bias": False, "use_conv_bias": True, "rmsnorm": True, "norm_before_gate": False, "D_has_hdim": False,
               "dt_limit": [0.0, math.inf], "residual_in_fp32": True}
        out = _rename(state, [(r"^model\.embeddings\.", "backbone.embeddings."),
                              (r"^model\.layers\.(\d+)\.attn_norm\.", r"backbone.layers.\1.norm."),
                              (r"^model\.layers\.(\d+)\.attn\.", r"backbone.layers.\1.mixer."),
                              (r"^model\.norm\.", "backbone.norm_f.")])
    elif config.mixer == "nsa":
        if (o["initial_blocks"], o["local_blocks"], o["compression"]) != (1, 2, "mean"):
            why.append(f"initial_blocks={o['initial_blocks']}, local_blocks={o['local_blocks']}, compression={o['compression']!r} "
                       "(fla's NSA forces 1 initial and 2 local blocks and mean-pools)")
        if not config.intermediate_size:
            why.append("blocks without an MLP (fla's NSA blocks have one)")
        fla = {**_fla_common(config), "model_type": "nsa", "architectures": ["NSAForCausalLM"], "num_heads": config.num_heads,
               "num_kv_heads": o["num_kv_heads"] or config.num_heads, "head_dim": config.hidden_size // config.num_heads,
               "qkv_bias": False, "block_size": o["block_size"], "block_counts": o["block_counts"],
               "window_size": o["window_size"], "rope_theta": config.rope_theta, "intermediate_size": config.intermediate_size,
               "max_position_embeddings": config.max_position_embeddings}
        out = dict(state)
    else:

        cls = MIXERS[config.mixer]
        if not issubclass(cls, AttentionFamily):
            raise CheckpointError(f"attnlab's {config.mixer} mixer has no fla architecture to export to "
                                  "(fla exports: gla, mamba2, nsa, forgetting attention)")
        wanted = AttentionFamily.resolve_options(FOX_OPTIONS)
        differ = [f"{k}={o[k]!r} (FoX: {wanted[k]!r})" for k in wanted if o.get(k) != wanted[k]]
        if differ:
            raise CheckpointError(f"mixer {config.mixer!r} is not fla's forgetting attention, the one attention-family model "
                                  f"fla has: {'; '.join(differ)}")
        if not config.intermediate_size:
            why.append("blocks without an MLP (fla's forgetting-transformer blocks have one)")
        fla = {**_fla_common(config), "model_type": "forgetting_transformer",
               "architectures": ["ForgettingTransformerForCausalLM"], "num_heads": config.num_heads, "num_kv_heads": None,
               "qkv_bias": False, "qk_norm": False, "window_size": None, "use_output_gate": False,
               "intermediate_size": config.intermediate_size, "max_position_embeddings": config.max_position_embeddings}
        out = {}
        for name, tensor in state.items():
            if name.endswith(".attn.qkv_proj.weight"):
                p = name.removesuffix("qkv_proj.weight")
                for n, part in zip("qkv", tensor.chunk(3)):
                    out[p + f"{n}_proj.weight"] = part.clone()
            elif name.endswith(".attn.decay_proj.weight"):
                p = name.removesuffix("decay_proj.weight")
                out[p + "f_proj.weight"] = -tensor
                out[p + "f_proj.bias"] = tensor.new_zeros(tensor.shape[0])
            else:
                out[name] = tensor
    if why:
        raise CheckpointError(f"this attnlab {config.mixer} model does not match fla's architecture: {'; '.join(why)}")
    if config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return fla, out


def export_fla(src: str | Path, out: str | Path) -> str:
    """Write the attnlab model (or convertible checkpoint) in `src` as an fla checkpoint directory `out`."""
    src, out = resolve_model_dir(src), Path(out).expanduser()  # a run directory: its final model
    _check_free(out)
    model = load_converted(src)
    fla, state = fla_export(model.config, {k: v.detach().contiguous() for k, v in model.state_dict().items()})

    _check_free(out)
    with publishing(out, replace=False) as tmp:  # nothing half-written is left behind
        (tmp / "config.json").write_text(json.dumps(fla, indent=2) + "\n")
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        copy_tokenizer(src, tmp)
    return f"attnlab {model.config.mixer} model -> fla {fla['model_type']} checkpoint"
