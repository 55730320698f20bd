"""Preflight: every problem with a run, found and listed before it starts.

`attnlab preflight CONFIG` prints the report; `attnlab train` runs the same checks and refuses
to start on any error. The checks read the tokenizer and the data once and hand them on, so a
run that passes preflight never loads them again. The rules that read the config alone are
attnlab.config.preflight's; here the run directory, the checkpoint to resume from, the tokenizer,
the model and the data are checked.
"""

from __future__ import annotations

from pathlib import Path

from attnlab.config.loader import diff_configs, load_config
from attnlab.config.preflight import PreflightReport, check_config, resolve_device
from attnlab.config.schema import RESUME_LOCKED, RunConfig
from attnlab.data import build_datasets, load_tokenizer
from attnlab.data.blocks import build_prepared, check_tokenizer, is_prepared
from attnlab.data.cache import MB, prepared_cache, source_size
from attnlab.data.corpus import read_documents
from attnlab.data.mqar import build_mqar
from attnlab.data.packing import _blocks, tokenize_documents
from attnlab.data.prepared import _read_manifest
from attnlab.data.progress import PrepareReporter
from attnlab.errors import AttnLabError

from .build import default_vocab_size, init_from_config, model_config_from
from .checkpoint import CheckpointManager
from .schedule import resume_lr_note
from .telemetry import check_telemetry


def run_preflight(cfg: RunConfig, run_dir: Path | None = None, resume: bool = False, load_data: bool = True,
                  check_run_dir: bool = True, console=None) -> PreflightReport:
    """check_run_dir=False (ranks other than 0 under torchrun): rank 0 judges the run directory;
    the others only find the checkpoint to resume from. `console` (rich) hears about a raw corpus
    being prepared into the cache (data.prepare_above_mb), with a progress bar."""
    report = PreflightReport()
    report.device, report.precision = resolve_device(cfg)
    if check_run_dir:
        _check_run_dir(cfg, run_dir, resume, report)
    elif resume and run_dir is not None:
        report.resume_from = CheckpointManager(run_dir).newest()
    check_config(cfg, report)
    _check_model_and_data(cfg, report, load_data, console)
    return report


def _check_run_dir(cfg: RunConfig, run_dir: Path | None, resume: bool, report: PreflightReport) -> None:
    if run_dir is None:
        if resume:
            report.error("--run-dir", "--resume needs --run-dir pointing at the run to continue")
        return
    saved = run_dir / "config.yaml"
    if run_dir.exists() and not run_dir.is_dir():
        report.error("--run-dir", f"{run_dir} is a file, not a directory. Pass a directory (new, or holding the run to resume).")
        return
    if not resume:
        if saved.exists() or (run_dir / "checkpoints").exists():
            report.error("--run-dir", f"{run_dir} already holds a run. Continue it with --resume, or choose another --run-dir.")
        return
    if not saved.exists():
        report.error("--resume", f"nothing to resume: {run_dir} holds no run (no config.yaml). Start it without --resume.")
        return
    try:
        old = load_config(saved)
    except AttnLabError as e:
        report.error("--resume", f"the saved config of {run_dir} cannot be read: {e}")
        return
    changed = diff_configs(old, cfg, RESUME_LOCKED)
    if changed:
        report.error(
            "--resume",
            "the config differs from the run's saved config in fields that change the model or the data: "
            + "; ".join(changed) + f". Resume with the saved config ({saved}), or start a new run in another --run-dir.",
        )
    latest = run_dir / "checkpoints" / "latest"
    if latest.is_dir() and not latest.is_symlink():
        newest = CheckpointManager(run_dir).newest()
        fix = f"rm -r {latest} && ln -s {newest.name} {latest}" if newest is not None else f"rm -r {latest}"
        report.error("--resume", f"{latest} is a directory, not a link to the newest checkpoint (was the run copied with "
                     f"cp -rL?). A resume would have to replace it; do it yourself: {fix}")
        return
    try:
        check_telemetry(run_dir)
    except AttnLabError as e:
        report.error("--resume", str(e))
    try:
        report.resume_from = CheckpointManager(run_dir).resume_point()
    except AttnLabError as e:
        report.error("--resume", str(e))
        return
    own = _checkpoint_config(report.resume_from, report)
    if own is not None:
        changed = diff_configs(own, cfg, RESUME_LOCKED)
        if changed:
            report.error(
                "--resume",
                f"the checkpoint {report.resume_from} was written by a run with another model or data stream: "
                + "; ".join(changed) + f". Resume with the config it was trained with ({report.resume_from / CHECKPOINT_CONFIG}), "
                "or start a new run in another --run-dir.",
            )
    done = int(report.resume_from.name.split("-")[1])
    if done >= cfg.train.max_steps and (run_dir / "final").exists():
        report.error("train.max_steps", f"the run already reached step {done} (max_steps={cfg.train.max_steps}). To train further, resume with --set train.max_steps=N, N > {done}.")
        return
    if done < cfg.train.max_steps:
        try:
            note = resume_lr_note((own or old).train, cfg.train, done)
        except (ValueError, TypeError) as e:
            note = f"the learning rate at the resume step cannot be computed ({e})"
        if note:
            report.notes.append(note)


