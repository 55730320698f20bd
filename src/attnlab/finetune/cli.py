"""`attnlab finetune` and `attnlab merge`."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer
from rich.panel import Panel
from rich.syntax import Syntax
from rich.table import Table

from attnlab.console import make_console
from attnlab.errors import CheckpointError, PreflightError

from .config import finetune_config_to_yaml, load_finetune_config

console = make_console()


def finetune_command(
    config: Optional[Path] = typer.Argument(None, help="YAML fine-tuning config. Omit for the built-in style example (LoRA on SmolLM2-135M-Instruct with two style tokens).", show_default=False),
    set_: list[str] = typer.Option([], "--set", "-s", help="Override one config key, e.g. --set finetune.r=8 (repeatable).", metavar="KEY=VALUE"),
    run_dir: Optional[Path] = typer.Option(None, "--run-dir", help="Run directory. Default: runs/finetune-<date>-<time>."),
    merge: bool = typer.Option(False, "--merge", help="Also write a merged, standalone model to RUN/merged."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run in --run-dir from its newest complete checkpoint, with its own "
                                "config (--set may change only train.max_steps and cadence). Refuses if there is none."),
):
    """Fine-tune a causal LM (LoRA, DoRA, QLoRA or every parameter) on prompt–completion or chat data; writes an adapter directory."""
    from .run import run_finetune

    extra = ["finetune.merge=true"] if merge else []
    if run_dir is not None and run_dir.exists() and not run_dir.is_dir():
        raise PreflightError(f"--run-dir {run_dir} is a file; pass a directory (a new one, or a run to --resume)")
    if resume:
        if run_dir is None:
            raise PreflightError("--resume needs --run-dir pointing at the fine-tuning run to continue")
        saved = run_dir / "config.yaml"
        if not saved.is_file():
            raise PreflightError(f"nothing to resume: {run_dir} holds no fine-tuning run (no config.yaml). Start it without --resume.")
        cfg = load_finetune_config(config if config is not None else saved, list(set_) + extra)
    else:
        cfg = load_finetune_config(config, list(set_) + extra)
        run_dir = run_dir or Path("runs") / f"finetune-{time.strftime('%Y%m%d-%H%M%S')}"
        if (run_dir / "final").exists():
            raise PreflightError(f"{run_dir} already holds a finished fine-tuning run; choose another --run-dir "
                                 "(or continue it with --resume --set train.max_steps=N)")
        if (run_dir / "config.yaml").exists() or (run_dir / "checkpoints").exists():
            if not _failed_before_any_checkpoint(run_dir):
                raise PreflightError(f"{run_dir} already holds a fine-tuning run. Continue it with --resume, or choose another --run-dir.")
            console.print(f"[yellow]{run_dir} holds a run that failed before its first checkpoint; starting it again[/yellow]")
    console.print(Panel(Syntax(finetune_config_to_yaml(cfg), "yaml", background_color="default"), title="resolved config", expand=False))
    console.print(f"run directory: [bold]{run_dir}[/bold]")
    result = run_finetune(cfg, run_dir, console, resume=resume)
    r = result.report
    table = Table(title="fine-tuning finished", show_header=False)
    table.add_row("trainable parameters", f"{r['trainable_params']:,} of {r['total_params']:,} ({r['trainable_pct']:.3f}%)")
    table.add_row("examples (truncated, dropped)", f"{r['train_examples']} ({r['train_truncated']}, {r['train_dropped']})")
    table.add_row("steps", str(r.get("steps")))
    if r.get("eval"):
        table.add_row("eval", ", ".join(f"{k} {v:.4g}" for k, v in r["eval"].items() if isinstance(v, (int, float))))
    if r.get("best"):
        table.add_row("best checkpoint", f"{r['best']['checkpoint']} ({r['best']['metric']} {r['best']['value']:.4g})")
    if r.get("final_loss") is not None:
        at = r.get("final_loss_step")
        table.add_row("final train loss", f"{r['final_loss']:.4f}" + (f" (step {at})" if at is not None and at != r.get("steps") else ""))
    if r.get("val_loss") is not None:
        table.add_row("validation loss", f"{r['val_loss']:.4f}")
    table.add_row("tokens_per_s", f"{r.get('tokens_per_s', 0):,.0f}")
    table.add_row("peak_cpu_rss_mib", f"{r.get('peak_cpu_rss_mib')}")
    if "peak_gpu_mem_gib" in r:
        table.add_row("peak_gpu_mem_gib", f"{r['peak_gpu_mem_gib']}")
    if "style" in r:
        control = r.get("style_control") or {}
        for tok, mean in r["style"]["mean_new_tokens"].items():
            base = (control.get("mean_new_tokens") or {}).get(tok)
            shown = f"{mean:.1f}" if mean is not None else "-"
            table.add_row(f"mean new tokens {tok}", shown + (f" (untuned base: {base:.1f})" if base is not None else ""))
        if "style_separation" in r:
            line = f"{r['style_separation']:.2f}x ({r['style']['style_separation_of']})"
            if "style_separation_untuned" in r:
                line += f"; untuned base {r['style_separation_untuned']:.2f}x"
            table.add_row("style separation", line)
            table.add_row("style decoding", f"greedy, {r['style']['max_new_tokens']} new tokens at most for every style, stops at EOS")
    table.add_row("wall_s", f"{r['wall_s']:.1f}")
    table.add_row("model" if r.get("method") == "full" else "adapter", str(result.adapter_dir))
    if "merged_model" in r:
        table.add_row("merged model", r["merged_model"])
    console.print(table)


def _failed_before_any_checkpoint(run_dir: Path) -> bool:
    """Whether `run_dir` holds only a run that ended (failed, diverged, interrupted) before writing any checkpoint:
    there is nothing to resume, and starting it again loses nothing."""
    import json

    from attnlab.train.checkpoint import CheckpointManager

    try:
        status = json.loads((run_dir / "run.json").read_text()).get("status")
    except (OSError, ValueError, AttributeError):
        return False
    return status in ("failed", "diverged", "interrupted") and not CheckpointManager(run_dir).checkpoints()


def merge_command(
    adapter_dir: Path = typer.Argument(..., help="An adapter directory (RUN/final of attnlab finetune).", show_default=False),
    out: Path = typer.Argument(..., help="Where to write the merged, standalone model (a new directory).", show_default=False),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code", help="Allow the base model directory's own code to run."),
):
    """Fold an adapter into its base model and save the result as a standalone model."""
    from .adapter import is_adapter_dir, merge_adapter

    if not is_adapter_dir(adapter_dir):
        raise CheckpointError(f"{adapter_dir} is not an adapter directory (no attnlab_adapter.json); pass RUN/final of attnlab finetune")
    console.print(f"merged model written to [bold]{merge_adapter(adapter_dir, out, trust_remote_code)}[/bold]")
