"""Telemetry: heartbeat.jsonl, metrics.csv, TensorBoard, optional W&B, and a progress bar.

Field names carry their units (`_mib`, `_gib`, `_s`, `_per_s`, `_bpb`) so that nobody reads
MiB as GB again.
"""

from __future__ import annotations

import csv
import io
import json
import math
import time
from pathlib import Path
from typing import Any

import psutil
import torch

from attnlab.data.corpus import telemetry_records
from attnlab.errors import RunDirError
from attnlab.outputs import open_for_append, replace_file

METRICS_COLUMNS = ["step", "elapsed_s", "loss", "lr", "grad_norm", "tokens_per_s", "val_loss", "val_bpb"]
MIB = 1024 * 1024


def memory_fields() -> dict[str, float | None]:
    fields: dict[str, float | None] = {"cpu_rss_mib": round(psutil.Process().memory_info().rss / MIB, 1)}
    if torch.cuda.is_available():
        alloc, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        peak = torch.cuda.max_memory_allocated()
        fields.update(
            gpu_mem_alloc_mib=round(alloc / MIB, 1), gpu_mem_alloc_gib=round(alloc / MIB / 1024, 3),
            gpu_mem_reserved_mib=round(reserved / MIB, 1), gpu_mem_reserved_gib=round(reserved / MIB / 1024, 3),
            gpu_mem_peak_alloc_gib=round(peak / MIB / 1024, 3),
        )
    else:
        fields.update(gpu_mem_alloc_mib=None, gpu_mem_alloc_gib=None, gpu_mem_reserved_mib=None, gpu_mem_reserved_gib=None)
    return fields