def _check_mqar_vocab(cfg: RunConfig, tokenizer, report: PreflightReport) -> None:
    """An MQAR run's ids come from the task, not the tokenizer, so its model may be smaller than the tokenizer
    (model.vocab_size null: data.mqar.vocab_size); then only the mqar task can evaluate it: a text task would feed
    it token ids beyond its embedding."""
    vocab = cfg.model.vocab_size or default_vocab_size(cfg, tokenizer)
    text_tasks = [t.task for t in cfg.eval.tasks if t.task != "mqar"]
    if vocab < len(tokenizer) and text_tasks:
        report.error("eval.tasks", f"eval task {text_tasks[0]} reads text through the tokenizer ({len(tokenizer)} tokens), but this "
                     f"run on data.source=mqar has a model of {vocab} ids (the task's): evaluate it with task mqar only, or "
                     f"set model.vocab_size >= {len(tokenizer)}")


CHECKPOINT_CONFIG = "run_config.yaml"  # the config a checkpoint was written with (train/loop.py writes it)


def _checkpoint_config(checkpoint: Path, report: PreflightReport) -> RunConfig | None:
    """The config a checkpoint was written with; None for a checkpoint that does not record one."""
    path = checkpoint / CHECKPOINT_CONFIG
    if not path.is_file():
        return None
    try:
        return load_config(path)
    except AttnLabError as e:
        report.error("--resume", f"the config recorded in {path} cannot be read: {e}")
        return None


def _check_model_and_data(cfg: RunConfig, report: PreflightReport, load_data: bool, console=None) -> None:
    try:
        tokenizer = load_tokenizer(cfg.data.tokenizer)
    except AttnLabError as e:
        report.error("data.tokenizer", str(e))
        return
    report.tokenizer = tokenizer
    if cfg.train.init_from:
        kind, where, config, errors, warnings = init_from_config(cfg, tokenizer, report.resume_from)
        for key, message in errors:
            report.error(key, message)
        for key, message in warnings:
            report.warn(key, message)
        if kind:
            report.model_config, report.init_from = config, (kind, where)
    else:
        if cfg.data.source == "mqar":
            _check_mqar_vocab(cfg, tokenizer, report)
        elif cfg.model.vocab_size is not None and cfg.model.vocab_size < len(tokenizer):
            report.error("model.vocab_size", f"the tokenizer has {len(tokenizer)} tokens but model.vocab_size is {cfg.model.vocab_size}: token ids would fall outside the embedding. Set model.vocab_size >= {len(tokenizer)} or null.")
        try:
            report.model_config = model_config_from(cfg, tokenizer)
        except (ValueError, TypeError) as e:
            message = str(e)
            report.error(message.split(" ", 1)[0] if message.startswith("model.") else "model", message)
    if cfg.model.max_position_embeddings < cfg.data.seq_len:
        report.error("model.max_position_embeddings", f"model.max_position_embeddings ({cfg.model.max_position_embeddings}) is below "
                     f"data.seq_len ({cfg.data.seq_len}): training blocks would run past the positions the model is configured for. "
                     f"Set model.max_position_embeddings >= {cfg.data.seq_len}, or lower data.seq_len.")
    if not load_data:
        return
    if cfg.data.source == "mqar":  # synthetic: generated on the fly, accuracy measured by the mqar eval task
        report.data = build_mqar(cfg.data, cfg.train.max_steps * cfg.train.batch_size * cfg.train.grad_accum)
        return
    try:
        report.data = _load_data(cfg, tokenizer, report, console)
    except AttnLabError as e:
        report.error("data", str(e))
        return
    if report.data is None:
        return
    data = report.data
    if data.val is None or len(data.val) == 0:
        prepared = data.stats.get("prepared")
        if prepared and not cfg.data.val_source:
            if data.corpus.manifest["validation"]["fraction"] > 0:
                report.error("data.seq_len", f"the validation split of {prepared} is shorter than one block of data.seq_len={cfg.data.seq_len} tokens. "
                             "Lower data.seq_len, or prepare the corpus again with a larger --val-fraction.")
        elif cfg.data.val_fraction > 0 or cfg.data.val_source:
            report.error("data.seq_len", f"the validation split is shorter than one block of data.seq_len={cfg.data.seq_len} tokens. Lower data.seq_len or raise data.val_fraction.")
    per_step = cfg.train.batch_size * cfg.train.grad_accum
    if len(data.train) < per_step:
        report.warn("train.batch_size", f"the training data holds {len(data.train)} blocks, fewer than one step's {per_step}: every step repeats data")


