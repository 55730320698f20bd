"""Raw corpora too large to read into memory are prepared once, into a cache, by `attnlab train`.

When `data.source` is raw text (files, directories, globs, a saved dataset) of more than
`data.prepare_above_mb` megabytes, training prepares it with `prepare_corpus` into
``CACHE/<name>-<key>``, where CACHE is `data.cache_dir` (default: ``$XDG_CACHE_HOME/attnlab/prepared``,
else ``~/.cache/attnlab/prepared``) and the key hashes the source fingerprint (paths, sizes,
modification times), the tokenizer (its vocabulary hash), the text field and the validation split.
A later run with the same inputs finds the manifest there and reuses it; a changed file gives
another key, so a stale preparation is never read. An interrupted preparation resumes (complete
shards are kept). Processes that want the same key at once (torchrun ranks, two runs) take a file
lock: one prepares, the others wait for it and then reuse its result.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
from collections.abc import Callable
from pathlib import Path

from attnlab.data import corpus, prepare  # prepare.prepare_corpus is looked up when called
from attnlab.data.prepare import FORMAT_VERSION, MANIFEST, source_units, tokenizer_identity
from attnlab.outputs import open_lock_file

MB = 1_000_000


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "attnlab" / "prepared"


def _sizes(fingerprint: dict) -> int:
    return int(fingerprint.get("size", 0)) + sum(_sizes(f) for f in fingerprint.get("files", []))


def source_size(source: str, text_field: str) -> tuple[int | None, list[dict]]:
    """(bytes of the source's files, None when unknown (hf://, the built-in corpus); its fingerprints)."""
    units = source_units(source, text_field)
    fingerprints = [u.fingerprint for u in units]
    if str(source) == corpus.SHAKESPEARE or str(source).startswith(corpus.HF_PREFIX):
        return None, fingerprints
    return sum(_sizes(fp) for fp in fingerprints), fingerprints


def cache_key(fingerprints: list[dict], tokenizer, tokenizer_spec: str, text_field: str, val_fraction: float, seed: int) -> str:
    identity = tokenizer_identity(tokenizer, tokenizer_spec)
    what = {"format": FORMAT_VERSION, "fingerprint": fingerprints, "vocab_sha256": identity["vocab_sha256"],
            "eos_id": identity["eos_id"], "text_field": text_field, "val_fraction": val_fraction, "seed": seed}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def cache_path(source: str, key: str, cache_dir: str | None) -> Path:
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(str(source).rstrip("/*")).name or "corpus")[:60]
    return root / f"{name}-{key}"


def prepared_cache(source: str, tokenizer, tokenizer_spec: str, text_field: str, val_fraction: float, seed: int,
                   cache_dir: str | None, fingerprints: list[dict], workers: int, say: Callable[[str], None],
                   progress=None) -> Path:
    """The cache directory holding `source` prepared with these settings, preparing it first if needed."""
    key = cache_key(fingerprints, tokenizer, tokenizer_spec, text_field, val_fraction, seed)
    out = cache_path(source, key, cache_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    with os.fdopen(open_lock_file(out.parent / f".{out.name}.lock"), "r+b") as lock:  # never through a planted link
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process preparing the same key: wait for it
        if (out / MANIFEST).is_file():
            say(f"data: reusing the prepared corpus {out}")
            return out
        say(f"data: preparing {source} once into {out} (tokens in memory-mapped shards; later runs reuse it)")
        prepare.prepare_corpus(source, out, tokenizer_spec, workers=workers, text_field=text_field,
                               val_fraction=val_fraction, seed=seed, progress=progress)
    return out
