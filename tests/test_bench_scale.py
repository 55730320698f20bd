"""`attnlab bench scale`: keys, efficiency and what a run directory says, as units; the whole bench on CPU
processes (gloo) at tiny sizes; the refusal without CUDA."""

import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from attnlab.bench import scale
from attnlab.bench.scale import Variant
from conftest import run_cli

PNG = b"\x89PNG\r\n\x1a\n"


def test_the_key_names_model_gpus_per_gpu_batch_sequence_strategy_and_flags():
    assert Variant("attnlab-2mamba", 4, 16, 1024, "fsdp", ckpt=True, eager=True).key == "attnlab-2mamba@4x16x1024:fsdp:ckpt:eager"
    assert Variant("hf-llama", 1, 8, 2048).key == "hf-llama@1x8x2048:ddp"
    for v in (Variant("attnlab-2mamba-e", 2, 16, 1024, "ddp", eager=True), Variant("hf-llama", 8, 4, 4096, "fsdp", ckpt=True)):
        assert scale.parse_key(v.key) == v
        assert "@" not in v.name and ":" not in v.name
    with pytest.raises(ValueError):
        scale.parse_key("attnlab-gla@16x1024")


def test_the_plan_runs_one_gpu_once_under_the_first_strategy_each_model_from_its_baseline():
    plan = scale.variants(["attnlab-2mamba", "hf-llama"], [4, 1, 2], ["ddp", "fsdp"], 16, 1024, ckpt=True, eager=True)
    assert len(plan) == 2 * (4 + 2 * 4 + 2 * 4)  # per model: one GPU x 4 variants, then 2 strategies x 4 on 2 and on 4 GPUs
    assert len({v.key for v in plan}) == len(plan)
    assert {v.strategy for v in plan if v.gpus == 1} == {"ddp"}
    assert plan[0].is_baseline and plan[20].is_baseline and plan[20].model == "hf-llama"
    assert [v.gpus for v in plan[:20]] == sorted(v.gpus for v in plan[:20])
    assert [v.key for v in scale.variants(["hf-llama"], [1], ["fsdp"], 2, 32, ckpt=False, eager=False)] == ["hf-llama@1x2x32:fsdp"]


def test_side_by_side_runs_each_gpu_count_in_groups_that_share_the_gpus_out_fewest_gpus_first():
    plan = scale.variants(["attnlab-2mamba", "attnlab-gla", "hf-llama"], [1, 2, 4], ["ddp"], 9, 1024, ckpt=True, eager=False)
    assert [[v.key for v in wave] for wave in scale.waves(plan, 1)] == [[v.key] for v in plan]
    waves = scale.waves(plan, 4)
    assert [len(w) for w in waves] == [4, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1]
    assert [w[0].gpus for w in waves] == [1, 1, 2, 2, 2, 4, 4, 4, 4, 4, 4]
    assert all(len({v.gpus for v in w}) == 1 for w in waves)
    assert sorted(v.key for w in waves for v in w) == sorted(v.key for v in plan)
    assert scale.wave_devices(waves[0], cuda=True) == [[0], [1], [2], [3]]
    assert scale.wave_devices(waves[2], cuda=True) == [[0, 1], [2, 3]]
    assert scale.wave_devices(waves[-1], cuda=True) == [None]
    assert scale.wave_devices(scale.waves(plan, 1)[0], cuda=True) == [[0]]  # one process alone: one GPU, not every one visible
    assert scale.wave_devices(waves[0], cuda=False) == [None] * 4


