"""How `attnlab train` scales over GPUs (`attnlab bench scale`).

Every variant is one real `attnlab train` run in a fresh process: `python -m attnlab.cli train` on one
GPU, `torchrun --standalone --nproc_per_node G -m attnlab.cli train` on G, each into its own run
directory, with the global batch `batch_per_gpu x G` (train.batch_size), no evaluation, checkpoints or
samples during the run, a log every few steps. A variant is a model (an attnlab mixer or preset, or
`hf-llama`: an HF Llama of the same size trained through `train.init_from`), a GPU count, a strategy
(train.strategy), gradient checkpointing on or off, and the step captured as CUDA graphs (the default)
or eager (train.cuda_graphs=false; its blocks compiled where `train.compile`'s default "auto" compiles them). All
models share width, depth, heads, SwiGLU width and vocabulary (untied embeddings); the tokenizer is a byte-level BPE tokenizer trained once on the built-in corpus
(cached in the work directory), or the byte tokenizer for quick runs.

Measured from the run directory: tokens/s, the median over the logged steps after the first two
(metrics.csv, `tokens_per_s`: all processes together); peak allocated GPU memory, the largest
`gpu_mem_peak_alloc_gib` in any rank's heartbeat; the training loss of the last logged step and the held-out loss
at the end (`loss`, `val_loss`: the variants of one model start from the same weights and data, so a captured and an
eager run, or one GPU and several, should end close). The result is one JSON file, rewritten after every
run:

    {"env":      {"device", "gpus", "gpu_count", "torch", "transformers", "python", "command"},
     "settings": {"hidden", "layers", "heads", "intermediate", "vocab", "tokenizer", "batch_per_gpu", "seq_len", ...},
     "runs":     {"MODEL@GPUSxBATCHxSEQ:STRATEGY[:ckpt][:eager]": {"tokens_per_s", "per_gpu_tokens_per_s", "efficiency",
                  "peak_allocated_gib", "cuda_graphs", "wall_s", "loss", "val_loss"[, "note"]} | {"error": "<one line>"}}}

BATCH is the per-GPU batch. `efficiency` is the run's per-GPU tokens/s over that of the one-GPU run of
the same model and per-GPU batch, captured and without checkpointing (None when that run is missing
or failed). One process ignores the strategy, so one GPU runs once, under the first strategy asked
for. `cuda_graphs` says whether the step really ran captured (`attnlab train` says so; runs it cannot
capture train eagerly, with the reason in `note`). A run that fails (non-zero exit, out of memory) is the row
{"error": ...} and the bench goes on. A run stopped before its end (its time limit, or the bench interrupted: Ctrl-C,
or the SIGINT of a job's limit) keeps the figures of the steps it logged, with a `note` saying so, where it logged at
least two past the first two (a run that trained to its end and was stopped while its processes ended loses nothing);
else it is an error row too.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from attnlab.bench.data import train_bpe
from attnlab.data import read_documents
from attnlab.errors import PreflightError
from attnlab.outputs import open_fresh_file, prepare_output_file, publishing, write_text_atomic

HF_LLAMA = "hf-llama"
STRATEGIES = ("ddp", "fsdp")
TOKENIZERS = ("bpe", "byte")
CORPUS = "shakespeare"  # the built-in corpus: what the runs train on and the BPE tokenizer learns from
LR = 1e-4
# The sizes of a bench when not given: the 2Mamba study's scale on GPUs; a functional check in seconds on CPU.
DEFAULTS = {
    "cuda": {"hidden": 1024, "layers": 20, "heads": 16, "intermediate": 2048, "batch_per_gpu": 16, "seq_len": 1024, "steps": 40,
             "tokenizer": "bpe"},
    "cpu": {"hidden": 32, "layers": 1, "heads": 2, "intermediate": 64, "batch_per_gpu": 2, "seq_len": 32, "steps": 8,
            "tokenizer": "byte"},
}
SKIP_LOGS = 2  # logged steps left out of the median: the first steps build, capture, compile and autotune
KILL_GRACE_S = 30  # after SIGTERM at a run's time limit (a run stops at the end of its step), then SIGKILL


@dataclass(frozen=True)
class Size:
    """What every model of one bench shares."""

    hidden: int
    layers: int
    heads: int
    intermediate: int
    vocab: int | None  # None: the tokenizer's size (the byte tokenizer)


@dataclass(frozen=True)
class Variant:
    """One `attnlab train` run of the bench."""

    model: str  # attnlab-<mixer> or hf-llama
    gpus: int
    batch_per_gpu: int
    seq_len: int
    strategy: str = "ddp"
    ckpt: bool = False
    eager: bool = False

    @property
    def key(self) -> str:
        """MODEL@GPUSxBATCHxSEQ:STRATEGY[:ckpt][:eager], BATCH per GPU."""
        return (f"{self.model}@{self.gpus}x{self.batch_per_gpu}x{self.seq_len}:{self.strategy}"
                + (":ckpt" if self.ckpt else "") + (":eager" if self.eager else ""))

    @property
    def name(self) -> str:
        """The key as a file name."""
        return re.sub(r"[@:]", "-", self.key)

    @property
    def is_baseline(self) -> bool:
        """One GPU, captured, no checkpointing: what the efficiency of this model and batch is relative to."""
        return self.gpus == 1 and not self.ckpt and not self.eager


def parse_key(key: str) -> Variant:
    """The variant a result key names (the inverse of `Variant.key`)."""
    m = re.fullmatch(r"(?P<model>.+)@(?P<gpus>\d+)x(?P<batch>\d+)x(?P<seq>\d+):(?P<strategy>\w+)(?P<flags>(?::\w+)*)", key)
    if m is None:
        raise ValueError(f"not a bench scale key: {key!r}")
    flags = m["flags"].split(":")[1:]
    if set(flags) - {"ckpt", "eager"}:
        raise ValueError(f"unknown flag in bench scale key {key!r}: {flags}")
    return Variant(m["model"], int(m["gpus"]), int(m["batch"]), int(m["seq"]), m["strategy"], "ckpt" in flags, "eager" in flags)


def variants(models: list[str], gpu_counts: list[int], strategies: list[str], batch_per_gpu: int, seq_len: int,
             ckpt: bool, eager: bool) -> list[Variant]:
    """Every run of a bench, each model's one-GPU baseline first. One GPU runs under the first strategy
    only (one process ignores train.strategy)."""
    out = []
    for model in models:
        for gpus in sorted(set(gpu_counts)):
            for strategy in strategies[:1] if gpus == 1 else strategies:
                for with_ckpt in (False, True) if ckpt else (False,):
                    for is_eager in (False, True) if eager else (False,):
                        out.append(Variant(model, gpus, batch_per_gpu, seq_len, strategy, with_ckpt, is_eager))
    return out


def default_gpu_counts(visible: int) -> list[int]:
    """1, 2, 4, ... up to the visible count, and the visible count itself."""
    counts = [1]
    while counts[-1] * 2 <= visible:
        counts.append(counts[-1] * 2)
    return counts + ([visible] if visible > counts[-1] else [])


def efficiencies(runs: dict[str, dict]) -> dict[str, float | None]:
    """key -> per-GPU tokens/s over that of the one-GPU captured run without checkpointing of the same
    model, per-GPU batch and sequence length (None where that run is missing or failed, or the run failed)."""
    baselines: dict[tuple, float] = {}
    for key, row in runs.items():
        v = parse_key(key)
        if v.is_baseline and row.get("per_gpu_tokens_per_s"):
            baselines.setdefault((v.model, v.batch_per_gpu, v.seq_len), row["per_gpu_tokens_per_s"])
    out = {}
    for key, row in runs.items():
        v = parse_key(key)
        base = baselines.get((v.model, v.batch_per_gpu, v.seq_len))
        value = row.get("per_gpu_tokens_per_s")
        out[key] = round(value / base, 3) if base and value is not None else None
    return out


# --- what a run directory says -------------------------------------------------------------------


def metrics_rows(metrics_csv: Path) -> list[dict[str, str]]:
    """The rows of a run's metrics.csv (none where it is missing)."""
    if not metrics_csv.is_file():
        return []
    with open(metrics_csv, newline="") as f:
        return list(csv.DictReader(f))


