"""`attnlab bench zoo`: one schema for every run, a row per failure instead of a crash, on CPU at tiny sizes."""

import json
import sys

import pytest
import torch
import torch.nn.functional as F

import attnlab.models.mixers.attention_family as attention_family
from attnlab.bench import zoo
from conftest import run_cli

TINY = ["--device", "cpu", "--hidden", "64", "--layers", "2", "--heads", "4", "--vocab", "256", "--intermediate", "128",
        "--shape", "2x32", "--steps", "1", "--warmup", "1", "--op-repeats", "1", "--op-heads", "2", "--op-head-dim", "16"]


@pytest.fixture
def stand_in_mixing(monkeypatch):
    """A stand-in for the attention family's `mixing_function` (same contract), recording its calls."""
    calls = []

    def mixing_function(options, head_dim):
        def mix(q, k, v, log_decay):  # [B, T, H, D] each, log_decay [B, T, H] or None
            calls.append((options["decay"], head_dim, log_decay is not None))
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2)
            return o if log_decay is None else o * log_decay.exp()[..., None]
        return mix

    monkeypatch.setattr(attention_family, "mixing_function", mixing_function, raising=False)
    return calls


@pytest.fixture
def no_fla(monkeypatch):
    """fla cannot be imported, whether or not it is installed."""
    for name in [m for m in sys.modules if m == "fla" or m.startswith("fla.")] + ["fla"]:
        monkeypatch.setitem(sys.modules, name, None)


def test_zoo_writes_train_and_ops_rows_in_one_schema_and_a_plot(tmp_path, stand_in_mixing):
    out = tmp_path / "zoo.json"
    assert run_cli("bench", "zoo", *TINY, "--model", "softmax", "--model", "attnlab-gla", "--model", "hf-llama",
                   "--op-model", "2mamba", "--op-model", "sdpa", "--out", str(out)) == 0
    result = json.loads(out.read_text())
    assert set(result) == {"env", "train", "ops", "decode"} and result["decode"] == {}
    assert set(result["env"]) == {"gpu", "torch", "triton", "fla", "transformers", "python", "command"}
    assert result["env"]["torch"] == torch.__version__ and result["env"]["gpu"] is None
    assert list(result["train"]) == ["attnlab-softmax@2x32", "attnlab-gla@2x32", "hf-llama@2x32"]
    for row in result["train"].values():
        assert row["tokens_per_s"] > 0 and row["step_s"] > 0 and row["first_step_s"] > 0 and row["params_M"] > 0
        assert row["peak_allocated_gib"] is None and row["peak_reserved_gib"] is None and row["cuda_graphs"] is False  # CPU
    assert list(result["ops"]) == ["attnlab-2mamba@2x32", "sdpa@2x32"]
    for row in result["ops"].values():
        assert set(row) == {"fwd_bwd_ms", "extra_gib"} and row["fwd_bwd_ms"] > 0 and row["extra_gib"] is None
    assert set(stand_in_mixing) == {("neg_softplus", 16, True)}  # 2mamba decays: the op gets a log-decay
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_missing_peer_is_an_error_row_and_the_run_goes_on(tmp_path, no_fla, capsys):
    out = tmp_path / "zoo.json"
    assert run_cli("bench", "zoo", *TINY, "--model", "fla-gla", "--model", "fla-mamba2", "--model", "softmax",
                   "--op-model", "fla-chunk_gla", "--op-model", "fla-parallel_forgetting_attn", "--out", str(out)) == 0
    result = json.loads(out.read_text())
    for key in ("fla-gla@2x32", "fla-mamba2@2x32"):
        assert result["train"][key] == {"error": "fla is not installed"}
    assert result["ops"] == {"fla-chunk_gla@2x32": {"error": "fla is not installed"},
                             "fla-parallel_forgetting_attn@2x32": {"error": "fla is not installed"}}
    assert result["train"]["attnlab-softmax@2x32"]["tokens_per_s"] > 0
    assert "n/a" in capsys.readouterr().out  # in the table


