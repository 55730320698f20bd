"""Run a suite's jobs as `attnlab train` subprocesses on a fixed set of slots.

Each job is decided from its run directory before anything starts:
  a run made with another config        -> changed: refused, never skipped as done (every key is
                                           compared for an ended run, the resume-locked keys otherwise)
  finished run                          -> skip
  diverged run                          -> skip (resuming would diverge again; reported)
  a published checkpoint                -> resume (`--resume`)
  a run but no checkpoint               -> move the directory aside, start fresh
  nothing                               -> start
A slot is one GPU share (`CUDA_VISIBLE_DEVICES` set per job) or, without GPUs, one of
`--parallel` CPU workers. A failed job does not stop the others. Ctrl-C sends SIGINT to every
running job, waits for each to record `interrupted` in its run.json, and leaves them resumable.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table

from attnlab.config import load_config
from attnlab.config.loader import diff_configs
from attnlab.config.schema import RESUME_LOCKED
from attnlab.errors import AttnLabError
from attnlab.outputs import open_for_append
from attnlab.train.checkpoint import CheckpointManager

from .suite import Job

TERMINAL = ("finished", "failed", "interrupted", "skipped", "invalid", "changed")


@dataclass
class Slot:
    name: str                      # 'gpu0/1' or 'cpu/1'
    env: dict[str, str]


@dataclass
class JobState:
    job: Job
    action: str                    # start | resume | restart | skip | invalid | changed
    note: str = ""
    max_steps: int = 0
    state: str = "pending"         # pending | running | finished | failed | interrupted | skipped | invalid | changed
    slot: Optional[Slot] = None
    proc: Optional[subprocess.Popen] = None
    log_path: Path = Path()
    started: float = 0.0
    ended: float = 0.0
    returncode: Optional[int] = None
    last: dict = field(default_factory=dict)  # newest heartbeat record


def _default_sigint() -> None:
    """In the child: Ctrl-C raises KeyboardInterrupt even when the sweep was started with SIGINT ignored
    (a background job of a non-interactive shell), so a forwarded SIGINT always stops the job cleanly."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def make_slots(gpus: list[str] | None, per_gpu: int, parallel: int) -> list[Slot]:
    if gpus:
        return [Slot(f"gpu{g}/{k + 1}", {"CUDA_VISIBLE_DEVICES": g}) for g in gpus for k in range(per_gpu)]
    threads = max(1, (os.cpu_count() or 1) // max(1, parallel))
    env = {} if "OMP_NUM_THREADS" in os.environ else {"OMP_NUM_THREADS": str(threads)}
    return [Slot(f"cpu/{k + 1}", env) for k in range(max(1, parallel))]


def read_run_status(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "run.json").read_text())
    except (OSError, ValueError):
        return {}


def decide(job: Job, base: Path | None) -> JobState:
    """What to do with a job, from its run directory (nothing is changed here)."""
    try:
        cfg = load_config(base, job.overrides)
    except AttnLabError as e:
        return JobState(job, "invalid", note=str(e))
    st = JobState(job, "start", max_steps=cfg.train.max_steps)
    run_dir = job.run_dir
    status = read_run_status(run_dir).get("status")
    newest = CheckpointManager(run_dir).newest()
    holds_run = (run_dir / "config.yaml").exists() or (run_dir / "run.json").exists() or (run_dir / "checkpoints").exists()
    ended = status in ("finished", "diverged")
    changed = _changed_since(run_dir, cfg, everything=ended) if ended or newest is not None else []
    if changed:
        what = f"holds a {status} run" if ended else f"holds a run to resume from {newest.name}"
        st.action, st.note = "changed", (
            f"{run_dir} {what} with another config than this job's now: {'; '.join(changed)}. "
            f"Move or delete {run_dir} to run the job again, or restore the suite's old values.")
    elif status == "finished":
        st.action, st.note = "skip", "finished earlier"
    elif status == "diverged":
        st.action, st.note = "skip", "diverged earlier (loss became NaN); see its log. Delete the run directory to retry."
    elif newest is not None:
        st.action, st.note = "resume", f"{status or 'unfinished'} run, resuming from {newest.name}"
    elif holds_run:
        st.action, st.note = "restart", f"{status or 'unfinished'} run without a checkpoint: moved aside, starting fresh"
    return st


