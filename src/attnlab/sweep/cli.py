"""`attnlab sweep SUITE.yaml`: run every job of a suite, skipping finished ones and resuming the rest."""

from __future__ import annotations

import json
import shlex
import time
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from attnlab.config import load_config
from attnlab.console import make_console
from attnlab.errors import AttnLabError, ConfigError
from attnlab.outputs import replace_file

from .suite import base_config_path, expand, load_suite, resolve_suite_path


def _parse_gpus(gpus: Optional[str]) -> list[str] | None:
    if not gpus:
        return None
    ids = [g.strip() for g in gpus.replace(" ", ",").split(",") if g.strip()]
    if not all(g.isdigit() for g in ids):
        raise ConfigError(f"--gpus takes GPU indices separated by commas (e.g. 0,1,2), got '{gpus}'")
    return ids


def _refuse_in_dry_run(state, base: Path | None) -> None:
    """Preflight a job that a dry run would start, resume or restart, as its `attnlab train` would: a job whose
    preflight finds errors is marked `refused`, with the errors as its note, instead of reporting it as started."""
    from attnlab.train.preflight import run_preflight

    resume = state.action == "resume"
    run_dir = None if state.action == "restart" else state.job.run_dir  # a restart moves the old run aside first
    try:
        report = run_preflight(load_config(base, state.job.overrides), run_dir, resume)
    except AttnLabError as e:
        errors = [str(e)]
    else:
        errors = [f"{p.key}: {p.message}" for p in report.errors]
    if errors:
        state.action, state.note = "refused", "preflight refuses it: " + "; ".join(errors)


def _plan_table(states: list, slots_desc: str) -> Table:
    table = Table(title=f"sweep plan ({slots_desc})")
    for col in ("job", "action", "run directory", "overrides", "note"):
        table.add_column(col, overflow="fold")
    for s in states:
        table.add_row(s.job.name, s.action, str(s.job.run_dir), escape(" ".join(f"{k}={v}" for k, v in s.job.varying.items())),
                      escape(s.note if s.action != "invalid" else s.note.splitlines()[-1].strip()))
    return table


def sweep(
    suite_file: str = typer.Argument(..., metavar="SUITE", help="Suite YAML file, or the name of a built-in suite (mixers-shakespeare)."),
    gpus: Optional[str] = typer.Option(None, "--gpus", help="GPU indices to use, e.g. 0,1,2. Each job sees one GPU (CUDA_VISIBLE_DEVICES)."),
    per_gpu: int = typer.Option(1, "--per-gpu", min=1, help="Concurrent jobs per GPU."),
    parallel: int = typer.Option(1, "--parallel", min=1, help="Without --gpus: jobs run this many at a time on CPU."),
    set_: list[str] = typer.Option([], "--set", "-s", metavar="KEY=VALUE", help="Override one config key in every job (wins over the suite; repeatable)."),
    out_dir: Optional[Path] = typer.Option(None, "--out-dir", help="Where the run directories go. Default: the suite's out_dir, else runs/<suite name>."),
    only: list[str] = typer.Option([], "--only", help="Run only the jobs with these names (repeatable)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the jobs, what would happen to each, and their commands; run nothing."),
    launcher: str = typer.Option("local", "--launcher", help="local (slots on this machine) or slurm (submit through submitit)."),
    slurm_partition: Optional[str] = typer.Option(None, "--slurm-partition", help="With --launcher slurm: the partition."),
    slurm_time_min: int = typer.Option(240, "--slurm-time-min", help="With --launcher slurm: time limit per job, minutes."),
    tail: int = typer.Option(20, "--tail", help="Lines of a failed job's log to print."),
):
    """Run a suite of training jobs (a base config x a grid/list of overrides), each in its own run directory.

    Re-running skips finished jobs and resumes interrupted ones from their newest checkpoint.
    A failed job is reported with the end of its log; the others go on. Ctrl-C stops every job
    cleanly (each stays resumable)."""
    from .runner import SweepRunner, decide, make_slots, summary, train_command

    console = make_console()
    path = resolve_suite_path(suite_file)
    suite = load_suite(path)
    name = suite.name or path.stem
    root = out_dir or (Path(suite.out_dir) if suite.out_dir else Path("runs") / name)
    base = base_config_path(suite, path)
    jobs = expand(suite, set_)
    if only:
        unknown = sorted(set(only) - {j.name for j in jobs})
        if unknown:
            raise ConfigError(f"--only names no job of this suite: {', '.join(unknown)}. Jobs: {', '.join(j.name for j in jobs)}")
        jobs = [j for j in jobs if j.name in only]
    for j in jobs:
        j.run_dir = root / j.name
    states = [decide(j, base) for j in jobs]
    gpu_ids = _parse_gpus(gpus)
    slots = make_slots(gpu_ids, per_gpu, parallel)
    slots_desc = f"GPUs {','.join(gpu_ids)} x {per_gpu}" if gpu_ids else f"{len(slots)} at a time on CPU"
    if launcher not in ("local", "slurm"):
        raise ConfigError(f"--launcher must be local or slurm, got '{launcher}'")

    if dry_run:  # what each job's own preflight would say, so that the plan never says "start" for a job that will be refused
        for s in states:
            if s.action in ("start", "resume", "restart"):
                _refuse_in_dry_run(s, base)
    console.print(f"suite [bold]{escape(name)}[/bold] ({escape(str(path))}): {len(jobs)} jobs into {escape(str(root))}", highlight=False)
    console.print(_plan_table(states, slots_desc if launcher == "local" else "slurm"))
    if dry_run:
        for s in states:
            if s.action in ("start", "resume", "restart"):
                console.print(f"{s.job.name}: " + escape(shlex.join(["attnlab", *train_command(s.job, base, s.action == "resume")[3:]])),
                              highlight=False, soft_wrap=True)
        console.print("[dim]dry run: nothing was started.[/dim]")
        return

    if launcher == "slurm":
        from .slurm import submit

        submit(states, base, root, console, partition=slurm_partition, time_min=slurm_time_min)
        return

    runner = SweepRunner(states, base, slots, root, console)
    t0 = time.time()
    runner.run(live=console.is_terminal)
    failed = summary(states, console, tail)
    root.mkdir(parents=True, exist_ok=True)
    record = {
        "suite": str(path), "name": name, "updated": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "wall_s": round(time.time() - t0, 1),
        "jobs": [{"name": s.job.name, "state": s.state, "action": s.action, "run_dir": str(s.job.run_dir),
                  "overrides": s.job.overrides, "returncode": s.returncode} for s in states],
    }
    replace_file(root / "sweep.json", json.dumps(record, indent=1))
    console.print(f"report: attnlab report {escape(str(root))} --out {escape(str(root / 'report.html'))}", highlight=False)
    if any(s.state == "interrupted" for s in states):
        raise typer.Exit(130)
    if failed:
        raise typer.Exit(1)

