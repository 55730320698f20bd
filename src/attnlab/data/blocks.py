"""Training blocks read lazily from a prepared corpus (`attnlab data prepare`, `PreparedCorpus`).

The training documents of the corpus, one after another (each ends with EOS, as packing writes
them), are cut into blocks of `seq_len` tokens; the tokens after the last full block are dropped.
Block b is read from the memory maps when it is asked for: nothing of the corpus is copied into
memory before training starts, and memory does not grow with the corpus.

Order: training reads a stream of positions 0, 1, 2, ...; position p is block
``BlockOrder(n_blocks, seed).block(p)``: epoch e = p // n_blocks takes every block once, in the order
of a seeded permutation of its own (a Feistel network over the block numbers, computed per position
in O(1) time and memory, so that neither a start nor a resume materialises a permutation). The
position after global step s is ``s * batch_size * grad_accum`` (the global batch): the checkpoint
records it (``data_state.json``) and a resume starts there, so it sees exactly the batches the
uninterrupted run would have seen. Under torchrun each micro-batch of `batch_size` consecutive
positions is cut into one slice per rank (accelerate hands out the per-rank batches in turn), so the
ranks read disjoint blocks and together the single-process batch.

Validation: the manifest's held-out documents (whole documents), one after another, cut into blocks;
the first ``train.eval_batches * train.batch_size`` of them are read once into memory.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from attnlab.data.prepare import MANIFEST, tokenizer_identity
from attnlab.data.prepared import PreparedCorpus
from attnlab.errors import DataError

DATA_STATE = "data_state.json"  # in a checkpoint: the position of the block stream
_M64 = (1 << 64) - 1
_ROUNDS = 4


def is_prepared(source: str) -> bool:
    """Whether `source` names a directory written by `attnlab data prepare` (finished or not: one whose
    preparation did not finish is refused by `PreparedCorpus`, never read as raw JSON files)."""
    path = Path(str(source)).expanduser()
    return path.is_dir() and ((path / MANIFEST).is_file() or any(path.glob("shard-[0-9]*.bin*")))


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on a uint64 array (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _key(*values: int) -> int:
    digest = hashlib.sha256(json.dumps(values).encode()).digest()
    return int.from_bytes(digest[:8], "little")


class BlockOrder:
    """A seeded permutation of range(n) per epoch: a balanced Feistel network on the smallest even
    number of bits that holds n, with cycle walking (values >= n go round again, fewer than 4 rounds
    on average). Any position maps to its block in O(1); no permutation is stored."""

    def __init__(self, n: int, seed: int):
        if n < 1:
            raise ValueError(f"a block order needs at least one block, got {n}")
        self.n, self.seed = int(n), int(seed)
        bits = max(2, (self.n - 1).bit_length())
        bits += bits % 2
        self.half = bits // 2
        self.mask = np.uint64((1 << self.half) - 1)
        self._keys: dict[int, list[np.uint64]] = {}

    def _round_keys(self, epoch: int) -> list[np.uint64]:
        keys = self._keys.get(epoch)
        if keys is None:
            keys = [np.uint64(_key(self.seed, epoch, r)) for r in range(_ROUNDS)]
            self._keys = {epoch: keys}  # one epoch at a time is all a run needs
        return keys

    def _permute(self, x: np.ndarray, keys: list[np.uint64]) -> np.ndarray:
        half = np.uint64(self.half)
        left, right = x >> half, x & self.mask
        with np.errstate(over="ignore"):
            for key in keys:
                left, right = right, left ^ (_mix(right ^ key) & self.mask)
        return (left << half) | right

    def permutation(self, indices: np.ndarray, epoch: int) -> np.ndarray:
        """The blocks at places `indices` (each in [0, n)) of epoch `epoch`'s order."""
        keys = self._round_keys(epoch)
        x = np.asarray(indices, dtype=np.uint64)
        out = self._permute(x, keys)
        todo = out >= self.n
        while todo.any():
            out[todo] = self._permute(out[todo], keys)
            todo = out >= self.n
        return out.astype(np.int64)

    def blocks(self, positions: np.ndarray) -> np.ndarray:
        """The block read at each stream position."""
        positions = np.asarray(positions, dtype=np.int64)
        epochs, places = np.divmod(positions, self.n)
        out = np.empty(len(positions), dtype=np.int64)
        for epoch in np.unique(epochs):
            at = epochs == epoch
            out[at] = self.permutation(places[at], int(epoch))
        return out

    def block(self, position: int) -> int:
        return int(self.blocks(np.array([position]))[0])