def test_a_stats_row_steps_the_model_with_its_health_statistics_recorded(tmp_path, monkeypatch):
    """`nsa-stats` is `nsa` stepped as `attnlab train` steps it, statistics recorded; a mixer without any is an error row."""
    from attnlab.models.modeling import AttnLabForCausalLM

    recorded = []
    enable = AttnLabForCausalLM.enable_health_stats
    monkeypatch.setattr(AttnLabForCausalLM, "enable_health_stats", lambda self, on=True: (recorded.append(on), enable(self, on)))
    out = tmp_path / "zoo.json"
    assert run_cli("bench", "zoo", *TINY, "--skip-ops", "--model", "nsa", "--model", "nsa-stats", "--model", "softmax-stats",
                   "--mixer-option", "nsa.block_size=8", "--mixer-option", "nsa.block_counts=3", "--mixer-option", "nsa.window_size=8",
                   "--out", str(out)) == 0
    train = json.loads(out.read_text())["train"]
    assert train["attnlab-nsa@2x32"]["tokens_per_s"] > 0 and train["attnlab-nsa-stats@2x32"]["tokens_per_s"] > 0
    assert recorded == [True]  # the -stats row only
    assert "records no training-health statistics" in train["attnlab-softmax-stats@2x32"]["error"]


@pytest.mark.parametrize("option, name", [("--model", "softmx"), ("--op-model", "softmax")])
def test_unknown_model_exits_with_one_message_naming_the_valid_ones(option, name, capsys):
    assert run_cli("bench", "zoo", *TINY, option, name) == 1
    err = capsys.readouterr().err
    assert f"unknown {option} {name!r}" in err and "2mamba" in err and ("hf-llama" in err if option == "--model" else "sdpa" in err)


def test_out_of_memory_is_a_row_and_every_row_is_written_as_it_comes(tmp_path, monkeypatch):
    measured = dict(tokens_per_s=1, peak_allocated_gib=None, peak_reserved_gib=None, first_step_s=1.0, step_s=1.0, params_M=1.0,
                    loss=1.0, cuda_graphs=False)

    def train_row(name, *args):
        if name == "big":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")
        return measured

    monkeypatch.setattr(zoo, "train_row", train_row)
    out = tmp_path / "zoo.json"
    seen = []

    def log(line):
        seen.append(json.loads(out.read_text())["train"])  # the JSON already holds the row just logged
        if len(seen) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        zoo.run_zoo(["big", "small", "never"], [], [(1, 8)], {}, 2, 16, 1, 1, 1, torch.device("cpu"), out, log)
    assert json.loads(out.read_text())["train"] == {"big@1x8": {"error": "out of memory"}, "small@1x8": measured}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_without_cuda_the_zoo_refuses_to_start(capsys):
    assert run_cli("bench", "zoo", "--skip-ops") == 1
    assert "no CUDA device" in capsys.readouterr().err


def test_zoo_help_lists_its_options(capsys):
    assert run_cli("bench", "zoo", "--help") == 0
    help_text = capsys.readouterr().out
    for option in ("--model", "--op-model", "--shape", "--skip-train", "--skip-ops", "--out"):
        assert option in help_text


@pytest.mark.skipif(not hasattr(attention_family, "mixing_function"), reason="the attention family's mixing_function is not written yet")
def test_ops_row_times_the_real_mixing_function_of_a_preset():
    row = zoo.op_row("attnlab-2mamba", 1, 16, 2, 8, repeats=1, warmup=1, device=torch.device("cpu"))
    assert row["fwd_bwd_ms"] > 0 and row["extra_gib"] is None


def test_mixer_options_reach_the_model_and_bad_ones_are_refused(tmp_path, monkeypatch, capsys):
    from attnlab.bench import train

    built = {}
    real_build = train.build

    def recording_build(name, **size):
        model = real_build(name, **size)
        built[name] = model.config.mixer_options
        return model

    monkeypatch.setattr(zoo, "build", recording_build)
    out = tmp_path / "zoo.json"
    assert run_cli("bench", "zoo", *TINY, "--skip-ops", "--model", "nsa", "--mixer-option", "nsa.block_size=8",
                   "--mixer-option", "nsa.block_counts=3", "--out", str(out)) == 0
    assert built["attnlab-nsa"]["block_size"] == 8 and built["attnlab-nsa"]["block_counts"] == 3
    assert "tokens_per_s" in json.loads(out.read_text())["train"]["attnlab-nsa@2x32"]
    capsys.readouterr()
    assert run_cli("bench", "zoo", *TINY, "--skip-ops", "--model", "nsa", "--mixer-option", "nsa.block_sise=8") == 1
    assert "block_sise" in capsys.readouterr().err
    assert run_cli("bench", "zoo", *TINY, "--skip-ops", "--model", "nsa", "--mixer-option", "nosuch.x=1") == 1
    assert "MIXER.OPTION=VALUE" in capsys.readouterr().err
