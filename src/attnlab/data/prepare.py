"""Tokenize a corpus once into memory-mapped token shards: `attnlab data prepare`.

`prepare_corpus(source, out_dir, tokenizer_spec)` reads any source `data.source` accepts,
tokenizes its documents in a pool of worker processes (documents in batches of about 1 MB of text,
at most 2 x workers batches in flight; byte-level BPE tokenizers through `pretokenized.WordCachedEncoder`,
other HF fast tokenizers through the `tokenizers` batch encoder;
the byte tokenizer in the reading process, see `effective_workers`) and writes, in `out_dir`:

* ``shard-00000.bin``: the tokens of whole documents, each followed by the tokenizer's EOS id (as
  `packing.tokenize_documents` does), raw ``uint16`` when the vocabulary fits, else ``uint32``;
* ``shard-00000.idx.npy``: the start offset of every document in that shard (int64);
* ``shard-00000.json``: what the shard holds and the inputs it was made from, written last: a shard
  is complete when its ``.json`` exists and its files have the recorded sizes. Every file is written
  under a temporary name and renamed when complete, so a shard is complete or absent;
* ``manifest.json``, written last and atomically: the source fingerprint (paths, sizes, mtimes),
  tokenizer name and vocabulary hash, dtype, token and document counts per shard and in total, and
  the validation split.

A shard closes at the first document boundary at or past `shard_tokens` tokens, so shard
boundaries depend only on the documents and the tokenizer: a preparation that was interrupted and
is run again keeps the complete shards whose recorded inputs still match (same source, tokenizer and
shard size, the files they were read from unchanged) and redoes the rest, byte for byte as an
uninterrupted run would have written them.

The validation split holds whole documents: document number i (counting the non-empty documents
of the source in reading order) is held out when a hash of (seed, i) falls below `val_fraction`
(`is_validation`). It needs no second pass and `PreparedCorpus` recomputes it from the manifest.

What is streamed: local files, directories and globs are read one file at a time, a JSON Lines
file line by line and a Parquet file by batches of rows (a ``.txt`` file is one document and a
``.json`` file is read whole); documents go to the workers in batches and the tokens of a shard go to
disk as they arrive, so memory is bounded by the largest document (or ``.json`` file), the batches
in flight and a shard's document offsets. Not yet streamed: the built-in corpus, a saved dataset and ``hf://`` sources are read as one
list of documents by the existing readers (an ``hf://`` source is fingerprinted by its name only).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import hashlib
import json
import os
import signal
import tempfile
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from multiprocessing import current_process, get_context
from pathlib import Path

import numpy as np

from attnlab.data import corpus
from attnlab.data.pretokenized import WordCachedEncoder
from attnlab.errors import DataError
from attnlab.outputs import open_lock_file, replace_file

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
DEFAULT_SHARD_TOKENS = 100_000_000  # 200 MB of uint16 per shard

# The cheap check of a shard made whenever a prepared corpus is opened: the SHA-256 of SAMPLE_BLOCKS blocks of
# SAMPLE_BYTES spread evenly over the shard, its first and last blocks included (16 reads of 64 KiB, whatever
# the shard's size; a shard of at most SAMPLE_BLOCKS * SAMPLE_BYTES bytes is hashed whole). The full SHA-256
# (`sha256`) is checked with data.verify_shards.
SAMPLE_BLOCKS = 16
SAMPLE_BYTES = 1 << 16


def sampled_sha256(path: Path) -> str:
    """The SHA-256 of `path`'s sampled blocks (SAMPLE_BLOCKS of SAMPLE_BYTES, evenly spread, first and last
    included), each preceded by its offset, and of the file's size."""
    size = path.stat().st_size
    digest = hashlib.sha256(f"size {size}\n".encode())
    span = max(size - SAMPLE_BYTES, 0)
    starts = sorted({span * i // (SAMPLE_BLOCKS - 1) for i in range(SAMPLE_BLOCKS)}) if span else [0]
    with open(path, "rb") as f:
        for start in starts:
            f.seek(start)
            digest.update(f"{start}\n".encode())
            digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()
BATCH_BYTES = 1 << 20  # text per batch sent to a worker
WORKERS_NEED_MAIN_GUARD = (
    "Worker processes start with 'spawn', which imports the __main__ module again: where prepare_corpus runs "
    'from a script, call it under `if __name__ == "__main__":`; or pass workers=1.'
)
UINT16_LIMIT = 1 << 16


def shard_name(index: int) -> str:
    return f"shard-{index:05d}"


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id of a `vocab_size` vocabulary fits in it, else uint32."""
    return np.dtype(np.uint16) if vocab_size <= UINT16_LIMIT else np.dtype(np.uint32)


def is_validation(doc_indices: np.ndarray, val_fraction: float, seed: int) -> np.ndarray:
    """Which of the documents numbered `doc_indices` belong to the validation split (a bool array):
    those whose splitmix64 hash of (seed, index), as a fraction of 2**64, is below `val_fraction`."""
    if val_fraction <= 0.0:
        return np.zeros(len(doc_indices), dtype=bool)
    with np.errstate(over="ignore"):
        z = np.asarray(doc_indices, dtype=np.uint64) + np.uint64(seed & 0xFFFFFFFF) * np.uint64(0x9E3779B97F4A7C15)
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / float(1 << 53) < val_fraction


# --- the source: units of documents and their fingerprint ---------------------------------------


@dataclass
class Unit:
    """One piece of the source read at once: a data file, or a whole non-file source."""

    fingerprint: dict
    read: Callable[[], Iterable[str]]


def _file_fingerprint(path: Path) -> dict:
    stat = path.stat()
    return {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def source_units(source: str, text_field: str) -> list[Unit]:
    """The units of `source` in reading order (the order `read_documents` reads them in)."""
    source = str(source)
    if source == corpus.SHAKESPEARE:
        files = sorted(corpus.shakespeare_dir().glob("**/*.md"))
        return [Unit({"source": source, "files": [_file_fingerprint(f) for f in files]}, corpus.shakespeare_documents)]
    if source.startswith(corpus.HF_PREFIX):
        return [Unit({"source": source}, lambda: corpus.read_hf_cached(source, text_field))]
    resolved = corpus.resolve_local(source)
    if isinstance(resolved, Path):
        files = sorted(p for p in resolved.rglob("*") if p.is_file())
        fp = {"saved_dataset": str(resolved.resolve()), "files": [_file_fingerprint(f) for f in files]}
        return [Unit(fp, lambda: corpus.read_saved_dataset(resolved, text_field))]
    return [Unit(_file_fingerprint(f), lambda f=f: corpus.iter_file_documents(f, text_field)) for f in resolved]


def _documents(units: list[Unit]) -> Iterator[tuple[int, str]]:
    """(unit index, document) for every non-empty document, in order."""
    for u, unit in enumerate(units):
        for doc in unit.read():
            if doc.strip():
                yield u, doc


# --- the tokenizer: identity, and encoding in workers -------------------------------------------


def tokenizer_identity(tokenizer, spec: str) -> dict:
    """Name, class, vocabulary size, EOS id and a hash of the vocabulary (ids and added tokens)."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: (kv[1], kv[0]))
    digest = hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode("utf-8"))
    digest.update(f"eos={tokenizer.eos_token_id}".encode())
    return {
        "name": str(spec),
        "class": type(tokenizer).__name__,
        "vocab_size": len(tokenizer),
        "eos_id": tokenizer.eos_token_id,
        "vocab_sha256": digest.hexdigest(),
    }


_WORKER: dict = {}


class _Bytes:
    """The byte tokenizer's encoding (`ByteTokenizer.encode_bytes`) without loading transformers:
    what a worker process needs for the built-in tokenizer."""

    def __init__(self, eos_token_id: int):
        self.eos_token_id = eos_token_id

    def encode_bytes(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


class _Backend:
    """An HF fast tokenizer's `tokenizers` backend, as the reading process loaded it (transformers applied
    the tokenizer's config to it), without loading transformers: what a worker needs to encode."""

    is_fast = True

    def __init__(self, backend_file: str, eos_token_id: int):
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(backend_file)
        self.eos_token_id = eos_token_id


def _init_worker(spec: str, eos_token_id: int, backend_file: str | None = None) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the pool is the parallelism; no threads per worker
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the main process, which shuts the pool down
    if spec == "byte":
        _WORKER["tokenizer"] = _Bytes(eos_token_id)
        return
    if backend_file is not None:  # a worker starts in a fraction of a second instead of importing transformers
        _WORKER["tokenizer"] = _Backend(backend_file, eos_token_id)
        return
    from attnlab.data.tokenizer import load_tokenizer

    _WORKER["tokenizer"] = load_tokenizer(spec)


_WORD_CACHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _word_cached(tokenizer, backend):
    """The `WordCachedEncoder` of a tokenizer's `tokenizers` backend, one per tokenizer so that its cache of
    pieces lasts as long as the tokenizer; None where the pipeline is not one it reproduces."""
    kept = _WORD_CACHED.get(tokenizer)
    if kept is None or kept[0] is not backend:
        kept = _WORD_CACHED[tokenizer] = (backend, WordCachedEncoder.of(backend))
    return kept[1]


def encoder(tokenizer):
    """A function: list of documents -> list of int arrays (no special tokens): the byte tokenizer's
    bytes; for a byte-level BPE tokenizer `pretokenized.WordCachedEncoder` (the ids of `tokenizers`, several
    times faster); HF `tokenizers` batch encoding in Rust where the tokenizer has it; else the tokenizer's call.
    `packing.tokenize_documents` and the preparation both tokenize through it."""
    if hasattr(tokenizer, "encode_bytes"):  # ByteTokenizer, or _Bytes in a worker
        return lambda docs: [tokenizer.encode_bytes(d) for d in docs]
    backend = getattr(tokenizer, "_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is not None and hasattr(backend, "encode_batch"):  # HF `tokenizers`
        fast = _word_cached(tokenizer, backend)
        if fast is not None:  # a byte-level BPE pipeline: the same ids, pre-tokenized here, each piece encoded once
            return fast
        encode = getattr(backend, "encode_batch_fast", backend.encode_batch)  # _fast: the same ids, no offsets
        return lambda docs: [np.asarray(e.ids, dtype=np.int64) for e in encode(docs, add_special_tokens=False)]
    return lambda docs: [np.asarray(ids, dtype=np.int64) for ids in tokenizer(docs, add_special_tokens=False, verbose=False)["input_ids"]]


def join_with_eos(pieces: list, eos_id: int, dtype) -> np.ndarray:
    """The pieces one after another, each followed by `eos_id`, as one array of `dtype`."""
    flat = np.empty(sum(len(p) for p in pieces) + len(pieces), dtype=dtype)
    pos = 0
    for piece in pieces:
        flat[pos : pos + len(piece)] = piece
        pos += len(piece)
        flat[pos] = eos_id
        pos += 1
    return flat


def encode_batch(docs: list[str], dtype: str, tokenizer=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens of `docs`, each followed by EOS, as `dtype`; each document's length with its EOS;
    each document's UTF-8 bytes)."""
    tokenizer = tokenizer if tokenizer is not None else _WORKER["tokenizer"]
    pieces = encoder(tokenizer)(docs)
    lengths = np.fromiter((len(p) + 1 for p in pieces), dtype=np.int64, count=len(pieces))
    flat = join_with_eos(pieces, tokenizer.eos_token_id, dtype)
    text_bytes = np.fromiter((len(d.encode("utf-8")) for d in docs), dtype=np.int64, count=len(docs))
    return flat, lengths, text_bytes


def _batches(docs: Iterator[tuple[int, str]], skip: int) -> Iterator[tuple[int, list[int], list[str]]]:
    """(number of the batch's first document, each document's unit index, documents), skipping
    the first `skip` documents (they are read, not tokenized)."""
    batch: list[str] = []
    units: list[int] = []
    size = 0
    number = 0
    for unit, doc in docs:
        number += 1
        if number <= skip:
            continue
        batch.append(doc)
        units.append(unit)
        size += len(doc)
        if size >= BATCH_BYTES:
            yield number - len(batch), units, batch
            batch, units, size = [], [], 0
    if batch:
        yield number - len(batch), units, batch


def effective_workers(tokenizer, workers: int) -> int:
    """The processes that tokenize: `workers`, except for the byte tokenizer, whose encoding (a copy
    of the UTF-8 bytes) costs less than sending the text to another process: it runs in this one."""
    return 1 if hasattr(tokenizer, "encode_bytes") else max(1, workers)


class _Encoded:
    """Encoded batches in order, from a pool of processes (or this one when workers <= 1); at most
    2 x workers batches in flight, so memory does not grow with the corpus."""

    def __init__(self, spec: str, tokenizer, dtype: np.dtype, workers: int):
        self.dtype, self.workers, self.tokenizer = dtype.name, workers, tokenizer
        self.pool, self.backend_file = None, None
        if workers > 1 and getattr(current_process(), "_inheriting", False):
            # a worker process of another preparation, importing that script's __main__ as it starts
            raise DataError(WORKERS_NEED_MAIN_GUARD)
        if workers > 1:
            backend = getattr(tokenizer, "_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
            if backend is not None and hasattr(backend, "save"):
                # through a file, not the arguments: what a spawned worker is sent must fit the pipe's buffer,
                # or the start of a worker that dies before reading it waits for ever (multiprocessing)
                handle, self.backend_file = tempfile.mkstemp(prefix="attnlab-tokenizer-", suffix=".json")
                os.close(handle)
                backend.save(self.backend_file)
            self.pool = ProcessPoolExecutor(workers, mp_context=get_context("spawn"), initializer=_init_worker,
                                            initargs=(spec, tokenizer.eos_token_id, self.backend_file))

    def map(self, batches: Iterator[tuple[int, list[int], list[str]]]):
        """(first document number, unit indices, encode_batch's result) for every batch, in order."""
        if self.pool is None:
            for first, units, docs in batches:
                yield first, units, encode_batch(docs, self.dtype, self.tokenizer)
            return
        window: collections.deque = collections.deque()
        for first, units, docs in batches:
            try:
                window.append((first, units, self.pool.submit(encode_batch, docs, self.dtype)))
            except (BrokenPipeError, BrokenProcessPool) as error:  # a worker died as it started
                self.close(force=True)
                raise DataError(f"A tokenizing worker process failed to start ({type(error).__name__}). {WORKERS_NEED_MAIN_GUARD}") from None
            if len(window) >= 2 * self.workers:
                first, units, future = window.popleft()
                yield first, units, self._result(future)
        while window:
            first, units, future = window.popleft()
            yield first, units, self._result(future)

    def _result(self, future):
        try:
            return future.result()
        except BrokenProcessPool:
            self.close(force=True)
            raise DataError(f"A tokenizing worker process died (killed, or it failed as it started). {WORKERS_NEED_MAIN_GUARD}") from None

    def close(self, force: bool = False) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=not force, cancel_futures=True)  # force: a broken pool, nothing to wait for
            self.pool = None
        if self.backend_file is not None:
            Path(self.backend_file).unlink(missing_ok=True)
            self.backend_file = None


# --- files: atomic writes and the shard records -------------------------------------------------


def _write_json(path: Path, data: dict) -> None:
    replace_file(path, json.dumps(data, indent=1) + "\n", fsync=True)


def _open_for_writing(path: Path):
    """`open(path, "wb")` that refuses a symlink planted at `path` rather than writing through it."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o666), "wb")


def _our_files(out_dir: Path) -> list[Path]:
    return sorted(p for p in out_dir.glob("shard-*") if p.is_file()) + [p for p in (out_dir / MANIFEST, out_dir / (MANIFEST + ".tmp")) if p.exists()] + sorted(out_dir.glob(f".{MANIFEST}.*.tmp"))


def _existing_identity(out_dir: Path) -> dict | None:
    """The source and tokenizer an earlier preparation of `out_dir` recorded, if any."""
    candidates = [out_dir / MANIFEST] + sorted(out_dir.glob("shard-*.json"))
    for path in candidates:
        if path.is_file():
            try:
                record = json.loads(path.read_text(encoding="utf-8"))
                return {"source": record["source"], "tokenizer": record["tokenizer"], "where": path.name}
            except (OSError, ValueError, KeyError, TypeError):
                continue
    return None


def _kept_shards(out_dir: Path, inputs: dict, fingerprints: list[dict]) -> list[dict]:
    """The records of the leading complete shards made from `inputs` whose files are unchanged."""
    kept = []
    while True:
        name = shard_name(len(kept))
        meta_path = out_dir / f"{name}.json"
        if not meta_path.is_file():
            break
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            break
        units = meta.get("units", [])
        if meta.get("inputs") != inputs or units != fingerprints[: len(units)] or not units:
            break
        if meta.get("last") and units != fingerprints:  # the source grew: its short last shard must fill up
            break
        bin_path, idx_path = out_dir / f"{name}.bin", out_dir / f"{name}.idx.npy"
        if not bin_path.is_file() or bin_path.stat().st_size != meta["tokens"] * np.dtype(inputs["dtype"]).itemsize:
            break
        if not idx_path.is_file() or idx_path.stat().st_size != meta["idx_bytes"]:
            break
        if meta.get("sampled_sha256") is not None and sampled_sha256(bin_path) != meta["sampled_sha256"]:
            break  # overwritten in place since: made anew
        kept.append(meta)
    return kept


class _ShardWriter:
    """Writes one shard: tokens appended to a temporary file, then the index, then the record."""

    def __init__(self, out_dir: Path, index: int, doc_start: int, dtype: np.dtype):
        self.out_dir, self.index, self.doc_start, self.dtype = out_dir, index, doc_start, dtype
        self.name = shard_name(index)
        self.tmp = out_dir / f"{self.name}.bin.tmp"
        self.file = _open_for_writing(self.tmp)  # open for the life of the shard
        self.sha = hashlib.sha256()
        self.tokens = 0
        self.offsets: list[np.ndarray] = []
        self.bytes = 0

    def add(self, flat: np.ndarray, lengths: np.ndarray, text_bytes: int, last_unit: int) -> None:
        starts = self.tokens + np.concatenate(([0], np.cumsum(lengths[:-1])))
        self.offsets.append(starts.astype(np.int64))
        data = flat.tobytes()
        self.file.write(data)
        self.sha.update(data)
        self.tokens += len(flat)
        self.bytes += text_bytes
        self.last_unit = last_unit

    def finish(self, inputs: dict, units: list[dict], val_fraction: float, seed: int, last: bool = False) -> dict:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        offsets = np.concatenate(self.offsets) if self.offsets else np.zeros(0, dtype=np.int64)
        idx_tmp = self.out_dir / f"{self.name}.idx.tmp.npy"
        with _open_for_writing(idx_tmp) as f:
            np.save(f, offsets)
        os.replace(self.tmp, self.out_dir / f"{self.name}.bin")
        os.replace(idx_tmp, self.out_dir / f"{self.name}.idx.npy")
        record = {
            "shard": self.index,
            "file": f"{self.name}.bin",
            "index": f"{self.name}.idx.npy",
            "source": inputs["source"],
            "tokenizer": inputs["tokenizer"],
            "inputs": inputs,
            "units": units,
            "doc_start": self.doc_start,
            "documents": len(offsets),
            "tokens": int(self.tokens),
            "text_bytes": int(self.bytes),
            "idx_bytes": (self.out_dir / f"{self.name}.idx.npy").stat().st_size,
            "sha256": self.sha.hexdigest(),
            "sampled_sha256": sampled_sha256(self.out_dir / f"{self.name}.bin"),
            "last": last,  # ended by the end of the source, not by the shard size
        }
        record.update(_val_counts(offsets, self.tokens, self.doc_start, val_fraction, seed))
        _write_json(self.out_dir / f"{self.name}.json", record)
        return record

    def abort(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)


def _val_counts(offsets: np.ndarray, tokens: int, doc_start: int, val_fraction: float, seed: int) -> dict:
    held = is_validation(np.arange(doc_start, doc_start + len(offsets)), val_fraction, seed)
    lengths = np.diff(np.append(offsets, tokens))
    return {"val_documents": int(held.sum()), "val_tokens": int(lengths[held].sum())}


# --- the preparation ------------------------------------------------------------------------------


@dataclass
class Progress:
    """What `prepare_corpus` reports after every batch (and once when it resumes)."""

    text_bytes: int = 0
    tokens: int = 0
    documents: int = 0
    shards: int = 0
    kept_shards: int = 0
    total_bytes: int | None = None  # of the source files, when known
    source_bytes: int = 0  # of the source read so far: whole files, and the text so far of the file being read
    workers: int = 1  # processes that tokenize (see effective_workers)


LOCK = ".prepare.lock"
WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG, errno.EIO}


def prepare_corpus(source: str, out_dir: str | Path, *args, **kwargs) -> dict:
    """Prepare `source` into `out_dir` (see the module docstring); returns the manifest.

    One preparation at a time per directory: a second one (another process) is refused at once, naming the
    first. A write that fails (a full disk, a quota, a read-only file system) is one DataError; the shards
    completed before it are kept for the next run and no temporary file is left behind."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise DataError(f"--out {out_dir} is a file, not a directory. Give a directory (it is created if missing).")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"--out {out_dir} cannot be created ({e.strerror or e}); pass a directory you can write to.") from None
    with _exclusive(out_dir):
        try:
            return _prepare_unlocked(source, out_dir, *args, **kwargs)
        except OSError as e:
            if e.errno not in WRITE_ERRNOS and not (e.filename and Path(str(e.filename)).parent == out_dir):
                raise
            raise DataError(f"cannot write to {out_dir} ({e.strerror or e}): the preparation stopped. Complete shards are kept and "
                            "nothing half-written is left; free some space (or pass another --out) and run the same command "
                            "again to continue.") from None
        finally:
            _remove_temporaries(out_dir)


@contextlib.contextmanager
def _exclusive(out_dir: Path):
    """Hold `out_dir`'s preparation lock (flock on out_dir/.prepare.lock, holding the preparer's process id)."""
    import fcntl

    fd = open_lock_file(out_dir / LOCK)  # never through a planted link
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            raise DataError(f"another attnlab data prepare{f' (process {holder})' if holder.isdigit() else ''} is writing to "
                            f"{out_dir} now; wait for it to finish (then run this command again: its shards are reused), "
                            "or pass another --out.") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def _remove_temporaries(out_dir: Path) -> None:
    """The temporary files of a stopped preparation (only ever ours: the lock is held)."""
    for tmp in [*out_dir.glob("shard-*.tmp*"), *out_dir.glob(".shard-*.tmp"), *out_dir.glob(f".{MANIFEST}.*.tmp")]:
        with contextlib.suppress(OSError):
            tmp.unlink()


def _prepare_unlocked(
    source: str,
    out_dir: str | Path,
    tokenizer_spec: str = "byte",
    workers: int = 1,
    text_field: str = "text",
    val_fraction: float = 0.0,
    seed: int = 0,
    overwrite: bool = False,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    progress: Callable[[Progress], None] | None = None,
) -> dict:
    """Prepare `source` into `out_dir` (see the module docstring); returns the manifest."""
    from attnlab.data.tokenizer import load_tokenizer

    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"--val-fraction must be in [0, 1), got {val_fraction}. Use e.g. 0.01, or 0 for no validation.")
    if shard_tokens < 1:
        raise DataError(f"--shard-tokens must be a positive number of tokens, got {shard_tokens}.")
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise DataError(f"--out {out_dir} is a file, not a directory. Give a directory (it is created if missing).")
    units = source_units(source, text_field)
    fingerprints = [u.fingerprint for u in units]
    tokenizer = load_tokenizer(tokenizer_spec)
    if tokenizer.eos_token_id is None:
        raise DataError(f"The tokenizer {tokenizer_spec!r} has no EOS token, which goes between documents. Add one and save it again.")
    identity = tokenizer_identity(tokenizer, tokenizer_spec)
    dtype = token_dtype(identity["vocab_size"])
    inputs = {"format": FORMAT_VERSION, "source": str(source), "text_field": text_field, "tokenizer": identity,
              "dtype": dtype.name, "shard_tokens": int(shard_tokens)}

    out_dir.mkdir(parents=True, exist_ok=True)
    if overwrite:
        for path in _our_files(out_dir):
            path.unlink()
    else:
        found = _existing_identity(out_dir)
        if found is not None and (found["source"] != inputs["source"] or found["tokenizer"] != identity):
            what = "source" if found["source"] != inputs["source"] else "tokenizer"
            raise DataError(
                f"{out_dir} was prepared from a different {what} ({found['source']!r} with tokenizer "
                f"{found['tokenizer'].get('name')!r}, per {found['where']}); pass --overwrite to start it afresh, or choose another --out."
            )
    (out_dir / MANIFEST).unlink(missing_ok=True)  # the directory is not a complete corpus until the end
    for tmp in [*out_dir.glob("shard-*.tmp*"), *out_dir.glob(".shard-*.tmp")]:
        tmp.unlink()

    kept = _kept_shards(out_dir, inputs, fingerprints)
    for path in out_dir.glob("shard-*"):  # shards after the kept ones are redone
        number = path.name.split(".")[0].split("-")[-1]
        if number.isdigit() and int(number) >= len(kept):
            path.unlink()

    sizes = np.array([fp.get("size", 0) for fp in fingerprints], dtype=np.int64)
    workers = effective_workers(tokenizer, workers)
    state = Progress(total_bytes=int(sizes.sum()) or None, kept_shards=len(kept), shards=len(kept), workers=workers)
    state.source_bytes = int(sizes[: len(kept[-1]["units"]) - 1].sum()) if kept else 0
    state.tokens = sum(m["tokens"] for m in kept)
    state.documents = sum(m["documents"] for m in kept)
    state.text_bytes = sum(m["text_bytes"] for m in kept)
    if progress:
        progress(state)

    records = list(kept)
    encoded = _Encoded(str(tokenizer_spec), tokenizer, dtype, workers)
    writer: _ShardWriter | None = None
    try:
        batches = _batches(_documents(units), state.documents)
        for doc_number, doc_units, (flat, lengths, doc_bytes) in encoded.map(batches):
            # A batch may cross the shard size: split it at the first document boundary past it.
            start = 0
            while start < len(lengths):
                if writer is None:
                    writer = _ShardWriter(out_dir, len(records), doc_number + start, dtype)
                need = shard_tokens - writer.tokens
                ends = np.cumsum(lengths[start:])
                stop = start + int(np.searchsorted(ends, need)) + 1 if ends[-1] >= need else len(lengths)
                lo = int(lengths[:start].sum())
                hi = lo + int(lengths[start:stop].sum())
                share = int(doc_bytes[start:stop].sum())
                writer.add(flat[lo:hi], lengths[start:stop], share, doc_units[stop - 1])
                state.tokens += hi - lo
                state.documents += stop - start
                state.text_bytes += share
                if writer.tokens >= shard_tokens:
                    records.append(writer.finish(inputs, fingerprints[: writer.last_unit + 1], val_fraction, seed))
                    writer = None
                    state.shards = len(records)
                start = stop
            # Files read completely, and within the file being read its text so far (about its bytes).
            done_files = int(sizes[: doc_units[-1]].sum())
            state.source_bytes = max(done_files, min(state.text_bytes, done_files + int(sizes[doc_units[-1]])))
            if progress:
                progress(state)
        if writer is not None and writer.tokens:
            records.append(writer.finish(inputs, fingerprints, val_fraction, seed, last=True))
            writer = None
            state.shards = len(records)
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    finally:
        encoded.close()
    if not records:
        raise DataError(f"The corpus {source!r} is empty: it has no text other than whitespace. Point SOURCE at files that contain text.")
    state.source_bytes = int(sizes.sum())
    if progress:
        progress(state)
    return _write_manifest(out_dir, inputs, fingerprints, records, val_fraction, seed)


def _write_manifest(out_dir: Path, inputs: dict, fingerprints: list[dict], records: list[dict], val_fraction: float, seed: int) -> dict:
    shards = []
    for meta in records:
        val = _val_counts(np.load(out_dir / meta["index"]), meta["tokens"], meta["doc_start"], val_fraction, seed)
        shards.append({
            "file": meta["file"], "index": meta["index"], "doc_start": meta["doc_start"], "documents": meta["documents"],
            "tokens": meta["tokens"], "text_bytes": meta["text_bytes"], "sha256": meta["sha256"],
            "sampled_sha256": meta.get("sampled_sha256") or sampled_sha256(out_dir / meta["file"]), **val,
        })
    manifest = {
        "format": FORMAT_VERSION,
        "source": inputs["source"],
        "text_field": inputs["text_field"],
        "fingerprint": fingerprints,
        "tokenizer": inputs["tokenizer"],
        "dtype": inputs["dtype"],
        "shard_tokens": inputs["shard_tokens"],
        "shards": shards,
        "documents": sum(s["documents"] for s in shards),
        "tokens": sum(s["tokens"] for s in shards),
        "text_bytes": sum(s["text_bytes"] for s in shards),
        "validation": {
            "rule": "document i is held out when splitmix64(seed, i) / 2**64 < fraction (attnlab.data.prepare.is_validation)",
            "fraction": val_fraction,
            "seed": seed,
            "documents": sum(s["val_documents"] for s in shards),
            "tokens": sum(s["val_tokens"] for s in shards),
        },
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    _write_json(out_dir / MANIFEST, manifest)
    return manifest
