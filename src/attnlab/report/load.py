"""Read what a run directory recorded: resolved config, run.json, metrics.csv, heartbeat, samples."""

from __future__ import annotations

import csv
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from attnlab.data.corpus import telemetry_records
from attnlab.errors import AttnLabError
from attnlab.eval import niah


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
    error: str | None = None        # why the run could not be read; such a run is listed, not plotted
    parameters: int | None = None   # trainable parameters, from run.json or the saved model config

    @property
    def tokens_per_step(self) -> int:
        t, d = _section(self.config, "train"), _section(self.config, "data")
        values = (t.get("batch_size", 1), t.get("grad_accum", 1), d.get("seq_len", 1), self.status.get("world_size", 1))
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
            return 0  # a hand-edited config: no token axis rather than a wrong one
        return values[0] * values[1] * values[2] * values[3]

    @property
    def mixer(self) -> str:
        return str(_section(self.config, "model").get("mixer", ""))

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
        if not events and isinstance(self.status.get("eval"), dict):  # run.json keeps the newest one too
            events = [self.status["eval"]]
        if not events:
            return {}
        return {k: v for k, v in events[-1].items() if k not in ("event", "step", "elapsed_s") and isinstance(v, (int, float))}


class UnreadableRun(AttnLabError):
    """One file of a run cannot be read; the report lists the run with this reason and goes on."""


def _section(config: dict[str, Any], name: str) -> dict[str, Any]:
    value = config.get(name)
    return value if isinstance(value, dict) else {}


def _float(x: str, where: str) -> float | None:
    if x is None or x == "":
        return None
    try:
        return float(x)
    except ValueError:
        raise UnreadableRun(f"{where}: {x[:40]!r} is not a number") from None


def _text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UnreadableRun(f"{path.name} is not UTF-8 text (byte {e.start})") from None


def _jsonl(path: Path) -> list[dict]:
    """The records of a JSONL file; a last line cut short by a kill is left out, any other bad line is an error."""
    if not path.exists():
        return []
    try:
        return telemetry_records(_text(path))
    except ValueError as e:
        line, holds = e.args
        raise UnreadableRun(f"{path.name} line {line} holds {holds}") from None


def _metrics(path: Path) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    """(training rows, validation rows) of metrics.csv, one per step, the newest record of a step winning."""
    by_step: dict[int, dict] = {}
    val_by_step: dict[int, dict] = {}
    if not path.exists():
        return [], []
    text = _text(path)
    rows = list(csv.reader(text.splitlines()))
    if not rows:
        return [], []
    header = rows[0]
    if "step" not in header:
        raise UnreadableRun(f"{path.name} has no step column (header {','.join(header)[:80]!r})")
    for n, row in enumerate(rows[1:], 2):
        if not row:
            continue
        if len(row) != len(header):
            if n == len(rows) and not text.endswith("\n"):
                continue  # the torn last row of a killed writer
            raise UnreadableRun(f"{path.name} line {n} has {len(row)} fields, the header {len(header)}")
        values = {k: _float(v, f"{path.name} line {n}, {k}") for k, v in zip(header, row) if k}
        step = values.get("step")
        if step is None or step != step or step < 0 or step != int(step):
            raise UnreadableRun(f"{path.name} line {n}: step {row[header.index('step')]!r} is not a step number")
        step = int(step)
        if values.get("loss") is not None:
            by_step[step] = values  # a resumed run re-logs steps: the newest record wins
        if values.get("val_loss") is not None:
            val_by_step[step] = values
    return [by_step[k] for k in sorted(by_step)], [val_by_step[k] for k in sorted(val_by_step)]


