"""The CLI: help on every verb, bad config input, preflight."""

import pytest

from conftest import run_cli, sets


@pytest.mark.parametrize("verb", [[], ["train"], ["preflight"], ["generate"], ["eval"], ["score"], ["finetune"], ["merge"], ["sweep"], ["report"], ["bench"], ["bench", "decode"], ["bench", "train"], ["bench", "scale"]])
def test_every_verb_has_help(verb, capsys):
    assert run_cli(*verb, "--help") == 0
    assert "Usage" in capsys.readouterr().out


def test_missing_config_file_exits_non_zero_with_a_message(tmp_path, capsys):
    assert run_cli("train", str(tmp_path / "missing.yaml")) == 1
    assert "config file not found" in capsys.readouterr().err


def test_yaml_syntax_error_exits_non_zero_with_the_line(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("train: {lr: 1e-3\n")
    assert run_cli("train", str(path)) == 1
    assert "YAML syntax error" in capsys.readouterr().err


def test_unknown_key_exits_non_zero_with_a_suggestion(capsys):
    assert run_cli("train", "--set", "train.batchsize=4") == 1
    assert "did you mean 'train.batch_size'" in capsys.readouterr().err


def test_wrong_type_exits_non_zero_naming_the_key(capsys):
    assert run_cli("preflight", "--set", "train.lr=fast") == 1
    assert "train.lr" in capsys.readouterr().err


def test_preflight_lists_every_problem_at_once(tmp_path, tiny, capsys):
    overrides = tiny + ["train.max_steps=5000", "train.save_every=0", "train.profile=production", "model.vocab_size=10"]
    assert run_cli("preflight", *sets(overrides)) == 1
    out = capsys.readouterr().out
    for key in ("train.save_every", "train.profile", "model.vocab_size"):
        assert key in out


def test_preflight_passes_the_default_config(capsys):
    assert run_cli("preflight") == 0
    assert "no problems" in capsys.readouterr().out


def test_preflight_refuses_a_long_cuda_fp32_run_under_the_production_profile(tiny, monkeypatch):
    import torch

    from attnlab.config import load_config
    from attnlab.train.preflight import run_preflight

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    tiny = [o for o in tiny if not o.startswith("train.device")]
    cfg = load_config(None, tiny + ["train.max_steps=5000", "train.save_every=500", "train.profile=production", "train.precision=fp32"])
    report = run_preflight(cfg, load_data=False)
    keys = {p.key for p in report.errors}
    assert {"train.precision", "train.gradient_checkpointing"} <= keys
    relaxed = run_preflight(load_config(None, tiny + ["train.max_steps=5000", "train.save_every=500", "train.precision=fp32"]), load_data=False)
    assert not relaxed.errors and {p.key for p in relaxed.problems} >= {"train.precision"}


@pytest.mark.skipif(__import__("importlib.util").util.find_spec("wandb") is not None, reason="wandb is installed")
def test_wandb_without_the_extra_fails_preflight_with_the_install_command(capsys):
    assert run_cli("preflight", "--set", "train.wandb=true") == 1
    assert "attnlab[wandb]" in capsys.readouterr().out
