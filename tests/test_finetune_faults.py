"""Fine-tuning faults and bad input: one clear `error:` message each, exit != 0, no traceback, and the run's
files (run.json, the last good checkpoint) left saying what happened."""

import json
import sys

from conftest import run_cli, sets

ROWS = [{"prompt": f"<T> what is {w}?\n", "completion": f"{w}."} for w in ("red", "sky", "sea", "sun")] + \
       [{"prompt": f"<V> what is {w}?\n", "completion": f"{w} is a thing that we all know well."} for w in ("red", "sky", "sea", "sun")]
QUICK = ["train.max_steps=2", "train.warmup_steps=0", "train.batch_size=4", "train.log_every=1", "train.device=cpu",
         "finetune.r=4", "finetune.dropout=0.0", "data.max_len=64"]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _finetune(run, base, data, *extra, resume=False):
    cfg = run.parent / "ft.yaml"
    if not cfg.exists():
        cfg.write_text("finetune:\n  control_tokens: ['<T>', '<V>']\n")
    args = ["finetune"] + ([] if resume else [str(cfg)])
    args += sets([f"base.path={base}", f"data.train={data}", *QUICK, *extra]) if not resume else sets(list(extra))
    return run_cli(*args, "--run-dir", str(run), *(["--resume"] if resume else []))


def _one_error(err: str) -> str:
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    return err


def _status(run):
    return json.loads((run / "run.json").read_text())


def _snapshot(run):
    return {p.relative_to(run).as_posix(): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file() and "tb" not in p.parts}


def test_finetune_on_non_utf8_data_is_refused_and_the_run_is_marked_failed(attnlab_dir, tmp_path, capsys):
    data = tmp_path / "latin1.jsonl"
    data.write_bytes(json.dumps({"prompt": "caf\u00e9", "completion": "ok"}).encode().replace(b"\\u00e9", "\u00e9".encode("latin-1")) + b"\n")
    run = tmp_path / "run"
    assert _finetune(run, attnlab_dir, data) == 1
    err = _one_error(capsys.readouterr().err)
    assert "is not UTF-8" in err and "line 1" in err and "iconv" in err
    status = _status(run)
    assert status["status"] == "failed" and "not UTF-8" in status["error"]
    # nothing was trained, so the same command with the data fixed starts the run again
    assert _finetune(run, attnlab_dir, _jsonl(tmp_path / "latin1.jsonl", ROWS)) == 0
    assert _status(run)["status"] == "finished"


def test_a_failure_while_preparing_never_leaves_run_json_at_preparing(attnlab_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # qlora's import fails as if bitsandbytes were missing
    run = tmp_path / "run"
    assert _finetune(run, attnlab_dir, _jsonl(tmp_path / "d.jsonl", ROWS), "finetune.method=qlora") == 1
    assert "needs bitsandbytes" in _one_error(capsys.readouterr().err)
    status = _status(run)
    assert status["status"] == "failed" and "needs bitsandbytes" in status["error"]


def _adapter(tmp_path, attnlab_dir):
    run = tmp_path / "run"
    assert _finetune(run, attnlab_dir, _jsonl(tmp_path / "d.jsonl", ROWS)) == 0
    return run / "final"


def test_merge_with_adapter_metadata_lacking_base_model_is_refused(attnlab_dir, tmp_path, capsys):
    adapter = _adapter(tmp_path, attnlab_dir)
    meta = json.loads((adapter / "attnlab_adapter.json").read_text())
    del meta["base_model"]
    (adapter / "attnlab_adapter.json").write_text(json.dumps(meta))
    capsys.readouterr()
    assert run_cli("merge", str(adapter), str(tmp_path / "merged")) == 1
    err = _one_error(capsys.readouterr().err)
    assert "records no base_model" in err and "base.path" in err
    assert not (tmp_path / "merged").exists()


def test_merge_with_adapter_metadata_that_is_not_an_object_is_refused(attnlab_dir, tmp_path, capsys):
    adapter = _adapter(tmp_path, attnlab_dir)
    (adapter / "attnlab_adapter.json").write_text("[1, 2]")
    capsys.readouterr()
    assert run_cli("merge", str(adapter), str(tmp_path / "merged")) == 1
    assert "not the adapter's metadata object" in _one_error(capsys.readouterr().err)


def test_merge_onto_an_existing_file_is_refused(attnlab_dir, tmp_path, capsys):
    adapter = _adapter(tmp_path, attnlab_dir)
    (tmp_path / "merged").write_text("x")
    capsys.readouterr()
    assert run_cli("merge", str(adapter), str(tmp_path / "merged")) == 1
    assert "is a file" in _one_error(capsys.readouterr().err)


def test_resume_of_a_run_without_a_checkpoint_is_refused_never_started_afresh(attnlab_dir, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    data = _jsonl(tmp_path / "d.jsonl", ROWS)
    from attnlab.finetune.config import load_finetune_config, save_finetune_config

    save_finetune_config(load_finetune_config(None, [f"base.path={attnlab_dir}", f"data.train={data}", *QUICK]), run / "config.yaml")
    before = _snapshot(run)
    assert _finetune(run, attnlab_dir, data, resume=True) == 1
    assert "nothing to resume" in _one_error(capsys.readouterr().err)
    assert _snapshot(run) == before and not (run / "heartbeat.jsonl").exists()


def test_resume_of_a_directory_without_a_run_is_refused(tmp_path, capsys):
    assert run_cli("finetune", "--resume", "--run-dir", str(tmp_path / "none")) == 1
    assert "holds no fine-tuning run" in _one_error(capsys.readouterr().err)


def test_resume_with_a_changed_config_is_refused_and_leaves_the_run_intact(attnlab_dir, tmp_path, capsys):
    run = tmp_path / "run"
    data = _jsonl(tmp_path / "d.jsonl", ROWS)
    assert _finetune(run, attnlab_dir, data, "train.save_every=2") == 0
    before = _snapshot(run)
    capsys.readouterr()
    assert _finetune(run, attnlab_dir, data, "train.max_steps=4", "finetune.r=8", "train.lr=1e-2", resume=True) == 1
    err = _one_error(capsys.readouterr().err)
    assert "finetune.r: 4 -> 8" in err and "train.lr" in err
    after = _snapshot(run)
    assert {k: v for k, v in after.items() if k != "run.json"} == {k: v for k, v in before.items() if k != "run.json"}


def test_a_new_run_into_a_directory_holding_a_run_is_refused(attnlab_dir, tmp_path, capsys):
    run = tmp_path / "run"
    data = _jsonl(tmp_path / "d.jsonl", ROWS)
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("{}\n")
    assert _finetune(run, attnlab_dir, data) == 1
    assert "Continue it with --resume" in _one_error(capsys.readouterr().err)


def test_a_run_dir_that_is_a_file_is_refused(attnlab_dir, tmp_path, capsys):
    run = tmp_path / "run"
    run.write_text("x")
    assert _finetune(run, attnlab_dir, _jsonl(tmp_path / "d.jsonl", ROWS)) == 1
    assert "is a file" in _one_error(capsys.readouterr().err)
    assert run.read_text() == "x"
