"""`train.init_from`: a run continues pretraining from an attnlab model, a checkpoint attnlab converts, or
any HF causal LM directory, with the same trainer; its first step's loss is the peer model's own loss."""

import json

import pytest
import torch
from conftest import run_cli, sets
from transformers import AutoModelForCausalLM

from attnlab.train.loop import AttnLabTrainer

pytestmark = pytest.mark.hf_interop  # CI runs these against the oldest transformers and peft it supports too

VOCAB = 259  # the byte tokenizer's size


def save_tiny_llama(path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                 tie_word_embeddings=False)).save_pretrained(path)


def save_tiny_qwen3(path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
                                 tie_word_embeddings=True)).save_pretrained(path)


def save_tiny_mamba2(path):
    from transformers import Mamba2Config, Mamba2ForCausalLM

    torch.manual_seed(0)
    Mamba2ForCausalLM(Mamba2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, head_dim=8, num_heads=8,
                                   expand=2, n_groups=2, state_size=16, conv_kernel=4, chunk_size=8,
                                   tie_word_embeddings=False)).save_pretrained(path)


@pytest.fixture
def first_batch(monkeypatch):
    """The inputs and loss of the run's first training forward, recorded as the trainer computes them."""
    seen = []
    original = AttnLabTrainer.compute_loss

    def record(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = original(self, model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        if model.training and not seen:
            seen.append(({k: v.detach().clone() for k, v in inputs.items()}, float((out[0] if return_outputs else out).detach())))
        return out

    monkeypatch.setattr(AttnLabTrainer, "compute_loss", record)
    return seen


ONE_STEP = ["train.max_steps=2", "train.warmup_steps=0", "train.log_every=1", "train.save_every=0", "train.eval_every=0",
            "train.sample_tokens=0"]


def no_model(overrides: list[str]) -> list[str]:
    return [o for o in overrides if not o.startswith("model.")]


def first_logged_loss(run_dir) -> float:
    rows = [json.loads(line) for line in (run_dir / "heartbeat.jsonl").read_text().splitlines() if line.strip()]
    return next(r["loss"] for r in rows if r.get("step") == 1)


@pytest.mark.parametrize("save, trained_as", [(save_tiny_llama, "llama"), (save_tiny_qwen3, "qwen3"), (save_tiny_mamba2, "attnlab")],
                         ids=["llama", "qwen3", "mamba2"])
def test_first_step_loss_is_the_peer_models_loss_on_the_same_batch(tmp_path, tiny, first_batch, save, trained_as):
    """HF Mamba2 converts (and trains as attnlab's mamba2); Llama and Qwen3 train as themselves."""
    save(tmp_path / "peer")
    run = tmp_path / "run"
    assert run_cli("train", "--run-dir", str(run), *sets(no_model(tiny) + ONE_STEP + [f"train.init_from={tmp_path / 'peer'}"])) == 0
    inputs, trainer_loss = first_batch[0]
    peer = AutoModelForCausalLM.from_pretrained(tmp_path / "peer", dtype=torch.float32).eval()
    with torch.no_grad():
        peer_loss = float(peer(**inputs).loss)
    assert abs(trainer_loss - peer_loss) <= 1e-4
    assert abs(first_logged_loss(run) - peer_loss) <= 1e-4
    assert json.loads((run / "final" / "config.json").read_text())["model_type"] == trained_as


def test_an_attnlab_run_continues_from_another_runs_final_model(tmp_path, tiny, first_batch):
    first = tmp_path / "first"
    assert run_cli("train", "--run-dir", str(first), *sets(tiny + ONE_STEP)) == 0
    first_batch.clear()
    second = tmp_path / "second"
    assert run_cli("train", "--run-dir", str(second), *sets(no_model(tiny) + ONE_STEP + [f"train.init_from={first}"])) == 0
    inputs, trainer_loss = first_batch[0]
    peer = AutoModelForCausalLM.from_pretrained(first / "final", dtype=torch.float32).eval()
    with torch.no_grad():
        assert abs(trainer_loss - float(peer(**inputs).loss)) <= 1e-4


def test_model_fields_that_disagree_with_the_checkpoint_are_refused_by_preflight(tmp_path, tiny, capsys):
    save_tiny_llama(tmp_path / "llama")
    run = tmp_path / "run"
    code = run_cli("train", "--run-dir", str(run), *sets(tiny + ONE_STEP + [f"train.init_from={tmp_path / 'llama'}"]))
    assert code != 0
    out = capsys.readouterr()
    assert "model.num_layers=1, but the model in" in out.out and "has 2" in out.out
    assert "error:" in out.err
    assert not (run / "checkpoints").exists() and not (run / "final").exists()


def test_a_missing_init_from_path_is_refused_naming_it(tmp_path, tiny, capsys):
    code = run_cli("preflight", *sets(no_model(tiny) + [f"train.init_from={tmp_path / 'nowhere'}"]))
    assert code != 0
    assert "model not found" in capsys.readouterr().out


def test_a_checkpoint_with_options_attnlab_lacks_is_refused_listing_them(tmp_path, tiny, capsys):
    from transformers import Mamba2Config, Mamba2ForCausalLM

    Mamba2ForCausalLM(Mamba2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, head_dim=8, num_heads=8, expand=2,
                                   state_size=16, use_bias=True, time_step_limit=(0.0, 5.0))).save_pretrained(tmp_path / "m")
    code = run_cli("preflight", *sets(no_model(tiny) + [f"train.init_from={tmp_path / 'm'}"]))
    assert code != 0
    out = capsys.readouterr().out
    assert "use_bias=True" in out and "time_step_limit" in out


def test_a_run_started_from_a_checkpoint_resumes(tmp_path, tiny):
    save_tiny_llama(tmp_path / "llama")
    run = tmp_path / "run"
    base = no_model(tiny) + [f"train.init_from={tmp_path / 'llama'}", "train.max_steps=4", "train.warmup_steps=0",
                             "train.save_every=2", "train.eval_every=0", "train.sample_tokens=0"]
    assert run_cli("train", "--run-dir", str(run), *sets(base + ["train.max_steps=2"])) == 0
    (tmp_path / "llama").rename(tmp_path / "moved")  # the run's checkpoint holds the model: the source is not needed again
    assert run_cli("train", "--run-dir", str(run), "--resume", *sets(base)) == 0
    steps = [json.loads(line)["step"] for line in (run / "heartbeat.jsonl").read_text().splitlines() if line.strip()]
    assert max(steps) == 4


def test_an_hf_model_that_is_not_a_causal_lm_is_refused(tmp_path, tiny, capsys):
    (tmp_path / "vit").mkdir()
    (tmp_path / "vit" / "config.json").write_text(json.dumps({"model_type": "vit", "hidden_size": 32}))
    assert run_cli("preflight", *sets(no_model(tiny) + [f"train.init_from={tmp_path / 'vit'}"])) != 0
    assert "not a causal language model" in capsys.readouterr().out
