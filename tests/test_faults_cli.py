"""Bad input and faults met by generate, eval, score and report: one `error:` line that says what to do,
a non-zero exit, no traceback, and nothing half-written left behind."""

import errno
import json
import struct

import pytest
import torch

from conftest import run_cli


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from attnlab.data import ByteTokenizer
    from attnlab.models import AttnLabConfig, AttnLabForCausalLM

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("model") / "m"
    AttnLabForCausalLM(AttnLabConfig(vocab_size=259, hidden_size=32, num_layers=1, num_heads=2, mixer="gla")).save_pretrained(path)
    ByteTokenizer().save_pretrained(path)
    return path


def one_error(capsys, *words: str) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.count("error:") == 1, err
    for word in words:
        assert word in err, err
    return err


# --- generate ---------------------------------------------------------------------------------------------


def test_generate_refuses_a_prompt_file_that_is_not_utf8(model_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes("café\n".encode("latin-1"))
    assert run_cli("generate", str(model_dir), "--input", str(prompts)) == 1
    one_error(capsys, "not UTF-8", str(prompts))


def test_generate_refuses_cuda_when_no_cuda_device_is_visible(model_dir, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert run_cli("generate", str(model_dir), "--prompt", "x", "--device", "cuda") == 1
    one_error(capsys, "no CUDA device", "--device cpu")


def test_generate_refuses_a_device_it_does_not_know(model_dir, capsys):
    assert run_cli("generate", str(model_dir), "--prompt", "x", "--device", "gpu") == 1
    one_error(capsys, "--device takes auto, cpu or cuda")


def test_generate_creates_the_missing_directories_of_its_output(model_dir, tmp_path):
    out = tmp_path / "new" / "deeper" / "out.jsonl"
    assert run_cli("generate", str(model_dir), "-p", "a", "-p", "b", "--output", str(out), "--max-new-tokens", "2") == 0
    assert [json.loads(line)["prompt"] for line in out.read_text().splitlines()] == ["a", "b"]


def test_generate_refuses_an_output_that_is_a_directory(model_dir, tmp_path, capsys):
    assert run_cli("generate", str(model_dir), "-p", "a", "-p", "b", "--output", str(tmp_path), "--max-new-tokens", "2") == 1
    one_error(capsys, "is a directory")


@pytest.mark.skipif(not hasattr(__import__("os"), "geteuid") or __import__("os").geteuid() == 0, reason="root writes anywhere")
def test_generate_refuses_an_output_in_a_read_only_directory_before_loading_the_model(model_dir, tmp_path, capsys, monkeypatch):
    import attnlab.loading

    monkeypatch.setattr(attnlab.loading, "load", lambda *a, **k: pytest.fail("the model must not load"))
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        assert run_cli("generate", str(model_dir), "-p", "a", "-p", "b", "--output", str(locked / "out.jsonl")) == 1
    finally:
        locked.chmod(0o755)
    one_error(capsys, "not writable")
    assert list(locked.iterdir()) == []


@pytest.mark.parametrize("code, reason", [(errno.ENOSPC, "No space left on device"), (errno.EROFS, "Read-only file system")])
def test_generate_says_when_its_output_cannot_be_written_and_leaves_nothing_behind(model_dir, tmp_path, capsys, monkeypatch, code, reason):
    from pathlib import Path

    write_text = Path.write_text

    def failing(self, *args, **kwargs):
        if self.name.endswith(".tmp"):
            write_text(self, "partial")  # the disk filled up half way
            raise OSError(code, reason)
        return write_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", failing)
    out = tmp_path / "out.jsonl"
    assert run_cli("generate", str(model_dir), "-p", "a", "-p", "b", "--output", str(out), "--max-new-tokens", "2") == 1
    one_error(capsys, reason, str(out))
    assert list(tmp_path.iterdir()) == []


def test_generate_refuses_a_model_whose_config_json_is_malformed(model_dir, tmp_path, capsys):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in model_dir.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    (broken / "config.json").write_text('{"model_type": "attnlab", ')
    assert run_cli("generate", str(broken), "--prompt", "x") == 1
    one_error(capsys, "config.json", "not valid JSON")


def test_generate_refuses_a_model_whose_config_json_is_not_an_object(model_dir, tmp_path, capsys):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("[1, 2]")
    assert run_cli("generate", str(broken), "--prompt", "x") == 1
    one_error(capsys, "config.json", "not an object")


@pytest.mark.parametrize("cut", [10, 40])
def test_generate_refuses_a_gguf_file_with_a_truncated_header(tmp_path, capsys, cut):
    key = b"general.architecture"
    header = b"GGUF" + struct.pack("<IQQ", 3, 1, 2) + struct.pack("<Q", len(key)) + key + struct.pack("<I", 8) + struct.pack("<Q", 5) + b"llama"
    path = tmp_path / "model.gguf"
    path.write_bytes(header[:cut])
    assert run_cli("generate", str(path), "--prompt", "x") == 1
    one_error(capsys, "not a readable GGUF model", "truncated")


def test_generate_with_a_vanishing_temperature_samples_the_greedy_tokens(model_dir, tmp_path, capsys):
    greedy, tiny = tmp_path / "greedy.jsonl", tmp_path / "tiny.jsonl"
    args = ["generate", str(model_dir), "-p", "Hello", "-p", "A", "--max-new-tokens", "6"]
    assert run_cli(*args, "--output", str(greedy)) == 0
    assert run_cli(*args, "--do-sample", "--temperature", "1e-45", "--output", str(tiny)) == 0
    assert "error" not in capsys.readouterr().err
    tokens = lambda path: [json.loads(line)["token_ids"] for line in path.read_text().splitlines()]
    assert tokens(tiny) == tokens(greedy)


def test_sampling_warper_never_yields_nan_probabilities():
    from attnlab.generation.processors import warp_for_sampling

    scores = torch.tensor([[3.0, 1.0, 3.0, -2.0], [0.5, 0.25, 0.0, 40.0]])
    for temperature in (1e-45, 1e-30, 1e-6):
        probs = warp_for_sampling(scores, temperature, top_k=0, top_p=0.9).softmax(-1)
        assert torch.isfinite(probs).all()
        assert torch.equal(probs.argmax(-1), torch.tensor([0, 3]))
    assert torch.allclose(warp_for_sampling(scores, 0.7, 0, 1.0).softmax(-1), (scores / 0.7).softmax(-1))


# --- eval and score ---------------------------------------------------------------------------------------


def test_eval_refuses_an_output_dir_that_is_a_file_before_loading_the_model(model_dir, tmp_path, capsys, monkeypatch):
    import attnlab.loading

    monkeypatch.setattr(attnlab.loading, "load", lambda *a, **k: pytest.fail("the model must not load"))
    taken = tmp_path / "taken"
    taken.write_text("keep me")
    assert run_cli("eval", str(model_dir), "--task", "perplexity", "--output-dir", str(taken)) == 1
    one_error(capsys, "is a file")
    assert taken.read_text() == "keep me"


def test_score_refuses_an_output_dir_that_is_a_file(tmp_path, capsys):
    taken, predictions = tmp_path / "taken", tmp_path / "predictions.txt"
    taken.write_text("keep me")
    predictions.write_text("SELECT 1\n")
    assert run_cli("score", "--task", "spider", "--predictions", str(predictions), "--output-dir", str(taken)) == 1
    one_error(capsys, "is a file")
    assert taken.read_text() == "keep me"


# --- help -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("verb, shown", [("generate", "at most [default: 64]"), ("eval", "at most [default: the task's]")])
def test_help_shows_the_defaults_written_in_brackets(verb, shown, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    assert run_cli(verb, "--help") == 0
    out = capsys.readouterr().out
    assert shown in out and "Sampling temperature [default: 1.0]" in out
    assert "at most ." not in out and "temperature ." not in out
