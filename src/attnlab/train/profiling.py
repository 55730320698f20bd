"""`train.profile_steps`: a few optimizer steps of a run under torch's profiler, to see where a step's time goes.

The window runs from the end of step `train.profile_from - 1` to the end of step `profile_from + profile_steps - 1`,
so each profiled step is one whole cycle of the trainer: fetching its batch, the forward and backward, clipping, the
optimizer, the loss check and the log. Each process writes, into the run directory:

- `profile_rank{R}.txt`: per step, the wall time, the GPU's kernel time and its share of the wall time, the host's
  time spent waiting for the GPU (`cudaStreamSynchronize` and its kind: a blocking copy, a `.item()`), the kernels
  launched; the code that made the host wait (each implicit synchronisation that CUDA's sync debug mode reports: a
  `.item()`, a `bool()` of a tensor, a copy to the host, by the line that asked for it); then the host's operations by
  their own time and the kernels by GPU time;
- `profile_rank{R}.json`: the same figures;
- `profile_rank{R}.pt.trace.json.gz`: the whole timeline, for Perfetto (ui.perfetto.dev) or chrome://tracing.

A step whose GPU share is well below 1 waits on its host: the host operations say on what.
"""

from __future__ import annotations

import gzip
import json
import tempfile
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

import torch
from transformers import TrainerCallback

from attnlab.outputs import replace_file

# CUDA runtime calls in which the host waits for the GPU
HOST_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
TOP = 20
SYNC_WARNING = "called a synchronizing CUDA operation"  # torch.cuda.set_sync_debug_mode("warn")'s message
TORCH_DIR = Path(torch.__file__).resolve().parent