class _Stream:
    """Documents of one split of a prepared corpus read as one stream of tokens."""

    def __init__(self, corpus: PreparedCorpus, ranges: np.ndarray):
        self.corpus = corpus
        self.ranges = ranges
        self.cum = np.concatenate(([0], np.cumsum(ranges[:, 1] - ranges[:, 0]))).astype(np.int64)
        self.vocab_size = int(corpus.tokenizer["vocab_size"])

    @property
    def tokens(self) -> int:
        return int(self.cum[-1])

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of the stream as int64, checked against the vocabulary."""
        k = int(np.searchsorted(self.cum, start, side="right")) - 1
        pieces, end = [], start + length
        while start < end:
            lo = int(self.ranges[k, 0]) + start - int(self.cum[k])
            take = min(end, int(self.cum[k + 1])) - start
            pieces.append(self.corpus.tokens(lo, lo + take))
            start += take
            k += 1
        out = np.concatenate(pieces).astype(np.int64) if len(pieces) > 1 else pieces[0].astype(np.int64)
        if len(out) and int(out.max()) >= self.vocab_size:
            bad = int(np.argmax(out >= self.vocab_size))
            shard = self._shard_of(end - length + bad)
            raise DataError(
                f"The prepared corpus {self.corpus.directory} holds token id {int(out[bad])} in {shard}, outside its "
                f"tokenizer's {self.vocab_size} ids: the shard is corrupt. Check it with data.verify_shards=true, and prepare "
                f"the corpus again (attnlab data prepare {self.corpus.manifest['source']} --out {self.corpus.directory} --overwrite)."
            )
        return out

    def _shard_of(self, position: int) -> str:
        k = int(np.searchsorted(self.cum, position, side="right")) - 1
        global_pos = int(self.ranges[k, 0]) + position - int(self.cum[k])
        shard = int(np.searchsorted(self.corpus.shard_starts, global_pos, side="right")) - 1
        return self.corpus.manifest["shards"][shard]["file"]


class PreparedBlocks(Dataset):
    """The training blocks of a prepared corpus; item i is the block at stream position i
    (`BlockOrder`), read from the memory maps. Labels equal inputs (the model shifts them)."""

    def __init__(self, corpus: PreparedCorpus, seq_len: int, seed: int):
        self.stream = _Stream(corpus, corpus.train_ranges)
        self.seq_len, self.seed = int(seq_len), int(seed)
        self.n_blocks = self.stream.tokens // self.seq_len
        if self.n_blocks == 0:
            raise DataError(f"The sequence length ({seq_len} tokens) is longer than the training data of {corpus.directory} "
                            f"({self.stream.tokens} tokens). Lower data.seq_len or prepare more data.")
        self.order = BlockOrder(self.n_blocks, seed)

    def __len__(self) -> int:
        """Blocks in one epoch."""
        return self.n_blocks

    def block(self, index: int) -> np.ndarray:
        """Block `index` (in corpus order) as int64 tokens."""
        return self.stream.read(index * self.seq_len, self.seq_len)

    def __getitem__(self, position: int) -> dict[str, torch.Tensor]:
        row = torch.from_numpy(self.block(self.order.block(position)))
        return {"input_ids": row, "labels": row}

    def identity(self) -> dict:
        """What fixes the stream: a resume checks it against the checkpoint's."""
        m = self.stream.corpus.manifest
        return {"blocks": self.n_blocks, "seq_len": self.seq_len, "seed": self.seed, "tokens": m["tokens"],
                "vocab_sha256": m["tokenizer"]["vocab_sha256"]}