def _changed_since(run_dir: Path, cfg, everything: bool) -> list[str]:
    """How the job's config differs from the one saved in its run directory: every key for a run
    that has ended (its results are the old config's), the keys a resume locks for one that will
    resume. An unreadable saved config counts as a difference."""
    saved = run_dir / "config.yaml"
    if not saved.exists():
        return []
    try:
        old = load_config(saved)
    except AttnLabError as e:
        return [f"its config.yaml cannot be read ({str(e).splitlines()[0]})"]
    return diff_configs(old, cfg, ("model", "data", "train", "eval") if everything else RESUME_LOCKED)


def train_command(job: Job, base: Path | None, resume: bool) -> list[str]:
    cmd = [sys.executable, "-m", "attnlab.cli", "train"]
    if base is not None:
        cmd.append(str(base))
    for o in job.overrides:
        cmd += ["--set", o]
    cmd += ["--run-dir", str(job.run_dir)]
    if resume:
        cmd.append("--resume")
    return cmd


def _last_heartbeat(run_dir: Path) -> dict:
    path = run_dir / "heartbeat.jsonl"
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 8192))
            lines = f.read().decode("utf-8", "replace").split("\n")  # not splitlines: U+2028 may sit inside a JSON string
    except OSError:
        return {}
    for line in reversed(lines):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if "loss" in rec and rec.get("event") is None:
            return rec
    return {}


