"""`attnlab report RUN_DIR...`: compare runs on one self-contained HTML page."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from attnlab.console import make_console
from attnlab.errors import AttnLabError

from .load import load_runs
from .recall import find_niah


def report(
    run_dirs: list[Path] = typer.Argument(..., metavar="RUN_DIR...", help="Run directories, or a sweep's output directory (all runs in it)."),
    out: Path = typer.Option(Path("report.html"), "--out", "-o", help="The HTML page; the loss plot goes to the same name .png, the table to .md."),
    title: Optional[str] = typer.Option(None, "--title", help="Page title. Default: 'attnlab report: N runs'."),
):
    """Compare runs: loss and bits per byte against steps, tokens and wall time, tokens/s, peak memory,
    eval metrics, config differences and samples, in one HTML page that needs no network. Needle-in-a-haystack
    evaluations (attnlab eval --task niah) show as heatmaps side by side; MQAR runs as accuracy against length."""
    from .render import write_report

    console = make_console()
    err_console = make_console(stderr=True)
    runs = load_runs(run_dirs)
    niah = find_niah(run_dirs)
    bad = [r for r in runs if r.error is not None]
    if len(bad) == len(runs) and not niah:
        raise AttnLabError("no run could be read: " + "; ".join(f"{r.path}: {r.error}" for r in bad))
    for r in bad:
        err_console.print(f"[yellow]warning:[/yellow] left out {escape(str(r.path))}: {escape(r.error)}", highlight=False, soft_wrap=True)
    readable = len(runs) - len(bad)
    paths = write_report(runs, out, title or f"attnlab report: {readable} runs" + (f", {len(niah)} niah evaluations" if niah else ""), niah=niah)
    console.print((paths["md"]).read_text(), highlight=False, markup=False)
    for kind, p in paths.items():
        console.print(f"{kind}: {escape(str(p))}", highlight=False)
