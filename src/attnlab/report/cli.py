"""`attnlab report RUN_DIR...`: compare runs on one self-contained HTML page."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape


def report(
    run_dirs: list[Path] = typer.Argument(..., metavar="RUN_DIR...", help="Run directories, or a sweep's output directory (all runs in it)."),
    out: Path = typer.Option(Path("report.html"), "--out", "-o", help="The HTML page; the loss plot goes to the same name .png, the table to .md."),
    title: Optional[str] = typer.Option(None, "--title", help="Page title. Default: 'attnlab report: N runs'."),
):
    """Compare runs: loss and bits per byte against steps, tokens and wall time, tokens/s, peak memory,
    eval metrics, config differences and samples, in one HTML page that needs no network."""
    from .load import load_runs
    from .render import write_report

    console = Console()
    runs = load_runs(run_dirs)
    paths = write_report(runs, out, title or f"attnlab report: {len(runs)} runs")
    console.print((paths["md"]).read_text(), highlight=False, markup=False)
    for kind, p in paths.items():
        console.print(f"{kind}: {escape(str(p))}", highlight=False)
