"""The attnlab command line: one Typer app, `--help` on every verb."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.panel import Panel
from rich.syntax import Syntax
from rich.markup import escape
from rich.table import Table

from attnlab.errors import AttnLabError, PreflightError

app = typer.Typer(
    name="attnlab",
    help="Pretrain, fine-tune, generate from and evaluate efficient-mixer language models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
err_console = Console(stderr=True)

CONFIG_ARG = typer.Argument(None, help="YAML run config. Omit for the built-in default (a small GLA model on Shakespeare, CPU, a few minutes).", show_default=False)
SET_OPT = typer.Option([], "--set", "-s", help="Override one config key, e.g. --set train.lr=1e-3 (repeatable).", metavar="KEY=VALUE")
RUN_DIR_OPT = typer.Option(None, "--run-dir", help="Run directory. Default: runs/<mixer>-<date>-<time>. Required with --resume.")


def _version(value: bool):
    if value:
        import attnlab

        console.print(f"attnlab {attnlab.__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit.")):
    """attnlab: pretrain, fine-tune, generate from and evaluate language models built on efficient token mixers."""


def _load(config: Optional[Path], overrides: list[str], run_dir: Optional[Path], resume: bool):
    from attnlab.config import load_config

    if resume and config is None:
        if run_dir is None:
            raise PreflightError("--resume needs --run-dir pointing at the run to continue")
        saved = run_dir / "config.yaml"
        if not saved.exists():
            raise PreflightError(f"nothing to resume: {run_dir} holds no run (no config.yaml). Start it without --resume.")
        return load_config(saved, overrides)
    return load_config(config, overrides)


def _print_report(report) -> None:
    if not report.problems:
        console.print("[green]preflight: no problems found[/green]")
        return
    for p in report.problems:
        mark = "[bold red]error  [/bold red]" if p.level == "error" else "[yellow]warning[/yellow]"
        console.print(f"preflight {mark} [bold]{p.key}[/bold]: {escape(p.message)}", soft_wrap=True, highlight=False)


def _fail_on_errors(report) -> None:
    if report.errors:
        n = len(report.errors)
        raise PreflightError(f"preflight found {n} error{'s' if n > 1 else ''} (listed above); nothing was started.")


@app.command()
def train(
    config: Optional[Path] = CONFIG_ARG,
    set_: list[str] = SET_OPT,
    run_dir: Optional[Path] = RUN_DIR_OPT,
    resume: bool = typer.Option(False, "--resume", help="Continue the run in --run-dir from its newest complete checkpoint. Refuses if there is none."),
):
    """Train a language model. With no argument: the built-in default on CPU."""
    from attnlab.config import config_to_yaml
    from attnlab.config.preflight import run_preflight
    from attnlab.train import run_training

    cfg = _load(config, set_, run_dir, resume)
    if run_dir is None:
        run_dir = Path("runs") / f"{cfg.model.mixer}-{time.strftime('%Y%m%d-%H%M%S')}"
    console.print(Panel(Syntax(config_to_yaml(cfg), "yaml", background_color="default"), title="resolved config", expand=False))
    report = run_preflight(cfg, run_dir, resume)
    _print_report(report)
    _fail_on_errors(report)
    stats = report.data.stats
    console.print(
        f"data: {stats['train_documents']} train / {stats['val_documents']} val documents, "
        f"{len(report.data.train):,} train blocks of {cfg.data.seq_len} tokens; "
        f"device {report.device}, precision {report.precision}"
    )
    if report.resume_from:
        console.print(f"resuming from [bold]{report.resume_from}[/bold]")
    console.print(f"run directory: [bold]{run_dir}[/bold]")
    result = run_training(cfg, run_dir, report, console)
    summary = Table(title="run finished", show_header=False)
    summary.add_row("steps", str(result.steps))
    summary.add_row("wall time", f"{result.wall_s:.1f} s")
    if result.val_loss is not None:
        summary.add_row("validation loss", f"{result.val_loss:.4f} nats/token")
        summary.add_row("validation bits per byte", f"{result.val_bpb:.3f}")
    summary.add_row("final model", str(run_dir / "final"))
    summary.add_row("run directory", str(run_dir))
    console.print(summary)
    if result.sample:
        console.print(Panel(cfg.train.sample_prompt + result.sample, title="sample continuation", expand=False), highlight=False)


@app.command()
def preflight(
    config: Optional[Path] = CONFIG_ARG,
    set_: list[str] = SET_OPT,
    run_dir: Optional[Path] = RUN_DIR_OPT,
    resume: bool = typer.Option(False, "--resume", help="Check the run as a resume of --run-dir."),
):
    """Check a run config (and its data, tokenizer and run directory) without training; exit 1 on any error."""
    from attnlab.config.preflight import run_preflight

    cfg = _load(config, set_, run_dir, resume)
    report = run_preflight(cfg, run_dir, resume)
    _print_report(report)
    _fail_on_errors(report)


def main() -> None:
    try:
        app()
    except AttnLabError as e:
        err_console.print(f"[bold red]error:[/bold red] {escape(str(e))}", highlight=False, soft_wrap=True)
        sys.exit(1)
    except KeyboardInterrupt:
        err_console.print("[yellow]interrupted.[/yellow] Continue with: attnlab train --resume --run-dir RUN")
        sys.exit(130)


if __name__ == "__main__":
    main()