class RunLogger:
    """Writes one run's telemetry files. On resume it drops rows past the resumed step.

    Under several processes (torchrun), rank 0 writes everything; every rank also writes its own
    `heartbeat_rank{r}.jsonl` (its memory and throughput), as seed 004's runs had.
    """

    def __init__(self, run_dir: Path, resume_step: int = 0, wandb_run: Any = None, rank: int = 0, world_size: int = 1):
        self.run_dir = Path(run_dir)
        self.is_main = rank == 0
        self.rank_path = self.run_dir / f"heartbeat_rank{rank}.jsonl" if world_size > 1 else None
        self.heartbeat_path = self.run_dir / "heartbeat.jsonl"
        self.metrics_path = self.run_dir / "metrics.csv"
        self.samples_path = self.run_dir / "samples.jsonl"
        for path in (self.rank_path, self.heartbeat_path, self.metrics_path, self.samples_path, self.run_dir / "eval" / "metrics.jsonl"):
            if path is not None and path.is_symlink():
                raise RunDirError(f"{path} is a symbolic link; attnlab writes its telemetry only into files of its own, never "
                                  f"through a link. Remove the link (rm {path}), or restore the file, and run again.")
        if self.rank_path is not None:
            _truncate_jsonl_after(self.rank_path, resume_step)
        self.tb = None
        self.wandb = wandb_run
        if not self.is_main:
            return
        for path in (self.heartbeat_path, self.samples_path, self.run_dir / "eval" / "metrics.jsonl"):
            _truncate_jsonl_after(path, resume_step)
        _truncate_csv_after(self.metrics_path, resume_step)
        if not self.metrics_path.exists():
            header = io.StringIO(newline="")
            csv.writer(header).writerow(METRICS_COLUMNS)
            replace_file(self.metrics_path, header.getvalue())
        self.columns = _csv_header(self.metrics_path) or list(METRICS_COLUMNS)
        self.eval_metrics: dict[str, Any] = {}  # the newest evaluation during training, as run.json records it
        from torch.utils.tensorboard import SummaryWriter

        self.tb = SummaryWriter(str(self.run_dir / "tb"), purge_step=resume_step + 1 if resume_step else None)

    def heartbeat(self, record: dict[str, Any]) -> None:
        extra = [k for k in record if k not in METRICS_COLUMNS]  # statistics a mixer reports (NSA's nsa_*)
        record = {**record, **memory_fields()}
        if self.rank_path is not None:
            with open_for_append(self.rank_path) as f:
                f.write(json.dumps(record) + "\n")
        if not self.is_main:
            return
        with open_for_append(self.heartbeat_path) as f:
            f.write(json.dumps(record) + "\n")
        self._row(record, extra)
        step = record["step"]
        for key, value in record.items():
            if key not in ("step", "elapsed_s") and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.tb.add_scalar(f"train/{key}", value, step)
        if self.wandb is not None:
            self.wandb.log({f"train/{k}": v for k, v in record.items() if isinstance(v, (int, float))}, step=step)

    def validation(self, step: int, elapsed_s: float, val_loss: float, val_bpb: float) -> None:
        self._row({"step": step, "elapsed_s": elapsed_s, "val_loss": val_loss, "val_bpb": val_bpb})
        self.tb.add_scalar("val/loss", val_loss, step)
        self.tb.add_scalar("val/bpb", val_bpb, step)
        if self.wandb is not None:
            self.wandb.log({"val/loss": val_loss, "val/bpb": val_bpb}, step=step)

    def validation_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """Task metrics from evaluation during training (e.g. spider/execution_accuracy)."""
        with open_for_append(self.heartbeat_path) as f:
            f.write(json.dumps({"step": step, "event": "eval", **metrics}) + "\n")
        self._row({"step": step, **metrics}, list(metrics))
        self.eval_metrics = {"step": step, **metrics}
        _merge_into_json(self.run_dir / "run.json", "eval", self.eval_metrics)
        for key, value in metrics.items():
            if isinstance(value, (int, float)):
                self.tb.add_scalar(f"eval/{key}", value, step)
        if self.wandb is not None:
            self.wandb.log({f"eval/{k}": v for k, v in metrics.items()}, step=step)

    def sample(self, step: int, prompt: str, text: str) -> None:
        with open_for_append(self.samples_path) as f:
            f.write(json.dumps({"step": step, "prompt": prompt, "text": text}) + "\n")
        self.tb.add_text("sample", f"```\n{prompt}{text}\n```", step)
        if self.wandb is not None:
            self.wandb.log({"sample": prompt + text}, step=step)

    def _row(self, record: dict[str, Any], extra: list[str] = ()) -> None:
        new = [k for k in extra if k not in self.columns and isinstance(record.get(k), (int, float)) and not isinstance(record.get(k), bool)]
        if new:  # a statistic or eval metric seen for the first time: one more column, earlier rows blank there
            self.columns += new
            _widen_csv(self.metrics_path, self.columns)
        with open_for_append(self.metrics_path, newline="") as f:
            csv.writer(f).writerow([_fmt(record.get(c)) for c in self.columns])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.flush()
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.6g}"
    return str(v)


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSONL telemetry file. A torn last line (no newline: a process killed while writing it)
    is dropped; any other line that is not a JSON object is real damage, refused as a RunDirError."""
    if not path.exists():
        return []
    try:
        return telemetry_records(_read_text(path))
    except ValueError as e:
        raise RunDirError(f"{path}, line {e.args[0]}, is not a JSON record: the file is damaged. {_REPAIR}") from None


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise RunDirError(f"{path} is not UTF-8 text: the file is damaged. {_REPAIR}") from None


def read_csv_rows(path: Path) -> list[list[str]]:
    """metrics.csv as rows (header first); a torn last line is dropped, a malformed row is a RunDirError."""
    if not path.exists():
        return []
    text = _read_text(path)
    if text and not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]  # torn by a kill mid-write
    rows = list(csv.reader(io.StringIO(text, newline="")))
    for n, row in enumerate(rows[1:], 2):
        if not row:
            continue
        try:
            int(row[0])
        except ValueError:
            raise RunDirError(f"{path}, line {n}, is not a metrics row (it starts with {row[0][:40]!r}, not a step): "
                              f"the file is damaged. {_REPAIR}") from None
    return rows


_REPAIR = ("It is telemetry only (the checkpoints are intact): delete or repair that line, or move the file away, "
           "then resume.")


def check_telemetry(run_dir: Path) -> None:
    """Read every telemetry file a resume rewrites; RunDirError on real damage (before anything is written)."""
    run_dir = Path(run_dir)
    for path in [run_dir / "heartbeat.jsonl", run_dir / "samples.jsonl", run_dir / "eval" / "metrics.jsonl",
                 *sorted(run_dir.glob("heartbeat_rank*.jsonl"))]:
        read_jsonl(path)
    read_csv_rows(run_dir / "metrics.csv")


def _csv_header(path: Path) -> list[str]:
    with open(path, newline="") as f:
        return next(csv.reader(f), [])


def _widen_csv(path: Path, columns: list[str]) -> None:
    """Rewrite `path` under the header `columns` (the old ones first), atomically."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))[1:]
    text = io.StringIO(newline="")
    writer = csv.writer(text)
    writer.writerow(columns)
    writer.writerows(row + [""] * (len(columns) - len(row)) for row in rows)
    replace_file(path, text.getvalue())


def _merge_into_json(path: Path, key: str, value: Any) -> None:
    """Set `key` in the JSON object at `path` (written whole under a temporary name, then renamed)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        record = {}
    if not isinstance(record, dict):
        record = {}
    record[key] = value
    replace_file(path, json.dumps(record, indent=1))


def _truncate_jsonl_after(path: Path, step: int) -> None:
    if not path.exists():
        return
    keep = [r for r in read_jsonl(path) if r.get("step", 0) <= step]
    replace_file(path, "".join(json.dumps(r) + "\n" for r in keep))


def _truncate_csv_after(path: Path, step: int) -> None:
    if not path.exists():
        return
    rows = read_csv_rows(path)
    if not rows:
        path.unlink()
        return
    keep = [rows[0]] + [r for r in rows[1:] if r and int(r[0]) <= step]
    text = io.StringIO(newline="")
    csv.writer(text).writerows(keep)
    replace_file(path, text.getvalue())


class Throughput:
    """Tokens per second between two readings."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.tokens = 0

    def add(self, tokens: int) -> None:
        self.tokens += tokens

    def read(self) -> float:
        now = time.perf_counter()
        rate = self.tokens / max(now - self.t0, 1e-9)
        self.t0, self.tokens = now, 0
        return rate
