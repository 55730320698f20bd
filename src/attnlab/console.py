"""Consoles that read well in a terminal and in a log file.

Off a terminal (nohup, tmux logs, job logs, pipes) rich lays text out at 80 columns and wraps every longer
line, generated text included. attnlab's consoles take `LOG_WIDTH` columns there instead, unless `COLUMNS`
says otherwise; on a terminal they take its width. `progress` reports work done in steps: a bar on a terminal, lines in a log.
"""

from __future__ import annotations

import contextlib
import os
import time

from rich.console import Console

LOG_WIDTH = 160


def make_console(**kwargs) -> Console:
    """A rich Console (same arguments) that is `LOG_WIDTH` wide when it does not write to a terminal."""
    console = Console(**kwargs)
    if console.is_terminal or "width" in kwargs or os.environ.get("COLUMNS"):
        return console
    return Console(width=LOG_WIDTH, **kwargs)


# The CLI's consoles (attnlab.cli and the commands it wires): results on stdout, messages and errors on stderr.
console = make_console()
err_console = make_console(stderr=True)

PROGRESS_EVERY_S = 15.0  # off a terminal: a progress line at least this often while work goes on


class _LineProgress:
    """Progress as lines (a log file, a pipe): one when the work starts, one at least every `every_s` seconds
    while it goes on (from a timer thread, so a long batch is not silent), and one when it ends."""

    def __init__(self, console: Console, name: str, total: int | None, unit: str, every_s: float):
        import threading

        self.console, self.name, self.total, self.unit, self.every_s = console, name, total, unit, every_s
        self.done = 0
        self.t0 = time.perf_counter()
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._beat, daemon=True)

    def _line(self, final: bool = False) -> None:
        elapsed = time.perf_counter() - self.t0
        of = f"/{self.total:,}" if self.total is not None else ""
        left = ""
        if not final and self.total and self.done:
            left = f", about {_duration(elapsed / self.done * (self.total - self.done))} left"
        state = "done" if final else "running"
        self.console.print(f"{self.name}: {self.done:,}{of} {self.unit} {state}, {_duration(elapsed)}{left}", highlight=False,
                           soft_wrap=True)

    def _beat(self) -> None:
        while not self.stopped.wait(self.every_s):
            with self.lock:
                self._line()

    def start(self) -> None:
        of = f"{self.total:,} " if self.total is not None else ""
        self.console.print(f"{self.name}: started, {of}{self.unit}", highlight=False, soft_wrap=True)
        self.thread.start()

    def advance(self, n: int) -> None:
        with self.lock:
            self.done += n

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join()
        self._line(final=True)


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds} s" if seconds < 120 else f"{seconds // 60} min {seconds % 60:02d} s"


@contextlib.contextmanager
def progress(console: Console, name: str, total: int | None, unit: str = "examples", every_s: float | None = None):
    """A progress report for work done in steps; yields `advance(n)`. On a terminal a rich bar (gone when the
    work ends); elsewhere (a log file) lines: at the start, at least every `every_s` seconds, and at the end."""
    if console.is_terminal:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        columns = (TextColumn(f"[bold]{name}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn())
        with Progress(*columns, console=console, transient=True) as bar:
            task = bar.add_task(name, total=total)
            yield lambda n: bar.advance(task, n)
        return
    lines = _LineProgress(console, name, total, unit, PROGRESS_EVERY_S if every_s is None else every_s)
    lines.start()
    try:
        yield lines.advance
    finally:
        lines.stop()
