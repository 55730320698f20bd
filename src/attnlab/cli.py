"""The attnlab command line: one Typer app, `--help` on every verb."""

from __future__ import annotations

import json
import os
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

import attnlab
import attnlab.bench.data as bench_data
import attnlab.bench.scale as bench_scale
from attnlab.config import GenerateConfig, config_to_yaml, load_config
from attnlab.config.loader import validate_section
from attnlab.config.presets import settings_for_prompt
from attnlab.console import console, err_console, make_console
from attnlab.data.corpus import jsonl_records, text_lines
from attnlab.errors import AttnLabError, CheckpointError, DataError, PreflightError
from attnlab.finetune.presets import generate_with_presets
from attnlab.launch import rank, world_size
from attnlab.noise import held_until_done, silence
from attnlab.outputs import prepare_output_file, write_text_atomic

app = typer.Typer(
    name="attnlab",
    help="Pretrain, fine-tune, generate from and evaluate efficient-mixer language models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
CONFIG_ARG = typer.Argument(None, help="YAML run config. Omit for the built-in default (a small GLA model on Shakespeare, CPU, a few minutes).", show_default=False)
SET_OPT = typer.Option([], "--set", "-s", help="Override one config key, e.g. --set train.lr=1e-3 (repeatable).", metavar="KEY=VALUE")
RUN_DIR_OPT = typer.Option(None, "--run-dir", help="Run directory. Default: runs/<mixer>-<date>-<time>. Required with --resume.")


def _version(value: bool):
    if value:
        console.print(f"attnlab {attnlab.__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit.")):
    """attnlab: pretrain, fine-tune, generate from and evaluate language models built on efficient token mixers."""


def _load(config: Optional[Path], overrides: list[str], run_dir: Optional[Path], resume: bool):
    if resume and config is None:
        if run_dir is None:
            raise PreflightError("--resume needs --run-dir pointing at the run to continue")
        saved = run_dir / "config.yaml"
        if not saved.exists():
            raise PreflightError(f"nothing to resume: {run_dir} holds no run (no config.yaml). Start it without --resume.")
        return load_config(saved, overrides)
    return load_config(config, overrides)


def _print_report(report) -> None:
    for note in getattr(report, "notes", []):
        console.print(f"preflight [cyan]note   [/cyan] {escape(note)}", soft_wrap=True, highlight=False)
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
    from attnlab.train.rundir import RunLock

    lock = None
    if run_dir is not None and rank() == 0:
        lock = RunLock(run_dir).acquire()  # one process per run directory; a second one is refused here, naming the holder
    try:
        cfg = _load(config, set_, run_dir, resume)
        if run_dir is None:
            if world_size() > 1:
                raise PreflightError("under torchrun, pass --run-dir: every process must write to the same run")
            run_dir = Path("runs") / f"{cfg.model.mixer}-{time.strftime('%Y%m%d-%H%M%S')}"
            if rank() == 0:
                lock = RunLock(run_dir).acquire()
        result = _train(cfg, run_dir, resume)
    finally:
        if lock is not None:
            lock.release()
    summary = Table(title="run finished", show_header=False)
    summary.add_row("steps", str(result.steps))
    if result.parameters is not None:
        summary.add_row("parameters", f"{result.parameters:,}")
    if result.segment_wall_s is not None and abs(result.segment_wall_s - result.wall_s) > 0.05:
        summary.add_row("wall time", f"{result.wall_s:.1f} s in all ({result.segment_wall_s:.1f} s in this segment)")
    else:
        summary.add_row("wall time", f"{result.wall_s:.1f} s")
    if result.val_loss is not None:
        summary.add_row("validation loss", f"{result.val_loss:.4f} nats/token")
        summary.add_row("validation bits per byte", f"{result.val_bpb:.3f}")
    summary.add_row("final model", str(run_dir / "final"))
    summary.add_row("run directory", str(run_dir))
    console.print(summary)
    if result.sample:
        console.print(Panel(cfg.train.sample_prompt + result.sample, title="sample continuation", expand=False), highlight=False)


def _train(cfg, run_dir: Path, resume: bool):
    """Preflight, then training, in a run directory this process holds."""
    from attnlab.train import run_training
    from attnlab.train.preflight import run_preflight

    console.quiet = rank() != 0  # one voice under torchrun
    console.print(Panel(Syntax(config_to_yaml(cfg), "yaml", background_color="default"), title="resolved config", expand=False))
    report = run_preflight(cfg, run_dir, resume, check_run_dir=rank() == 0, console=console)
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
    console.print(f"run directory: [bold]{run_dir}[/bold]" + (f" ({world_size()} processes)" if world_size() > 1 else ""))
    try:
        return run_training(cfg, run_dir, report, console)
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


@app.command()
def preflight(
    config: Optional[Path] = CONFIG_ARG,
    set_: list[str] = SET_OPT,
    run_dir: Optional[Path] = RUN_DIR_OPT,
    resume: bool = typer.Option(False, "--resume", help="Check the run as a resume of --run-dir."),
):
    """Check a run config (and its data, tokenizer and run directory) without training; exit 1 on any error."""
    from attnlab.train.preflight import run_preflight

    cfg = _load(config, set_, run_dir, resume)
    report = run_preflight(cfg, run_dir, resume, console=console)
    _print_report(report)
    _fail_on_errors(report)


@app.command()
def convert(
    src: Path = typer.Argument(..., help="Checkpoint directory: fla GLA / Mamba2 / NSA / forgetting transformer, HF Mamba2ForCausalLM, a 2Mamba study model, or (with --to fla) an attnlab model.", show_default=False),
    out: Path = typer.Argument(..., help="Output directory (must not exist).", show_default=False),
    to: str = typer.Option("attnlab", "--to", help="attnlab: an attnlab model directory with the same outputs; fla: the fla checkpoint of an attnlab model whose mixer matches an fla architecture."),
):
    """Convert a checkpoint into an attnlab model (or an attnlab model into fla's format), weights mapped one to one."""
    from attnlab.models.convert import convert as to_attnlab
    from attnlab.models.convert import export_fla

    if to not in ("attnlab", "fla"):
        raise CheckpointError(f"--to must be attnlab or fla, not {to!r}")
    what = to_attnlab(src, out) if to == "attnlab" else export_fla(src, out)
    console.print(f"{what}: wrote {out}", highlight=False)


