"""Typed configs: YAML + dotted overrides, strict keys with suggestions, one clear error each."""

import pytest
import yaml

from attnlab.config import RunConfig, default_config_path, diff_configs, load_config
from attnlab.errors import ConfigError


def test_default_yaml_is_exactly_the_schema_defaults():
    shipped = yaml.safe_load(default_config_path().read_text())
    assert RunConfig.model_validate(shipped) == RunConfig()


def test_set_overrides_are_validated_by_type():
    cfg = load_config(None, ["train.lr=3e-4", "train.batch_size=8", "train.gradient_checkpointing=true", "model.mixer=softmax"])
    assert cfg.train.lr == pytest.approx(3e-4)
    assert cfg.train.batch_size == 8 and cfg.train.gradient_checkpointing is True
    assert cfg.model.mixer == "softmax"


def test_mixer_options_accept_any_sub_key():
    cfg = load_config(None, ["model.mixer_options.chunk_size=32"])
    assert cfg.model.mixer_options == {"chunk_size": 32}


@pytest.mark.parametrize("override, suggestion", [
    ("train.batchsize=4", "train.batch_size"),
    ("train.learning_rate=1e-3", "train.lr"),
    ("model.mixr=gla", "model.mixer"),
    ("data.seq_length=64", "data.seq_len"),
])
def test_unknown_override_key_suggests_the_closest_valid_name(override, suggestion):
    with pytest.raises(ConfigError, match=f"did you mean '{suggestion}'"):
        load_config(None, [override])


def test_unknown_yaml_key_suggests_the_closest_valid_name(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  max_step: 10\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'train.max_step'.*did you mean 'train.max_steps'"):
        load_config(path)


def test_a_yaml_mapping_without_spaces_after_its_colons_says_to_add_them():
    with pytest.raises(ConfigError, match=r"YAML reads 'limit:512' as one key: write 'limit: 512'"):
        load_config(None, ["data.source=mqar", "eval.tasks=[{task: mqar,limit:512}]"])


def test_wrong_type_names_the_key_and_the_value():
    with pytest.raises(ConfigError, match=r"train.batch_size: .*integer.*'lots'"):
        load_config(None, ["train.batch_size=lots"])


def test_out_of_range_value_is_rejected():
    with pytest.raises(ConfigError, match="train.max_steps"):
        load_config(None, ["train.max_steps=0"])


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("train:\n  lr: [1e-3\n  batch_size: 4\n")
    with pytest.raises(ConfigError, match=r"YAML syntax error in .*broken.yaml at line \d+"):
        load_config(path)


def test_missing_config_file_says_so(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_override_without_equals_sign_is_rejected():
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        load_config(None, ["train.lr"])


def test_diff_configs_reports_only_locked_fields():
    a = RunConfig()
    b = load_config(None, ["model.hidden_size=64", "train.max_steps=100"])
    assert diff_configs(a, b, ("model",)) == ["model.hidden_size: 128 -> 64"]
