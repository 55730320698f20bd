"""Reading a corpus written by `attnlab data prepare` (see `attnlab.data.prepare`).

`PreparedCorpus(DIR)` checks the manifest and every shard (present, of the recorded size, its sampled
blocks' SHA-256 as recorded (manifests written before it was recorded: unchecked), with a document index that
fits it; with ``verify=True`` also the SHA-256 of all its tokens), memory-maps the
shards (`numpy.memmap`: nothing is read until used) and gives the total token count and the
train / validation token ranges. Token positions are global: shard after shard, in manifest order.
Every problem is one `DataError` naming the file and what to do.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from attnlab.data.prepare import FORMAT_VERSION, MANIFEST, SAMPLE_BLOCKS, is_validation, sampled_sha256
from attnlab.errors import DataError
from attnlab.outputs import inside


class PreparedCorpus:
    """The memory-mapped shards of a prepared corpus directory."""

    def __init__(self, directory: str | Path, verify: bool = False):
        self.directory = Path(directory)
        self.manifest = _read_manifest(self.directory)
        m = self.manifest
        self.dtype = np.dtype(m["dtype"])
        redo = f"Prepare it again: attnlab data prepare {m['source']} --out {self.directory} (complete shards are kept)."
        self.shards: list[np.memmap] = []
        self.doc_offsets: list[np.ndarray] = []
        for entry in m["shards"]:
            path = _in_corpus(self.directory, entry, "file")
            expected = entry["tokens"] * self.dtype.itemsize
            if not path.is_file():
                raise DataError(f"The shard {path} is missing. {redo}")
            size = path.stat().st_size
            if size != expected:
                raise DataError(f"The shard {path} is {size:,} bytes, not the {expected:,} its manifest records: it is truncated or corrupt. {redo}")
            if not verify and entry.get("sampled_sha256") is not None and sampled_sha256(path) != entry["sampled_sha256"]:
                raise DataError(f"The shard {path} does not match the checksum of its sampled blocks (first, last and {SAMPLE_BLOCKS - 2} "
                                f"between) that {MANIFEST} records: it was changed after it was prepared. {redo} "
                                "To check every shard in full first, train with --set data.verify_shards=true.")
            if verify and _sha256(path) != entry["sha256"]:
                raise DataError(f"The shard {path} does not match the SHA-256 its manifest records: it is corrupt. {redo}")
            index_path = _in_corpus(self.directory, entry, "index")
            try:
                offsets = np.load(index_path)
            except (OSError, ValueError) as exc:
                raise DataError(f"Cannot read the document index {index_path}: {exc}. {redo}") from None
            if (offsets.ndim != 1 or len(offsets) != entry["documents"] or (len(offsets) and (offsets[0] != 0 or offsets[-1] >= entry["tokens"]))
                    or np.any(np.diff(offsets) <= 0)):
                raise DataError(f"The document index {index_path} does not fit its shard ({entry['documents']} documents, {entry['tokens']} tokens). {redo}")
            self.shards.append(np.memmap(path, dtype=self.dtype, mode="r", shape=(entry["tokens"],)) if entry["tokens"] else np.zeros(0, self.dtype))
            self.doc_offsets.append(offsets)
        self.shard_starts = np.concatenate(([0], np.cumsum([e["tokens"] for e in m["shards"]]))).astype(np.int64)
        self.train_ranges, self.val_ranges = self._split_ranges()

    @property
    def total_tokens(self) -> int:
        return int(self.shard_starts[-1])

    @property
    def tokenizer(self) -> dict:
        """Name, class, vocabulary size, EOS id and vocabulary hash of the tokenizer used."""
        return self.manifest["tokenizer"]

    @property
    def train_tokens(self) -> int:
        return int((self.train_ranges[:, 1] - self.train_ranges[:, 0]).sum())

    @property
    def val_tokens(self) -> int:
        return int((self.val_ranges[:, 1] - self.val_ranges[:, 0]).sum())

    def tokens(self, start: int, end: int) -> np.ndarray:
        """The tokens at global positions [start, end), across shard boundaries (a copy when it crosses one)."""
        if not 0 <= start <= end <= self.total_tokens:
            raise IndexError(f"token range [{start}, {end}) is outside [0, {self.total_tokens})")
        first = int(np.searchsorted(self.shard_starts, start, side="right")) - 1
        pieces = []
        while start < end:
            lo = start - int(self.shard_starts[first])
            hi = min(end, int(self.shard_starts[first + 1])) - int(self.shard_starts[first])
            pieces.append(self.shards[first][lo:hi])
            start += hi - lo
            first += 1
        if len(pieces) == 1:
            return pieces[0]
        return np.concatenate(pieces) if pieces else np.zeros(0, self.dtype)

    def _split_ranges(self) -> tuple[np.ndarray, np.ndarray]:
        """[N, 2] arrays of global [start, end) token ranges of the train and validation documents,
        adjacent documents of the same split merged."""
        val = self.manifest["validation"]
        starts, ends, held = [], [], []
        for entry, offsets, base in zip(self.manifest["shards"], self.doc_offsets, self.shard_starts):
            starts.append(base + offsets)
            ends.append(base + np.append(offsets[1:], entry["tokens"]))
            held.append(is_validation(np.arange(entry["doc_start"], entry["doc_start"] + entry["documents"]), val["fraction"], val["seed"]))
        if not starts:
            empty = np.zeros((0, 2), dtype=np.int64)
            return empty, empty
        starts_a, ends_a, held_a = np.concatenate(starts), np.concatenate(ends), np.concatenate(held)
        return _merge(starts_a[~held_a], ends_a[~held_a]), _merge(starts_a[held_a], ends_a[held_a])

    def __repr__(self) -> str:
        return (f"PreparedCorpus({str(self.directory)!r}: {self.total_tokens:,} tokens in {len(self.shards)} shards, "
                f"{self.val_tokens:,} for validation, tokenizer {self.tokenizer['name']!r})")


def _merge(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    if not len(starts):
        return np.zeros((0, 2), dtype=np.int64)
    breaks = np.nonzero(starts[1:] != ends[:-1])[0]
    return np.stack([np.concatenate(([starts[0]], starts[breaks + 1])), np.concatenate((ends[breaks], [ends[-1]]))], axis=1).astype(np.int64)


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _in_corpus(directory: Path, entry: dict, key: str) -> Path:
    """The file a manifest entry names, refused if it leads outside the corpus directory (absolute, '..', a link)."""
    name = entry[key]
    try:
        inside(directory, name)
    except (ValueError, TypeError):
        raise DataError(f"{directory / MANIFEST}: shard entry {entry.get('shard', '?')} names {key} {name!r}, outside the corpus "
                        f"directory {directory}. A prepared corpus holds its shards itself: prepare it again with --overwrite.") from None
    return directory / name


def _read_manifest(directory: Path) -> dict:
    path = directory / MANIFEST
    if not directory.is_dir():
        raise DataError(f"{directory} is not a directory. Give the --out directory of `attnlab data prepare`.")
    if not path.is_file():
        raise DataError(
            f"{directory} holds no {MANIFEST}: it is not a prepared corpus, or its preparation did not finish. "
            "Run `attnlab data prepare SOURCE --out DIR` (again: complete shards are kept)."
        )
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise DataError(f"Cannot read {path}: {exc}. Prepare the corpus again with --overwrite.") from None
    keys = ("format", "source", "tokenizer", "dtype", "shards", "validation")
    if not isinstance(manifest, dict) or any(k not in manifest for k in keys):
        raise DataError(f"{path} is not a manifest of `attnlab data prepare` (it lacks {', '.join(keys)}). Prepare the corpus again with --overwrite.")
    if manifest["format"] != FORMAT_VERSION:
        raise DataError(f"{path} has format {manifest['format']}, this attnlab reads format {FORMAT_VERSION}. Prepare the corpus again with --overwrite.")
    return manifest