def test_a_run_side_by_side_sees_only_its_own_gpus_of_those_visible(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert scale.run_environment(1, [2])["CUDA_VISIBLE_DEVICES"] == "2"
    assert scale.run_environment(2, [2, 3])["CUDA_VISIBLE_DEVICES"] == "2,3"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert scale.run_environment(1, [1])["CUDA_VISIBLE_DEVICES"] == "5"
    assert scale.run_environment(2, [2, 3])["CUDA_VISIBLE_DEVICES"] == "6,7"
    assert scale.run_environment(4)["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"


def test_every_run_gets_torchruns_one_openmp_thread_so_torchrun_has_nothing_to_warn_about(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert scale.run_environment(1)["OMP_NUM_THREADS"] == scale.run_environment(4)["OMP_NUM_THREADS"] == "1"
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    assert scale.run_environment(4)["OMP_NUM_THREADS"] == "8"


def test_one_process_is_given_no_strategy_which_it_would_warn_that_it_ignores():
    bench = scale.Bench(scale.Size(32, 1, 2, 64, None), "cuda", "byte", 8)
    one, four = (scale.Variant("attnlab-2mamba", gpus, 9, 1024, "fsdp", False, False) for gpus in (1, 4))
    assert not [o for o in bench.overrides(one) if o.startswith("train.strategy=")]
    assert "train.strategy=fsdp" in bench.overrides(four)


@pytest.mark.parametrize("visible, counts", [(0, [1]), (1, [1]), (2, [1, 2]), (4, [1, 2, 4]), (6, [1, 2, 4, 6]), (8, [1, 2, 4, 8])])
def test_default_gpu_counts_double_up_to_every_visible_gpu(visible, counts):
    assert scale.default_gpu_counts(visible) == counts


def test_efficiency_is_per_gpu_throughput_over_the_one_gpu_captured_run_without_checkpointing_of_the_same_model_and_batch():
    def row(per_gpu, gpus=1):
        return {"tokens_per_s": per_gpu * gpus, "per_gpu_tokens_per_s": per_gpu}

    runs = {
        "attnlab-2mamba@1x16x1024:ddp": row(1000),
        "attnlab-2mamba@1x16x1024:ddp:eager": row(800),
        "attnlab-2mamba@1x16x1024:ddp:ckpt": row(700),
        "attnlab-2mamba@2x16x1024:ddp": row(900, 2),
        "attnlab-2mamba@4x16x1024:fsdp:ckpt": row(500, 4),
        "attnlab-2mamba@4x16x1024:ddp": {"error": "out of memory"},
        "attnlab-2mamba@2x8x1024:ddp": row(450, 2),  # another per-GPU batch: no baseline of its own
        "hf-llama@1x16x1024:ddp": {"error": "timed out after 900 s"},
        "hf-llama@2x16x1024:ddp": row(600, 2),
    }
    assert scale.efficiencies(runs) == {
        "attnlab-2mamba@1x16x1024:ddp": 1.0, "attnlab-2mamba@1x16x1024:ddp:eager": 0.8, "attnlab-2mamba@1x16x1024:ddp:ckpt": 0.7,
        "attnlab-2mamba@2x16x1024:ddp": 0.9, "attnlab-2mamba@4x16x1024:fsdp:ckpt": 0.5, "attnlab-2mamba@4x16x1024:ddp": None,
        "attnlab-2mamba@2x8x1024:ddp": None, "hf-llama@1x16x1024:ddp": None, "hf-llama@2x16x1024:ddp": None}


def test_tokens_per_s_is_the_median_of_the_logged_steps_after_the_first_two(tmp_path):
    metrics = tmp_path / "metrics.csv"
    metrics.write_text("step,elapsed_s,loss,lr,grad_norm,tokens_per_s,val_loss,val_bpb\n"
                       "5,1,5.5,1e-4,1,10.0,,\n10,2,5.4,1e-4,1,20.0,,\n15,3,5.3,1e-4,1,300.0,,\n20,4,5.2,1e-4,1,100.0,,\n"
                       "25,5,5.1,1e-4,1,200.0,,\n25,6,,,,,5.0,7.0\n")
    assert scale.median_tokens_per_s(scale.logged_rates(scale.metrics_rows(metrics))) == 200.0
    metrics.write_text("step,elapsed_s,loss,lr,grad_norm,tokens_per_s,val_loss,val_bpb\n5,1,5.5,1e-4,1,10.0,,\n")
    assert scale.median_tokens_per_s(scale.logged_rates(scale.metrics_rows(metrics))) == 10.0  # fewer logs than skipped: the last one
    assert scale.median_tokens_per_s(scale.logged_rates(scale.metrics_rows(tmp_path / "missing.csv"))) is None


def test_each_row_carries_the_last_training_loss_and_the_held_out_loss_and_the_table_shows_them(tmp_path):
    """A captured and an eager run (or one GPU and several) start alike: their losses side by side say whether they
    also trained alike."""
    metrics = tmp_path / "metrics.csv"
    metrics.write_text("step,elapsed_s,loss,lr,grad_norm,tokens_per_s,val_loss,val_bpb\n"
                       "5,1,5.5,1e-4,1,10.0,,\n10,2,5.25,1e-4,1,20.0,,\n10,3,,,,,5.125,7.0\n")
    assert scale.final_losses(scale.metrics_rows(metrics)) == (5.25, 5.125)
    assert scale.final_losses(scale.metrics_rows(tmp_path / "missing.csv")) == (None, None)
    metrics.write_text("step,elapsed_s,loss,lr,grad_norm,tokens_per_s,val_loss,val_bpb\n5,1,5.5,1e-4,1,10.0,,\n")
    assert scale.final_losses(scale.metrics_rows(metrics)) == (5.5, None)

    v = Variant("attnlab-softmax", 1, 2, 32, "ddp", False, True)
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / f"{v.name}.log").write_text("step 10/10\n")
    _logged(tmp_path / "run", [1, 2, 3, 4])
    with open(tmp_path / "run" / "metrics.csv", "a") as f:
        f.write("4,5,,,,,4.75,6.0\n")
    row = scale.run_row(v, tmp_path / "run", logs, 10.0)
    assert (row["loss"], row["val_loss"]) == (5.0, 4.75)

    from rich.console import Console

    from attnlab.bench.scale import results_table

    result = {"settings": {"batch_per_gpu": 2, "seq_len": 32}, "env": {"gpus": []}, "runs": {v.key: row}}
    console = Console(width=250, record=True)
    console.print(results_table(result)[0])
    assert "5.0000 (4.7500)" in console.export_text()


def test_peak_memory_is_the_largest_in_any_process_heartbeat(tmp_path):
    beat = lambda gib: json.dumps({"step": 5, "gpu_mem_peak_alloc_gib": gib}) + "\n"  # noqa: E731
    (tmp_path / "heartbeat.jsonl").write_text(beat(10.5) + beat(11.0))
    (tmp_path / "heartbeat_rank0.jsonl").write_text(beat(11.0))
    (tmp_path / "heartbeat_rank1.jsonl").write_text(beat(12.25) + '{"step": 10, "gpu_mem')  # a torn last line
    assert scale.peak_allocated_gib(tmp_path) == 12.25
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "heartbeat.jsonl").write_text(json.dumps({"step": 5, "gpu_mem_alloc_gib": None}) + "\n")
    assert scale.peak_allocated_gib(tmp_path / "cpu") is None


def test_the_log_says_whether_the_step_ran_captured_and_why_not():
    assert scale.graph_report("training step captured as CUDA graphs (batch (16,\n 1024); other shapes run eagerly)") == (True, None)
    assert scale.graph_report("training step runs eagerly: LlamaForCausalLM is not an\nattnlab model (train.cuda_graphs)") == (
        False, "LlamaForCausalLM is not an attnlab model")
    assert scale.graph_report("model: 1,000 parameters") == (False, None)


TORCHRUN_REPORT = """W1127 01:55:19.984000 9198 site-packages/torch/distributed/run.py:874] *****************************************
{worker}
E1127 01:55:34.635000 9198 site-packages/torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) local_rank: 1
Traceback (most recent call last):
  File "/usr/bin/torchrun", line 8, in <module>
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
attnlab.cli FAILED
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  exitcode  : 1 (pid: 9203)
============================================================
"""


@pytest.mark.parametrize("stdout, worker, reason", [
    ("", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", "out of memory"),
    ("preflight error   train.strategy: fsdp needs CUDA devices\n", "error: preflight found 1 error (listed above); nothing was started.",
     "preflight: train.strategy: fsdp needs CUDA devices"),
    ("", "error: cannot load the causal LM in /x (train.init_from): bad file", "cannot load the causal LM in /x (train.init_from): bad file"),
    ("", 'Traceback (most recent call last):\n  File "x.py", line 1\nRuntimeError: NCCL error: unhandled system error', "RuntimeError: NCCL error: unhandled system error"),
    ("", "Killed", "Killed"),
])
def test_a_failed_run_is_one_line_of_its_own_not_torchruns_report(stdout, worker, reason):
    assert scale.failure_reason(stdout, TORCHRUN_REPORT.format(worker=worker), 1) == reason
    assert scale.failure_reason("", "", -9) == "exit code -9"


def _alive(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    return status.is_file() and "\nState:\tZ" not in status.read_text()  # a zombie has ended


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_a_run_past_its_time_limit_is_stopped_with_every_process_it_started(tmp_path):
    pid_file = tmp_path / "worker.pid"
    launcher = ("import subprocess, sys, time; "
                f"worker = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); open({str(pid_file)!r}, 'w').write(str(worker.pid)); "
                "time.sleep(60)")
    # 10 s: time for the launcher to start its worker and write its pid even on a loaded machine
    done = scale.run_logged([sys.executable, "-c", launcher], tmp_path / "out.log", tmp_path / "err.log", timeout_s=10)
    assert done.timed_out and 10 <= done.wall_s < 40
    worker = int(pid_file.read_text())
    deadline = time.monotonic() + 10  # a killed process is gone once the kernel has torn it down
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(worker)


def test_without_cuda_the_bench_refuses_and_names_the_cpu_check(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert run_cli("bench", "scale", "--out", str(tmp_path / "scale.json")) == 1
    err = capsys.readouterr().err
    assert "no CUDA device is visible" in err and "--device cpu" in err
    assert not (tmp_path / "scale.json").exists()


def test_scale_on_one_and_two_cpu_processes_writes_every_run_the_table_and_the_plot(tmp_path, capsys):
    out = tmp_path / "scale.json"
    assert run_cli("bench", "scale", "--device", "cpu", "--model", "softmax", "--gpus", "1", "--gpus", "2", "--no-eager", "--no-ckpt",
                   "--steps", "6", "--out", str(out)) == 0
    result = json.loads(out.read_text())
    assert set(result) == {"env", "settings", "runs"}
    assert {"device", "gpus", "gpu_count", "torch", "transformers", "python", "command"} <= set(result["env"])
    assert result["env"]["device"] == "cpu" and result["settings"]["tokenizer"] == "byte"
    assert list(result["runs"]) == ["attnlab-softmax@1x2x32:ddp", "attnlab-softmax@2x2x32:ddp"]
    one, two = result["runs"].values()
    for row in (one, two):
        assert set(row) == {"tokens_per_s", "per_gpu_tokens_per_s", "efficiency", "peak_allocated_gib", "cuda_graphs", "wall_s",
                            "loss", "val_loss"}, row
        assert row["tokens_per_s"] > 0 and row["peak_allocated_gib"] is None and row["cuda_graphs"] is False
        assert row["loss"] > 0 and row["val_loss"] > 0
    assert one["efficiency"] == 1.0 and one["per_gpu_tokens_per_s"] == one["tokens_per_s"]
    assert abs(two["per_gpu_tokens_per_s"] - two["tokens_per_s"] / 2) <= 1  # each rounded from the unrounded figure
    assert two["efficiency"] == pytest.approx(two["per_gpu_tokens_per_s"] / one["per_gpu_tokens_per_s"], abs=2e-3)
    assert out.with_suffix(".png").read_bytes()[:8] == PNG
    assert (tmp_path / "scale-logs" / "attnlab-softmax-2x2x32-ddp.log").is_file()
    printed = capsys.readouterr().out
    assert "[2/2] attnlab-softmax@2x2x32:ddp: started (torchrun, 2 processes" in printed
    assert "per-GPU tokens/s" in printed


def test_a_profiled_run_keeps_each_summary_beside_its_logs_and_its_figures_in_the_row(tmp_path):
    """A run with --set train.profile_steps=N (`train.profile_steps`, tests/test_profiling.py) leaves profile_rank*.txt
    and .json in its run directory: each summary is copied beside the run's logs, the first process's figures go into
    its row."""
    from attnlab.bench.scale import PROFILE_FIGURES, run_profiles

    run_dir, logs = tmp_path / "run", tmp_path / "scale-logs"
    run_dir.mkdir()
    logs.mkdir()
    assert run_profiles(run_dir, logs, "attnlab-softmax-2x2x32-ddp") is None  # not profiled
    figures = {"wall_ms_per_step": 80.0, "gpu_kernel_ms_per_step": 60.0, "gpu_busy": 0.75, "host_wait_ms_per_step": 12.5,
               "kernels_per_step": 1500.0}
    for rank in (0, 1):
        (run_dir / f"profile_rank{rank}.txt").write_text(f"steps 3-4 profiled (2), rank {rank}\n")
        (run_dir / f"profile_rank{rank}.json").write_text(json.dumps({"first_step": 3, "last_step": 4, "steps": 2, **figures,
                                                                      "wait_callers": [["loop.py:391 _close", 1.0]],
                                                                      "host_ops": [], "kernels": []}))
    row = run_profiles(run_dir, logs, "attnlab-softmax-2x2x32-ddp")
    assert row == {"first_step": 3, "last_step": 4, **figures, "wait_callers": [["loop.py:391 _close", 1.0]]}
    assert set(PROFILE_FIGURES) <= set(row)
    assert (logs / "attnlab-softmax-2x2x32-ddp.profile_rank1.txt").read_text() == "steps 3-4 profiled (2), rank 1\n"

    # the table shows the profiled steps' wall time, GPU share and host waits beside the run's tokens/s
    from rich.console import Console

    from attnlab.bench.scale import results_table

    base = {"cuda_graphs": False, "tokens_per_s": 1000, "per_gpu_tokens_per_s": 500, "efficiency": 0.5, "peak_allocated_gib": None}
    result = {"settings": {"batch_per_gpu": 2, "seq_len": 32}, "env": {"gpus": []},
              "runs": {"attnlab-softmax@2x2x32:ddp:eager": {**base, "profile": row}, "attnlab-softmax@1x2x32:ddp:eager": base}}
    console = Console(width=250, record=True)
    console.print(results_table(result)[0])
    text = console.export_text()
    assert "host wait ms" in text and "GPU busy" in text
    assert "80.0" in text and "75%" in text and "12.5" in text


def test_hf_llama_trains_through_init_from_with_a_bpe_tokenizer_made_once_in_the_work_dir(tmp_path):
    out, work = tmp_path / "scale.json", tmp_path / "work"
    args = ["bench", "scale", "--device", "cpu", "--model", "hf-llama", "--gpus", "1", "--no-eager", "--no-ckpt", "--steps", "4",
            "--tokenizer", "bpe", "--vocab", "512", "--work-dir", str(work), "--out", str(out)]
    assert run_cli(*args) == 0
    result = json.loads(out.read_text())
    assert result["settings"]["vocab"] == 512 and result["settings"]["tokenizer"] == "bpe"
    assert result["runs"]["hf-llama@1x2x32:ddp"]["tokens_per_s"] > 0
    llama = json.loads(next(work.glob("hf-llama-*/config.json")).read_text())
    assert (llama["vocab_size"], llama["hidden_size"], llama["num_hidden_layers"], llama["tie_word_embeddings"]) == (512, 32, 1, False)
    assert (work / "bpe-512-shakespeare" / "tokenizer.json").is_file()
    assert not list((work / "runs").glob("*/final"))  # each run's weights are deleted once measured


def test_the_hf_llama_of_the_bench_carries_the_tokenizers_special_ids(tmp_path):
    """Else transformers' Trainer changes them at the start of every run and says so on every rank."""
    from transformers import AutoConfig

    special = {"bos_token_id": 256, "eos_token_id": 257, "pad_token_id": 258}
    out = scale.hf_llama_init(tmp_path, scale.Size(hidden=32, layers=1, heads=2, intermediate=64, vocab=None), 259, special)
    config = AutoConfig.from_pretrained(out)
    assert {key: getattr(config, key) for key in special} == special


def _logged(run_dir: Path, steps: list[int], rate: float = 1000.0) -> None:
    run_dir.mkdir(parents=True)
    lines = ["step,elapsed_s,loss,lr,grad_norm,tokens_per_s,val_loss,val_bpb"]
    lines += [f"{s},{s},5.0,0.001,1.0,{rate * s},," for s in steps]
    (run_dir / "metrics.csv").write_text("\n".join(lines) + "\n")


def test_a_run_stopped_before_its_end_keeps_what_it_logged_where_enough_was_logged(tmp_path):
    """A run stopped at its time limit (or by an interrupted bench) that logged at least two steps past the first two
    keeps their tokens/s, with a note; with fewer it is an error row."""
    v = Variant("attnlab-softmax", 2, 9, 1024, "ddp", False, False)
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / f"{v.name}.log").write_text("step 20/20\n")
    _logged(tmp_path / "trained", [1, 2, 3, 4, 5])
    row = scale.run_row(v, tmp_path / "trained", logs, 601.0, stopped="timed out after 600 s")
    assert row["tokens_per_s"] == 4000 and row["per_gpu_tokens_per_s"] == 2000 and row["wall_s"] == 601.0
    assert row["note"] == "timed out after 600 s after step 5: tokens/s of the 3 steps logged past the first 2"
    _logged(tmp_path / "early", [1, 2, 3])
    assert scale.run_row(v, tmp_path / "early", logs, None, stopped="interrupted") == {"error": "interrupted, after 3 logged steps"}
    assert scale.run_row(v, tmp_path / "none", logs, None, stopped="interrupted") == {"error": "interrupted"}


def test_an_interrupted_bench_writes_what_its_last_run_logged_before_the_stop(tmp_path, monkeypatch):
    plan = scale.variants(["attnlab-softmax"], [1, 2], ["ddp"], 2, 32, ckpt=False, eager=False)
    bench = SimpleNamespace(device="cpu", settings=lambda plan: {"batch_per_gpu": 2, "seq_len": 32})

    def measure(bench, v, runs_dir, logs_dir, timeout_s, devices=None):
        (logs_dir / f"{v.name}.log").write_text("")
        _logged(runs_dir / v.name, [1, 2, 3, 4, 5, 6], rate=100.0 * v.gpus)
        if v.gpus == 2:  # the stop comes as the two-process run ends: everything it trained is logged
            raise KeyboardInterrupt
        return scale.run_row(v, runs_dir / v.name, logs_dir, 10.0)

    monkeypatch.setattr(scale, "measure", measure)
    out = tmp_path / "scale.json"
    lines = []
    result, finished = scale.run_scale(bench, plan, tmp_path / "work", tmp_path / "logs", out, 60, log=lines.append)
    assert not finished
    written = json.loads(out.read_text())["runs"]
    stopped = written["attnlab-softmax@2x2x32:ddp"]
    assert stopped["tokens_per_s"] == 900 and stopped["efficiency"] == 1.0 and stopped["note"].startswith("interrupted after step 6")
    assert "with what attnlab-softmax@2x2x32:ddp logged before the stop" in lines[-1]


def test_an_interrupted_bench_stops_the_runs_under_way_side_by_side_and_keeps_what_they_logged(tmp_path):
    """Ctrl-C (or the SIGINT of a job's limit) while runs go side by side: every run's process group is stopped, not
    left training on its GPU, and what each logged is written."""
    import os
    import signal
    import threading

    plan = scale.variants(["attnlab-softmax"], [1], ["ddp"], 2, 32, ckpt=False, eager=False)
    plan = [plan[0], Variant("attnlab-gla", 1, 2, 32)]
    pids = tmp_path / "pids"
    pids.mkdir()
    script = ("import os, sys, time; from pathlib import Path; run = Path(sys.argv[1]); run.mkdir(parents=True, exist_ok=True); "
              "rows = ['step,tokens_per_s'] + [f'{s},{100 * s}' for s in range(1, 7)]; "
              "(run / 'metrics.csv').write_text(chr(10).join(rows) + chr(10)); "
              f"Path({str(pids)!r}, run.name).write_text(str(os.getpid())); time.sleep(60)")
    bench = SimpleNamespace(device="cpu", settings=lambda plan: {"batch_per_gpu": 2, "seq_len": 32},
                            command=lambda v, run_dir: [sys.executable, "-c", script, str(run_dir)])
    done = threading.Event()

    def interrupt():  # once both runs are under way, as a terminal's Ctrl-C would
        while len(list(pids.iterdir())) < 2 and not done.wait(0.1):
            pass
        if not done.is_set():
            os.kill(os.getpid(), signal.SIGINT)

    # SIGINT as at a terminal: a process started in the background of a script inherits it ignored
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Thread(target=interrupt, daemon=True).start()
    t0 = time.monotonic()
    try:
        result, finished = scale.run_scale(bench, plan, tmp_path / "work", tmp_path / "logs", tmp_path / "scale.json", 120,
                                           log=lambda line: None, side_by_side=2)
    finally:
        done.set()
        signal.signal(signal.SIGINT, previous)
    assert not finished and time.monotonic() - t0 < 40
    for pid_file in pids.iterdir():
        pid = int(pid_file.read_text())
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(pid)
    written = json.loads((tmp_path / "scale.json").read_text())["runs"]
    assert set(written) == {"attnlab-softmax@1x2x32:ddp", "attnlab-gla@1x2x32:ddp"}
    assert all(row["tokens_per_s"] == 450 and row["note"].startswith("interrupted after step 6") for row in written.values())
