"""Progress of a corpus preparation on a console: a rich bar on a terminal, a line every LOG_EVERY_S
seconds in a log file (`attnlab data prepare`, a raw corpus prepared into the cache before training,
`attnlab bench data`)."""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from attnlab.data.prepare import Progress as PrepareProgress

LOG_EVERY_S = 10.0  # a log file (not a terminal) gets one progress line this often


class PrepareReporter:
    """Progress of a preparation: a rich bar on a terminal, a line every LOG_EVERY_S seconds in a log file.
    Rates count the text tokenized in this run (not shards kept from an earlier one)."""

    def __init__(self, console: Console):
        self.console = console
        self.t0 = time.perf_counter()
        self.base: PrepareProgress | None = None
        self.workers = 1
        self.last_line = self.t0  # the first line after LOG_EVERY_S
        self.bar: Progress | None = None
        self.task = None
        if console.is_terminal:
            self.bar = Progress(
                TextColumn("[bold]prepare"), BarColumn(), DownloadColumn(), TextColumn("{task.fields[rates]}"),
                TextColumn("{task.fields[shards]}"), TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=False,
            )

    def rates(self, state: PrepareProgress) -> tuple[float, float]:
        dt = max(time.perf_counter() - self.t0, 1e-9)
        return (state.text_bytes - self.base.text_bytes) / dt / 1e6, (state.tokens - self.base.tokens) / dt

    def __call__(self, state: PrepareProgress) -> None:
        if self.base is None:  # the first report: what an earlier run left
            self.base = PrepareProgress(text_bytes=state.text_bytes, tokens=state.tokens)
            self.workers = state.workers
            if state.kept_shards:
                self.console.print(f"keeping {state.kept_shards} complete shard(s) of an earlier run: "
                                   f"{state.documents:,} documents, {state.tokens:,} tokens", highlight=False)
            if self.bar is not None:
                self.bar.start()
                self.task = self.bar.add_task("prepare", total=state.total_bytes, completed=state.source_bytes, rates="", shards="")
        mb_s, tok_s = self.rates(state)
        rates = f"{mb_s:,.1f} MB/s {tok_s:,.0f} tok/s"
        if self.bar is not None:
            self.bar.update(self.task, completed=state.source_bytes, rates=rates, shards=f"{state.shards} shards")
        elif time.perf_counter() - self.last_line >= LOG_EVERY_S:
            self.last_line = time.perf_counter()
            done = f"{state.source_bytes / state.total_bytes:.0%} of the source, " if state.total_bytes else ""
            self.console.print(f"prepare: {done}{state.documents:,} documents, {state.tokens:,} tokens, {state.shards} shards, "
                               f"{rates}, {time.perf_counter() - self.t0:,.0f} s", highlight=False, soft_wrap=True)

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()
