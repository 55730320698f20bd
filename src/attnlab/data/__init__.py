"""Data: tokenizers, reading corpora, and packing them into training blocks.

The names below are imported on first use, so that a module of this package (the workers of
`attnlab data prepare`) starts without importing torch and transformers.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "SHAKESPEARE": "corpus",
    "markdown_to_text": "corpus",
    "read_documents": "corpus",
    "shakespeare_documents": "corpus",
    "BlockDataset": "packing",
    "PackedData": "packing",
    "build_datasets": "packing",
    "pack_documents": "packing",
    "split_documents": "packing",
    "tokenize_documents": "packing",
    "BOS_ID": "tokenizer",
    "EOS_ID": "tokenizer",
    "PAD_ID": "tokenizer",
    "ByteTokenizer": "tokenizer",
    "load_tokenizer": "tokenizer",
    "register_auto_tokenizer": "tokenizer",
    "PreparedCorpus": "prepared",
    "PreparedBlocks": "blocks",
    "build_prepared": "blocks",
    "prepare_corpus": "prepare",
}
from attnlab.errors import DataError  # light: no third-party imports

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "PAD_ID",
    "SHAKESPEARE",
    "BlockDataset",
    "ByteTokenizer",
    "DataError",
    "PackedData",
    "PreparedBlocks",
    "PreparedCorpus",
    "build_datasets",
    "build_prepared",
    "load_tokenizer",
    "markdown_to_text",
    "pack_documents",
    "prepare_corpus",
    "read_documents",
    "register_auto_tokenizer",
    "shakespeare_documents",
    "split_documents",
    "tokenize_documents",
]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
