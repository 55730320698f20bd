"""One model config: the run config's `model` section is the source of AttnLabConfig's fields, their defaults
and their rules; a run's model config takes the section as it is."""

import json
from types import SimpleNamespace

import pytest

from attnlab.config import ModelSection, RunConfig
from attnlab.data import load_tokenizer
from attnlab.models import AttnLabConfig, AttnLabForCausalLM
from attnlab.models.mixers import build_mixer
from attnlab.train.build import model_config_from

# a value other than the default for every field of the model section
NOT_DEFAULTS = dict(mixer="softmax", hidden_size=64, num_layers=2, num_heads=2, intermediate_size=96, vocab_size=300,
                    mixer_options={"num_kv_heads": 1}, max_position_embeddings=512, rope_theta=500.0, norm_eps=1e-5,
                    tie_word_embeddings=False, initializer_range=0.01, kernels="torch")


def test_model_config_defaults_are_the_run_config_model_section_defaults():
    config, section = AttnLabConfig(), ModelSection()
    for name in ModelSection.model_fields:
        if name not in ("vocab_size", "intermediate_size", "mixer_options"):  # null or empty: filled in below
            assert getattr(config, name) == getattr(section, name), name
    assert config.vocab_size == len(load_tokenizer("byte"))  # null: the default tokenizer's size
    assert config.intermediate_size == 352  # null: 8/3 * hidden_size rounded up to 32
    assert config.mixer_options == AttnLabConfig(mixer_options=section.mixer_options).mixer_options


def test_a_run_model_config_takes_every_field_of_the_model_section():
    assert set(NOT_DEFAULTS) == set(ModelSection.model_fields)
    cfg = RunConfig(model=NOT_DEFAULTS)
    for name in ModelSection.model_fields:
        assert getattr(cfg.model, name) != ModelSection.model_fields[name].get_default(call_default_factory=True), name
    config = model_config_from(cfg, load_tokenizer("byte"))
    for name, value in NOT_DEFAULTS.items():
        have = getattr(config, name)
        assert ({k: have[k] for k in value} if name == "mixer_options" else have) == value, name


def test_a_saved_model_config_stores_every_field_so_a_default_never_changes_a_saved_model(tmp_path):
    AttnLabForCausalLM(AttnLabConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=2)).save_pretrained(tmp_path)
    stored = json.loads((tmp_path / "config.json").read_text())
    assert set(ModelSection.model_fields) <= set(stored)
    assert AttnLabConfig.from_pretrained(tmp_path).hidden_size == 32


@pytest.mark.parametrize("field, value, message", [
    ("kernels", "triton", r"model.kernels should be 'auto', 'torch' or 'fla' \(got 'triton'\)"),
    ("hidden_size", 0, r"model.hidden_size should be greater than 0"),
    ("intermediate_size", -1, r"model.intermediate_size should be greater than or equal to 0"),
    ("norm_eps", True, r"model.norm_eps should be a number, not a boolean"),
])
def test_model_config_refuses_what_the_run_config_refuses(field, value, message):
    with pytest.raises(ValueError, match=message):
        AttnLabConfig(**{field: value})
    with pytest.raises(ValueError):
        ModelSection(**{field: value})


def test_an_unknown_mixer_gets_one_message_from_the_config_and_from_the_mixer_builder():
    with pytest.raises(ValueError) as from_config:
        AttnLabConfig(mixer="mamba9")
    with pytest.raises(ValueError) as from_builder:
        build_mixer(SimpleNamespace(mixer="mamba9"), 0)
    assert str(from_config.value) == str(from_builder.value)
    assert "did you mean 'mamba2'" in str(from_config.value)