def _mapping(path: Path, value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise UnreadableRun(f"{path.name} holds a {type(value).__name__}, not a mapping of keys to values")
    return value


def load_run(path: Path, name: str | None = None) -> RunRecord:
    """What `path` recorded; a file that cannot be read raises `UnreadableRun` naming it and why."""
    path = Path(path)
    if not (path / "config.yaml").is_file():
        raise AttnLabError(f"{path} is not a run directory (no config.yaml). Pass directories written by attnlab train or attnlab sweep.")
    try:
        config = _mapping(path / "config.yaml", yaml.safe_load(_text(path / "config.yaml")))
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        raise UnreadableRun("config.yaml is not valid YAML" + (f" (line {where.line + 1})" if where else "")) from None
    status: dict[str, Any] = {}
    if (path / "run.json").exists():
        try:
            status = _mapping(path / "run.json", json.loads(_text(path / "run.json")))
        except ValueError as e:
            raise UnreadableRun(f"run.json is not valid JSON ({e})") from None
    rec = RunRecord(name or path.name, path, config, status)
    rec.train, rec.val = _metrics(path / "metrics.csv")
    rec.heartbeat = _jsonl(path / "heartbeat.jsonl")
    rec.samples = _jsonl(path / "samples.jsonl")
    rec.parameters = parameter_count(path, status)
    return rec


def parameter_count(path: Path, status: dict[str, Any]) -> int | None:
    """run.json's `parameters` when the run recorded it; else counted from the saved model config
    (final model or newest checkpoint) on the meta device, which allocates nothing; else None."""
    value = status.get("parameters", status.get("total_params"))  # train's key; finetune's
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, dict) and isinstance(value.get("total"), int):
        return value["total"]
    saved = [path / "final" / "config.json"] + sorted((path / "checkpoints").glob("step-*/config.json"), reverse=True)
    config_json = next((p for p in saved if p.is_file()), None)
    if config_json is None:
        return None
    try:
        import torch

        from attnlab.models import AttnLabConfig, AttnLabForCausalLM

        cfg = AttnLabConfig.from_json_file(str(config_json))
        with torch.device("meta"):
            model = AttnLabForCausalLM(cfg)
        return sum(p.numel() for p in model.parameters())
    except Exception:  # noqa: BLE001  (a config this attnlab cannot build: the count is only unknown)
        return None


def unreadable(path: Path, name: str, reason: str) -> RunRecord:
    return RunRecord(name, path, {}, {}, error=reason)


def read_niah(directory: Path) -> dict[str, Any] | None:
    return niah.read_niah(directory)


def _subdirs(path: Path) -> list[Path]:
    try:
        return sorted(c for c in path.iterdir() if c.is_dir())
    except OSError:
        return []


def _in_run(run: Path) -> list[Path]:
    return [d for d in _subdirs(run) + _subdirs(run / "eval") if read_niah(d) is not None]


def niah_dirs_in(path: Path) -> list[Path]:
    """The needle-in-a-haystack eval directories `path` stands for: itself; else those of a run (RUN/<dir>/,
    RUN/eval/<dir>/); else its children that are such directories, and those of the runs among them."""
    path = Path(path)
    if read_niah(path) is not None:
        return [path]
    if (path / "config.yaml").is_file():
        return _in_run(path)
    found = []
    for child in _subdirs(path):
        if read_niah(child) is not None:
            found.append(child)
        elif (child / "config.yaml").is_file():
            found += _in_run(child)
    return found


def find_runs(paths: list[Path]) -> list[Path]:
    """Run directories among `paths`; a directory that holds runs (a sweep's output) stands for all of them.
    Needle-in-a-haystack eval directories are not runs: report/recall.py finds them."""
    found: list[Path] = []
    for p in paths:
        p = Path(p)
        if (p / "config.yaml").is_file():
            found.append(p)
        elif p.is_dir():
            children = sorted(c for c in p.iterdir() if c.is_dir() and (c / "config.yaml").is_file())
            if not children and not niah_dirs_in(p):
                raise AttnLabError(f"{p} holds no runs (no config.yaml in it or in its subdirectories) and no niah evaluations")
            found.extend(children)
        else:
            raise AttnLabError(f"run directory not found: {p}")
    return found


def load_runs(paths: list[Path]) -> list[RunRecord]:
    dirs = find_runs(paths)
    names = [d.name for d in dirs]
    if len(set(names)) < len(names):  # same leaf name in two places: name them by parent too
        names = [f"{d.parent.name}/{d.name}" for d in dirs]
    runs = []
    for d, n in zip(dirs, names):
        try:
            runs.append(load_run(d, n))
        except UnreadableRun as e:
            runs.append(unreadable(d, n, str(e)))
        except Exception as e:  # noqa: BLE001  (one bad run must not take the report of the others down)
            runs.append(unreadable(d, n, f"{type(e).__name__}: {e}"))
    return runs


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
