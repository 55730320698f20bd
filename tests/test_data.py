"""Tests for attnlab.data: tokenizers, corpus reading, splitting and packing."""

from __future__ import annotations

import json
import re
import time

import pytest
import torch

from attnlab.data import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    BlockDataset,
    ByteTokenizer,
    DataError,
    build_datasets,
    load_tokenizer,
    markdown_to_text,
    pack_documents,
    read_documents,
    register_auto_tokenizer,
    split_documents,
)


@pytest.fixture(scope="module")
def byte_tok():
    return ByteTokenizer()


@pytest.fixture(scope="module")
def shakespeare():
    return read_documents("shakespeare")


# --- ByteTokenizer -------------------------------------------------------------------------


def test_byte_tokenizer_round_trips_utf8(byte_tok):
    text = "Hello, wörld! 你好 😀🎭 <eos> \n\t\x00end"
    ids = byte_tok(text)["input_ids"]
    assert ids == list(text.encode("utf-8"))
    assert byte_tok.decode(ids) == text
    assert byte_tok.encode_bytes(text).tolist() == ids


def test_byte_tokenizer_invalid_utf8_decodes_with_replacement(byte_tok):
    assert byte_tok.decode([0x41, 0xFF, 0x42, 0xF0, 0x9F]) == "A\ufffdB\ufffd"


def test_byte_tokenizer_special_ids_and_vocab_size(byte_tok):
    assert (byte_tok.bos_token_id, byte_tok.eos_token_id, byte_tok.pad_token_id) == (256, 257, 258)
    assert (BOS_ID, EOS_ID, PAD_ID) == (256, 257, 258)
    assert byte_tok.vocab_size == 259 and len(byte_tok) == 259
    assert byte_tok.padding_side == "left"
    assert byte_tok("ab")["input_ids"] == [97, 98]  # no BOS by default
    assert ByteTokenizer(add_bos_token=True)("ab")["input_ids"] == [256, 97, 98]
    assert byte_tok.decode([104, 105, EOS_ID]) == "hi<eos>"
    assert byte_tok.decode([BOS_ID, 104, 105, EOS_ID, PAD_ID], skip_special_tokens=True) == "hi"


def test_byte_tokenizer_save_load_round_trip(tmp_path):
    tok = ByteTokenizer(add_bos_token=True)
    tok.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "ByteTokenizer"
    loaded = ByteTokenizer.from_pretrained(tmp_path)
    assert loaded.add_bos_token is True
    assert loaded.padding_side == "left" and len(loaded) == 259
    assert loaded("é")["input_ids"] == tok("é")["input_ids"] == [256, 0xC3, 0xA9]
    assert isinstance(load_tokenizer(str(tmp_path)), ByteTokenizer)


def test_byte_tokenizer_batch_padding_is_left_with_attention_mask(byte_tok):
    batch = byte_tok(["a", "abc"], padding=True, return_tensors="pt")
    assert batch["input_ids"].tolist() == [[PAD_ID, PAD_ID, 97], [97, 98, 99]]
    assert batch["attention_mask"].tolist() == [[0, 0, 1], [1, 1, 1]]
    assert byte_tok.batch_decode(batch["input_ids"], skip_special_tokens=True) == ["a", "abc"]


def test_auto_tokenizer_loads_byte_tokenizer_through_registration(tmp_path):
    from transformers import AutoConfig, AutoTokenizer, PretrainedConfig

    class DummyConfig(PretrainedConfig):
        model_type = "attnlab-data-test-dummy"

    AutoConfig.register(DummyConfig.model_type, DummyConfig, exist_ok=True)
    register_auto_tokenizer(DummyConfig)
    register_auto_tokenizer(DummyConfig)  # idempotent
    DummyConfig().save_pretrained(tmp_path)
    ByteTokenizer().save_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert isinstance(tok, ByteTokenizer)
    assert tok("hi")["input_ids"] == [104, 105]


def test_load_tokenizer_missing_path_raises_data_error(tmp_path):
    missing = tmp_path / "no-such-tokenizer"
    with pytest.raises(DataError, match=re.escape(str(missing))):
        load_tokenizer(str(missing))


def test_local_hf_tokenizer_loads_with_pad_token_and_left_padding(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "[EOS]": 1, "hello": 2, "world": 3, "to": 4, "be": 5}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="[EOS]").save_pretrained(tmp_path)

    tok = load_tokenizer(str(tmp_path))
    assert not isinstance(tok, ByteTokenizer)
    assert tok.pad_token == "[EOS]" and tok.pad_token_id == 1
    assert tok.padding_side == "left"
    batch = tok(["hello", "to be world"], padding=True, return_tensors="pt")
    assert batch["input_ids"].tolist() == [[1, 1, 2], [4, 5, 3]]
    assert pack_documents(["hello world", "to be"], tok, 3).tolist() == [[2, 3, 1], [4, 5, 1]]


