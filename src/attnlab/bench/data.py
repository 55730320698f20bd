"""What a corpus costs before and during training (`attnlab bench data`).

For each size asked for, a synthetic corpus is written once (JSON Lines, deterministic: documents of
lognormal length cut from a text of Zipf-distributed pseudo-words, some of them non-ASCII) and kept
in the work directory. For each tokenizer (the byte tokenizer; a byte-level BPE tokenizer of 8,192
ids trained here with HF `tokenizers` on the corpus's own words, so nothing is downloaded) it measures:

* ``prepare``: `attnlab data prepare` of the corpus, in this process with its progress bar: seconds,
  MB/s of text and MB/s per tokenizing worker (the byte tokenizer always tokenizes in one process);
* ``train``: `attnlab train` of a tiny model on the prepared directory, in a fresh process: seconds
  from the launch of the process to the end of its first step (imports, preflight, opening the
  corpus, building the model, one step), the peak resident memory of the process (ru_maxrss), and
  the same run on the built-in Shakespeare corpus (packed in memory, same tokenizer) as its baseline;
* ``resume``: that run resumed from its checkpoint in a fresh process, launch to first step.

The result is one JSON file:

    {"env": {"cpu", "cores", "python", "torch", "transformers", "tokenizers", "command"},
     "model": [run overrides], "import_floor_s", "baseline": {TOKENIZER: {"first_step_s", "import_s", "preflight_s", "first_step_cpu_s",
                                                          "peak_rss_mib", "resume_first_step_s", ...}},
     "results": {"TOKENIZER@SIZE": {"text_mb", "documents", "tokens", "workers", "prepare_s",
                 "prepare_mb_s", "prepare_mb_s_per_worker", "prepare_cpu_s", "prepare_mb_per_cpu_s", the
                 baseline's keys, "rss_vs_baseline"}}}

`import_floor_s` (top level) is the median time of three fresh interpreters to import torch and
transformers' Trainer and nothing else: a floor under every `import_s` on that machine.
`import_s` is the part of `first_step_s` spent importing torch, transformers and the trainer,
`preflight_s` the checks with reading (or opening) the data; `*_cpu_s` are CPU seconds, which say
more than wall seconds on a machine shared with other work.
"""

from __future__ import annotations

import json
import os
import pkgutil
import platform
import re
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from attnlab.data.cache import default_cache_dir
from attnlab.data.prepare import prepare_corpus
from attnlab.data.progress import PrepareReporter
from attnlab.errors import PreflightError
from attnlab.outputs import fresh_dir, open_fresh_file, prepare_output_file, replace_file, staged_files, write_text_atomic

TOKENIZERS = ("byte", "bpe")
BPE_VOCAB = 8192
FILE_BYTES = 256 * 1000 * 1000  # the synthetic corpus is split into files of this much text
# The run whose start is timed: small enough that its step costs little next to the start.
RUN = ["model.hidden_size=64", "model.num_layers=2", "model.num_heads=2", "data.seq_len=256", "train.batch_size=8",
       "train.warmup_steps=0", "train.log_every=1", "train.eval_batches=2", "train.sample_tokens=0", "train.device=cpu",
       "train.eval_every=0"]
PROGRAM = "attnlab.cli:main"  # the program whose start is timed, by its entry point (the bench is one of its commands)
_UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9}


def parse_size(spec: str) -> int:
    """'2GB', '100MB', '500M', '1.5G' -> bytes (decimal units)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMG]?B?)\s*", spec.upper())
    if not m or m.group(2) not in _UNITS:
        raise PreflightError(f"--size takes a size such as 100MB or 2GB, not {spec!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def size_name(size: int) -> str:
    return f"{size / 1e9:g}GB" if size >= 10**9 else f"{size / 1e6:g}MB"


def default_work_dir() -> Path:
    return default_cache_dir().parent / "bench-data"


def _word_text(n_bytes: int, rng: np.random.Generator) -> str:
    """About `n_bytes` of text: Zipf-distributed pseudo-words, sentences and paragraphs."""
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    odd = ["naïve", "café", "über", "señor", "≈", "—", "façade", "smörgåsbord"]
    words = ["".join(rng.choice(letters, size=rng.integers(1, 10))) for _ in range(6000)] + odd
    ranks = np.arange(1, len(words) + 1)
    probs = (1.0 / ranks) / (1.0 / ranks).sum()
    n_words = n_bytes // 5
    chosen = rng.choice(len(words), size=n_words, p=probs)
    seps = rng.choice([" ", " ", " ", " ", " ", " ", " ", ", ", ". ", ".\n"], size=n_words)
    return "".join(w + s for w, s in zip(np.array(words, dtype=object)[chosen], seps))


def synthetic_corpus(work_dir: Path, size: int, seed: int = 0, progress: Callable[[int, int], None] | None = None) -> Path:
    """A directory of JSON Lines files holding `size` bytes of text (written once, then reused)."""
    out = work_dir / f"corpus-{size_name(size)}-seed{seed}"
    done = out / "COMPLETE"
    if done.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fresh_dir(out)  # created anew: the parts are written into a directory nothing was planted in
    rng = np.random.default_rng(seed)
    pool = _word_text(8 * 10**6, rng)  # documents are cut from this text
    written, part = 0, 0
    while written < size:
        with open(out / f"part-{part:05d}.jsonl", "w", encoding="utf-8") as f:
            in_file = 0
            while in_file < FILE_BYTES and written < size:
                lengths = np.clip(rng.lognormal(7.5, 1.0, size=1024).astype(np.int64), 100, 200_000)
                starts = rng.integers(0, len(pool) - 200_001, size=1024)
                lines = []
                for start, length in zip(starts, lengths):
                    length = int(min(length, size - written))
                    if length <= 0:
                        break
                    text = pool[start : start + length]
                    lines.append(json.dumps({"text": text}, ensure_ascii=False))
                    written += length
                    in_file += length
                f.write("\n".join(lines) + "\n")
                if progress:
                    progress(written, size)
        part += 1
    done.write_text(json.dumps({"bytes_of_text": written, "seed": seed}) + "\n")
    return out


def train_bpe(lines: list[str], vocab_size: int, out: Path) -> Path:
    """A byte-level BPE tokenizer of at most `vocab_size` ids (fewer when the text has no more merges to
    learn) with an <eos> token, trained with HF `tokenizers` on `lines` and saved into `out` with
    save_pretrained (nothing downloaded)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator((lines[i : i + 1000] for i in range(0, len(lines), 1000)), trainer=trainer)
    with staged_files(out) as staging:  # each file renamed into place, never written through a planted link
        PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>").save_pretrained(staging)
    return out


