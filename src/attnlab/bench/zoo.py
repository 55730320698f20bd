"""Every mixer family beside its peers, in one process on one device (`attnlab bench zoo`).

Training: an attnlab LM per preset (`attnlab-<preset>`), HF Llama on SDPA and fla's models, all of
one width, depth, head count, vocabulary and SwiGLU width (`train.build`), each stepped as
`attnlab train` steps it (`train.train_step`: bf16 autocast over fp32 weights on CUDA, fused AdamW,
forward and backward captured as CUDA graphs where the mixer allows). Ops: the token mixing alone,
forward and backward, of attention-family presets (their `mixing_function`) beside SDPA's flash
attention and fla's forgetting attention and chunked GLA, at one head count and head dim.

Every run writes one schema, so that runs compare by script:

    {"env":    {"gpu", "torch", "triton", "fla", "transformers", "python", "command"},
     "train":  {"MODEL@BxT": {"tokens_per_s", "peak_allocated_gib", "peak_reserved_gib",
                              "first_step_s", "step_s", "params_M", "loss", "cuda_graphs", ...}},
     "ops":    {"OP@BxT": {"fwd_bwd_ms", "extra_gib"}},
     "decode": {}}

A model or op that cannot be built or run (a peer not installed, a head grouping it refuses, out
of memory) is the row {"error": "<one-line reason>"}, and the run goes on. Off CUDA (tests) the
models train in fp32 and the memory fields are None.
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from attnlab.bench.names import OP_PEERS, OP_PRESETS, PRESETS, STATS_SUFFIX, TRAIN_PEERS
from attnlab.bench.timing import median_time, peak_gib, profile_step, release, sync
from attnlab.bench.train import build, train_step
from attnlab.config.loader import parse_override
from attnlab.errors import PreflightError
from attnlab.outputs import prepare_output_file, write_text_atomic



def _bench_names(names: list[str], peers: tuple[str, ...], valid: list[str], option: str, what: str) -> list[str]:
    """`attnlab-<name>` for each valid name (given with or without the prefix), peers as they are;
    one error naming the choices for anything else."""
    out = []
    for name in names:
        bare = name.removeprefix("attnlab-")
        if name not in peers and bare.removesuffix(STATS_SUFFIX) not in valid:
            raise PreflightError(f"unknown {option} {name!r}; choose a peer ({', '.join(peers)}) or {what}, "
                                 f"with or without the attnlab- prefix: {', '.join(sorted(valid))}")
        out.append(name if name in peers else f"attnlab-{bare}")
    return out


def model_names(names: list[str] | None) -> list[str]:
    """Bench names of the models to train (`attnlab-<mixer>` or a peer), the defaults for None."""
    from attnlab.models.mixers import MIXERS

    if not names:
        return [f"attnlab-{p}" for p in PRESETS] + list(TRAIN_PEERS)
    return _bench_names(names, TRAIN_PEERS, list(MIXERS), "--model", "a registered mixer")


def op_names(names: list[str] | None) -> list[str]:
    """Bench names of the ops to time (`attnlab-<preset>` of the attention family, or a peer), the defaults for None."""
    from attnlab.models.mixers import MIXERS
    from attnlab.models.mixers.attention_family import AttentionFamily

    if not names:
        return [f"attnlab-{p}" for p in OP_PRESETS] + list(OP_PEERS)
    family = [name for name, cls in MIXERS.items() if issubclass(cls, AttentionFamily)]
    return _bench_names(names, OP_PEERS, family, "--op-model", "an attention-family preset")


def mixer_options(items: list[str]) -> dict[str, dict]:
    """['nsa.block_size=64', ...] -> {'nsa': {'block_size': 64}}, each mixer's options checked as a model
    would check them (one error naming the mixer and option otherwise)."""
    from attnlab.models.mixers import MIXERS

    options: dict[str, dict] = {}
    for item in items:
        key, value = parse_override(item)
        mixer, _, option = key.partition(".")
        if mixer not in MIXERS or not option:
            raise PreflightError(f"--mixer-option expects MIXER.OPTION=VALUE with a registered mixer or preset, got {item!r}")
        options.setdefault(mixer, {})[option] = value
    for mixer, opts in options.items():
        try:
            MIXERS[mixer].resolve_options(opts)
        except ValueError as exc:
            raise PreflightError(f"--mixer-option {mixer}: {exc}") from None
    return options


def parse_shape(spec: str) -> tuple[int, int]:
    try:
        batch, seq_len = (int(v) for v in spec.lower().split("x"))
    except ValueError:
        raise PreflightError(f"--shape takes BATCHxSEQ_LEN such as 16x1024, not {spec!r}") from None
    return batch, seq_len


def environment(device: torch.device) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    def installed(dist: str) -> str | None:
        try:
            return version(dist)
        except PackageNotFoundError:
            return None

    return {"gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None, "torch": installed("torch"),
            "triton": installed("triton"), "fla": installed("flash-linear-attention") or installed("fla-core"),
            "transformers": installed("transformers"), "python": platform.python_version(),
            "command": " ".join(["attnlab", *sys.argv[1:]])}


def reason(exc: BaseException) -> str:
    """One line saying why a row could not be measured."""
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return "out of memory"
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        from importlib.util import find_spec

        top = exc.name.split(".")[0]
        if find_spec(top) is None:
            return f"{top} is not installed"
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:200]


def train_row(name: str, size: dict, batch: int, seq_len: int, steps: int, warmup: int, device: torch.device) -> dict:
    """Training throughput and memory of one model at one shape; `warmup` >= 1 steps (the first one
    timed alone, with capture, compilation and autotuning), then the median of `steps`."""
    if name.startswith("fla-") and device.type != "cuda":
        import fla.models  # noqa: F401  (says first when fla is missing)

        raise RuntimeError("fla's kernels need CUDA")
    torch.manual_seed(0)
    with device:  # weights initialised where they train (a few seconds less per row than on the host)
        model = build(name.removesuffix(STATS_SUFFIX), **size).train()
    if name.endswith(STATS_SUFFIX):
        from attnlab.models.mixers import Mixer

        if not any(isinstance(m, Mixer) and m.reports_stats for m in model.modules()):
            raise ValueError(f"{name}: this model records no training-health statistics")
        model.enable_health_stats(True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    x = torch.randint(0, size["vocab"], (batch, seq_len), device=device)

    def first_step():
        step, captured = train_step(model, opt, x)
        step()
        return step, captured is not None

    first_s, (step, graphs) = median_time(first_step, 1, device, wall=True)
    for _ in range(warmup - 1):
        step()
    step_s, loss = median_time(step, steps, device)
    allocated, reserved = peak_gib(device)
    params = sum(p.numel() for p in model.parameters())
    row = {"tokens_per_s": round(batch * seq_len / step_s), "peak_allocated_gib": allocated, "peak_reserved_gib": reserved,
           "first_step_s": round(first_s, 3), "step_s": round(step_s, 4), "params_M": round(params / 1e6, 1),
           "loss": round(loss.item(), 3), "cuda_graphs": graphs}
    if getattr(model, "bench_note", None):
        row["note"] = model.bench_note
    return row


def op_inputs(name: str, batch: int, seq_len: int, heads: int, head_dim: int, device: torch.device) -> tuple[Callable, list[torch.Tensor]]:
    """(fn, inputs): the op as a function of its inputs, and the inputs (bf16 on CUDA, log-decays fp32)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if name == "sdpa":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        q, k, v = (torch.randn(batch, heads, seq_len, head_dim, device=device, dtype=dtype) for _ in range(3))  # [B, H, T, D]

        def attention(q, k, v):
            if device.type != "cuda":
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        return attention, [q, k, v]
    q, k, v = (torch.randn(batch, seq_len, heads, head_dim, device=device, dtype=dtype) for _ in range(3))  # [B, T, H, D]
    log_decay = -F.softplus(torch.randn(batch, seq_len, heads, device=device))  # [B, T, H] fp32, <= 0
    if name == "fla-parallel_forgetting_attn":
        from fla.ops.forgetting_attn import parallel_forgetting_attn

        if device.type != "cuda":
            raise RuntimeError("fla's kernels need CUDA")
        return parallel_forgetting_attn, [q, k, v, log_decay]
    if name == "fla-chunk_gla":
        from fla.ops.gla import chunk_gla

        if device.type != "cuda":
            raise RuntimeError("fla's kernels need CUDA")
        g = log_decay[..., None].expand(-1, -1, -1, head_dim).contiguous()  # [B, T, H, D]: a head's decay on each key channel
        return (lambda q, k, v, g: chunk_gla(q, k, v, g)[0]), [q, k, v, g]
    from attnlab.models.mixers import MIXERS
    from attnlab.models.mixers.attention_family import mixing_function
    from attnlab.models.ops.attention_family import apply_feature_map

    options = MIXERS[name.removeprefix("attnlab-")].resolve_options(None)
    mix = mixing_function(options, head_dim)
    q, k = apply_feature_map(q, options["feature_map"]), apply_feature_map(k, options["feature_map"])  # what the mixing sees
    if options["decay"] == "none":
        return (lambda q, k, v: mix(q, k, v, None)), [q, k, v]
    return mix, [q, k, v, log_decay]