# --- corpora -------------------------------------------------------------------------------


def test_shakespeare_has_all_plays_without_markup(shakespeare):
    assert len(shakespeare) >= 37
    text = "\n".join(shakespeare)
    assert "#" not in text and "*" not in text and "_" not in text and "\\" not in text
    assert "\n\n\n" not in text
    assert not re.search(r"[ \t]$", text, re.M)
    assert shakespeare[0].startswith("A Midsummer Night's Dream\n\nACT I\n")  # sorted file order


def test_shakespeare_speaker_lines_are_name_colon(shakespeare):
    hamlet = next(doc for doc in shakespeare if doc.startswith("Hamlet"))
    assert "\nHAMLET:\n" in hamlet
    assert "\nSCENE II." in hamlet


def test_markdown_to_text_strips_play_markup():
    md = (
        "# Play\n\n## ACT I\n\n### SCENE I. A heath.\n\n_Thunder. Enter two_\n\n"
        "**First Witch**  \nWhen shall we meet  \nagain?\n\n\n\n**A: & B:**  \n"
        "__\\[Aside]_  \nFair\\--foul.\n*Exeunt.*\n"
    )
    assert markdown_to_text(md) == (
        "Play\n\nACT I\n\nSCENE I. A heath.\n\nThunder. Enter two\n\n"
        "First Witch:\nWhen shall we meet\nagain?\n\nA & B:\n[Aside]\nFair--foul.\nExeunt.\n"
    )


def test_shakespeare_dataset_builds_fast(byte_tok):
    start = time.perf_counter()
    data = build_datasets("shakespeare", byte_tok, 256, 0.05, seed=0)
    elapsed = time.perf_counter() - start
    assert elapsed < 2.0, f"building the Shakespeare dataset took {elapsed:.2f}s"
    assert data.train.shape[1] == 256 and data.train.dtype == torch.long
    assert data.stats["train_documents"] + data.stats["val_documents"] >= 37