def logged_rates(rows: list[dict[str, str]]) -> list[tuple[int, float]]:
    """(step, tokens_per_s) of every step metrics.csv (`metrics_rows`) logged a rate for."""
    return [(int(float(row["step"])), float(row["tokens_per_s"])) for row in rows if row.get("tokens_per_s")]


def final_losses(rows: list[dict[str, str]]) -> tuple[float | None, float | None]:
    """(the training loss of the last step metrics.csv (`metrics_rows`) logged one for, the last held-out loss); None
    where absent."""
    def last(key: str) -> float | None:
        return next((float(row[key]) for row in reversed(rows) if row.get(key)), None)

    return last("loss"), last("val_loss")


def median_tokens_per_s(logged: list[tuple[int, float]], skip: int = SKIP_LOGS) -> float | None:
    """Median `tokens_per_s` of the logged steps (`logged_rates`) after the first `skip` (fewer skipped when
    there are fewer logs); None when nothing was logged."""
    rates = [rate for _, rate in logged]
    return statistics.median(rates[min(skip, len(rates) - 1):]) if rates else None


def peak_allocated_gib(run_dir: Path) -> float | None:
    """The largest peak of allocated GPU memory in any process's heartbeat (GiB); None off CUDA."""
    peaks = []
    for path in [run_dir / "heartbeat.jsonl", *sorted(run_dir.glob("heartbeat_rank*.jsonl"))]:
        if not path.is_file():
            continue
        for line in path.read_text().splitlines():
            try:
                value = json.loads(line).get("gpu_mem_peak_alloc_gib")
            except (ValueError, AttributeError):
                continue  # a torn line
            if isinstance(value, (int, float)):
                peaks.append(value)
    return round(max(peaks), 2) if peaks else None