def _check_text(prompt: str, where: str) -> None:
    """Refuse a prompt that is not text: a lone surrogate (a JSON escape such as \\ud800, or an argument whose bytes
    were not UTF-8) cannot be encoded, so no tokenizer can read it."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        raise DataError(f"{where}: the prompt holds a lone surrogate ({prompt[e.start]!r} at character {e.start}), which is "
                        "not text; write the character itself, or save the prompt as UTF-8") from None


def _read_prompts(path: Path) -> list[dict]:
    if not path.is_file():
        raise DataError(f"prompt file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
                        "save the prompts as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None
    except OSError as e:
        raise DataError(f"cannot read the prompt file {path}: {e.strerror or e}") from None
    rows = []
    if path.suffix in (".jsonl", ".json"):
        for n, row in jsonl_records(text, path):
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise DataError(f'{path}, line {n}: expected an object with a "prompt" string, e.g. {{"id": 1, "prompt": "..."}}')
            _check_text(row["prompt"], f"{path}, line {n}")
            rows.append(row)
    else:
        rows = [{"prompt": line} for line in text_lines(text) if line.strip()]
    if not rows:
        raise DataError(f"{path} holds no prompts")
    return rows


@app.command()
def generate(
    model: str = typer.Argument(..., help="A run directory, a checkpoint, an HF model directory or a .gguf file.", show_default=False),
    prompt: list[str] = typer.Option([], "--prompt", "-p", help="A prompt (repeatable)."),
    input_file: Optional[Path] = typer.Option(None, "--input", "-i", help="Prompts: JSONL with a \"prompt\" field (and optional \"id\"), or a text file, one per line."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Write results as JSONL here."),
    chat: bool = typer.Option(False, "--chat", help="Wrap each prompt as a user message with the tokenizer's chat template."),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", help="Tokens generated after the prompt, at most [default: 64]."),
    min_new_tokens: Optional[int] = typer.Option(None, "--min-new-tokens", help="EOS is suppressed until this many tokens [default: 0]."),
    num_beams: Optional[int] = typer.Option(None, "--num-beams", help="Beam search with N beams [default: 1]."),
    length_penalty: Optional[float] = typer.Option(None, "--length-penalty", help="Beam score = log p / length ** this [default: 1.0]."),
    early_stopping: Optional[str] = typer.Option(None, "--early-stopping", help="Beam search stopping: true, false or never [default: false]."),
    do_sample: Optional[bool] = typer.Option(None, "--do-sample/--greedy", help="Sample instead of greedy decoding."),
    temperature: Optional[float] = typer.Option(None, "--temperature", help="Sampling temperature [default: 1.0]."),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="Sample among the k most likely tokens [default: off]."),
    top_p: Optional[float] = typer.Option(None, "--top-p", help="Nucleus sampling mass [default: 1.0 = off]."),
    repetition_penalty: Optional[float] = typer.Option(None, "--repetition-penalty", help="> 1 discourages repeats [default: 1.0]."),
    stop: list[str] = typer.Option([], "--stop", help="A string that ends generation (repeatable)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed of the sampler [default: 0]."),
    num_return_sequences: Optional[int] = typer.Option(None, "--num-return-sequences", help="Candidates per prompt [default: 1]."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", help="Prompts decoded together [default: 8]."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda."),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code", help="Allow a model directory's own Python code to run."),
):
    """Generate text from a model: greedy, sampling or beam search."""
    # Everything that can be refused is checked before torch and transformers are imported (seconds of imports).

    if not prompt and input_file is None:
        raise PreflightError("give at least one --prompt or an --input file")
    settings = {k: v for k, v in dict(
        max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens, num_beams=num_beams, length_penalty=length_penalty,
        early_stopping=_parse_early_stopping(early_stopping), do_sample=do_sample, temperature=temperature, top_k=top_k,
        top_p=top_p, repetition_penalty=repetition_penalty, seed=seed, num_return_sequences=num_return_sequences, batch_size=batch_size,
    ).items() if v is not None}
    if stop:
        settings["stop"] = list(stop)
    cfg = validate_section(GenerateConfig, settings, "generation settings")  # impossible settings fail here, before any import
    for n, p in enumerate(prompt, start=1):
        _check_text(p, f"--prompt {n}")
    rows = [{"prompt": p} for p in prompt] + (_read_prompts(input_file) if input_file else [])
    if output is not None:
        prepare_output_file(output)  # before the model loads: no compute spent on results that cannot be written
    from attnlab.generation import generate as run_generate
    from attnlab.loading import describe, load

    err_console.print(f"loading {describe(model)}", highlight=False)
    lm, tokenizer = load(model, device=device, trust_remote_code=trust_remote_code)
    presets = getattr(lm, "attnlab_generation_presets", None) or {}  # per-control-token settings of a fine-tuned adapter
    chat = chat or bool(getattr(lm, "attnlab_chat_template", False))
    if presets:
        cfg = settings_for_prompt(rows[0]["prompt"], presets, settings) if len(rows) == 1 else cfg
    prompts = [_chat_ids(tokenizer, r["prompt"]) if chat else r["prompt"] for r in rows]
    single = len(rows) == 1 and cfg.num_beams == 1 and cfg.num_return_sequences == 1 and output is None
    if single:
        console.print(rows[0]["prompt"], style="dim", end="" if not chat else "\n", highlight=False, soft_wrap=True)
        with held_until_done():  # library warnings after the answer, never between its words
            result = run_generate(lm, tokenizer, prompts, cfg, stream=lambda piece: console.print(piece, end="", highlight=False, markup=False, soft_wrap=True))
            console.print()
        err_console.print(f"[dim]finish: {result[0].finish_reason}, {len(result[0].token_ids)} tokens[/dim]")
        return
    from rich.progress import Progress

    with Progress(console=err_console, transient=True) as bar:
        task = bar.add_task("generating", total=len(rows))
        if presets:
            results = generate_with_presets(lm, tokenizer, [r["prompt"] for r in rows], presets, explicit=settings, chat=chat)
            bar.advance(task, len(rows))
        else:
            results = run_generate(lm, tokenizer, prompts, cfg, progress=lambda n: bar.advance(task, n))
    records = []
    for row, res in zip(rows, results):
        rec = {**row, "text": res.text, "token_ids": res.token_ids, "finish_reason": res.finish_reason}
        if res.score is not None:
            rec["score"] = res.score
        if len(res.candidates) > 1:
            rec["candidates"] = [{"text": c.text, "finish_reason": c.finish_reason, "score": c.score} for c in res.candidates]
        records.append(rec)
    if output is not None:
        write_text_atomic(output, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        console.print(f"wrote {len(records)} results to [bold]{output}[/bold]")
    else:
        for rec in records:
            console.print(Panel(escape(rec["text"]), title=escape(rec["prompt"][:60]), subtitle=rec["finish_reason"], expand=False), highlight=False)


def _parse_early_stopping(value: Optional[str]):
    if value is None:
        return None
    v = value.strip().lower()
    if v in ("true", "1", "yes"):
        return True
    if v in ("false", "0", "no"):
        return False
    if v == "never":
        return "never"
    raise PreflightError(f"--early-stopping takes true, false or never, not {value!r}")


def _chat_ids(tokenizer, text: str) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise PreflightError("--chat needs a tokenizer with a chat template; this one has none")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


from attnlab.eval.cli import eval_command, score_command  # noqa: E402
app.command("eval")(eval_command)
app.command("score")(score_command)
from attnlab.report.cli import report as _report_cmd  # noqa: E402
from attnlab.sweep.cli import sweep as _sweep_cmd  # noqa: E402

app.command("sweep")(_sweep_cmd)
app.command("report")(_report_cmd)


from attnlab.finetune.cli import finetune_command, merge_command  # noqa: E402
app.command("finetune")(finetune_command)
app.command("merge")(merge_command)
from attnlab.data.cli import prepare_command  # noqa: E402

data_app = typer.Typer(help="Data: tokenize corpora once into memory-mapped shards.", no_args_is_help=True)
app.add_typer(data_app, name="data")
data_app.command("prepare")(prepare_command)
bench_app = typer.Typer(help="Benchmarks: throughput and memory against peers.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")


def _print_table(grid: Table) -> None:
    """A table on the terminal as wide as the terminal; in a log file 200 columns wide, so that it keeps whole
    lines (`console.print(width=...)` can only narrow the console's 80 columns there)."""
    wide = console if console.is_terminal else Console(width=max(console.width, 200))
    wide.print(grid)


@bench_app.command("decode")
def bench_decode_cmd(
    model: Optional[str] = typer.Argument(None, help="A model (as for generate). Omit for the default config's architecture, randomly initialised.", show_default=False),
    batch_size: list[int] = typer.Option([1, 8], "--batch-size", "-b", help="Batch sizes to time (repeatable)."),
    prompt_len: int = typer.Option(64, "--prompt-len", help="Prompt tokens."),
    new_tokens: int = typer.Option(128, "--new-tokens", help="Tokens generated per row."),
    repeats: int = typer.Option(3, "--repeats", help="Timed runs per setting (median reported)."),
    hf: bool = typer.Option(True, "--hf/--no-hf", help="Also time HF generate on the same model."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda."),
    arch: Optional[str] = typer.Option(None, "--arch", help="Instead of MODEL: a randomly initialised attnlab-gla, fla-gla or hf-llama of the size below (bf16 on CUDA)."),
    hidden: int = typer.Option(1024, "--hidden", help="With --arch: hidden size."),
    layers: int = typer.Option(24, "--layers", help="With --arch: layers."),
    heads: int = typer.Option(4, "--heads", help="With --arch: heads."),
    vocab: int = typer.Option(32000, "--vocab", help="With --arch: vocabulary."),
    hf_arch: Optional[str] = typer.Option(None, "--hf-arch", help="Time HF generate on this randomly initialised architecture of the same size instead (e.g. fla-gla)."),
    hf_repeats: Optional[int] = typer.Option(None, "--hf-repeats", help="Timed HF generate runs (default: --repeats)."),
    beams: int = typer.Option(1, "--beams", help="> 1: also time beam search with this many beams against greedy over batch x beams rows."),
    mixer_option: Optional[list[str]] = typer.Option(None, "--mixer-option", show_default=False, help=(
        "With --arch: MIXER.OPTION=VALUE over a mixer's or preset's defaults (repeatable), e.g. 2mamba.state_dtype=bfloat16.")),
    profile: bool = typer.Option(False, "--profile", help="On CUDA: also count the kernels of one decode step and their GPU time, by category."),
    out: Optional[Path] = typer.Option(None, "--out", help="Write the results as JSON here, and a PNG plot beside it (same name, .png)."),
):
    """Time decoding (new tokens/s) with attnlab's engine and with HF generate; optionally beam search against greedy."""
    import platform

    import torch

    from attnlab.bench.decode import bench_decode

    if arch is not None:
        from attnlab.bench.decode import IdTokenizer
        from attnlab.bench.train import build

        torch.manual_seed(0)
        target = "cuda" if torch.cuda.is_available() and device != "cpu" else "cpu"
        from attnlab.bench.zoo import mixer_options

        lm = build(arch, hidden, layers, heads, vocab, mixer_options=mixer_options(mixer_option or []))
        lm = lm.to(target, torch.bfloat16 if target == "cuda" else torch.float32).eval()
        tokenizer = IdTokenizer(vocab)
        name = f"{arch} {hidden}x{layers} (untrained)" + "".join(f" {o}" for o in mixer_option or [])
    elif model is None:
        from attnlab.data import load_tokenizer
        from attnlab.models import AttnLabForCausalLM
        from attnlab.train.build import model_config_from

        tokenizer = load_tokenizer("byte")
        torch.manual_seed(0)
        lm = AttnLabForCausalLM(model_config_from(load_config(), tokenizer))
        lm = lm.to("cuda" if (device == "auto" and torch.cuda.is_available()) or device == "cuda" else "cpu").eval()
        name = "default config (untrained)"
    else:
        from attnlab.loading import describe, load

        lm, tokenizer = load(model, device=device)
        name = describe(model)
    hf_model = None
    if hf_arch is not None:
        from attnlab.bench.train import build

        torch.manual_seed(0)
        param = next(lm.parameters())
        hf_model = build(hf_arch, hidden, layers, heads, vocab).to(param.device, param.dtype).eval()
        name += f"; HF generate on {hf_arch} {hidden}x{layers}"
    rows = bench_decode(lm, tokenizer, batch_size, prompt_len, new_tokens, repeats, compare_hf=hf, hf_model=hf_model, beams=beams,
                        hf_repeats=hf_repeats, profile=profile)
    dev = torch.cuda.get_device_name() if next(lm.parameters()).is_cuda else f"cpu ({torch.get_num_threads()} threads)"
    table = Table(title=f"decode: {name} on {dev}")
    headers = {"batch": "batch", "prompt_len": "prompt", "new_tokens": "new", "attnlab_s": "attnlab s", "attnlab_new_tok_per_s": "attnlab tok/s",
               "hf_generate_s": "HF s", "hf_generate_new_tok_per_s": "HF tok/s", "speedup": "speedup", "beams": "beams",
               "greedy_rows_x_beams_s": "greedy BxN s", "beam_s": "beam s", "beam_cost_ratio": "beam/greedy",
               "graph_step_ms": "graph step ms", "engine_step_ms": "engine ms/step", "step_kernels": "kernels/step",
               "step_kernel_ms": "kernel ms/step",
               "prefill_ms": "prefill ms", "peak_gib": "peak GiB"}
    columns = [col for col in rows[0] if col != "step_profile"]
    for col in columns:
        table.add_column(headers.get(col, col), justify="right")
    for r in rows:
        table.add_row(*(str(r.get(col)) for col in columns))
    console.print(table)
    for r in rows:
        if "step_profile" in r:
            prof = r["step_profile"]
            console.print(f"decode step, batch {r['batch']}: {prof['kernels']} kernels, {prof['gpu_ms']} ms GPU: {prof['by_category_ms']}", highlight=False)
            for kname, ms in prof["top_kernels_ms"]:
                console.print(f"    {ms:8.3f} ms  {kname}", highlight=False)
    if out is not None:
        write_text_atomic(prepare_output_file(out, "--out"), json.dumps({
            "model": name, "device": dev, "torch": torch.__version__, "python": platform.python_version(),
            "command": " ".join(["attnlab", *sys.argv[1:]]), "results": rows}, indent=1), what="--out")
        from attnlab.bench.plot import plot_decode

        console.print(f"wrote {out} and {plot_decode(rows, out.with_suffix('.png'), dev)}")


@bench_app.command("train")
def bench_train_cmd(
    models: list[str] = typer.Option(["attnlab-gla", "fla-gla", "hf-llama"], "--model", "-m", help="attnlab-gla (its step captured as CUDA graphs, as `attnlab train` runs it), attnlab-gla-eager, fla-gla, hf-llama (repeatable); also attnlab-<mixer> for any mixer and the other peers of `bench zoo`."),
    hidden: int = typer.Option(1024, "--hidden", help="Hidden size."),
    layers: int = typer.Option(24, "--layers", help="Decoder layers."),
    heads: int = typer.Option(4, "--heads", help="Heads."),
    vocab: int = typer.Option(32000, "--vocab", help="Vocabulary size."),
    intermediate: Optional[int] = typer.Option(None, "--intermediate", min=1, help="SwiGLU width (default: fla's for the hidden size)."),
    shape: list[str] = typer.Option(["8x2048"], "--shape", help="BATCHxSEQ_LEN to time (repeatable)."),
    steps: int = typer.Option(10, "--steps", help="Timed steps (median reported)."),
    warmup: int = typer.Option(3, "--warmup", help="Untimed steps first (fla autotunes here)."),
    profile: bool = typer.Option(False, "--profile", help="Also profile one step: GPU time per kernel category and the top kernels."),
    saved: bool = typer.Option(False, "--saved", help="Also list what one forward keeps for the backward, largest first (where the activation memory goes)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Write the results as JSON here, and a PNG plot beside it (same name, .png)."),
):
    """Training tokens/s and peak memory on CUDA: attnlab GLA against fla's GLA and HF Llama (SDPA), one process."""
    import platform

    import torch

    from attnlab.bench.train import bench_train

    if not torch.cuda.is_available():
        raise PreflightError("bench train measures CUDA training; no CUDA device is visible")
    rows = []
    for spec in shape:
        try:
            batch, seq_len = (int(v) for v in spec.lower().split("x"))
        except ValueError:
            raise PreflightError(f"--shape takes BATCHxSEQ_LEN such as 8x2048, not {spec!r}") from None
        for name in models:
            row = bench_train(name, hidden, layers, heads, vocab, batch, seq_len, steps=steps, warmup=warmup, profile=profile,
                              intermediate=intermediate)
            if saved:
                from attnlab.bench.train import saved_for_backward

                row["saved"] = saved_for_backward(name, hidden, layers, heads, vocab, batch, seq_len, intermediate=intermediate)
            console.print({k: v for k, v in row.items() if k not in ("profile", "saved")}, highlight=False)
            if "saved" in row:
                console.print(f"  saved for backward: {row['saved']['saved_gib']} GiB; largest (module, shape, dtype, tensors, GiB):", highlight=False)
                for entry in row["saved"]["largest"]:
                    console.print(f"    {entry}", highlight=False, soft_wrap=True)
            if "profile" in row:
                console.print(f"  profile ({row['profile']['gpu_ms']} ms GPU, host issues the step in {row['profile']['host_issue_ms']} ms): {row['profile']['by_category_ms']}", highlight=False)
                for kname, ms in row["profile"]["top_kernels_ms"]:
                    console.print(f"    {ms:8.2f} ms  {kname}", highlight=False, soft_wrap=True)
            if out is not None:  # after every row, so that an interrupted run keeps what it measured
                write_text_atomic(prepare_output_file(out, "--out"),
                                  json.dumps({"device": torch.cuda.get_device_name(), "results": rows + [row]}, indent=1), what="--out")
            rows.append(row)
    table = Table(title=f"training, bf16 autocast, AdamW, on {torch.cuda.get_device_name()}")
    columns = ("model", "params_M", "batch", "seq_len", "tok_per_s", "peak_gib", "reserved_gib", "step_s")
    for col in columns:
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(*(str(r.get(c)) for c in columns))
    console.print(table)
    if out is not None:
        write_text_atomic(prepare_output_file(out, "--out"), json.dumps({
            "device": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
            "command": " ".join(["attnlab", *sys.argv[1:]]), "results": rows}, indent=1), what="--out")
        from attnlab.bench.plot import plot_train

        console.print(f"wrote {out} and {plot_train(rows, out.with_suffix('.png'), torch.cuda.get_device_name())}")


from attnlab.bench.names import OP_PEERS, OP_PRESETS, PRESETS, SCALE_MODELS, STATS_SUFFIX, TRAIN_PEERS  # noqa: E402


@bench_app.command("zoo")
def bench_zoo_cmd(
    models: Optional[list[str]] = typer.Option(None, "--model", "-m", show_default=False, help=(
        f"Model to train (repeatable): any registered mixer or preset (softmax or attnlab-softmax), {', '.join(TRAIN_PEERS)}; "
        f"a mixer with {STATS_SUFFIX} (nsa{STATS_SUFFIX}) records its training-health statistics each step, as `attnlab train` does. "
        f"Default: {', '.join(PRESETS)} and every peer.")),
    op_models: Optional[list[str]] = typer.Option(None, "--op-model", show_default=False, help=(
        f"Token-mixing op to time alone, forward and backward (repeatable): an attention-family preset (its mixing function), "
        f"{', '.join(OP_PEERS)} (sdpa: flash attention). Default: {', '.join(OP_PRESETS)} and every peer.")),
    shape: list[str] = typer.Option(["16x1024", "4x4096", "1x16384"], "--shape", help="BATCHxSEQ_LEN to measure (repeatable)."),
    hidden: int = typer.Option(1024, "--hidden", help="Hidden size of every model."),
    layers: int = typer.Option(20, "--layers", help="Decoder layers."),
    heads: int = typer.Option(16, "--heads", help="Heads (fla's Mamba-2: SSM heads; fla's NSA: query heads)."),
    vocab: int = typer.Option(32000, "--vocab", help="Vocabulary size (untied embeddings)."),
    intermediate: int = typer.Option(2048, "--intermediate", help="SwiGLU width of every model's MLP."),
    mixer_option: Optional[list[str]] = typer.Option(None, "--mixer-option", show_default=False, help=(
        "MIXER.OPTION=VALUE over a mixer's or preset's defaults, for attnlab's model and fla's model of that family "
        "(repeatable), e.g. nsa.block_size=64 nsa.block_counts=16 nsa.window_size=512.")),
    steps: int = typer.Option(5, "--steps", min=1, help="Timed training steps (median reported)."),
    warmup: int = typer.Option(2, "--warmup", min=1, help="Untimed steps first, for models and ops; the first is timed alone (first_step_s: capture, compilation, autotuning)."),
    op_repeats: int = typer.Option(20, "--op-repeats", min=1, help="Timed forward+backward runs per op (median reported)."),
    op_heads: int = typer.Option(16, "--op-heads", help="Heads of the ops' inputs."),
    op_head_dim: int = typer.Option(64, "--op-head-dim", help="Head dim of the ops' inputs."),
    skip_train: bool = typer.Option(False, "--skip-train", help="Time the ops only."),
    skip_ops: bool = typer.Option(False, "--skip-ops", help="Train the models only."),
    profile: bool = typer.Option(False, "--profile", help="On CUDA: also profile one forward+backward of each op (its kernels' GPU time, the host's time to issue it)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Write the results as JSON here (after every row), and a PNG plot beside it (same name, .png)."),
    device: str = typer.Option("cuda", "--device", hidden=True, help="cuda, or cpu for a functional check at tiny sizes (fp32, no memory figures)."),
):
    """Every mixer family beside its peers on one GPU: training tokens/s, peak memory and first-step time per model and
    shape, and forward+backward time and memory of the token mixing alone."""
    import torch

    from attnlab.bench.zoo import describe, mixer_options, model_names, op_names, parse_shape, run_zoo

    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise PreflightError("bench zoo measures on a CUDA device; no CUDA device is visible")
    if skip_train and skip_ops:
        raise PreflightError("--skip-train with --skip-ops leaves nothing to measure")
    shapes = [parse_shape(spec) for spec in shape]
    models = [] if skip_train else model_names(models)
    op_models = [] if skip_ops else op_names(op_models)
    size = dict(hidden=hidden, layers=layers, heads=heads, vocab=vocab, intermediate=intermediate,
                mixer_options=mixer_options(mixer_option or []))
    result = run_zoo(models, op_models, shapes, size, op_heads, op_head_dim, steps, warmup, op_repeats, torch.device(device), out,
                     log=lambda line: console.print(line, highlight=False, soft_wrap=True), profile=profile)
    where = result["env"]["gpu"] or "cpu"
    columns = [f"{b}x{t}" for b, t in shapes]

    def table(section: str, names: list[str], title: str, cell) -> None:
        grid = Table(title=title)
        grid.add_column("model" if section == "train" else "op", justify="left")
        for col in columns:
            grid.add_column(col, justify="right")
        for name in names:
            rows = [result[section][f"{name}@{col}"] for col in columns]
            grid.add_row(name, *("OOM" if r.get("error") == "out of memory" else "n/a" if "error" in r else cell(r) for r in rows))
        _print_table(grid)

    def gib(value) -> str:
        return "" if value is None else f" · {value} GiB"

    if models:
        table("train", models, f"training tokens/s · peak GiB reserved, on {where}", lambda r: f"{r['tokens_per_s']:,}{gib(r['peak_reserved_gib'])}")
    if op_models:
        table("ops", op_models, f"token mixing, forward+backward ms · GiB beyond the inputs, on {where}",
              lambda r: f"{r['fwd_bwd_ms']}{gib(r['extra_gib'])}")
    for section in ("train", "ops"):
        for key, row in result[section].items():
            if "error" in row or "note" in row:
                console.print(describe(section, key, row), highlight=False, soft_wrap=True)
    if out is not None:
        from attnlab.bench.plot import plot_zoo

        console.print(f"wrote {out} and {plot_zoo(result, out.with_suffix('.png'))}")


@bench_app.command("scale")
def bench_scale_cmd(
    models: Optional[list[str]] = typer.Option(None, "--model", "-m", show_default=False, help=(
        f"Model (repeatable): any registered mixer or preset (2mamba or attnlab-2mamba), or hf-llama (HF Llama of the same size, "
        f"trained through train.init_from). Default: {', '.join(SCALE_MODELS)}.")),
    gpus: Optional[list[int]] = typer.Option(None, "--gpus", "-g", show_default=False, help=(
        "GPU count to run on (repeatable); 1 runs one process, more run under torchrun. Default: 1, 2, 4, ... up to the visible GPUs.")),
    strategy: list[str] = typer.Option(["ddp"], "--strategy", help="train.strategy for several GPUs: ddp or fsdp (repeatable)."),
    batch_per_gpu: Optional[int] = typer.Option(None, "--batch-per-gpu", min=1, show_default=False, help="Sequences per GPU per step (train.batch_size = this x GPUs) [default: 16]."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", min=2, show_default=False, help="Tokens per sequence [default: 1024]."),
    steps: Optional[int] = typer.Option(None, "--steps", min=1, show_default=False, help="Optimizer steps per run; tokens/s is the median of the logged steps after the first two [default: 40]."),
    eager: bool = typer.Option(True, "--eager/--no-eager", help="Also run every variant eagerly (train.cuda_graphs=false) beside the captured step."),
    ckpt: bool = typer.Option(True, "--ckpt/--no-ckpt", help="Also run every variant with train.gradient_checkpointing=true."),
    hidden: Optional[int] = typer.Option(None, "--hidden", min=1, show_default=False, help="Hidden size of every model [default: 1024]."),
    layers: Optional[int] = typer.Option(None, "--layers", min=1, show_default=False, help="Decoder layers [default: 20]."),
    heads: Optional[int] = typer.Option(None, "--heads", min=1, show_default=False, help="Heads [default: 16]."),
    intermediate: Optional[int] = typer.Option(None, "--intermediate", min=1, show_default=False, help="SwiGLU width of every model's MLP [default: 2048]."),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", show_default=False, help=(
        "bpe: a byte-level BPE tokenizer of --vocab ids trained once on the built-in corpus (cached in --work-dir); byte: the byte "
        "tokenizer and its 259 ids, for quick runs [default: bpe; byte with --device cpu].")),
    vocab: int = typer.Option(32768, "--vocab", min=260, help="Vocabulary of the BPE tokenizer and of every model (untied embeddings)."),
    set_: list[str] = typer.Option([], "--set", "-s", metavar="KEY=VALUE", help="One more config override for every run, applied last, e.g. --set train.grad_clip=0 (repeatable)."),
    timeout_s: float = typer.Option(900, "--timeout-s", min=1, help="Time limit of one run in seconds; a run past it is stopped; it keeps the tokens/s of the steps it logged past the first two (with a note), else it is an error row."),
    side_by_side: bool = typer.Option(False, "--side-by-side/--one-at-a-time", help=(
        "Run the runs of each GPU count side by side on GPUs of their own (four one-GPU runs on 4 GPUs, then two 2-GPU runs): "
        "a shorter bench; the processes share the host (CPUs), which slows host-bound (eager) steps.")),
    work_dir: Optional[Path] = typer.Option(None, "--work-dir", show_default=False, help="Where the tokenizer, HF Llama's starting weights and the run directories go (kept, and reused by the next bench). Default: a temporary folder, deleted at the end."),
    out: Path = typer.Option(Path("scale.json"), "--out", help="JSON result, rewritten after every run; a PNG plot beside it (same name, .png), and the runs' logs in NAME-logs/ (with --set train.profile_steps=N also each run's profile summary there, and its figures in the JSON)."),
    device: str = typer.Option("cuda", "--device", help=(
        "cuda, or cpu: the same pipeline with gloo CPU processes (1 and 2 by default) and tiny defaults: hidden 32, 1 layer, 2 heads, "
        "SwiGLU 64, 2 x 32 tokens per process, 8 steps, the byte tokenizer (a functional check).")),
):
    """How `attnlab train` scales over GPUs: tokens/s, per-GPU tokens/s, efficiency against one GPU and peak memory of each
    model, GPU count, strategy, with and without gradient checkpointing, captured and eager; every variant a real run.

    Example: attnlab bench scale --model 2mamba --model hf-llama --gpus 1 --gpus 2 --gpus 4 --out scale.json
    """
    import shutil
    import tempfile

    import torch

    if device not in bench_scale.DEFAULTS:
        raise PreflightError(f"--device takes cuda or cpu, not {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise PreflightError("bench scale measures training on CUDA GPUs and no CUDA device is visible; "
                             "pass --device cpu for a functional check with CPU processes (gloo) at tiny sizes")
    for name in strategy:
        if name not in bench_scale.STRATEGIES:
            raise PreflightError(f"--strategy takes {' or '.join(bench_scale.STRATEGIES)}, not {name!r}")
    defaults = bench_scale.DEFAULTS[device]
    tokenizer = tokenizer or defaults["tokenizer"]
    if tokenizer not in bench_scale.TOKENIZERS:
        raise PreflightError(f"--tokenizer takes {' or '.join(bench_scale.TOKENIZERS)}, not {tokenizer!r}")
    visible = torch.cuda.device_count() if device == "cuda" else 0
    counts = gpus or bench_scale.default_gpu_counts(visible if device == "cuda" else 2)
    if any(g < 1 for g in counts):
        raise PreflightError("--gpus takes counts of 1 or more")
    if device == "cuda" and max(counts) > visible:
        raise PreflightError(f"--gpus {max(counts)} asks for more GPUs than the {visible} visible")
    size = bench_scale.Size(hidden or defaults["hidden"], layers or defaults["layers"], heads or defaults["heads"],
                            intermediate or defaults["intermediate"], vocab if tokenizer == "bpe" else None)
    if size.hidden % size.heads:
        raise PreflightError(f"--hidden {size.hidden} is not a multiple of --heads {size.heads}")
    names = bench_scale.model_names(models or list(SCALE_MODELS))
    steps = steps or defaults["steps"]
    plan = bench_scale.variants(names, counts, list(dict.fromkeys(strategy)), batch_per_gpu or defaults["batch_per_gpu"], seq_len or defaults["seq_len"], ckpt, eager)
    log = lambda line: console.print(line, highlight=False, soft_wrap=True, markup=False)  # noqa: E731
    temporary = work_dir is None
    work = Path(tempfile.mkdtemp(prefix="attnlab-bench-scale-")) if temporary else work_dir
    try:
        bench = bench_scale.prepare_bench(names, size, device, tokenizer, steps, work, set_, log)
        log(f"{len(plan)} runs of {steps} steps: {', '.join(names)} on {', '.join(map(str, sorted(set(counts))))} "
            f"{'GPU(s)' if device == 'cuda' else 'CPU process(es)'}")
        result, finished = bench_scale.run_scale(bench, plan, work, out.parent / f"{out.stem}-logs", out, timeout_s, log,
                                                 side_by_side=visible if side_by_side and device == "cuda" else 1)
    finally:
        if temporary:
            shutil.rmtree(work, ignore_errors=True)
    grid, errors = bench_scale.results_table(result)
    _print_table(grid)
    for line in errors:
        console.print(line, highlight=False, soft_wrap=True, markup=False)
    from attnlab.bench.plot import plot_scale

    console.print(f"wrote {out} and {plot_scale(result, out.with_suffix('.png'))}", highlight=False)
    if not finished:
        raise typer.Exit(130)


@bench_app.command("data")
def bench_data_cmd(
    size: list[str] = typer.Option(["2GB"], "--size", help="Size of the synthetic corpus (repeatable), e.g. 100MB, 2GB: written once into --work-dir, then reused."),
    workers: int = typer.Option(max(1, os.cpu_count() or 1), "--workers", "-w", min=1, help="Tokenizer processes of the preparation (the byte tokenizer always tokenizes in one).",
                                show_default="CPU cores"),
    tokenizer: list[str] = typer.Option(["byte", "bpe"], "--tokenizer", "-t", help="byte, or bpe (a byte-level BPE tokenizer of 8,192 ids trained offline on the corpus's words); repeatable."),
    work_dir: Optional[Path] = typer.Option(None, "--work-dir", help="Where the synthetic corpora, the BPE tokenizer and the prepared corpora go. Default: the user cache (~/.cache/attnlab/bench-data).", show_default=False),
    out: Path = typer.Option(Path("benchmarks/results/cpu-data.json"), "--out", help="JSON result, rewritten after every row."),
):
    """What a corpus costs: prepare throughput (MB/s of text per worker), time from launch to the first training step,
    peak resident memory (against the same run on Shakespeare) and resume time, per corpus size and tokenizer."""
    for name in tokenizer:
        if name not in bench_data.TOKENIZERS:
            raise PreflightError(f"--tokenizer takes {' or '.join(bench_data.TOKENIZERS)}, not {name!r}")
    sizes = [bench_data.parse_size(spec) for spec in size]
    result = bench_data.run_bench(sizes, list(dict.fromkeys(tokenizer)), workers, work_dir or bench_data.default_work_dir(), out, console)
    base = result["baseline"]
    grid = Table(title=f"data: prepare, start and resume on {result['env']['cpu']} ({result['env']['cores']} cores)")
    for col in ("corpus", "tokens", "prepare MB/s (per worker; per CPU s)", "first step s (imports; data+checks; CPU s)",
                "resume s (imports; data+checks; CPU s)", "peak RSS MiB (x Shakespeare)"):
        grid.add_column(col, justify="left" if col == "corpus" else "right")

    def start(row: dict, prefix: str = "") -> str:
        return f"{row[prefix + 'first_step_s']} ({row[prefix + 'import_s']}; {row[prefix + 'preflight_s']}; {row[prefix + 'first_step_cpu_s']})"

    for name, row in base.items():
        grid.add_row(f"shakespeare, {name} (in memory)", "", "", start(row), start(row, "resume_"), f"{row['peak_rss_mib']:,.0f}")
    for key, row in result["results"].items():
        grid.add_row(key, f"{row['tokens']:,}", f"{row['prepare_mb_s']:,.1f} ({row['prepare_mb_s_per_worker']:,.1f} x {row['workers']}; "
                     f"{row['prepare_mb_per_cpu_s']:,.1f})", start(row), start(row, "resume_"),
                     f"{row['peak_rss_mib']:,.0f} ({row['rss_vs_baseline']:.2f}x)")
    _print_table(grid)
    console.print(f"import floor: {result['import_floor_s']} s from launch to `import torch; from transformers import Trainer` in a "
                  "fresh interpreter (median of 3), under every first step above", highlight=False)
    names = [bench_data.size_name(s) for s in sizes]
    if len(names) > 1:
        for name in dict.fromkeys(tokenizer):
            small, large = result["results"].get(f"{name}@{names[0]}"), result["results"].get(f"{name}@{names[-1]}")
            if small and large and small["first_step_s"]:
                console.print(f"{name}: first step at {names[-1]} takes {large['first_step_s'] / small['first_step_s']:.2f}x the time at {names[0]}", highlight=False)
    console.print(f"wrote {out}")


def _literal_help(typer_app: typer.Typer, seen: set[int] | None = None) -> None:
    """Escape square brackets in every option's and argument's help, so that rich prints
    `[default: 64]` as written instead of eating it as a markup tag."""
    import inspect

    from typer.models import ParameterInfo

    seen = set() if seen is None else seen
    for command in typer_app.registered_commands:
        for param in inspect.signature(command.callback).parameters.values():
            info = param.default
            if isinstance(info, ParameterInfo) and info.help and id(info) not in seen:  # options shared by verbs: once
                seen.add(id(info))
                info.help = escape(info.help)
    for group in typer_app.registered_groups:
        _literal_help(group.typer_instance, seen)


_literal_help(app)


# One example on every --help (shown under the options); keyed by the command's path below `attnlab`.
EXAMPLES = {
    "": "attnlab train --set train.max_steps=200 --run-dir runs/first",
    "train": "attnlab train my_run.yaml --set train.lr=1e-3 --run-dir runs/lr1e-3   (continue: attnlab train --resume --run-dir runs/lr1e-3)",
    "preflight": "attnlab preflight my_run.yaml --set train.batch_size=64",
    "convert": "attnlab convert checkpoints/gla-340M models/gla-340m   (an fla or HF checkpoint directory; --to fla for the way back)",
    "generate": "attnlab generate runs/first --prompt \"ROMEO:\" --max-new-tokens 200 --do-sample --top-p 0.9",
    "eval": "attnlab eval runs/first --task perplexity --limit 50   (text-to-SQL: --task spider --data spider/)",
    "score": "attnlab score --task spider --data spider/ --predictions predictions.jsonl",
    "sweep": "attnlab sweep mixers-shakespeare --dry-run   (then without --dry-run to run it)",
    "report": "attnlab report runs/softmax runs/gla --out report.html",
    "finetune": "attnlab finetune --set train.max_steps=20 --run-dir runs/style   (the built-in style fine-tune of SmolLM2 on CPU)",
    "merge": "attnlab merge runs/finetune/final models/merged",
    "data": "attnlab data prepare plays.txt --out corpus/plays",
    "data prepare": "attnlab data prepare plays.txt --out corpus/plays --workers 4   (then --set data.source=corpus/plays)",
    "bench": "attnlab bench decode runs/first --batch-size 1 --batch-size 8",
    "bench decode": "attnlab bench decode runs/first --batch-size 1 --batch-size 8 --beams 4",
    "bench train": "attnlab bench train --shape 8x2048 --profile",
    "bench zoo": "attnlab bench zoo --model gla --model softmax --shape 8x1024 --out zoo.json",
    "bench scale": "attnlab bench scale --model 2mamba --gpus 1 --gpus 2 --out scale.json",
    "bench data": "attnlab bench data --size 1GB --workers 4 --tokenizer byte",
}


def _add_examples(typer_app: typer.Typer, prefix: str = "") -> None:
    """Put `EXAMPLES[<command>]` under every command's --help (a command without one is a test failure)."""
    typer_app.info.epilog = typer_app.info.epilog or _example(prefix)
    for command in typer_app.registered_commands:
        name = f"{prefix} {command.name or command.callback.__name__}".strip()
        command.epilog = command.epilog or _example(name)
    for group in typer_app.registered_groups:
        _add_examples(group.typer_instance, f"{prefix} {group.name}".strip())


def _example(name: str) -> str | None:
    return f"Example: {escape(EXAMPLES[name])}" if name in EXAMPLES else None


def _flags_take_no_value() -> None:
    """Boolean flags (--chat, --do-sample/--greedy, --help) show no `<bool>` type in --help: they take no value.
    Typer prints every option's type, a flag's included; its types column is given nothing for flags."""
    from typer.core import TyperOption

    shown = getattr(TyperOption, "display_type_rich", None)  # recent Typer releases; older ones show flags without a type already
    if shown is None or getattr(shown, "attnlab_flags", False):
        return

    def display_type_rich(self, ctx):
        return None if self.is_flag and not self.count else shown(self, ctx)

    display_type_rich.attnlab_flags = True
    TyperOption.display_type_rich = display_type_rich


HELP_MIN_WIDTH = 100  # the widest option names and their types fit whole beside a readable description


def _help_width() -> None:
    """--help as wide as the terminal (off one: the log width), never narrower than HELP_MIN_WIDTH: narrower,
    rich cuts option names short with '…'."""
    import typer.rich_utils

    if typer.rich_utils.MAX_WIDTH is None:  # TERMINAL_WIDTH, Typer's own setting, wins
        typer.rich_utils.MAX_WIDTH = max(make_console().width, HELP_MIN_WIDTH)


_add_examples(app)
_flags_take_no_value()
_help_width()


def main() -> None:
    import contextlib

    silence()  # again: a caller's warnings.catch_warnings around the first import of attnlab would have undone it

    # finetune and merge load the built-in GGUF base themselves (generate and eval go through attnlab.loading):
    # no conversion bar there either; other verbs do not pay for importing transformers' GGUF support
    verb = sys.argv[1] if len(sys.argv) > 1 else ""
    quiet = contextlib.nullcontext()
    if verb in ("finetune", "merge") and "--help" not in sys.argv:
        from attnlab.loading import quiet_gguf_conversion  # imports torch: not for the other verbs

        quiet = quiet_gguf_conversion()
    try:
        with quiet:
            app()
    except AttnLabError as e:
        err_console.print(f"[bold red]error:[/bold red] {escape(str(e))}", highlight=False, soft_wrap=True)
        sys.exit(getattr(e, "exit_code", 1))
    except KeyboardInterrupt:
        err_console.print("[yellow]interrupted.[/yellow] Continue with: attnlab train --resume --run-dir RUN")
        sys.exit(130)


if __name__ == "__main__":
    main()
