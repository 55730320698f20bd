"""`attnlab train` under torchrun: 2 CPU processes on gloo follow the single-process trajectory."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import run_cli, sets


def _losses(run):
    return [json.loads(line)["loss"] for line in (run / "heartbeat.jsonl").read_text().splitlines() if '"loss"' in line]


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory, small_corpus):
    from conftest import TINY

    overrides = TINY + [f"data.source={small_corpus}"]
    run = tmp_path_factory.mktemp("ddp") / "run"
    torchrun = shutil.which("torchrun")
    launcher = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([*launcher, "--nproc_per_node", "2", "-m", "attnlab.cli", "train", *sets(overrides), "--run-dir", str(run)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run, overrides


def test_two_gloo_processes_match_the_single_process_loss_trajectory(two_process_run, tmp_path):
    run, overrides = two_process_run
    single = tmp_path / "single"
    assert run_cli("train", *sets(overrides), "--run-dir", str(single)) == 0
    assert _losses(run) == pytest.approx(_losses(single), abs=1e-4)
    assert json.loads((run / "run.json").read_text())["val_loss"] == pytest.approx(json.loads((single / "run.json").read_text())["val_loss"], abs=1e-4)


def test_each_rank_writes_its_own_heartbeat_and_rank_0_writes_the_rest(two_process_run):
    run, _ = two_process_run
    for r in (0, 1):
        beats = [json.loads(line) for line in (run / f"heartbeat_rank{r}.jsonl").read_text().splitlines()]
        assert [b["step"] for b in beats] == [2, 4, 6, 8] and "cpu_rss_mib" in beats[-1]
    assert json.loads((run / "run.json").read_text())["world_size"] == 2
    assert (run / "final" / "model.safetensors").is_file()
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == ["step-0000004", "step-0000008"]


def test_a_two_process_checkpoint_resumes_in_one_process(two_process_run, tmp_path):
    run, _ = two_process_run
    copy = tmp_path / "copy"
    shutil.copytree(run, copy, symlinks=True)
    assert run_cli("train", "--resume", "--run-dir", str(copy), "--set", "train.max_steps=10") == 0
    assert os.readlink(copy / "checkpoints" / "latest") == "step-0000010"
