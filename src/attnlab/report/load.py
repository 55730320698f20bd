"""Read what a run directory recorded: resolved config, run.json, metrics.csv, heartbeat, samples."""

from __future__ import annotations

import csv
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from attnlab.errors import AttnLabError


@dataclass
class RunRecord:
    name: str
    path: Path
    config: dict[str, Any]
    status: dict[str, Any]
    train: list[dict[str, float]] = field(default_factory=list)   # step, elapsed_s, loss, tokens_per_s, ...
    val: list[dict[str, float]] = field(default_factory=list)     # step, elapsed_s, val_loss, val_bpb
    heartbeat: list[dict[str, Any]] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)

    @property
    def tokens_per_step(self) -> int:
        t, d = self.config.get("train", {}), self.config.get("data", {})
        return int(t.get("batch_size", 1) * t.get("grad_accum", 1) * d.get("seq_len", 1) * self.status.get("world_size", 1))

    @property
    def mixer(self) -> str:
        return str(self.config.get("model", {}).get("mixer", ""))

    @property
    def steps(self) -> int:
        return int(max([r["step"] for r in self.train] + [r["step"] for r in self.val] + [0]))

    @property
    def tokens_per_s(self) -> float | None:
        """Median over logged steps, the first one excluded (it carries start-up time)."""
        values = [r["tokens_per_s"] for r in self.train if r.get("tokens_per_s") is not None][1:]
        return statistics.median(values) if values else None

    def peak(self, key: str) -> float | None:
        values = [h[key] for h in self.heartbeat if isinstance(h.get(key), (int, float))]
        return max(values) if values else None

    @property
    def eval_metrics(self) -> dict[str, Any]:
        """The newest eval event's metrics (task metrics recorded during training)."""
        events = [h for h in self.heartbeat if h.get("event") == "eval"]
        if not events:
            return {}
        return {k: v for k, v in events[-1].items() if k not in ("event", "step", "elapsed_s") and isinstance(v, (int, float))}


def _float(x: str) -> float | None:
    try:
        return float(x) if x != "" else None
    except ValueError:
        return None


def _jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line cut by a kill
    return out


def load_run(path: Path, name: str | None = None) -> RunRecord:
    path = Path(path)
    if not (path / "config.yaml").is_file():
        raise AttnLabError(f"{path} is not a run directory (no config.yaml). Pass directories written by attnlab train or attnlab sweep.")
    config = yaml.safe_load((path / "config.yaml").read_text(encoding="utf-8")) or {}
    try:
        status = json.loads((path / "run.json").read_text())
    except (OSError, ValueError):
        status = {}
    rec = RunRecord(name or path.name, path, config, status)
    by_step: dict[int, dict] = {}
    val_by_step: dict[int, dict] = {}
    if (path / "metrics.csv").exists():
        with open(path / "metrics.csv", newline="", encoding="utf-8") as f:
            for row in csv.DictReader(f):
                values = {k: _float(v) for k, v in row.items() if k}
                if values.get("step") is None:
                    continue
                step = int(values["step"])
                if values.get("loss") is not None:
                    by_step[step] = values  # a resumed run re-logs steps: the newest record wins
                if values.get("val_loss") is not None:
                    val_by_step[step] = values
    rec.train = [by_step[k] for k in sorted(by_step)]
    rec.val = [val_by_step[k] for k in sorted(val_by_step)]
    rec.heartbeat = _jsonl(path / "heartbeat.jsonl")
    rec.samples = _jsonl(path / "samples.jsonl")
    return rec


def find_runs(paths: list[Path]) -> list[Path]:
    """Run directories among `paths`; a directory that holds runs (a sweep's output) stands for all of them."""
    found: list[Path] = []
    for p in paths:
        p = Path(p)
        if (p / "config.yaml").is_file():
            found.append(p)
        elif p.is_dir():
            children = sorted(c for c in p.iterdir() if c.is_dir() and (c / "config.yaml").is_file())
            if not children:
                raise AttnLabError(f"{p} holds no runs (no config.yaml in it or in its subdirectories)")
            found.extend(children)
        else:
            raise AttnLabError(f"run directory not found: {p}")
    return found


def load_runs(paths: list[Path]) -> list[RunRecord]:
    dirs = find_runs(paths)
    names = [d.name for d in dirs]
    if len(set(names)) < len(names):  # same leaf name in two places: name them by parent too
        names = [f"{d.parent.name}/{d.name}" for d in dirs]
    return [load_run(d, n) for d, n in zip(dirs, names)]


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_differences(runs: list[RunRecord]) -> dict[str, list[Any]]:
    """Dotted key -> each run's value, for the keys whose values are not all equal."""
    flats = [flatten(r.config) for r in runs]
    keys = sorted(set().union(*flats)) if flats else []
    diffs = {}
    for k in keys:
        values = [f.get(k) for f in flats]
        if any(json.dumps(v, sort_keys=True, default=str) != json.dumps(values[0], sort_keys=True, default=str) for v in values):
            diffs[k] = values
    return diffs
