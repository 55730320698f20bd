"""`train.profile_steps`: a run's steps under torch's profiler, summarised into the run directory."""

import gzip
import json
import warnings
from types import SimpleNamespace

import pytest
import torch

from conftest import run_cli, sets
from attnlab.train.profiling import SYNC_WARNING, WaitCallers, summarize, summary_text


def test_a_run_profiles_the_steps_asked_for_and_says_where_the_summary_is(tmp_path, tiny, capsys):
    run = tmp_path / "run"
    assert run_cli("train", *sets(tiny + ["train.profile_steps=2", "train.profile_from=3"]), "--run-dir", str(run)) == 0
    out = capsys.readouterr().out
    assert "profiled steps 3-4" in out and "no GPU work" in out

    summary = json.loads((run / "profile_rank0.json").read_text())
    assert (summary["first_step"], summary["last_step"], summary["steps"]) == (3, 4, 2)
    assert summary["wall_ms_per_step"] > 0 and summary["gpu_busy"] is None and summary["kernels_per_step"] == 0
    names = [name for name, _, _ in summary["host_ops"]]
    assert any(name.startswith("aten::") for name in names)  # the model's operations, by their own time
    assert any("Optimizer.step" in name for name in names)  # the whole cycle, the optimizer's step included
    assert summary["wait_callers"] == []  # CUDA's sync debug mode reports nothing on a CPU run
    text = (run / "profile_rank0.txt").read_text()
    assert text.startswith("steps 3-4 profiled (2)") and "host operations by their own time" in text
    trace = json.loads(gzip.decompress((run / "profile_rank0.pt.trace.json.gz").read_bytes()))
    assert trace["traceEvents"]


def test_a_profile_window_past_the_last_step_is_refused_with_the_fix(tmp_path, tiny, capsys):
    run = tmp_path / "run"
    assert run_cli("train", *sets(tiny + ["train.profile_steps=4", "train.profile_from=6"]), "--run-dir", str(run)) == 1
    captured = capsys.readouterr()
    out = captured.out + captured.err
    assert "past train.max_steps" in out and "train.profile_from=5" in out


def _event(name, cuda=False, own_us=0.0, total_us=0.0, device_us=0.0):
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    return SimpleNamespace(name=name, device_type=kind, self_cpu_time_total=own_us, cpu_time_total=total_us,
                           device_time=device_us)


def test_the_summary_splits_a_step_into_gpu_time_host_waits_and_host_operations():
    events = [
        *[_event("gemm_kernel", cuda=True, device_us=3000.0) for _ in range(4)],
        _event("triton_fused", cuda=True, device_us=1000.0),
        _event("aten::mm", own_us=500.0, total_us=900.0),
        _event("cudaStreamSynchronize", own_us=4000.0, total_us=4000.0),  # a blocking copy's wait
        _event("cudaLaunchKernel", own_us=50.0, total_us=50.0),
    ]
    summary = summarize(events, steps=2, wall_s=0.010)  # 2 steps in 10 ms
    assert summary["wall_ms_per_step"] == 5.0
    assert summary["gpu_kernel_ms_per_step"] == 6.5 and summary["gpu_busy"] == pytest.approx(1.3)
    assert summary["host_wait_ms_per_step"] == 2.0 and summary["kernels_per_step"] == 2.5
    assert summary["kernels"][0] == ["gemm_kernel", 2.0, 6.0]
    assert summary["host_ops"][0] == ["cudaStreamSynchronize", 0.5, 2.0]
    text = summary_text(summary, 5, 6)
    assert "130% of the wall time" in text and "steps 5-6 profiled (2)" in text


def _asks_the_gpu():
    warnings.warn(SYNC_WARNING)  # what torch raises at an implicit synchronisation under set_sync_debug_mode("warn")


def test_the_host_waits_are_counted_by_the_code_that_asked_and_other_warnings_still_show():
    waits = WaitCallers(cuda=False)
    waits.start()
    try:
        for _ in range(3):
            _asks_the_gpu()
        with pytest.warns(UserWarning, match="something else"):
            warnings.warn("something else")
    finally:
        waits.stop()
    [(caller, n)] = waits.callers.items()
    assert n == 3 and caller.startswith("test_profiling.py:") and "_asks_the_gpu <- " in caller
    assert "test_the_host_waits_are_counted" in caller  # with its caller
    with pytest.warns(UserWarning, match="synchronizing"):  # off again: torch's warning is a warning like any other
        _asks_the_gpu()
    assert sum(waits.callers.values()) == 3

    summary = summarize([], steps=3, wall_s=0.03, wait_callers=waits.callers)
    assert summary["wait_callers"] == [[caller, 1.0]]
    assert caller[:60] in summary_text(summary, 1, 3)
