"""The word-cached byte-level BPE encoder gives exactly the ids of `tokenizers`' own encoder."""

import random

import numpy as np
import pytest

pytest.importorskip("regex")
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from attnlab.data.prepare import encoder  # noqa: E402
from attnlab.data.pretokenized import GPT2_PATTERN, WordCachedEncoder, ascii_pattern, split_patterns  # noqa: E402

# Llama 3's split (the one Qwen's tokenizers use differs only in \p{N} vs \p{N}{1,3})
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")

TRAIN_TEXT = [
    "The quick brown fox jumps over the lazy dog. It's 2024; we'll see 12345 dogs!\n\n",
    "Naïve café façade, smörgåsbord über señor — résumé “quoted” ‘single’ …\tTabs\tand  double  spaces.\r\n",
    "中文字符和日本語のテキスト。한국어 텍스트. Emoji 😀🎉 and math ∑ ≈ ∞ ½ ² Ⅻ ٣.",
    "don't I'LL You'RE they've she'd x1y2z3 a_b-c.d/e\\f \"g\" <tag> {brace} [bracket] (paren) #hash @at $5.00 100%",
] * 20

PRE_TOKENIZERS = {
    "gpt2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    "llama3": lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
    "digits": lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]),
}


def byte_level_bpe(pre_tokenizer, normalizer=None) -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizer
    if normalizer is not None:
        backend.normalizer = normalizer
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=["<eos>", "<|im_start|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(TRAIN_TEXT, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")


def hard_documents() -> list[str]:
    rng = random.Random(0)
    planes = [(0x20, 0x7F), (0xA0, 0x2FF), (0x370, 0x52F), (0x600, 0x6FF), (0x900, 0xDFF), (0x1D00, 0x1FFF),
              (0x2000, 0x2BFF), (0x3000, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0xE000, 0xF8FF),
              (0xFE00, 0xFFFF), (0x10000, 0x1FFFF), (0x20000, 0x3FFFF), (0xE0000, 0xE01EF), (0xF0000, 0x10FFFF)]
    random_docs = []
    for _ in range(40):
        chars = []
        for _ in range(300):
            lo, hi = rng.choice(planes)
            chars.append(chr(rng.randint(lo, hi)) if rng.random() < 0.5 else rng.choice("ab 1 \n'.!\t  xyz"))
        random_docs.append("".join(chars))
    return [
        *TRAIN_TEXT[:4], "", " ", "\n\n\n", "   leading and trailing   ", "word", "12345678901234567890",
        "controls \x1c\x1d\x1e\x1f \x85 \x0b\x0c and separators \u2028\u2029 \u00a0nbsp \u3000ideographic \u200bzero-width",
        "ASCII controls \x00\x01 a\x1c\x1db \x1e\x1f c\x0b\x0c d\x7f e \x1c \r\n\t x\x1f",
        "an <eos> in the text and <|im_start|>system too, <eos><eos>",
        "combining e\u0301 a\u0308 ﬁ ligature, Ⅻ ⅻ ① ⁵ ₅ ٣ ߂ 𝟘 digits of other scripts",
        "newer characters \U00030000\U00031350\U00032000 and \U0001FAE8 \U0001F9CC",
        "CRLF\r\nlines\r\n\r\n and 'quoted' 'S 'LL 's's", "x" * 5000, "ab " * 3000,
        *random_docs,
    ]


@pytest.mark.parametrize("name", list(PRE_TOKENIZERS))
def test_word_cached_encoder_gives_the_ids_of_tokenizers(name):
    tokenizer = byte_level_bpe(PRE_TOKENIZERS[name]())
    encode = encoder(tokenizer)
    assert isinstance(encode, WordCachedEncoder)
    docs = hard_documents()
    expected = [e.ids for e in tokenizer._tokenizer.encode_batch(docs, add_special_tokens=False)]
    for _ in range(2):  # cold, then from the cache of pieces
        got = encode(docs)
        assert all(g.dtype == np.int64 for g in got)
        assert [g.tolist() for g in got] == expected
    assert encoder(tokenizer) is encode  # one encoder (and one cache) per tokenizer in a process


def test_documents_with_added_tokens_or_differing_characters_are_encoded_by_tokenizers(monkeypatch):
    tokenizer = byte_level_bpe(PRE_TOKENIZERS["gpt2"]())
    encode = encoder(tokenizer)
    sent = []
    real = tokenizer._tokenizer.encode_batch_fast
    monkeypatch.setattr(encode, "backend", type("Spy", (), {
        "pre_tokenizer": tokenizer._tokenizer.pre_tokenizer,
        "encode_batch_fast": lambda self, docs, add_special_tokens: sent.extend(docs) or real(docs, add_special_tokens=add_special_tokens),
    })())
    encode.differs.add("§")
    encode.checked.add("§")
    docs = ["plain words", "a literal <eos> token", "a § sign", "more plain words"]
    got = encode(docs)
    assert sent == ["a literal <eos> token", "a § sign"]
    assert [g.tolist() for g in got] == [e.ids for e in real(docs, add_special_tokens=False)]


