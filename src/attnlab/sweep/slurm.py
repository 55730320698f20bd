"""`--launcher slurm`: the same jobs, submitted through submitit (one GPU per job)."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from attnlab.errors import ConfigError

from .runner import JobState, train_command


def submit(states: list[JobState], base: Path | None, root: Path, console: Console, partition: str | None, time_min: int) -> list:
    try:
        import submitit
    except ImportError:
        raise ConfigError("--launcher slurm needs the 'submitit' package: pip install submitit") from None
    executor = submitit.AutoExecutor(folder=str(root / "slurm" / "%j"))
    params = {"timeout_min": time_min, "gpus_per_node": 1, "tasks_per_node": 1, "nodes": 1}
    if partition:
        params["slurm_partition"] = partition
    executor.update_parameters(**params)
    submitted = []
    for s in states:
        if s.action not in ("start", "resume", "restart"):
            continue
        if s.action == "restart":  # same rule as locally: a run without a checkpoint is moved aside
            aside = root / ".aside" / s.job.name
            aside.parent.mkdir(parents=True, exist_ok=True)
            s.job.run_dir.replace(aside)
        s.job.run_dir.parent.mkdir(parents=True, exist_ok=True)
        executor.update_parameters(name=s.job.name)
        job = executor.submit(submitit.helpers.CommandFunction(train_command(s.job, base, s.action == "resume")))
        submitted.append(job)
        console.print(f"submitted {s.job.name}: slurm job {job.job_id}", highlight=False)
    console.print(f"{len(submitted)} job(s) submitted; run the same command again after they end to resume unfinished ones.")
    return submitted