def bpe_tokenizer(work_dir: Path, seed: int = 0) -> Path:
    """A byte-level BPE tokenizer of BPE_VOCAB ids with an <eos> token, trained on the synthetic words
    (written once, then reused)."""
    out = work_dir / f"bpe-{BPE_VOCAB}"
    if (out / "tokenizer.json").is_file():
        return out
    text = _word_text(4 * 10**6, np.random.default_rng(seed))
    return train_bpe(text.split("\n"), BPE_VOCAB, out)


def _child() -> None:
    """`attnlab train` in this process, timed from `launch` (the parent's clock) to the end of the first step."""
    spec = json.loads(sys.argv[1])
    import attnlab.train.loop as loop  # torch, transformers and the trainer: what every run imports

    imported = time.time()
    first: dict = {}
    real = loop.TelemetryCallback.on_step_end

    def on_step_end(self, args, state, control, **kw):
        if "t" not in first:
            first.update(t=time.time(), cpu=time.process_time())
        return real(self, args, state, control, **kw)

    loop.TelemetryCallback.on_step_end = on_step_end
    import attnlab.train.preflight as preflight

    checks = preflight.run_preflight

    def timed_preflight(*args, **kwargs):  # the checks, and reading (or opening) the data
        t0, c0 = time.time(), time.process_time()
        try:
            return checks(*args, **kwargs)
        finally:
            first.update(preflight_s=time.time() - t0, preflight_cpu_s=time.process_time() - c0)

    preflight.run_preflight = timed_preflight
    main = pkgutil.resolve_name(PROGRAM)

    sys.argv = ["attnlab", "train", *spec["argv"]]
    code = 0
    try:
        main()
    except SystemExit as exc:
        code = int(exc.code or 0)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    result = {"code": code, "first_step_s": round(first["t"] - spec["launch"], 2) if "t" in first else None,
              "import_s": round(imported - spec["launch"], 2), "first_step_cpu_s": round(first.get("cpu", 0.0), 2),
              "preflight_s": round(first.get("preflight_s", 0.0), 2), "preflight_cpu_s": round(first.get("preflight_cpu_s", 0.0), 2),
              "peak_rss_mib": round(rss, 1)}
    replace_file(spec["out"], json.dumps(result))


def timed_train(argv: list[str], log: Path) -> dict:
    """Run `attnlab train ARGV` in a fresh process; its first-step time and peak resident memory."""
    result = log.with_suffix(".json")
    spec = {"argv": argv, "out": str(result), "launch": time.time()}
    with open_fresh_file(log) as out:
        proc = subprocess.run([sys.executable, "-c", "from attnlab.bench.data import _child; _child()", json.dumps(spec)],
                              stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "COLUMNS": "200"})
    if proc.returncode != 0 or not result.is_file() or json.loads(result.read_text())["code"] != 0:
        raise PreflightError(f"the timed run failed (exit {proc.returncode}); its output is in {log}")
    return json.loads(result.read_text())


# What any run on transformers' Trainer imports before its own code: the floor under `import_s` on this machine.
FLOOR = "import sys, time; t0 = float(sys.argv[1]); import torch, transformers; from transformers import Trainer; print(time.time() - t0)"


