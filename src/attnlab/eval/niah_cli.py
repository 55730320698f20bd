"""`attnlab eval MODEL --task niah`: build the cases, load the model, answer, score, write metrics.json,
predictions.jsonl and heatmap.png, and say how far it has got while it runs (a bar on a terminal, a plain
line now and then in a log file)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Optional

from rich.table import Table

from attnlab.console import progress
from attnlab.errors import ConfigError
from attnlab.outputs import prepare_output_dir

from .niah import (
    grid, haystack_documents, length_label, make_cases, needle_form, parse_depths, parse_lengths, run_niah, short_name,
    write_niah_outputs,
)

NIAH_NAMES = ("niah", "needle", "needle-in-a-haystack")


def is_niah(task: Optional[str]) -> bool:
    return task is not None and task.strip().lower() in NIAH_NAMES


def cell_table(cells: list[dict]) -> Table:
    """Proportion correct: one row per depth, one column per length (as the heatmap)."""
    lengths, depths, acc = grid(cells)
    table = Table()
    table.add_column("depth")
    for n in lengths:
        table.add_column(length_label(n), justify="right")
    for i, d in enumerate(depths):
        table.add_row(f"{100 * d:g}%", *(f"{acc[i, j]:.2f}" if acc[i, j] == acc[i, j] else "" for j in range(len(lengths))))
    return table


def niah_command(model: str, data: Optional[Path], lengths: str, depths: str, samples: int, seed: int, needle: str,
                 batch_size: int, max_new_tokens: Optional[int], output_dir: Optional[Path], device: str,
                 trust_remote_code: bool, console, err_console) -> None:
    from attnlab.loading import describe, load

    length_list, depth_list = parse_lengths(lengths), parse_depths(depths)
    form = needle_form(needle)
    out = prepare_output_dir(output_dir or Path("eval") / f"niah-{time.strftime('%Y%m%d-%H%M%S')}")
    source = str(data) if data is not None else "shakespeare"
    documents, described = haystack_documents(source)  # a bad source fails before the model loads
    err_console.print(f"loading {describe(model)}", highlight=False)
    lm, tokenizer = load(model, device=device, trust_remote_code=trust_remote_code)
    limit = getattr(getattr(lm, "config", None), "max_position_embeddings", None)
    if isinstance(limit, int) and max(length_list) > limit:
        raise ConfigError(f"--lengths asks for {max(length_list)} tokens but the model is configured for {limit} positions "
                          f"(max_position_embeddings); ask for lengths of at most {limit}")
    t0 = time.perf_counter()
    cases = make_cases(tokenizer, documents, length_list, depth_list, samples, seed, form.name)
    build_s = time.perf_counter() - t0
    err_console.print(f"niah: {len(cases)} prompts ({len(length_list)} lengths x {len(depth_list)} depths x {samples} samples, "
                      f"{form.name} needle) from {described} in {build_s:.1f} s", highlight=False, soft_wrap=True)

    with progress(err_console, "niah", len(cases), "prompts") as advance:
        result = run_niah(lm, tokenizer, cases, batch_size=batch_size, max_new_tokens=max_new_tokens, progress=advance)
    result.data = described
    title = f"{short_name(model)} ({form.name} needle)"
    extra: dict[str, Any] = {
        "model": describe(model), "model_name": short_name(model), "needle": form.name, "lengths": length_list, "depths": depth_list, "samples": samples,
        "seed": seed, "batch_size": batch_size, "build_s": round(build_s, 2), "command": " ".join(sys.argv),
    }
    paths = write_niah_outputs(result, out, extra, title)
    console.print("niah: proportion correct by needle depth (rows) and context length (columns)", highlight=False)
    console.print(cell_table(result.metrics["cells"]))
    console.print(f"accuracy {result.metrics['accuracy']:.4f} over {result.metrics['examples']} prompts; "
                  f"generation {result.metrics['generation_s']:.1f} s", highlight=False)
    console.print("wrote " + ", ".join(f"[bold]{p}[/bold]" for p in paths.values()))