def op_row(name: str, batch: int, seq_len: int, heads: int, head_dim: int, repeats: int, warmup: int, device: torch.device,
           profile: bool = False) -> dict:
    """Median milliseconds of the op's forward and backward (gradients of every input), and the
    memory it takes beyond its inputs (peak allocated during one forward and backward). With
    `profile` (CUDA), also one forward and backward under the profiler: its kernels' GPU time and
    the host's time to issue it (when that is close to the median, the op waits for the host)."""
    torch.manual_seed(0)
    fn, inputs = op_inputs(name, batch, seq_len, heads, head_dim, device)
    for t in inputs:
        t.requires_grad_()
    with torch.no_grad():
        grad_out = torch.randn_like(fn(*inputs))

    def fwd_bwd():
        return torch.autograd.grad(fn(*inputs), inputs, grad_out)

    for _ in range(warmup):
        fwd_bwd()
    extra_gib = None
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fwd_bwd()
        sync(device)
        extra_gib = round((torch.cuda.max_memory_allocated(device) - before) / 2**30, 3)
    seconds, _ = median_time(fwd_bwd, repeats, device)
    row = {"fwd_bwd_ms": round(seconds * 1000, 3), "extra_gib": extra_gib}
    if profile and device.type == "cuda":
        row["profile"] = profile_step(fwd_bwd)
    return row