def _load_data(cfg: RunConfig, tokenizer, report: PreflightReport, console):
    """The training data: a prepared corpus read lazily (data.source is one, or raw text larger than
    data.prepare_above_mb, prepared once into the cache), else the documents packed in memory."""
    import os

    d = cfg.data
    say = (lambda text: console.print(text, highlight=False, soft_wrap=True)) if console is not None else (lambda text: None)
    directory = None
    if is_prepared(d.source):
        directory = Path(d.source).expanduser()
    elif d.prepare_above_mb is not None:
        size, fingerprints = source_size(d.source, d.text_field)
        if size is not None and size > d.prepare_above_mb * MB:
            say(f"data: {d.source} holds {size / MB:,.0f} MB of text, more than data.prepare_above_mb={d.prepare_above_mb:g}: "
                "training reads it from a prepared corpus")
            reporter = None
            if console is not None:
                reporter = PrepareReporter(console)
            try:
                directory = prepared_cache(
                    d.source, tokenizer, d.tokenizer, d.text_field, 0.0 if d.val_source else d.val_fraction, cfg.train.seed,
                    d.cache_dir, fingerprints, workers=max(1, min(8, os.cpu_count() or 1)), say=say, progress=reporter)
            finally:
                if reporter is not None:
                    reporter.stop()
    if directory is None:
        return build_datasets(d.source, tokenizer, d.seq_len, d.val_fraction, cfg.train.seed,
                              text_field=d.text_field, val_source=d.val_source)

    manifest = _read_manifest(directory)
    try:
        check_tokenizer(manifest, tokenizer, d.tokenizer, directory)
    except AttnLabError as e:
        report.error("data.tokenizer", str(e))
        return None
    val_blocks, val_docs = None, []
    if d.val_source:
        val_docs = read_documents(d.val_source, text_field=d.text_field)
        val_blocks = _blocks(tokenize_documents(val_docs, tokenizer), d.seq_len, f"validation data in {d.val_source!r}")
        val_blocks = val_blocks[: cfg.train.eval_batches * cfg.train.batch_size]
    elif is_prepared(d.source) and manifest["validation"]["fraction"] != d.val_fraction:
        report.warn("data.val_fraction", f"validation holds out the documents {directory} was prepared with (--val-fraction "
                    f"{manifest['validation']['fraction']:g}), not data.val_fraction={d.val_fraction:g}: prepare it again to change the split.")
    return build_prepared(directory, tokenizer, d.seq_len, cfg.train.seed, cfg.train.eval_batches * cfg.train.batch_size,
                          verify=d.verify_shards, val_blocks=val_blocks, val_documents=len(val_docs))
