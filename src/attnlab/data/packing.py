"""Train/validation split and packing of documents into fixed-length token blocks."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from attnlab.data.corpus import read_documents
from attnlab.data.prepare import encoder, join_with_eos
from attnlab.errors import DataError

_HF_BATCH = 1000  # documents per call to a Hugging Face tokenizer


def split_documents(docs: Sequence[str], val_fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """Deterministically split `docs` into (train, val).

    With two or more documents, whole documents (in an order shuffled by `seed`) are held
    out until at least `val_fraction` of the characters are, keeping at least one document
    for training. A single document is cut at (1 - val_fraction) of its length.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"data.val_fraction must be in [0, 1), got {val_fraction}. Use e.g. 0.05, or 0 for no validation.")
    docs = list(docs)
    if val_fraction == 0.0 or not docs:
        return docs, []
    if len(docs) == 1:
        text = docs[0]
        if len(text) < 2:
            return docs, []
        cut = min(max(round(len(text) * (1.0 - val_fraction)), 1), len(text) - 1)
        return [text[:cut]], [text[cut:]]

    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    target = val_fraction * sum(len(d) for d in docs)
    held: set[int] = set()
    held_chars = 0
    for index in order:
        if held_chars >= target or len(held) == len(docs) - 1:
            break
        held.add(index)
        held_chars += len(docs[index])
    train = [d for i, d in enumerate(docs) if i not in held]
    val = [d for i, d in enumerate(docs) if i in held]
    return train, val


def tokenize_documents(docs: Sequence[str], tokenizer) -> np.ndarray:
    """All documents' token ids, each followed by the tokenizer's EOS id, as one int64 array."""
    eos_id = tokenizer.eos_token_id
    if eos_id is None:
        raise DataError(
            "The tokenizer has no EOS token, which packing puts between documents. "
            "Add one (tokenizer.add_special_tokens({'eos_token': ...})) and save the tokenizer again."
        )
    encode, pieces = encoder(tokenizer), []
    for start in range(0, len(docs), _HF_BATCH):  # in batches: bounded memory for the encoder's own objects
        pieces.extend(encode(list(docs[start : start + _HF_BATCH])))
    return join_with_eos(pieces, eos_id, np.int64)


def _blocks(flat: np.ndarray, seq_len: int, what: str, fix: str = "Lower data.seq_len or add more data.") -> torch.Tensor:
    if not isinstance(seq_len, int) or seq_len < 1:
        raise DataError(f"data.seq_len must be a positive integer, got {seq_len!r}.")
    n_blocks = len(flat) // seq_len
    if n_blocks == 0:
        raise DataError(
            f"The sequence length ({seq_len} tokens) is longer than the {what} ({len(flat)} tokens). {fix}"
        )
    return torch.from_numpy(flat[: n_blocks * seq_len].reshape(n_blocks, seq_len))


def pack_documents(docs: Sequence[str], tokenizer, seq_len: int) -> torch.Tensor:
    """Tokenise `docs`, put EOS after each, concatenate and cut into [N, seq_len] blocks.

    The tokens left over after the last full block are dropped.
    """
    return _blocks(tokenize_documents(docs, tokenizer), seq_len, "data")


@dataclass
class PackedData:
    """Packed training (and optional validation) blocks plus corpus statistics.

    `stats` keys: train_documents, val_documents, train_tokens, val_tokens (all tokens
    including EOS, before the remainder is dropped), train_bytes, val_bytes (UTF-8 bytes of
    the text), train_blocks, val_blocks, seq_len and val_bytes_per_token (val_bytes /
    val_tokens, to turn a loss per token into bits per byte; None without validation).
    """

    train: torch.Tensor
    val: torch.Tensor | None
    stats: dict = field(default_factory=dict)


def _utf8_bytes(docs: Sequence[str]) -> int:
    return sum(len(d.encode("utf-8")) for d in docs)


def build_datasets(
    source: str,
    tokenizer,
    seq_len: int,
    val_fraction: float,
    seed: int,
    text_field: str = "text",
    val_source: str | None = None,
) -> PackedData:
    """Read `source`, split off validation (or read `val_source`), and pack both."""
    docs = read_documents(source, text_field=text_field)
    if val_source:
        train_docs, val_docs = docs, read_documents(val_source, text_field=text_field)
    else:
        train_docs, val_docs = split_documents(docs, val_fraction, seed)

    train_flat = tokenize_documents(train_docs, tokenizer)
    train = _blocks(train_flat, seq_len, "training data")
    stats = {
        "seq_len": seq_len,
        "train_documents": len(train_docs),
        "train_tokens": int(len(train_flat)),
        "train_bytes": _utf8_bytes(train_docs),
        "train_blocks": int(train.shape[0]),
        "val_documents": len(val_docs),
        "val_tokens": 0,
        "val_bytes": 0,
        "val_blocks": 0,
        "val_bytes_per_token": None,
    }
    val = None
    if val_docs:
        val_flat = tokenize_documents(val_docs, tokenizer)
        if val_source:
            val = _blocks(val_flat, seq_len, f"validation data in {val_source!r}")
        else:
            fix = (
                f"Lower data.seq_len, raise data.val_fraction (now {val_fraction}), "
                "or set it to 0 for no validation."
            )
            val = _blocks(val_flat, seq_len, "validation split", fix)
        val_bytes = _utf8_bytes(val_docs)
        stats.update(
            val_tokens=int(len(val_flat)),
            val_bytes=val_bytes,
            val_blocks=int(val.shape[0]),
            val_bytes_per_token=val_bytes / len(val_flat),
        )
    return PackedData(train=train, val=val, stats=stats)


class BlockDataset(Dataset):
    """A torch Dataset over [N, seq_len] blocks; labels equal inputs (the model shifts them)."""

    def __init__(self, blocks: torch.Tensor):
        if blocks.dim() != 2:
            raise ValueError(f"blocks must be a 2-D [N, seq_len] tensor, got shape {tuple(blocks.shape)}")
        self.blocks = blocks

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        row = self.blocks[index]
        return {"input_ids": row, "labels": row}