def describe(section: str, key: str, row: dict) -> str:
    """One progress line for a measured row."""
    if "error" in row:
        return f"{section} {key}: error: {row['error']}"
    if section == "ops":
        extra = "" if row["extra_gib"] is None else f", {row['extra_gib']} GiB beyond the inputs"
        prof = row.get("profile")
        if prof:
            top = ", ".join(f"{name} {ms}" for name, ms in prof["top_kernels_ms"][:6])
            host = ", ".join(f"{name} x{count} {ms}" for name, count, ms in prof["host_self_ms"][:8])
            extra += (f"; profiled: {prof['gpu_ms']} ms in {prof['kernels']} kernels on the GPU, issued in {prof['host_issue_ms']} ms"
                      f" by the host; top kernels (ms): {top}; host's own time (ms): {host}")
        return f"{section} {key}: forward+backward {row['fwd_bwd_ms']} ms{extra}"
    memory = ("" if row["peak_allocated_gib"] is None
              else f", peak {row['peak_allocated_gib']} / {row['peak_reserved_gib']} GiB allocated / reserved")
    note = f" ({row['note']})" if row.get("note") else ""
    return (f"{section} {key}: {row['tokens_per_s']:,} tokens/s, step {row['step_s']} s, first step {row['first_step_s']} s{memory}, "
            f"{row['params_M']}M params{', CUDA graphs' if row['cuda_graphs'] else ''}{note}")


def write(result: dict, out: Path) -> None:
    """The JSON, replaced whole (an interrupted run leaves the rows measured so far, never half a file)."""
    write_text_atomic(prepare_output_file(out, "--out"), json.dumps(result, indent=1), what="--out")


def run_zoo(models: list[str], ops: list[str], shapes: list[tuple[int, int]], size: dict, op_heads: int, op_head_dim: int,
            steps: int, warmup: int, op_repeats: int, device: torch.device, out: Path | None = None,
            log: Callable[[str], None] = print, profile: bool = False) -> dict:
    """Measure every op, then every model, at every shape (the ops first: seconds in all); a line to
    `log` and the JSON rewritten after each row."""
    result = {"env": environment(device), "train": {}, "ops": {}, "decode": {}}
    jobs = [("ops", name, shape) for shape in shapes for name in ops] + [("train", name, shape) for shape in shapes for name in models]
    for section, name, (batch, seq_len) in jobs:
        key = f"{name}@{batch}x{seq_len}"
        release(device)
        try:
            if section == "train":
                row = train_row(name, size, batch, seq_len, steps, warmup, device)
            else:
                row = op_row(name, batch, seq_len, op_heads, op_head_dim, op_repeats, warmup, device, profile)
        except Exception as exc:  # noqa: BLE001  (any failure of one row is that row's result)
            row = {"error": reason(exc)}
        release(device)
        result[section][key] = row
        if out is not None:
            write(result, out)
        log(describe(section, key, row))
    return result