def import_floor(repeats: int = 3) -> float:
    """Seconds from the launch of a fresh interpreter to `import torch` and `from transformers import Trainer`
    done (the median of `repeats`), with nothing of attnlab's: the part of every first step that no code
    of attnlab's can shorten while training runs on transformers' Trainer."""
    times = []
    for _ in range(repeats):
        proc = subprocess.run([sys.executable, "-c", FLOOR, repr(time.time())], capture_output=True, text=True, check=True)
        times.append(float(proc.stdout.strip().splitlines()[-1]))
    return round(sorted(times)[len(times) // 2], 2)


def _sets(overrides: list[str]) -> list[str]:
    return [arg for item in overrides for arg in ("--set", item)]


def train_and_resume(source: str, tokenizer: str, work: Path, name: str) -> dict:
    """First-step time and peak memory of a tiny run on `source`, then the first-step time of its resume."""
    run = work / f"run-{name}"
    shutil.rmtree(run, ignore_errors=True)
    overrides = RUN + [f"data.source={source}", f"data.tokenizer={tokenizer}", "train.max_steps=2", "train.save_every=2"]
    first = timed_train(_sets(overrides) + ["--run-dir", str(run)],
                        work / f"train-{name}.log")
    resumed = timed_train(["--resume", "--run-dir", str(run), "--set", "train.max_steps=4"], work / f"resume-{name}.log")
    shutil.rmtree(run, ignore_errors=True)
    keys = ("first_step_s", "import_s", "first_step_cpu_s", "preflight_s", "preflight_cpu_s", "peak_rss_mib")
    return {**{k: first[k] for k in keys}, **{f"resume_{k}": resumed[k] for k in keys}}


def _cpu_s() -> float:
    """CPU seconds of this process and of its children that have ended (the preparation's workers)."""
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


def environment() -> dict:
    from importlib.metadata import version

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "load_average": [round(x, 2) for x in os.getloadavg()], "python": platform.python_version(), "torch": version("torch"),
            "transformers": version("transformers"), "tokenizers": version("tokenizers"),
            "command": " ".join(["attnlab", *sys.argv[1:]])}


def run_bench(sizes: list[int], tokenizers: list[str], workers: int, work_dir: Path, out: Path | None, console) -> dict:
    """Every measurement for every size and tokenizer; `out` is rewritten after every row."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from attnlab.data.tokenizer import load_tokenizer

    work_dir.mkdir(parents=True, exist_ok=True)
    result = {"env": environment(), "model": RUN, "import_floor_s": import_floor(), "baseline": {}, "results": {}}

    def save() -> None:
        if out is not None:
            write_text_atomic(prepare_output_file(out, "--out"), json.dumps(result, indent=1) + "\n", what="--out")

    specs = {"byte": "byte"}
    if "bpe" in tokenizers:
        specs["bpe"] = str(bpe_tokenizer(work_dir))
    for name in tokenizers:
        console.print(f"baseline: the same run on the built-in Shakespeare corpus with the {name} tokenizer (packed in memory)", highlight=False)
        result["baseline"][name] = train_and_resume("shakespeare", specs[name], work_dir, f"shakespeare-{name}")
        save()
    for size in sizes:
        with Progress(TextColumn(f"[bold]corpus {size_name(size)}"), BarColumn(), DownloadColumn(), TimeElapsedColumn(),
                      TimeRemainingColumn(), console=console, transient=True) as bar:
            task = bar.add_task("corpus", total=size)
            corpus = synthetic_corpus(work_dir, size, progress=lambda done, total: bar.update(task, completed=done))
        for name in tokenizers:
            key = f"{name}@{size_name(size)}"
            prepared = work_dir / f"prepared-{key.replace('@', '-')}"
            shutil.rmtree(prepared, ignore_errors=True)
            console.print(f"{key}: prepare", highlight=False)
            load_tokenizer(specs[name])  # imports transformers: not part of the preparation's time
            reporter = PrepareReporter(console)
            t0, cpu0 = time.perf_counter(), _cpu_s()
            try:
                manifest = prepare_corpus(str(corpus), prepared, specs[name], workers=workers, val_fraction=0.001, progress=reporter)
            finally:
                reporter.stop()
            prepare_s, cpu_s = time.perf_counter() - t0, _cpu_s() - cpu0
            used = reporter.workers
            text_mb = manifest["text_bytes"] / 1e6
            row = {"text_mb": round(text_mb, 1), "documents": manifest["documents"], "tokens": manifest["tokens"], "workers": used,
                   "prepare_s": round(prepare_s, 2), "prepare_mb_s": round(text_mb / prepare_s, 2),
                   "prepare_mb_s_per_worker": round(text_mb / prepare_s / used, 2),
                   "prepare_cpu_s": round(cpu_s, 2), "prepare_mb_per_cpu_s": round(text_mb / cpu_s, 2),
                   "load_average": [round(x, 2) for x in os.getloadavg()]}
            console.print(f"{key}: train and resume on the prepared corpus", highlight=False)
            row.update(train_and_resume(str(prepared), specs[name], work_dir, key.replace("@", "-")))
            base = result["baseline"][name]["peak_rss_mib"]
            row["rss_vs_baseline"] = round(row["peak_rss_mib"] / base, 3) if base else None
            result["results"][key] = row
            save()
            shutil.rmtree(prepared, ignore_errors=True)
    return result