def log_tail(path: Path, lines: int = 20) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _fmt_eta(seconds: float | None) -> str:
    if seconds is None:
        return ""
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}" if seconds >= 3600 else f"{seconds // 60}:{seconds % 60:02d}"


def status_table(states: list[JobState], title: str) -> Table:
    table = Table(title=title)
    for col in ("job", "state", "slot", "step", "loss", "tokens/s", "ETA"):
        table.add_column(col, justify="right" if col in ("step", "loss", "tokens/s", "ETA") else "left")
    colors = {"running": "cyan", "finished": "green", "failed": "red", "invalid": "red", "changed": "red", "interrupted": "yellow", "skipped": "dim"}
    for s in states:
        step = s.last.get("step")
        loss = s.last.get("loss")
        tps = s.last.get("tokens_per_s")
        eta = None
        if s.state == "running" and step and s.last.get("elapsed_s"):
            eta = (s.max_steps - step) * s.last["elapsed_s"] / step
        c = colors.get(s.state, "")
        table.add_row(
            s.job.name, f"[{c}]{s.state}[/{c}]" if c else s.state, s.slot.name if s.slot else "",
            f"{step}/{s.max_steps}" if step else "", f"{loss:.4f}" if isinstance(loss, (int, float)) else "",
            f"{tps:,.0f}" if isinstance(tps, (int, float)) else "", _fmt_eta(eta),
        )
    return table


class SweepRunner:
    def __init__(self, states: list[JobState], base: Path | None, slots: list[Slot], out_dir: Path, console: Console,
                 poll_s: float = 0.5, grace_s: float = 120.0):
        self.states, self.base, self.slots, self.out_dir = states, base, slots, out_dir
        self.console, self.poll_s, self.grace_s = console, poll_s, grace_s
        self.logs = out_dir / "logs"
        self._live = False

    # -- one job --------------------------------------------------------------------------------
    def _launch(self, s: JobState, slot: Slot) -> None:
        run_dir = s.job.run_dir
        if s.action == "restart":
            aside = self.out_dir / ".aside" / f"{s.job.name}-{time.strftime('%Y%m%d-%H%M%S')}"
            aside.parent.mkdir(parents=True, exist_ok=True)
            run_dir.replace(aside)
            s.note = f"previous attempt had no checkpoint; moved to {aside}"
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        s.log_path = self.logs / f"{s.job.name}.log"
        cmd = train_command(s.job, self.base, resume=s.action == "resume")
        env = {**os.environ, **slot.env, "PYTHONUNBUFFERED": "1", "COLUMNS": "120"}
        log = open_for_append(s.log_path)  # never through a link planted at the log's name
        log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {s.action} on {slot.name}"
                  + "".join(f" {k}={v}" for k, v in slot.env.items()) + "\n$ " + " ".join(cmd[1:]) + "\n")
        log.flush()
        # own process group: a terminal Ctrl-C reaches the sweep only, which forwards it once
        s.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True,
                                  preexec_fn=_default_sigint)
        log.close()
        s.slot, s.state, s.started = slot, "running", time.time()
        self._say(f"[cyan]start[/cyan] {s.job.name} on {slot.name}" + (f" ({s.note})" if s.action != "start" else ""))

    def _reap(self, s: JobState) -> bool:
        assert s.proc is not None
        rc = s.proc.poll()
        if rc is None:
            s.last = _last_heartbeat(s.job.run_dir) or s.last
            return False
        s.returncode, s.ended = rc, time.time()
        s.last = _last_heartbeat(s.job.run_dir) or s.last
        status = read_run_status(s.job.run_dir).get("status")
        if rc == 0 and status == "finished":
            s.state = "finished"
            self._say(f"[green]done[/green]  {s.job.name} in {s.ended - s.started:.0f} s")
        elif status == "interrupted" or rc in (130, -signal.SIGINT):
            s.state = "interrupted"
        else:
            s.state = "failed"
            self._say(f"[red]failed[/red] {s.job.name} (exit {rc}); log: {s.log_path}")
        return True

    def _say(self, text: str) -> None:
        if not self._live:
            self.console.print(text, highlight=False)

    # -- the whole suite ------------------------------------------------------------------------
    def run(self, live: bool) -> list[JobState]:
        self._live = live
        previous = {sig: signal.signal(sig, _raise_interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}  # both stop cleanly
        queue = [s for s in self.states if s.action in ("start", "resume", "restart")]
        for s in self.states:
            if s.action == "skip":
                s.state, s.last = "skipped", _last_heartbeat(s.job.run_dir)
            elif s.action in ("invalid", "changed"):
                s.state = s.action
        free = list(self.slots)
        running: list[JobState] = []
        title = f"sweep: {len(self.states)} jobs, {len(self.slots)} slots"
        display = Live(status_table(self.states, title), console=self.console, refresh_per_second=2, transient=False) if live else None
        try:
            if display:
                display.start()
            while queue or running:
                while queue and free:
                    job = queue.pop(0)
                    self._launch(job, free.pop(0))
                    running.append(job)
                time.sleep(self.poll_s)
                for s in list(running):
                    if self._reap(s):
                        running.remove(s)
                        free.append(s.slot)
                if display:
                    display.update(status_table(self.states, title))
        except KeyboardInterrupt:
            self._stop(running)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if display:
                display.update(status_table(self.states, title))
                display.stop()
        return self.states

    def _stop(self, running: list[JobState]) -> None:
        """Ctrl-C: SIGINT every job, wait for each to write its run.json, then report."""
        self._live = False
        self.console.print(f"[yellow]interrupt:[/yellow] stopping {len(running)} running job(s); each records 'interrupted' and stays resumable")
        for s in running:
            if s.proc and s.proc.poll() is None:
                s.proc.send_signal(signal.SIGINT)
        deadline = time.time() + self.grace_s
        for s in running:
            try:
                s.proc.wait(timeout=max(1.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                s.proc.kill()
                s.proc.wait()
            self._reap(s)
            if s.state != "finished":
                s.state = "interrupted"


def summary(states: list[JobState], console: Console, tail_lines: int = 20) -> int:
    """Print the final table and, for each failed job, the tail of its log. Returns the number failed."""
    table = Table(title="sweep summary")
    for col in ("job", "state", "steps", "val loss", "val bpb", "wall s", "note"):
        table.add_column(col)
    failed = 0
    for s in states:
        info = read_run_status(s.job.run_dir) if s.action != "invalid" else {}
        bad = s.state in ("failed", "invalid", "changed")
        failed += bad
        vl, vb, wall = info.get("val_loss"), info.get("val_bpb"), info.get("wall_s")
        step = s.last.get("step")
        table.add_row(
            s.job.name, s.state, f"{step}/{s.max_steps}" if step else "",
            f"{vl:.4f}" if isinstance(vl, (int, float)) else "", f"{vb:.3f}" if isinstance(vb, (int, float)) else "",
            f"{wall:.0f}" if isinstance(wall, (int, float)) else "",
            escape({"invalid": "invalid config", "changed": "config changed: not run"}.get(s.action, s.note)),
        )
    console.print(table)
    for s in states:
        if s.state == "invalid":
            console.print(Panel(escape(s.note), title=f"{s.job.name}: invalid config (not started)", border_style="red", expand=False))
        elif s.state == "changed":
            console.print(Panel(escape(s.note), title=f"{s.job.name}: its config changed since its run (not started)", border_style="red", expand=False))
        elif s.state == "failed":
            console.print(Panel(escape(log_tail(s.log_path, tail_lines)), title=f"{s.job.name}: failed (exit {s.returncode}), last lines of {s.log_path}",
                                border_style="red", expand=False))
    interrupted = [s for s in states if s.state in ("interrupted", "pending")]
    if interrupted:
        console.print(f"[yellow]{len(interrupted)} job(s) not finished[/yellow]; run the same sweep command again to resume them.")
    return failed
