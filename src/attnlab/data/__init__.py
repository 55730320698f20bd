"""Data: tokenizers, reading corpora, and packing them into training blocks."""

from attnlab.data.corpus import SHAKESPEARE, markdown_to_text, read_documents, shakespeare_documents
from attnlab.data.packing import (
    BlockDataset,
    PackedData,
    build_datasets,
    pack_documents,
    split_documents,
    tokenize_documents,
)
from attnlab.data.tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    ByteTokenizer,
    load_tokenizer,
    register_auto_tokenizer,
)
from attnlab.errors import DataError

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "PAD_ID",
    "SHAKESPEARE",
    "BlockDataset",
    "ByteTokenizer",
    "DataError",
    "PackedData",
    "build_datasets",
    "load_tokenizer",
    "markdown_to_text",
    "pack_documents",
    "read_documents",
    "register_auto_tokenizer",
    "shakespeare_documents",
    "split_documents",
    "tokenize_documents",
]