def graph_report(stdout: str) -> tuple[bool, str | None]:
    """(captured, why not): whether the run's training step ran as CUDA graphs, as `attnlab train` says."""
    text = " ".join(stdout.split())  # a line wrapped by the console is one line again
    if "training step captured as CUDA graphs" in text:
        return True, None
    m = re.search(r"training step runs eagerly: (.+?) \(train\.cuda_graphs\)", text)
    return False, m.group(1) if m else None


_NOISE = re.compile(
    r"^\s|^[=\-*]{3,}|ChildFailedError|torch\.distributed\.elastic|^\[\d+\]:|^Failures:|^Root Cause|<NO_OTHER_FAILURES>|"
    r"FAILED$|^[WIEF]\d{4} |OMP_NUM_THREADS|^Traceback|^During handling|^The above exception")


def failure_reason(stdout: str, stderr: str, returncode: int) -> str:
    """One line saying why a run failed: out of memory; the first preflight error; the last `error:` line;
    the last exception raised; the last line of its own on stderr (torchrun's report left out)."""
    if re.search(r"OutOfMemoryError|out of memory", stdout + stderr, re.IGNORECASE):
        return "out of memory"
    m = re.search(r"^preflight error\s+(.+)$", stdout, re.MULTILINE)
    if m:
        return f"preflight: {m.group(1).strip()}"[:300]
    lines = [line.rstrip() for line in stderr.splitlines() if line.strip() and not _NOISE.search(line)]
    for pattern in (r"^error: ", r"^[\w.]+(Error|Exception|Interrupt)\b"):
        hits = [line for line in lines if re.search(pattern, line)]
        if hits:
            return hits[-1].removeprefix("error: ")[:300]
    return lines[-1][:300] if lines else f"exit code {returncode}"


# --- launching runs ------------------------------------------------------------------------------


def launcher(gpus: int) -> list[str]:
    """The command that starts `gpus` training processes of attnlab's CLI, up to `train`."""
    if gpus == 1:
        return [sys.executable, "-m", "attnlab.cli"]
    beside = Path(sys.executable).parent / "torchrun"  # this interpreter's, before any other on PATH
    torchrun = str(beside) if beside.is_file() else shutil.which("torchrun")
    start = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    return [*start, "--standalone", "--nproc_per_node", str(gpus), "-m", "attnlab.cli"]


@dataclass
class Finished:
    """A finished (or stopped) process: exit code, whether it ran past its limit, its wall seconds."""

    returncode: int
    timed_out: bool
    wall_s: float


def run_environment(gpus: int, devices: list[int] | None = None) -> dict[str, str]:
    """The environment of a run: whole lines in its logs, written as they come; every process gets the one
    OpenMP thread that torchrun would give each of its own (unless the caller set a count), so that one GPU
    and several differ only in their count, and torchrun has no default to warn about. `devices`: the GPUs
    the run sees (runs side by side, or one process pinned to one GPU), as indices into those this process sees."""
    env = {**os.environ, "COLUMNS": "400", "PYTHONUNBUFFERED": "1"}
    env.setdefault("OMP_NUM_THREADS", "1")
    if devices is not None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = [i.strip() for i in visible.split(",")] if visible else [str(i) for i in range(max(devices) + 1)]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[i] for i in devices)
    return env


