"""`attnlab eval` and `attnlab score`: evaluate a model on a task, or score predictions made elsewhere."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Optional

import typer
from rich.table import Table

from attnlab.console import make_console, progress
from attnlab.errors import ConfigError
from attnlab.outputs import prepare_output_dir, write_text_atomic

from .lmeval import require_lm_eval, run_lm_eval
from .niah_cli import is_niah, niah_command
from .runner import evaluate, evaluate_perplexity, generation_config, resolve_data, score, write_outputs
from .tasks import get_task, task_name

console = make_console()
err_console = make_console(stderr=True)

TASK_HELP = "spider (text-to-SQL), dart (data-to-text), samsum (summarisation), perplexity or niah (needle in a haystack)."
DATA_HELP = ("The task's data in its official layout: a Spider directory; a DART or SAMSum JSON file or directory; "
             "for perplexity a text file or a training config .yaml (its validation split); for niah the haystack text "
             "(any data.source, or a training config .yaml). Omit for the bundled fixture (niah: the built-in plays).")


def _template(value: Optional[str]) -> Optional[str]:
    if value is None:
        return None
    path = Path(value)
    if len(value) < 4096 and "\n" not in value and "{" not in value and path.is_file():
        return path.read_text(encoding="utf-8-sig")
    return value.replace("\\n", "\n")


def _summary(title: str, metrics: dict[str, Any]) -> Table:
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in metrics.items():
        if isinstance(value, float):
            shown = f"{value:.4f}"
        elif value is None:
            shown = "n/a"
        else:
            shown = str(value)
        table.add_row(key, shown)
    return table


def _default_out(task: str) -> Path:
    return Path("eval") / f"{task}-{time.strftime('%Y%m%d-%H%M%S')}"


def eval_command(
    model: str = typer.Argument(..., help="A run directory, a checkpoint, an HF model directory, a .gguf file or an adapter directory.", show_default=False),
    task: Optional[str] = typer.Option(None, "--task", "-t", help=TASK_HELP, show_default=False),
    data: Optional[Path] = typer.Option(None, "--data", "-d", help=DATA_HELP, show_default=False),
    split: str = typer.Option("dev", "--split", help="Split to evaluate: dev, test or train."),
    limit: Optional[int] = typer.Option(None, "--limit", "-n", min=1, help="Evaluate the first N examples (perplexity: N windows)."),
    output_dir: Optional[Path] = typer.Option(None, "--output-dir", "-o", help="Where metrics.json and predictions.jsonl go. Default: eval/<task>-<date>-<time>."),
    template: Optional[str] = typer.Option(None, "--template", help="Prompt template (a string with \\n escapes, or a file), e.g. '{schema}\\n-- {question}\\nSELECT'."),
    chat: bool = typer.Option(False, "--chat", help="Wrap each prompt as a user message with the tokenizer's chat template."),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", help="Tokens generated per example, at most [default: the task's]."),
    min_new_tokens: Optional[int] = typer.Option(None, "--min-new-tokens", help="EOS is suppressed until this many tokens [default: 0]."),
    num_beams: Optional[int] = typer.Option(None, "--num-beams", help="Beam search with N beams [default: 1]."),
    length_penalty: Optional[float] = typer.Option(None, "--length-penalty", help="Beam score = log p / length ** this [default: 1.0]."),
    do_sample: Optional[bool] = typer.Option(None, "--do-sample/--greedy", help="Sample instead of greedy decoding [default: greedy]."),
    temperature: Optional[float] = typer.Option(None, "--temperature", help="Sampling temperature [default: 1.0]."),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="Sample among the k most likely tokens [default: off]."),
    top_p: Optional[float] = typer.Option(None, "--top-p", help="Nucleus sampling mass [default: 1.0 = off]."),
    repetition_penalty: Optional[float] = typer.Option(None, "--repetition-penalty", help="> 1 discourages repeats [default: 1.0]."),
    stop: list[str] = typer.Option([], "--stop", help="A string that ends generation (repeatable) [default: the task's]."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed of the sampler; niah: of the cases [default: 0]."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", help="Examples decoded (or windows scored) together [default: 8]."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", help="Perplexity: tokens per window [default: the config's seq_len, else min(1024, the model's limit)]."),
    lm_eval: Optional[str] = typer.Option(None, "--lm-eval", help="Run lm-evaluation-harness tasks (comma-separated) on the model instead; needs the lmeval extra.", show_default=False),
    lm_eval_include: Optional[Path] = typer.Option(None, "--lm-eval-include", help="Directory of local lm-eval task YAMLs.", show_default=False),
    lengths: str = typer.Option("1k,2k,4k", "--lengths", help="niah: prompt lengths in tokens of the model's tokenizer (k = 1024)."),
    depths: str = typer.Option("0,0.25,0.5,0.75,1", "--depths", help="niah: needle depths, 0 = the haystack's start, 1 = its end."),
    samples: int = typer.Option(10, "--samples", min=1, help="niah: prompts per length and depth."),
    needle: str = typer.Option("magic", "--needle", help="niah: 'magic' (the special magic number for a key) or 'passkey'."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda."),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code", help="Allow a model directory's own Python code to run."),
):
    """Evaluate a model on text-to-SQL, data-to-text, summarisation, perplexity or needle in a haystack; write metrics.json and predictions.jsonl (niah: and heatmap.png)."""
    from attnlab.loading import describe, load

    if output_dir is not None:
        prepare_output_dir(output_dir)  # before the model loads: no compute spent on results that cannot be written
    if lm_eval is not None:
        return _lm_eval(model, lm_eval, lm_eval_include, limit, output_dir, batch_size or 8, device, trust_remote_code)
    if task is None:
        raise ConfigError("give --task (spider, dart, samsum, perplexity or niah), or --lm-eval TASKS")

    if is_niah(task):
        if do_sample or (num_beams or 1) > 1:
            raise ConfigError("niah answers by greedy decoding, as the published results do: drop --do-sample and --num-beams")
        return niah_command(model, data, lengths, depths, samples, seed or 0, needle, batch_size or 8, max_new_tokens,
                            output_dir, device, trust_remote_code, console, err_console)
    name = task_name(task)
    settings = {k: v for k, v in dict(
        max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens, num_beams=num_beams, length_penalty=length_penalty,
        do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty,
        seed=seed, batch_size=batch_size,
    ).items() if v is not None}
    if stop:
        settings["stop"] = list(stop)
    where = resolve_data(name, data)
    if data is None:
        err_console.print(f"[yellow]no --data: using the bundled {name} fixture {where}[/yellow]", highlight=False)
    # Data, template and settings are checked before the model loads.
    if name == "perplexity":
        from .tasks.perplexity import load_texts

        load_texts(where, split)
        task_obj, examples, total = None, None, None
    else:
        task_obj = get_task(name, _template(template))
        examples = task_obj.load(where, split, limit)
        cfg = generation_config(task_obj, settings)
        total = len(examples)
    err_console.print(f"loading {describe(model)}", highlight=False)
    lm, tokenizer = load(model, device=device, trust_remote_code=trust_remote_code)
    # a bar on a terminal; in a log file a line at the start, every few seconds and at the end
    with progress(err_console, name, total, "windows scored" if task_obj is None else "examples generated") as advance:
        if task_obj is None:
            result = evaluate_perplexity(lm, tokenizer, where, split, limit, seq_len=seq_len, batch_size=batch_size or 8, progress=advance)
        else:
            result = evaluate(lm, tokenizer, task_obj, examples=examples, generation=cfg, chat=chat, progress=advance)
    result.data = str(where)
    extra: dict[str, Any] = {"model": describe(model), "split": split, "limit": limit, "command": " ".join(sys.argv)}
    if task_obj is not None:
        extra["generation"] = cfg.model_dump()
        extra["template"] = task_obj.template
    out = output_dir or _default_out(name)
    metrics_path, predictions_path = write_outputs(result, out, extra)
    console.print(f"{name} ({split}) on {where}", highlight=False)
    console.print(_summary(f"{name} ({split})", result.metrics))
    console.print(f"wrote [bold]{metrics_path}[/bold]" + (f" and [bold]{predictions_path}[/bold]" if result.records else ""))


def _lm_eval(model: str, tasks: str, include: Optional[Path], limit: Optional[int], output_dir: Optional[Path],
             batch_size: int, device: str, trust_remote_code: bool) -> None:
    from attnlab.loading import describe, load

    names = [t.strip() for t in tasks.split(",") if t.strip()]
    if not names:
        raise ConfigError("--lm-eval needs at least one task name, e.g. --lm-eval hellaswag,arc_easy")
    require_lm_eval()
    if include is not None and not include.is_dir():
        raise ConfigError(f"--lm-eval-include {include} is not a directory of task YAMLs")
    lm, tokenizer = load(model, device=device, trust_remote_code=trust_remote_code)
    metrics = run_lm_eval(lm, tokenizer, names, limit=limit, include_path=str(include) if include else None, batch_size=batch_size)
    out = prepare_output_dir(output_dir or _default_out("lmeval"))
    write_text_atomic(out / "metrics.json", json.dumps({"task": "lmeval", "tasks": names, "model": describe(model), "metrics": metrics}, indent=1) + "\n",
                      what="the eval output")
    console.print(_summary("lm-evaluation-harness", metrics))
    console.print(f"wrote [bold]{out / 'metrics.json'}[/bold]")


def score_command(
    task: str = typer.Option(..., "--task", "-t", help="spider, dart or samsum.", show_default=False),
    predictions: Path = typer.Option(..., "--predictions", "-p", help="One prediction per line in the data's order, or JSONL with \"id\" and \"prediction\".", show_default=False),
    data: Optional[Path] = typer.Option(None, "--data", "-d", help=DATA_HELP, show_default=False),
    split: str = typer.Option("dev", "--split", help="Split the predictions are for."),
    limit: Optional[int] = typer.Option(None, "--limit", "-n", min=1, help="The predictions cover the first N examples."),
    output_dir: Optional[Path] = typer.Option(None, "--output-dir", "-o", help="Also write metrics.json and predictions.jsonl (with per-example scores) here."),
):
    """Score predictions made elsewhere with attnlab's scorer, for comparison on identical scoring."""
    name = task_name(task)
    if name == "perplexity":
        raise ConfigError("perplexity scores a model, not predictions; use attnlab eval MODEL --task perplexity")
    if output_dir is not None:
        prepare_output_dir(output_dir)
    where = resolve_data(name, data)
    result = score(name, predictions, where, split, limit)
    result.data = str(where)
    console.print(f"{name} ({split}): {predictions} scored on {where}", highlight=False)
    console.print(_summary(f"{name} ({split})", result.metrics))
    if output_dir is not None:
        metrics_path, _ = write_outputs(result, output_dir, {"predictions": str(predictions), "split": split, "limit": limit})
        console.print(f"wrote [bold]{metrics_path}[/bold]")