def test_reads_txt_file(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("first document\nline two\n", encoding="utf-8")
    assert read_documents(str(path)) == ["first document\nline two\n"]


def test_reads_directory_and_glob_of_txt(tmp_path):
    (tmp_path / "b.txt").write_text("bee")
    (tmp_path / "a.txt").write_text("ay")
    (tmp_path / "notes.md").write_text("ignored in a directory")
    assert read_documents(str(tmp_path)) == ["ay", "bee"]
    assert read_documents(str(tmp_path / "*.txt")) == ["ay", "bee"]


def test_reads_jsonl_and_json(tmp_path):
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text('{"text": "one", "id": 1}\n\n{"text": "two"}\n')
    assert read_documents(str(jsonl)) == ["one", "two"]
    array = tmp_path / "d.json"
    array.write_text(json.dumps([{"body": "x"}, {"body": "y"}]))
    assert read_documents(str(array), text_field="body") == ["x", "y"]


def test_reads_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": ["alpha", "beta"], "n": [1, 2]}), path)
    assert read_documents(str(path)) == ["alpha", "beta"]


def test_reads_save_to_disk_dataset_and_dataset_dict(tmp_path):
    import datasets

    ds = datasets.Dataset.from_dict({"text": ["d1", "d2", "d3"]})
    ds.save_to_disk(str(tmp_path / "single"))
    assert read_documents(str(tmp_path / "single")) == ["d1", "d2", "d3"]
    dd = datasets.DatasetDict({"train": ds, "test": datasets.Dataset.from_dict({"text": ["t"]})})
    dd.save_to_disk(str(tmp_path / "dict"))
    assert read_documents(str(tmp_path / "dict")) == ["d1", "d2", "d3"]


def test_reads_hf_dataset_from_local_cache_only(tmp_path, monkeypatch):
    import os

    import datasets
    from datasets.packaged_modules.json.json import Json

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "src.jsonl"
    source.write_text('{"text": "cached one"}\n{"text": "cached two"}\n')
    builder = Json(
        cache_dir=str(tmp_path / "cache"), dataset_name="tiny_corpus", data_files={"train": str(source)}, hash="h"
    )
    builder.download_and_prepare()
    # Hub datasets are cached under their config name.
    (tmp_path / "cache" / "tiny_corpus" / builder.config_id).rename(tmp_path / "cache" / "tiny_corpus" / "default")
    before = os.environ.get("HF_DATASETS_OFFLINE")

    assert read_documents("hf://tiny_corpus") == ["cached one", "cached two"]
    with pytest.raises(DataError, match="not in the local Hugging Face cache.*load_dataset"):
        read_documents("hf://attnlab-test/not-cached")
    assert os.environ.get("HF_DATASETS_OFFLINE") == before


# --- corpus errors -------------------------------------------------------------------------


def test_missing_path_raises_data_error(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(DataError, match=re.escape(str(missing))):
        read_documents(str(missing))


def test_glob_matching_nothing_raises_data_error(tmp_path):
    pattern = str(tmp_path / "*.txt")
    with pytest.raises(DataError, match=re.escape(pattern)):
        read_documents(pattern)


def test_unsupported_extension_raises_data_error(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("a,b\n")
    with pytest.raises(DataError, match=r"Unsupported file type '\.csv'.*data\.csv"):
        read_documents(str(path))


def test_directory_without_data_files_raises_data_error(tmp_path):
    (tmp_path / "readme.md").write_text("hi")
    with pytest.raises(DataError, match=re.escape(str(tmp_path))):
        read_documents(str(tmp_path))


def test_unreadable_file_raises_data_error(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes(b"caf\xe9\n")
    with pytest.raises(DataError, match=r"latin1\.txt is not valid UTF-8"):
        read_documents(str(path))


def test_invalid_jsonl_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n{"text": oops}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl, line 2: not valid JSON"):
        read_documents(str(path))


def test_missing_text_field_lists_existing_fields(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text('{"content": "x", "id": 1}\n')
    with pytest.raises(DataError, match=r"no field 'text'; its fields are \['content', 'id'\]"):
        read_documents(str(jsonl))
    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.table({"body": ["x"]}), parquet)
    with pytest.raises(DataError, match=r"d\.parquet has no column 'text'; its columns are \['body'\]"):
        read_documents(str(parquet))


def test_whitespace_only_corpus_raises_data_error(tmp_path):
    (tmp_path / "a.txt").write_text("  \n\n\t")
    (tmp_path / "b.txt").write_text("")
    with pytest.raises(DataError, match="empty"):
        read_documents(str(tmp_path))


# --- split and packing ---------------------------------------------------------------------


def test_split_is_deterministic_and_holds_out_about_the_fraction():
    docs = [f"document {i} " * (10 + i) for i in range(50)]
    train, val = split_documents(docs, 0.2, seed=3)
    assert (train, val) == split_documents(docs, 0.2, seed=3)
    assert split_documents(docs, 0.2, seed=4) != (train, val)
    assert sorted(train + val) == sorted(docs)
    held = sum(map(len, val)) / sum(map(len, docs))
    assert 0.2 <= held < 0.25


def test_split_keeps_one_train_document_and_handles_zero_fraction():
    docs = ["a" * 10, "b" * 10]
    train, val = split_documents(docs, 0.9, seed=0)
    assert len(train) == 1 and len(val) == 1
    assert split_documents(docs, 0.0, seed=0) == (docs, [])


def test_split_single_document_cuts_text():
    assert split_documents(["abcdefghij"], 0.2, seed=0) == (["abcdefgh"], ["ij"])


def test_packing_puts_eos_after_documents_and_drops_remainder(byte_tok):
    blocks = pack_documents(["ab", "cde"], byte_tok, seq_len=3)
    # tokens: a b EOS c d e EOS -> two blocks of 3, one token dropped
    assert blocks.dtype == torch.long
    assert blocks.tolist() == [[97, 98, EOS_ID], [99, 100, 101]]


def test_packing_too_little_data_names_both_numbers(byte_tok):
    with pytest.raises(DataError, match=r"sequence length \(64 tokens\).*\(6 tokens\).*data\.seq_len"):
        pack_documents(["hello"], byte_tok, seq_len=64)


def test_val_bytes_per_token_is_exact(tmp_path, byte_tok):
    train, val = tmp_path / "train.txt", tmp_path / "val.txt"
    train.write_text("abcdefgh")
    val.write_text("héé")  # 5 UTF-8 bytes, 5 byte tokens + EOS
    data = build_datasets(str(train), byte_tok, 3, val_fraction=0.5, seed=0, val_source=str(val))
    assert data.stats["train_documents"] == 1 and data.stats["val_documents"] == 1
    assert data.stats["val_bytes"] == 5 and data.stats["val_tokens"] == 6
    assert data.stats["val_bytes_per_token"] == 5 / 6
    assert data.train.shape == (3, 3) and data.val.shape == (2, 3)


def test_build_without_validation_has_no_val(tmp_path, byte_tok):
    path = tmp_path / "a.txt"
    path.write_text("x" * 20)
    data = build_datasets(str(path), byte_tok, 4, val_fraction=0.0, seed=0)
    assert data.val is None and data.stats["val_bytes_per_token"] is None
    assert data.stats["train_tokens"] == 21 and data.train.shape == (5, 4)


def test_block_dataset_items_have_input_ids_and_labels():
    blocks = torch.arange(12).view(3, 4)
    ds = BlockDataset(blocks)
    assert len(ds) == 3
    item = ds[1]
    assert item["input_ids"].tolist() == [4, 5, 6, 7]
    assert torch.equal(item["labels"], item["input_ids"])