def test_a_character_the_regex_engines_split_differently_is_found_by_its_probe(monkeypatch):
    tokenizer = byte_level_bpe(PRE_TOKENIZERS["gpt2"]())
    encode = WordCachedEncoder.of(tokenizer._tokenizer)
    split = encode.split
    monkeypatch.setattr(encode, "split", lambda text, unicode=False: [w for piece in split(text, unicode) for w in piece.split("q")])  # 'q' cut out
    encode._check({"a", "q", "é"})
    assert encode.differs == {"q"} and encode.checked == {"a", "q", "é"}


@pytest.mark.parametrize("normalizer, pre_tokenizer", [
    (normalizers.NFC(), PRE_TOKENIZERS["gpt2"]),
    (normalizers.Lowercase(), PRE_TOKENIZERS["gpt2"]),
    (None, lambda: pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)),
    (None, lambda: pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), pre_tokenizers.ByteLevel(use_regex=False)])),
])
def test_other_pipelines_keep_the_tokenizers_encoder_and_its_ids(normalizer, pre_tokenizer):
    tokenizer = byte_level_bpe(pre_tokenizer(), normalizer)
    assert WordCachedEncoder.of(tokenizer._tokenizer) is None
    docs = TRAIN_TEXT[:4]
    assert [g.tolist() for g in encoder(tokenizer)(docs)] == [e.ids for e in tokenizer._tokenizer.encode_batch(docs, add_special_tokens=False)]


def test_a_split_regex_that_python_cannot_read_keeps_the_tokenizers_encoder():
    onig_only = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"\p{L}+|(?~abc)"), behavior="isolated"),
                                         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer = byte_level_bpe(onig_only)
    assert WordCachedEncoder.of(tokenizer._tokenizer) is None
    assert encoder(tokenizer)(["abc def"])[0].tolist() == tokenizer._tokenizer.encode("abc def", add_special_tokens=False).ids


def test_ascii_text_splits_through_the_ascii_patterns_as_through_the_unicode_ones():
    rng = random.Random(1)
    ascii_docs = ["".join(rng.choice([chr(c) for c in range(128)] + ["e", " ", "'s", "'LL", "12", "\r\n"] * 8)
                          for _ in range(400)) for _ in range(30)]
    for name in PRE_TOKENIZERS:
        encode = WordCachedEncoder.of(byte_level_bpe(PRE_TOKENIZERS[name]())._tokenizer)
        assert encode.ascii_patterns is not None
        for doc in ascii_docs:
            assert encode.split(doc) == encode.split(doc, unicode=True)
    assert ascii_pattern(r"\p{L}+|[^\s\p{N}]|\s+(?!\S)") == r"[A-Za-z]+|[^\t\n\x0b\x0c\r 0-9]|[\t\n\x0b\x0c\r ]+(?![^\t\n\x0b\x0c\r ])"
    assert ascii_pattern(r"\w+") is None and ascii_pattern(r"\p{Lu}") is None


def test_split_patterns_reads_the_pre_tokenizer_json():
    assert split_patterns({"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}) == [GPT2_PATTERN]
    assert split_patterns({"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}) is None
    split = {"type": "Split", "pattern": {"Regex": "x+"}, "behavior": "Isolated", "invert": False}
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}
    assert split_patterns({"type": "Sequence", "pretokenizers": [split, byte_level]}) == ["x+"]
    assert split_patterns({"type": "Sequence", "pretokenizers": [{**split, "behavior": "Removed"}, byte_level]}) is None
    assert split_patterns({"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True},
                                                                  {**byte_level, "use_regex": True}]}) == [r"\p{N}", GPT2_PATTERN]
    assert split_patterns({"type": "Metaspace"}) is None and split_patterns(None) is None


def test_a_pool_of_workers_prepares_the_ids_of_tokenizers(tmp_path):
    import json

    from attnlab.data.corpus import read_documents
    from attnlab.data.prepare import prepare_corpus

    tokenizer = byte_level_bpe(PRE_TOKENIZERS["llama3"]())
    tokenizer.save_pretrained(tmp_path / "tok")
    docs = hard_documents()
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "c.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs if d))
    manifest = prepare_corpus(str(tmp_path / "src"), tmp_path / "out", str(tmp_path / "tok"), workers=2, val_fraction=0.0)
    read = list(read_documents(str(tmp_path / "src")))  # the reader skips the blank documents
    assert len(read) > 50
    expected = [t for e in tokenizer._tokenizer.encode_batch(read, add_special_tokens=False) for t in [*e.ids, tokenizer.eos_token_id]]
    got = np.concatenate([np.fromfile(p, dtype=manifest["dtype"]) for p in sorted((tmp_path / "out").glob("shard-*.bin"))])
    assert got.tolist() == expected


def test_a_worker_encodes_without_importing_transformers(tmp_path):
    import subprocess
    import sys

    tokenizer = byte_level_bpe(PRE_TOKENIZERS["gpt2"]())
    tokenizer._tokenizer.save(str(tmp_path / "backend.json"))
    code = (
        "import sys, pathlib, numpy as np\n"
        "from attnlab.data import prepare\n"
        "prepare._init_worker('unused', 0, sys.argv[1])\n"
        "flat, lengths, _ = prepare.encode_batch(['hello world', 'again'], 'uint16')\n"
        "print(type(prepare.encoder(prepare._WORKER['tokenizer'])).__name__, lengths.tolist(), 'transformers' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "backend.json")], capture_output=True, text=True, check=True)
    name, *rest = out.stdout.split(maxsplit=1)
    assert name == "WordCachedEncoder" and rest[0].strip().endswith("False"), out.stdout