_LIVE: set[subprocess.Popen] = set()  # the runs under way, each leading its process group
_LIVE_LOCK = threading.Lock()


def run_logged(command: list[str], stdout_path: Path, stderr_path: Path, timeout_s: float, env: dict[str, str] | None = None) -> Finished:
    """Run `command` in its own process group, its output into the two files; at `timeout_s`, SIGTERM to
    the group, SIGKILL after KILL_GRACE_S. The group is stopped the same way if this process is interrupted
    (runs side by side, waited for in other threads: `stop_runs`)."""
    t0 = time.perf_counter()

    with open_fresh_file(stdout_path) as out, open_fresh_file(stderr_path) as err:  # never through a planted link
        proc = subprocess.Popen(command, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        with _LIVE_LOCK:
            _LIVE.add(proc)
        try:
            proc.wait(timeout=timeout_s)
            return Finished(proc.returncode, False, time.perf_counter() - t0)
        except subprocess.TimeoutExpired:
            _stop_groups([proc])
            return Finished(proc.returncode, True, time.perf_counter() - t0)
        except BaseException:
            _stop_groups([proc], grace_s=5)  # quickly: whoever interrupted this process may not wait long
            raise
        finally:
            with _LIVE_LOCK:
                _LIVE.discard(proc)


def stop_runs(grace_s: float = 5) -> None:
    """Stop every run under way (SIGTERM to each group, SIGKILL to those left after `grace_s`)."""
    with _LIVE_LOCK:
        procs = list(_LIVE)
    _stop_groups(procs, grace_s)


def _stop_groups(procs: list[subprocess.Popen], grace_s: float = KILL_GRACE_S) -> None:
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10)):
        for proc in procs:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        procs = [proc for proc in procs if not _ended(proc, deadline)]
        if not procs:
            return


def _ended(proc: subprocess.Popen, deadline: float) -> bool:
    try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        return True
    except subprocess.TimeoutExpired:
        return False


# --- what the runs share: the tokenizer and HF Llama's starting weights ----------------------------


def corpus_bpe_tokenizer(work_dir: Path, vocab: int) -> Path:
    """A byte-level BPE tokenizer of `vocab` ids trained on the built-in corpus (written once into
    `work_dir`, then reused)."""
    out = work_dir / f"bpe-{vocab}-{CORPUS}"
    if not (out / "tokenizer.json").is_file():
        lines = [line for doc in read_documents(CORPUS) for line in doc.split("\n")]

        with publishing(out) as part:
            train_bpe(lines, vocab, part)
    return out


def hf_llama_init(work_dir: Path, size: Size, vocab: int, special: dict[str, int | None] | None = None) -> Path:
    """A randomly initialised HF Llama of `size` (SDPA, untied embeddings), saved once into `work_dir`
    for `train.init_from`; `bench zoo` builds the same model. `special`: the tokenizer's bos, eos and pad ids,
    written into the model's config (else transformers' Trainer says at the start of every run that it changed them)."""
    import torch

    from attnlab.bench.train import build

    special = special or {}
    ids = "-".join(f"{special.get(key)}" for key in ("bos_token_id", "eos_token_id", "pad_token_id"))
    out = work_dir / f"hf-llama-{size.hidden}x{size.layers}x{size.heads}-mlp{size.intermediate}-vocab{vocab}-ids{ids}"
    if not (out / "config.json").is_file():
        import transformers

        transformers.utils.logging.disable_progress_bar()  # no bar for writing one shard
        torch.manual_seed(0)
        model = build(HF_LLAMA, size.hidden, size.layers, size.heads, vocab, size.intermediate)
        for key, value in special.items():
            setattr(model.config, key, value)
            setattr(model.generation_config, key, value)

        with publishing(out) as part:
            model.save_pretrained(part, safe_serialization=True)
    return out