class PositionSampler(Sampler[int]):
    """Stream positions start, start + 1, ... (`length` of them): the training order of `PreparedBlocks`."""

    def __init__(self, start: int, length: int):
        self.start, self.length = int(start), int(length)

    def __iter__(self):
        return iter(range(self.start, self.start + self.length))

    def __len__(self) -> int:
        return self.length


@dataclass
class PreparedData:
    """What `build_prepared` gives the trainer: lazy training blocks, the validation rows (or None),
    and the same `stats` keys as `packing.PackedData` (bytes that a prepared corpus does not record
    per split are None)."""

    train: PreparedBlocks
    val: torch.Tensor | None
    corpus: PreparedCorpus
    stats: dict = field(default_factory=dict)


def _val_bytes_per_token(tokenizer, rows: torch.Tensor) -> float:
    """UTF-8 bytes of the text per token of `rows` (EOS included, as packing counts it)."""
    ids = rows.reshape(-1)
    if hasattr(tokenizer, "encode_bytes"):  # the byte tokenizer: ids below 256 are the bytes
        text_bytes = int((ids < 256).sum())
    else:
        text_bytes = len(tokenizer.decode(ids.tolist(), skip_special_tokens=True).encode("utf-8"))
    return text_bytes / max(len(ids), 1)


def build_prepared(directory: str | Path, tokenizer, seq_len: int, seed: int, eval_rows: int, verify: bool = False,
                   val_blocks: torch.Tensor | None = None, val_documents: int | None = None) -> PreparedData:
    """Open a prepared corpus for training; `val_blocks` (from data.val_source, of `val_documents`
    documents) replaces its validation split."""
    corpus = PreparedCorpus(directory, verify=verify)
    train = PreparedBlocks(corpus, seq_len, seed)
    m = corpus.manifest
    val = val_blocks
    if val is None and corpus.val_tokens:
        stream = _Stream(corpus, corpus.val_ranges)
        rows = min(eval_rows, stream.tokens // seq_len)
        val = torch.from_numpy(stream.read(0, rows * seq_len).reshape(rows, seq_len)) if rows else None
    stats = {
        "seq_len": seq_len,
        "train_documents": m["documents"] - m["validation"]["documents"],
        "train_tokens": corpus.train_tokens,
        "train_bytes": None,
        "train_blocks": train.n_blocks,
        "val_documents": m["validation"]["documents"] if val_blocks is None else val_documents,
        "val_tokens": corpus.val_tokens if val_blocks is None else int(val_blocks.numel()),
        "val_bytes": None,
        "val_blocks": 0 if val is None else int(val.shape[0]),
        "val_bytes_per_token": None if val is None else _val_bytes_per_token(tokenizer, val),
        "prepared": str(corpus.directory),
    }
    return PreparedData(train=train, val=val, corpus=corpus, stats=stats)


def check_tokenizer(manifest: dict, tokenizer, spec: str, directory: Path) -> None:
    """DataError unless the corpus in `directory` was tokenized by this tokenizer (same vocabulary and EOS)."""
    theirs, ours = manifest["tokenizer"], tokenizer_identity(tokenizer, spec)
    if theirs.get("vocab_sha256") == ours["vocab_sha256"] and theirs.get("eos_id") == ours["eos_id"]:
        return
    raise DataError(
        f"{directory} was prepared with the tokenizer {theirs.get('name')!r} ({theirs.get('class')}, {theirs.get('vocab_size')} ids), "
        f"but the model is trained with data.tokenizer={spec!r} ({ours['class']}, {ours['vocab_size']} ids): its token ids would mean "
        f"other tokens. Set data.tokenizer={theirs.get('name')!r}, or prepare the corpus again with this tokenizer: "
        f"attnlab data prepare {manifest['source']} --out DIR --tokenizer {spec}."
    )
