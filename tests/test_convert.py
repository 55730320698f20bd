"""fla GLA checkpoints import into attnlab's gla mixer with every tensor accounted for."""

import importlib.util
import json

import pytest
import torch
from safetensors.torch import save_file

from attnlab.errors import CheckpointError
from attnlab.models.convert import load_fla_gla

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
