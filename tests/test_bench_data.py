"""`attnlab bench data`'s pieces: sizes, a deterministic synthetic corpus, the offline BPE tokenizer."""

import json

import pytest

from attnlab.bench.data import bpe_tokenizer, parse_size, size_name, synthetic_corpus
from attnlab.errors import PreflightError


def test_sizes_are_read_in_decimal_units_and_named_back():
    assert parse_size("2GB") == 2 * 10**9 and parse_size("100MB") == 10**8 and parse_size("1.5g") == 1_500_000_000
    assert size_name(parse_size("2GB")) == "2GB" and size_name(parse_size("100MB")) == "100MB"
    with pytest.raises(PreflightError, match="100MB or 2GB"):
        parse_size("two gigs")


def test_the_synthetic_corpus_has_the_size_asked_for_and_is_the_same_every_time(tmp_path):
    first = synthetic_corpus(tmp_path / "a", 300_000)
    second = synthetic_corpus(tmp_path / "b", 300_000)
    files = sorted(p.name for p in first.glob("*.jsonl"))
    assert files == sorted(p.name for p in second.glob("*.jsonl"))
    assert all((first / f).read_bytes() == (second / f).read_bytes() for f in files)
    texts = [json.loads(line)["text"] for f in files for line in (first / f).read_text(encoding="utf-8").splitlines()]
    assert sum(len(t) for t in texts) == 300_000 and len(texts) > 10 and any(not t.isascii() for t in texts)


def test_the_bpe_tokenizer_is_trained_offline_and_loads_with_an_eos_token(tmp_path):
    from attnlab.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(bpe_tokenizer(tmp_path)))
    assert tokenizer.eos_token == "<eos>" and len(tokenizer) == 8192
    ids = tokenizer("naïve words", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == "naïve words" and len(ids) < len("naïve words")


def test_the_import_floor_is_a_positive_number_of_seconds_from_fresh_interpreters():
    from attnlab.bench.data import import_floor

    floor = import_floor(repeats=1)
    assert isinstance(floor, float) and 0 < floor < 120
