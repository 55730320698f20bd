"""`attnlab data prepare SOURCE --out DIR`: tokenize a corpus once into memory-mapped shards."""

from __future__ import annotations

import os
import time
from pathlib import Path

import typer

from attnlab.config.schema import DataSection
from attnlab.console import console, err_console
from attnlab.data.prepare import DEFAULT_SHARD_TOKENS, prepare_corpus
from attnlab.data.prepare import Progress as PrepareProgress
from attnlab.data.progress import PrepareReporter


def prepare_command(
    source: str = typer.Argument(..., help="The corpus, as data.source takes it: a .txt/.jsonl/.json/.parquet file, a directory of them, a glob, "
                                           "a directory written by save_to_disk, hf://NAME from the local cache, or 'shakespeare'.", show_default=False),
    out: Path = typer.Option(..., "--out", "-o", help="Directory for the shards and manifest.json (created if missing). Run the same command "
                                                     "again to resume: complete shards are kept.", show_default=False),
    tokenizer: str = typer.Option("byte", "--tokenizer", "-t", help="'byte' for the built-in byte tokenizer, or a local tokenizer directory (save_pretrained)."),
    workers: int = typer.Option(max(1, min(8, os.cpu_count() or 1)), "--workers", "-w", min=1, help="Tokenizer processes (HF tokenizers); 1 tokenizes in this process, as the byte tokenizer always does (its encoding costs less than sending text to a worker).",
                                show_default="CPU cores, at most 8"),
    text_field: str = typer.Option("text", "--text-field", help="JSON field / Parquet or dataset column that holds the text."),
    val_fraction: float = typer.Option(DataSection.model_fields["val_fraction"].default, "--val-fraction",
                                       help="Fraction of the documents (whole documents, chosen by --seed) held out for validation, as "
                                            "`attnlab train` holds out of a plain corpus (data.val_fraction); 0 for none."),
    seed: int = typer.Option(0, "--seed", help="Seed of the validation split."),
    shard_tokens: int = typer.Option(DEFAULT_SHARD_TOKENS, "--shard-tokens", min=1, help="Tokens per shard, at least (a shard ends at a document boundary)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Delete the shards and manifest already in --out and start afresh (needed when the source or tokenizer changed)."),
):
    """Tokenize a corpus once into memory-mapped token shards (uint16 or uint32) with a document index and a manifest.

    Local files are read one at a time (JSON Lines line by line, Parquet by batches of rows); the built-in corpus, saved datasets and hf:// sources are still read whole. Interrupted? Run the same command again: complete shards are kept.
    """
    from rich.table import Table

    reporter = PrepareReporter(console)
    try:
        manifest = prepare_corpus(source, out, tokenizer, workers=workers, text_field=text_field, val_fraction=val_fraction,
                                  seed=seed, overwrite=overwrite, shard_tokens=shard_tokens, progress=reporter)
    except KeyboardInterrupt:
        reporter.stop()
        err_console.print("[yellow]interrupted.[/yellow] Complete shards are kept: run the same command again to continue.")
        raise typer.Exit(130) from None
    finally:
        reporter.stop()
    elapsed = time.perf_counter() - reporter.t0
    mb_s, tok_s = reporter.rates(PrepareProgress(text_bytes=manifest["text_bytes"], tokens=manifest["tokens"]))
    summary = Table(title="prepared corpus", show_header=False)
    summary.add_row("directory", str(out))
    summary.add_row("shards", f"{len(manifest['shards'])} ({manifest['dtype']})")
    summary.add_row("documents", f"{manifest['documents']:,} ({manifest['validation']['documents']:,} validation)")
    summary.add_row("tokens", f"{manifest['tokens']:,} ({manifest['validation']['tokens']:,} validation)")
    summary.add_row("tokenizer", f"{manifest['tokenizer']['name']} ({manifest['tokenizer']['vocab_size']:,} ids)")
    summary.add_row("time", f"{elapsed:.1f} s, {mb_s:,.1f} MB/s, {tok_s:,.0f} tokens/s ({reporter.workers} worker{'s' if reporter.workers > 1 else ''})")
    console.print(summary)
    if val_fraction > 0 and not manifest["validation"]["documents"]:
        err_console.print(f"[yellow]warning:[/yellow] --val-fraction {val_fraction} held out no document of {manifest['documents']}; "
                          "raise it for a validation split.", highlight=False, soft_wrap=True)
