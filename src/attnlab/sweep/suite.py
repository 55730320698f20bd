"""A suite: one base config and a grid or list of overrides, expanded into named jobs.

    name: mixers-shakespeare
    base: null                  # a run config (path relative to this file), null = the built-in default
    set:                        # overrides shared by every job
      train.max_steps: 200
    grid:                       # cartesian product, first key varies slowest
      model.mixer: [gla, softmax]
      train.seed: [0, 1]
    jobs:                       # and/or an explicit list; each entry is crossed with the grid
      - {name: small-lr, set: {train.lr: 1.0e-3}}

Job names are built from the values that vary ('gla-seed0'), or given with `name`.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from attnlab.config.loader import load_yaml
from attnlab.errors import ConfigError


class JobEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Optional[str] = Field(None, description="Job name (default: built from its overrides).")
    set: dict[str, Any] = Field(default_factory=dict, description="Overrides of this job, dotted keys.")


class Suite(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Optional[str] = Field(None, description="Suite name; default: the file name. Runs go to runs/<name>/.")
    command: Literal["train"] = Field("train", description="The attnlab verb every job runs.")
    base: Optional[str] = Field(None, description="Base run config, relative to the suite file; null = the built-in default.")
    set: dict[str, Any] = Field(default_factory=dict, description="Overrides shared by every job.")
    grid: dict[str, list[Any]] = Field(default_factory=dict, description="Key -> values; every combination is a job.")
    jobs: list[JobEntry] = Field(default_factory=list, description="Explicit jobs, each crossed with the grid.")
    out_dir: Optional[str] = Field(None, description="Where the run directories go; default runs/<name>.")

    @field_validator("name")
    @classmethod
    def _one_directory_name(cls, name: Optional[str]) -> Optional[str]:
        if name is not None and not is_plain_name(name):
            raise ValueError(f"{name!r} is not a directory name: runs go to runs/<name>/, so it must be one name "
                             "(no '/', no '..', not absolute); set out_dir to put the runs elsewhere")
        return name


@dataclass
class Job:
    name: str
    overrides: list[str]          # KEY=VALUE, in the order they are applied
    varying: dict[str, Any] = field(default_factory=dict)  # what distinguishes this job from its siblings
    run_dir: Path = Path()


def builtin_suites_dir() -> Path:
    return Path(str(resources.files("attnlab") / "configs" / "suites"))


def resolve_suite_path(spec: str | Path) -> Path:
    """A path, or the name of a built-in suite ('mixers-shakespeare')."""
    path = Path(spec)
    if path.is_file():
        return path
    builtin = builtin_suites_dir() / f"{Path(spec).name.removesuffix('.yaml')}.yaml"
    if builtin.is_file():
        return builtin
    names = sorted(p.stem for p in builtin_suites_dir().glob("*.yaml"))
    raise ConfigError(f"suite file not found: {spec}. Pass a suite YAML file or a built-in suite name ({', '.join(names)}).")


def load_suite(path: Path) -> Suite:
    try:
        data = load_yaml(path.read_text(encoding="utf-8"), f"suite {path}") or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"YAML syntax error in suite {path}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"suite {path} must hold a mapping (name, base, set, grid, jobs)")
    try:
        return Suite.model_validate(data)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            key = ".".join(str(p) for p in err["loc"])
            msg = "unknown key (valid: name, command, base, set, grid, jobs, out_dir)" if err["type"] == "extra_forbidden" else err["msg"]
            lines.append(f"{key}: {msg}")
        raise ConfigError(f"invalid suite {path}:\n  " + "\n  ".join(lines)) from None


def format_value(value: Any) -> str:
    """A value as the right-hand side of --set KEY=VALUE (read back as YAML)."""
    if isinstance(value, str):
        return value
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()


def _label(key: str, value: Any) -> str:
    leaf = key.rsplit(".", 1)[-1]
    text = format_value(value)
    if leaf in ("mixer", "name", "source") or isinstance(value, str) and len(text) > 12:
        text = Path(text).stem if "/" in text else text
        return text
    return f"{leaf}{text}"


def is_plain_name(name: Any) -> bool:
    """`name` names one directory entry: no path separators, not '.', '..' or absolute."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
            and "\0" not in name and Path(name).name == name)


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._+-]+", "-", name).strip("-.") or "job"


def base_config_path(suite: Suite, suite_path: Path) -> Path | None:
    if suite.base in (None, "default"):
        return None
    base = Path(suite.base)
    return base if base.is_absolute() else (suite_path.parent / base)


def expand(suite: Suite, extra_overrides: list[str] | None = None) -> list[Job]:
    """Every job of the suite, in a stable order, with unique readable names.

    Overrides apply in this order: the suite's `set`, the job's entry, the grid values, then
    `extra_overrides` (the command line's --set, which wins over everything)."""
    entries = suite.jobs or [JobEntry()]
    keys = list(suite.grid)
    for k, values in suite.grid.items():
        if not values:
            raise ConfigError(f"suite grid key '{k}' has no values")
    combos = list(itertools.product(*(suite.grid[k] for k in keys))) if keys else [()]
    shared = [f"{k}={format_value(v)}" for k, v in suite.set.items()]
    tail = list(extra_overrides or [])
    jobs: list[Job] = []
    for entry in entries:
        for combo in combos:
            grid_values = dict(zip(keys, combo))
            varying = {**entry.set, **grid_values}
            overrides = shared + [f"{k}={format_value(v)}" for k, v in entry.set.items()]
            overrides += [f"{k}={format_value(v)}" for k, v in grid_values.items()]
            parts = ([entry.name] if entry.name else [_label(k, v) for k, v in entry.set.items()])
            parts += [_label(k, v) for k, v in grid_values.items() if len(suite.grid[k]) > 1 or not parts]
            jobs.append(Job(name=_safe("-".join(parts)) if parts else "job", overrides=overrides + tail, varying=varying))
    taken: set[str] = set()
    counts: dict[str, int] = {}
    for job in jobs:  # unique names: a second 'gla' becomes 'gla-2' (or 'gla-3' if a job is named 'gla-2')
        name, n = job.name, counts.get(job.name, 1)
        while name in taken:
            n += 1
            name = f"{job.name}-{n}"
        counts[job.name] = n
        taken.add(name)
        job.name = name
    return jobs
