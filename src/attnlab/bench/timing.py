"""What every bench shares: timing calls on a device, peak memory, and the profiler's view of a step."""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any, Callable

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(fn: Callable[[], Any], repeats: int, device: torch.device, wall: bool = False) -> tuple[float, Any]:
    """Median seconds over `repeats` calls of `fn`, and its last result.

    On a CUDA device, the time between CUDA events recorded around each call (what the GPU spends,
    waits for the host inside the call included); elsewhere, or with `wall`, the host's clock with
    the device drained before and after each call (what a caller waits for).
    """
    times, out = [], None
    for _ in range(repeats):
        if device.type == "cuda" and not wall:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end) / 1000)
        else:
            sync(device)
            t0 = time.perf_counter()
            out = fn()
            sync(device)
            times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def release(device: torch.device) -> None:
    """Free what the last measurement left (its model, graphs, cached blocks) and restart the peak counters."""
    gc.collect()  # autograd graphs and tracebacks hold reference cycles
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> tuple[float | None, float | None]:
    """(allocated, reserved): the CUDA allocator's peaks since `release`, in GiB; (None, None) off CUDA."""
    if device.type != "cuda":
        return None, None
    return (round(torch.cuda.max_memory_allocated(device) / 2**30, 2), round(torch.cuda.max_memory_reserved(device) / 2**30, 2))


CATEGORIES = (  # kernel name fragments -> what the time goes to
    ("gla (fla chunk/recurrent)", ("chunk", "recurrent", "cumsum")),
    ("matmul", ("gemm", "nvjet", "cutlass", "sm90_", "sm80_", "ampere", "hopper", "matmul")),
    ("attention (sdpa/flash)", ("flash", "fmha", "attention", "sdp")),
    ("norms/swiglu/ce (fused)", ("layer_norm", "rms", "swiglu", "cross_entropy", "logsumexp", "softmax")),
    ("optimizer", ("adam", "multi_tensor")),
    ("elementwise/copies", ("elementwise", "vectorized", "copy", "reduce", "fill", "cat", "index", "unrolled")),
)


def host_ms(step, repeats: int = 3) -> float:
    """How long the host takes to issue one step (median), with the GPU drained before each: when
    this is close to the step time, the step is bound by the host, not by the GPU's kernels."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return round(statistics.median(times) * 1000, 1)


def host_python_calls(step, top: int = 25) -> list:
    """The Python functions the host spends one step in (the GPU drained first), by their own time:
    [[function (file:line), calls, own ms, cumulative ms], ...]. cProfile slows every call down by
    about the same factor, so read the shares, not the sums."""
    import cProfile
    import pstats

    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    step()
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof).stats  # {(file, line, name): (primitive calls, calls, own s, cumulative s, callers)}
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    short = lambda f, line, name: f"{name} ({'/'.join(f.split('/')[-2:])}:{line})"  # noqa: E731
    return [[short(*key)[:90], calls, round(own * 1000, 2), round(cum * 1000, 2)] for key, (_, calls, own, cum, _) in rows]


def profile_step(step) -> dict:
    """One training step under the profiler: GPU time per kernel category, the top kernels, the
    host's time to issue the step, and the host-side calls that take most of it."""
    from torch.profiler import ProfilerActivity, profile

    from attnlab.train.profiling import kernel_times

    issue_ms = host_ms(step)
    python_calls = host_python_calls(step)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    host_calls = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:10]
    per_kernel = kernel_times(prof.events())
    kernels = {name: ms for name, (_, ms) in per_kernel.items()}
    launches = sum(n for n, _ in per_kernel.values())
    total = sum(kernels.values()) or 1.0
    shares: dict[str, float] = {}
    for kname, ms in kernels.items():
        low = kname.lower()
        cat = next((c for c, frags in CATEGORIES if any(f in low for f in frags)), "other")
        shares[cat] = shares.get(cat, 0.0) + ms
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:30]
    return {"gpu_ms": round(total, 3), "kernels": launches, "host_issue_ms": issue_ms,
            "host_self_ms": [[e.key[:60], e.count, round(e.self_cpu_time_total / 1000, 2)] for e in host_calls],
            "host_python_ms": python_calls,
            "by_category_ms": {k: round(v, 3) for k, v in sorted(shares.items(), key=lambda kv: -kv[1])},
            "top_kernels_ms": [[k[:90], round(v, 3)] for k, v in top]}