@dataclass
class Bench:
    """What every run of one bench shares, and the overrides of one run."""

    size: Size
    device: str  # cuda or cpu
    tokenizer: str  # data.tokenizer: 'byte' or the BPE tokenizer's directory
    steps: int
    hf_llama_dir: Path | None = None
    extra: list[str] = field(default_factory=list)  # --set overrides, applied last

    @property
    def warmup_steps(self) -> int:
        return min(10, self.steps // 4)

    @property
    def log_every(self) -> int:
        return min(5, max(1, self.steps // 8))

    def settings(self, plan: list[Variant]) -> dict:
        """What the JSON records of the bench as a whole (its runs share one per-GPU batch and sequence length)."""
        s = self.size
        return {"hidden": s.hidden, "layers": s.layers, "heads": s.heads, "intermediate": s.intermediate, "vocab": s.vocab,
                "tokenizer": "byte" if self.tokenizer == "byte" else "bpe", "corpus": CORPUS,
                "batch_per_gpu": plan[0].batch_per_gpu, "seq_len": plan[0].seq_len,
                "steps": self.steps, "lr": LR, "warmup_steps": self.warmup_steps, "log_every": self.log_every,
                "skipped_logs": SKIP_LOGS, "overrides": self.extra}

    def overrides(self, v: Variant) -> list[str]:
        """The `--set` overrides of one run."""
        if v.model == HF_LLAMA:
            model = [f"train.init_from={self.hf_llama_dir}"]  # its size comes from the checkpoint
        else:
            s = self.size
            model = [f"model.mixer={v.model.removeprefix('attnlab-')}", f"model.hidden_size={s.hidden}", f"model.num_layers={s.layers}",
                     f"model.num_heads={s.heads}", f"model.intermediate_size={s.intermediate}", "model.tie_word_embeddings=false"]
            if s.vocab is not None:
                model.append(f"model.vocab_size={s.vocab}")
            if v.seq_len > 2048:
                model.append(f"model.max_position_embeddings={v.seq_len}")
        return [
            *model, f"data.source={CORPUS}", f"data.tokenizer={self.tokenizer}", f"data.seq_len={v.seq_len}",
            f"train.batch_size={v.batch_per_gpu * v.gpus}", f"train.max_steps={self.steps}", f"train.lr={LR:g}",
            f"train.warmup_steps={self.warmup_steps}", f"train.log_every={self.log_every}", "train.eval_every=0", "train.eval_batches=1",
            "train.save_every=0", "train.sample_tokens=0", f"train.device={self.device}",
            f"train.precision={'bf16' if self.device == 'cuda' else 'fp32'}", f"train.cuda_graphs={str(not v.eager).lower()}",
            f"train.gradient_checkpointing={str(v.ckpt).lower()}",
            # one process has nothing to share or shard: the trainer would warn that it ignores the strategy
            *([f"train.strategy={v.strategy}"] if v.gpus > 1 else []), *self.extra,
        ]

    def command(self, v: Variant, run_dir: Path) -> list[str]:
        sets = [arg for item in self.overrides(v) for arg in ("--set", item)]
        return [*launcher(v.gpus), "train", *sets, "--run-dir", str(run_dir)]


def measure(bench: Bench, v: Variant, runs_dir: Path, logs_dir: Path, timeout_s: float, devices: list[int] | None = None) -> dict:
    """Run one variant and read its row from its run directory (the weights it wrote are deleted);
    `devices`: the GPUs the run is pinned to."""
    run_dir = runs_dir / v.name
    shutil.rmtree(run_dir, ignore_errors=True)
    stdout_path, stderr_path = logs_dir / f"{v.name}.log", logs_dir / f"{v.name}.stderr.log"
    done = run_logged(bench.command(v, run_dir), stdout_path, stderr_path, timeout_s, run_environment(v.gpus, devices))
    for heavy in ("final", "checkpoints"):
        shutil.rmtree(run_dir / heavy, ignore_errors=True)
    if done.timed_out:
        return run_row(v, run_dir, logs_dir, done.wall_s, stopped=f"timed out after {timeout_s:g} s")
    if done.returncode != 0:
        return {"error": failure_reason(stdout_path.read_text(errors="replace"), stderr_path.read_text(errors="replace"),
                                        done.returncode)}
    return run_row(v, run_dir, logs_dir, done.wall_s)


def run_row(v: Variant, run_dir: Path, logs_dir: Path, wall_s: float | None, stopped: str | None = None) -> dict:
    """The row of a run from its run directory and its log. `stopped`: why the run ended before its end (its time
    limit, the bench interrupted); it keeps the figures of the steps it logged where at least two came after the first
    SKIP_LOGS, with a note saying so, else the row is the error."""
    rows = metrics_rows(run_dir / "metrics.csv")
    logged = logged_rates(rows)
    if stopped is not None and len(logged) < SKIP_LOGS + 2:
        return {"error": f"{stopped}, after {len(logged)} logged steps" if logged else stopped}
    if not logged:
        return {"error": f"no step was logged (see {logs_dir / v.name}.log)"}
    tokens_per_s = median_tokens_per_s(logged)
    captured, why_eager = graph_report((logs_dir / f"{v.name}.log").read_text(errors="replace"))
    row = {"tokens_per_s": round(tokens_per_s), "per_gpu_tokens_per_s": round(tokens_per_s / v.gpus), "efficiency": None,
           "peak_allocated_gib": peak_allocated_gib(run_dir), "cuda_graphs": captured,
           "wall_s": None if wall_s is None else round(wall_s, 1)}
    row["loss"], row["val_loss"] = final_losses(rows)
    notes = []
    if stopped is not None:
        notes.append(f"{stopped} after step {logged[-1][0]}: tokens/s of the {len(logged) - SKIP_LOGS} steps logged past "
                     f"the first {SKIP_LOGS}")
    if why_eager and not v.eager:
        notes.append(f"ran eagerly: {why_eager}")
    if notes:
        row["note"] = "; ".join(notes)
    profile = run_profiles(run_dir, logs_dir, v.name)
    if profile is not None:
        row["profile"] = profile
    return row


PROFILE_FIGURES = ("wall_ms_per_step", "gpu_kernel_ms_per_step", "gpu_busy", "host_wait_ms_per_step", "kernels_per_step")


def run_profiles(run_dir: Path, logs_dir: Path, name: str) -> dict | None:
    """A run with `train.profile_steps` (`--set train.profile_steps=N`): each process's summary copied beside the run's
    logs (NAME.profile_rankR.txt), and the first process's figures for the row (`PROFILE_FIGURES`)."""
    for path in sorted(run_dir.glob("profile_rank*.txt")):
        write_text_atomic(logs_dir / f"{name}.{path.name}", path.read_text(), what="a run's profile")
    first = run_dir / "profile_rank0.json"
    if not first.is_file():
        return None
    summary = json.loads(first.read_text())
    # and the code that made the host wait most often (`train.profile_steps`' wait_callers)
    return {**{key: summary.get(key) for key in ("first_step", "last_step", *PROFILE_FIGURES)},
            "wait_callers": summary.get("wait_callers", [])[:5]}


# --- the bench -----------------------------------------------------------------------------------


def gpu_names() -> list[str]:
    """The visible CUDA devices' names, asked of a fresh process (this one keeps no CUDA context on a GPU
    that the runs measure)."""
    code = "import json, torch; print(json.dumps([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return []


def environment(device: str) -> dict:
    import platform
    from importlib.metadata import version

    names = gpu_names() if device == "cuda" else []
    return {"device": device, "gpus": names, "gpu_count": len(names), "torch": version("torch"),
            "transformers": version("transformers"), "python": platform.python_version(),
            "command": " ".join(["attnlab", *sys.argv[1:]])}


def write(result: dict, out: Path) -> None:
    """The JSON, replaced whole (an interrupted bench leaves the runs measured so far, never half a file)."""
    write_text_atomic(prepare_output_file(out, "--out"), json.dumps(result, indent=1) + "\n", what="--out")


def describe(key: str, row: dict) -> str:
    """The words of one measured row."""
    if "error" in row:
        return f"error: {row['error']}"
    eff = "" if row["efficiency"] is None else f", efficiency {row['efficiency']:.2f}"
    peak = "" if row["peak_allocated_gib"] is None else f", peak {row['peak_allocated_gib']} GiB allocated"
    graphs = ", CUDA graphs" if row["cuda_graphs"] else ""
    note = f" ({row['note']})" if row.get("note") else ""
    wall = "" if row.get("wall_s") is None else f", {row['wall_s']} s"
    return f"{row['tokens_per_s']:,} tokens/s ({row['per_gpu_tokens_per_s']:,} per GPU{eff}){peak}{graphs}{wall}{note}"


def waves(plan: list[Variant], side_by_side: int) -> list[list[Variant]]:
    """The plan in the order it runs: with `side_by_side` (the visible GPU count) > 1, the runs of each GPU
    count in groups that share the GPUs out (four one-GPU runs on 4 GPUs, then two 2-GPU runs, then one
    4-GPU run), fewest GPUs first."""
    if side_by_side <= 1:
        return [[v] for v in plan]
    out = []
    for gpus in sorted({v.gpus for v in plan}):
        same = [v for v in plan if v.gpus == gpus]
        per = max(1, side_by_side // gpus)
        out += [same[i:i + per] for i in range(0, len(same), per)]
    return out


def wave_devices(wave: list[Variant], cuda: bool) -> list[list[int] | None]:
    """The GPUs each run of a wave is pinned to: the i-th run of k GPUs gets GPUs i*k .. i*k+k-1; a run
    alone sees every GPU unless it is one process (pinned to the first, so that it never trains on one GPU
    of several visible and warns about it); None off CUDA."""
    if not cuda:
        return [None] * len(wave)
    if len(wave) == 1:
        return [[0] if wave[0].gpus == 1 else None]
    return [list(range(i * v.gpus, (i + 1) * v.gpus)) for i, v in enumerate(wave)]


def run_scale(bench: Bench, plan: Iterable[Variant], work_dir: Path, logs_dir: Path, out: Path, timeout_s: float,
              log: Callable[[str], None] = print, side_by_side: int = 1) -> tuple[dict, bool]:
    """Run every variant of `plan`; a line to `log` as each starts and ends, the JSON rewritten after each.
    `side_by_side` > 1 (the visible GPU count): the runs of one GPU count go as many at a time as the GPUs
    hold, each pinned to GPUs of its own (runs on different GPUs share nothing but the host). Returns
    (result, finished): finished is False when the bench was interrupted."""
    from concurrent.futures import ThreadPoolExecutor

    plan = list(plan)
    runs_dir = work_dir / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    logs_dir.mkdir(parents=True, exist_ok=True)
    result = {"env": environment(bench.device), "settings": bench.settings(plan), "runs": {}}
    if side_by_side > 1:
        result["settings"]["runs_side_by_side_on_gpus"] = side_by_side
    write(result, out)
    n = 0
    for wave in waves(plan, side_by_side):
        numbers = {v.key: n + i for i, v in enumerate(wave, 1)}
        n += len(wave)
        devices = wave_devices(wave, bench.device == "cuda")
        for v, on in zip(wave, devices):
            where = "1 process" if v.gpus == 1 else f"torchrun, {v.gpus} processes"
            where += f" on GPU {', '.join(map(str, on))}" if on is not None and len(wave) > 1 else ""
            log(f"[{numbers[v.key]}/{len(plan)}] {v.key}: started ({where}; log {logs_dir / v.name}.log)")
        try:
            if len(wave) == 1:
                rows = [measure(bench, wave[0], runs_dir, logs_dir, timeout_s, devices[0])]
            else:
                with ThreadPoolExecutor(len(wave)) as pool:
                    futures = [pool.submit(measure, bench, v, runs_dir, logs_dir, timeout_s, on) for v, on in zip(wave, devices)]
                    try:
                        rows = [f.result() for f in futures]
                    except KeyboardInterrupt:
                        stop_runs()  # the threads waiting for them return, and the pool with them
                        raise
        except KeyboardInterrupt:
            kept = []
            for v in wave:  # what the interrupted runs logged before the stop
                row = run_row(v, runs_dir / v.name, logs_dir, None, stopped="interrupted")
                if "error" not in row:
                    result["runs"][v.key] = row
                    kept.append(v.key)
            _set_efficiencies(result)
            write(result, out)
            log(f"[{numbers[wave[0].key]}/{len(plan)}] {wave[0].key}: interrupted; {out} holds the {len(result['runs'])} runs "
                f"measured before it{' (with what ' + ', '.join(kept) + ' logged before the stop)' if kept else ''}")
            return result, False
        for v, row in zip(wave, rows):
            result["runs"][v.key] = row
        _set_efficiencies(result)
        write(result, out)
        for v in wave:
            log(f"[{numbers[v.key]}/{len(plan)}] {v.key}: {describe(v.key, result['runs'][v.key])}")
    return result, True


def _set_efficiencies(result: dict) -> None:
    for key, value in efficiencies(result["runs"]).items():
        if "error" not in result["runs"][key]:
            result["runs"][key]["efficiency"] = value


def model_names(names: list[str]) -> list[str]:
    """Bench names (`attnlab-<mixer>`, or hf-llama) of the models asked for, given with or without the
    attnlab- prefix; one error naming the choices for anything else."""
    from attnlab.models.mixers import MIXERS

    out = []
    for name in names:
        bare = name.removeprefix("attnlab-")
        if name != HF_LLAMA and bare not in MIXERS:
            raise PreflightError(f"unknown --model {name!r}; choose {HF_LLAMA} or a registered mixer or preset, with or "
                                 f"without the attnlab- prefix: {', '.join(sorted(MIXERS))}")
        out.append(name if name == HF_LLAMA else f"attnlab-{bare}")
    return list(dict.fromkeys(out))


def prepare_bench(models: list[str], size: Size, device: str, tokenizer: str, steps: int, work_dir: Path, extra: list[str],
                  log: Callable[[str], None] = print) -> Bench:
    """The tokenizer and, when hf-llama is measured, its starting weights (made once in `work_dir`)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    if tokenizer == "bpe":
        log(f"tokenizer: byte-level BPE of {size.vocab:,} ids trained on the built-in corpus (once, in {work_dir})")
        spec = str(corpus_bpe_tokenizer(work_dir, size.vocab))
    else:
        spec = "byte"
    bench = Bench(size, device, spec, steps, extra=list(extra))
    if HF_LLAMA in models:
        from attnlab.data import load_tokenizer

        tok = load_tokenizer(spec)
        vocab = size.vocab if size.vocab is not None else len(tok)
        special = {key: getattr(tok, key, None) for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
        log(f"{HF_LLAMA}: randomly initialised weights for train.init_from (once, in {work_dir})")
        bench.hf_llama_dir = hf_llama_init(work_dir, size, vocab, special)
    return bench


def _figure(value, fmt: str) -> str:
    return "" if value is None else format(value, fmt)


def _losses(row: dict) -> str:
    """The last logged training loss and, in brackets, the held-out loss, e.g. 7.6766 (7.6764); each left out where
    absent."""
    loss, val_loss = _figure(row.get("loss"), ".4f"), _figure(row.get("val_loss"), ".4f")
    return f"{loss} ({val_loss})" if val_loss else loss


def results_table(result: dict):
    """(table, error lines): the runs of a bench as one rich table, and a line per failed run."""
    from rich.table import Table

    settings = result["settings"]
    where = ", ".join(dict.fromkeys(result["env"]["gpus"])) or "CPU processes"
    grid = Table(title=f"attnlab train over GPUs, {settings['batch_per_gpu']} x {settings['seq_len']} tokens per GPU, on {where}")
    # runs with --set train.profile_steps=N: their profiled steps' wall time, GPU share and host waits (`PROFILE_FIGURES`)
    profiled = any("profile" in row for row in result["runs"].values())
    profile_cols = ("step ms", "GPU busy", "host wait ms") if profiled else ()
    for col in ("model", "GPUs", "strategy", "ckpt", "eager", "graphs", "tokens/s", "per-GPU tokens/s", "efficiency", "peak GiB",
                "loss (held-out)", *profile_cols):
        grid.add_column(col, justify="left" if col in ("model", "strategy") else "right")
    errors = []
    for key, row in result["runs"].items():
        v = parse_key(key)
        head = [v.model, str(v.gpus), v.strategy if v.gpus > 1 else "-", "yes" if v.ckpt else "no", "yes" if v.eager else "no"]
        if "error" in row:
            errors.append(f"{key}: {row['error']}")
            grid.add_row(*head, "", "OOM" if row["error"] == "out of memory" else "error", "", "", "", "", *[""] * len(profile_cols))
            continue
        prof = row.get("profile") or {}
        shown = [_figure(prof.get(key), fmt) for key, fmt in
                 (("wall_ms_per_step", ".1f"), ("gpu_busy", ".0%"), ("host_wait_ms_per_step", ".1f"))] if profiled else []
        grid.add_row(*head, "yes" if row["cuda_graphs"] else "no", f"{row['tokens_per_s']:,}", f"{row['per_gpu_tokens_per_s']:,}",
                     _figure(row["efficiency"], ".2f"), _figure(row["peak_allocated_gib"], ".2f"), _losses(row), *shown)
    return grid, errors