class WaitCallers:
    """While on, where the host is made to wait for the GPU: CUDA's sync debug mode warns at each implicit
    synchronisation (a `.item()`, a tensor's `bool()`, a copy to the host; not explicit `synchronize()` calls), and
    each warning is counted under the line outside torch that led to it (with its two callers). The mode costs nothing
    where nothing synchronises; its warnings go nowhere else while on."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda  # whether the run is on CUDA (else nothing can synchronise, and CUDA is left uninitialised)
        self.callers: Counter[str] = Counter()
        self._catch = None
        self._mode = 0  # the sync debug mode before (0: off)

    def start(self) -> None:
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.filterwarnings("always", message=SYNC_WARNING)
        shown = warnings.showwarning

        def record(message, category, filename, lineno, file=None, line=None):
            if SYNC_WARNING not in str(message):
                return shown(message, category, filename, lineno, file, line)
            self.callers[where(traceback.extract_stack()[:-1])] += 1

        warnings.showwarning = record
        if self.cuda:
            self._mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")

    def stop(self) -> None:
        if self.cuda:
            torch.cuda.set_sync_debug_mode(self._mode)
        if self._catch is not None:
            self._catch.__exit__(None, None, None)
            self._catch = None


def where(stack) -> str:
    """The innermost frame outside torch and the warnings machinery, with its two callers: "file:line function <- ..."."""
    frames = [f for f in stack if not Path(f.filename).resolve().is_relative_to(TORCH_DIR) and "warnings" not in Path(f.filename).name]
    return " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames[-3:])) or "torch"


def kernel_times(events) -> dict[str, list]:
    """The GPU's side of the profiler's events (`prof.events()`): kernel name -> [launches, GPU ms]."""
    kernels: dict[str, list] = {}
    for evt in events:
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            entry = kernels.setdefault(evt.name, [0, 0.0])
            entry[0] += 1
            entry[1] += evt.device_time / 1000
    return kernels


def summarize(events, steps: int, wall_s: float, wait_callers: Counter | None = None) -> dict:
    """The figures of `steps` profiled steps from the profiler's events (`prof.events()`), their wall time and where
    the host was made to wait (`WaitCallers.callers`)."""
    kernels = kernel_times(events)  # name -> [launches, GPU ms]
    host: dict[str, list[float]] = {}  # operation -> [calls, own ms]
    waits_ms = 0.0
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CUDA:
            continue
        entry = host.setdefault(e.name, [0, 0.0])
        entry[0] += 1
        entry[1] += e.self_cpu_time_total / 1000
        if e.name in HOST_WAITS:
            waits_ms += e.cpu_time_total / 1000
    wall_ms = wall_s * 1000 / steps
    gpu_ms = sum(ms for _, ms in kernels.values()) / steps if kernels else None  # None: no GPU work (a CPU run)
    per_step = lambda table: [[name[:100], round(n / steps, 2), round(ms / steps, 3)]  # noqa: E731
                              for name, (n, ms) in sorted(table.items(), key=lambda kv: -kv[1][1])[:TOP]]
    return {
        "steps": steps,
        "wall_ms_per_step": round(wall_ms, 3),
        "gpu_kernel_ms_per_step": round(gpu_ms, 3) if gpu_ms is not None else None,
        "gpu_busy": round(gpu_ms / wall_ms, 3) if gpu_ms is not None and wall_ms else None,
        "host_wait_ms_per_step": round(waits_ms / steps, 3),
        "kernels_per_step": round(sum(n for n, _ in kernels.values()) / steps, 1),
        # [the code that asked, host waits a step]
        "wait_callers": [[caller, round(n / steps, 2)] for caller, n in (wait_callers or Counter()).most_common(TOP)],
        "host_ops": per_step(host),  # [operation, calls a step, own ms a step]
        "kernels": per_step(kernels),  # [kernel, launches a step, GPU ms a step]
    }


def summary_text(summary: dict, first: int, last: int) -> str:
    lines = [
        f"steps {first}-{last} profiled ({summary['steps']})",
        f"wall time a step            {summary['wall_ms_per_step']:10.3f} ms",
        f"GPU kernel time a step      {summary['gpu_kernel_ms_per_step']:10.3f} ms  ({summary['gpu_busy']:.0%} of the wall time)"
        if summary["gpu_busy"] is not None else "GPU kernel time a step            none (no GPU work profiled)",
        f"host waiting on the GPU     {summary['host_wait_ms_per_step']:10.3f} ms a step ({', '.join(HOST_WAITS)})",
        f"kernels launched a step     {summary['kernels_per_step']:10.1f}",
        "",
        "where the host was made to wait (CUDA's sync debug mode)                          waits/step",
    ]
    lines += [f"  {caller[:90]:90s} {n:10.2f}" for caller, n in summary["wait_callers"]] or ["  nowhere"]
    lines += [
        "",
        f"host operations by their own time ({TOP} longest)        calls/step   own ms/step",
    ]
    lines += [f"  {name[:60]:60s} {n:10.2f} {ms:12.3f}" for name, n, ms in summary["host_ops"]]
    lines += ["", f"kernels by GPU time ({TOP} longest)                         launches/step   GPU ms/step"]
    lines += [f"  {name[:60]:60s} {n:10.2f} {ms:12.3f}" for name, n, ms in summary["kernels"]]
    return "\n".join(lines) + "\n"


class ProfileSteps(TrainerCallback):
    """Profiles steps `first` to `first + count - 1` of the run (see the module's docstring); `say` reports the
    summary's first lines where the files went."""

    def __init__(self, run_dir: Path, first: int, count: int, rank: int, cuda: bool, say=print) -> None:
        self.run_dir, self.first, self.last, self.rank, self.say = Path(run_dir), first, first + count - 1, rank, say
        self.cuda = cuda  # the run's device is CUDA: its kernels profiled, its waits traced
        self.prof = None
        self.waits = WaitCallers(cuda)
        self.t0 = 0.0
        self.started_after: int | None = None

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step
        if self.prof is None and step == self.first - 1:
            self._start(step)
        elif self.prof is not None and step >= self.last:
            self._stop(step)

    def on_train_end(self, args, state, control, **kwargs):
        if self.prof is not None:  # stopped early: what was profiled
            self._stop(state.global_step)

    def _start(self, step: int) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self.prof = profile(activities=activities)
        self.started_after = step
        self.prof.__enter__()
        self.waits.start()
        self.t0 = time.perf_counter()

    def _stop(self, step: int) -> None:
        self.waits.stop()  # before the window's own wait for the GPU
        if self.cuda:
            torch.cuda.synchronize()
        wall_s = time.perf_counter() - self.t0
        prof, self.prof = self.prof, None
        prof.__exit__(None, None, None)
        steps = step - self.started_after
        if steps <= 0:
            return
        first, last = self.started_after + 1, step
        summary = summarize(prof.events(), steps, wall_s, self.waits.callers)
        stem = self.run_dir / f"profile_rank{self.rank}"
        text = summary_text(summary, first, last)
        replace_file(stem.with_suffix(".txt"), text)
        replace_file(stem.with_suffix(".json"), json.dumps({"first_step": first, "last_step": last, **summary}, indent=1) + "\n")
        with tempfile.TemporaryDirectory() as tmp:  # the profiler writes a path itself: a fresh private one
            trace = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(trace))
            replace_file(self.run_dir / f"profile_rank{self.rank}.pt.trace.json.gz", gzip.compress(trace.read_bytes()))
        if self.rank == 0:
            gpu = "no GPU work" if summary["gpu_busy"] is None else (
                f"GPU kernels {summary['gpu_kernel_ms_per_step']:.1f} ms ({summary['gpu_busy']:.0%} of it), the host waiting "
                f"on the GPU {summary['host_wait_ms_per_step']:.1f} ms, {summary['kernels_per_step']:.0f} kernels")
            self.say(f"profiled steps {first}-{last} (train.profile_steps): {summary['wall_ms_per_step']:.1f} ms a step, {gpu}; "
                     f"{stem.with_suffix('.txt')} says on what, the timeline is beside it")
