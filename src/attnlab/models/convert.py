"""Import flash-linear-attention GLA checkpoints (`model_type: gla`) into attnlab's `gla` mixer.

attnlab's GLA layer uses fla's parameter names, so the weight mapping is one to one; what this
module checks is that the checkpoint uses only the GLA options attnlab implements, and that every
tensor of the checkpoint lands in exactly one parameter of the model (nothing left over, nothing
missing, every shape equal).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from attnlab.errors import CheckpointError

# fla GLAConfig options attnlab's gla mixer does not implement, with the value that is supported.
_UNSUPPORTED = {
    "use_short_conv": False, "feature_map": None, "clamp_min": None, "use_gv": False, "attn": None,
    "attnres_block_size": None, "use_output_gate": True, "use_gk": True, "hidden_act": "swish", "elementwise_affine": True,
}


def fla_mlp_width(hidden: int, ratio: int | None) -> int:
    width = int(hidden * (ratio or 4) * 2 / 3)
    return 256 * ((width + 255) // 256)


def attnlab_config_from_fla_gla(fla: dict):
    from attnlab.models import AttnLabConfig

    wrong = [f"{k}={fla[k]!r} (attnlab supports {v!r})" for k, v in _UNSUPPORTED.items() if k in fla and fla[k] != v]
    if fla.get("num_kv_heads") not in (None, fla.get("num_heads")):
        wrong.append(f"num_kv_heads={fla['num_kv_heads']} (attnlab's gla has one key/value head per query head)")
    if wrong:
        raise CheckpointError("this fla GLA checkpoint uses options attnlab's gla mixer does not implement: " + "; ".join(wrong))
    hidden = fla.get("hidden_size", 2048)
    return AttnLabConfig(
        vocab_size=fla.get("vocab_size", 32000), hidden_size=hidden, num_layers=fla.get("num_hidden_layers", 24),
        num_heads=fla.get("num_heads", 4), mixer="gla",
        mixer_options={"expand_k": fla.get("expand_k", 0.5), "expand_v": fla.get("expand_v", 1.0)},
        intermediate_size=fla.get("intermediate_size") or fla_mlp_width(hidden, fla.get("hidden_ratio")),
        max_position_embeddings=fla.get("max_position_embeddings", 2048), norm_eps=fla.get("norm_eps", 1e-6),
        tie_word_embeddings=fla.get("tie_word_embeddings", False), initializer_range=fla.get("initializer_range", 0.02),
        bos_token_id=fla.get("bos_token_id"), eos_token_id=fla.get("eos_token_id"), pad_token_id=fla.get("pad_token_id"),
    )


def read_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path} holds no *.safetensors weights; attnlab loads fla checkpoints only from safetensors")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(str(path / name)))
    return state


def load_fla_gla(path: str | Path, dtype: torch.dtype = torch.float32):
    """An `AttnLabForCausalLM` holding the weights of the fla GLA checkpoint in `path`."""
    from attnlab.models import AttnLabForCausalLM

    path = Path(path)
    fla_config = json.loads((path / "config.json").read_text())
    if fla_config.get("model_type") != "gla":
        raise CheckpointError(f"{path} is not an fla GLA checkpoint (model_type {fla_config.get('model_type')!r})")
    model = AttnLabForCausalLM(attnlab_config_from_fla_gla(fla_config))
    state = read_safetensors_dir(path)
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    expected = model.state_dict()
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    mis_shaped = sorted(k for k in set(state) & set(expected) if state[k].shape != expected[k].shape)
    if missing or unexpected or mis_shaped:
        parts = [f"{label}: {', '.join(names[:8])}{' ...' if len(names) > 8 else ''}"
                 for label, names in (("missing", missing), ("not used", unexpected), ("wrong shape", mis_shaped)) if names]
        raise CheckpointError(f"the fla GLA checkpoint in {path} does not map onto attnlab's gla model ({'; '.join(parts)})")
    model.load_state_dict(state, strict=not model.config.tie_word_embeddings)
    return model.to(dtype)
