"""`attnlab data prepare` and `PreparedCorpus`: shards equal the packing path's tokens, resume is exact,
damage and mismatches are refused with one clear message."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import run_cli

from attnlab.data import prepare as prep
from attnlab.data.corpus import read_documents
from attnlab.data.packing import tokenize_documents
from attnlab.data.prepare import prepare_corpus, token_dtype
from attnlab.data.prepared import PreparedCorpus
from attnlab.data.tokenizer import load_tokenizer
from attnlab.errors import DataError


def _corpus(root):
    """A directory of JSONL, text and Parquet files (nested, with empty records), about 45 documents."""
    rng = np.random.default_rng(0)
    words = ["lorem", "ipsum", "dolor", "sit", "amet", "ünïcode", "≠", "naïve", "\n"]
    (root / "sub").mkdir(parents=True)
    for f in range(3):
        lines = [json.dumps({"text": " ".join(rng.choice(words, size=rng.integers(3, 60))), "id": i}) for i in range(10)]
        lines.insert(4, json.dumps({"text": "   "}))
        (root / f"part{f}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    for f in range(5):
        (root / "sub" / f"doc{f}.txt").write_text(" ".join(rng.choice(words, size=rng.integers(20, 200))), encoding="utf-8")
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [" ".join(rng.choice(words, size=rng.integers(3, 30))) for _ in range(7)] + [None]
    pq.write_table(pa.table({"text": rows}), root / "sub" / "rows.parquet", row_group_size=3)
    return root


def _shard_tokens(out):
    manifest = json.loads((out / "manifest.json").read_text())
    return np.concatenate([np.fromfile(out / s["file"], dtype=manifest["dtype"]) for s in manifest["shards"]])


def _shard_bytes(out):
    return {p.name: p.read_bytes() for p in sorted(out.glob("shard-*")) if p.suffix != ".json"}


def test_shards_hold_exactly_the_tokens_of_the_packing_path(tmp_path):
    src = _corpus(tmp_path / "src")
    manifest = prepare_corpus(str(src), tmp_path / "out", "byte", shard_tokens=300)
    expected = tokenize_documents(read_documents(str(src)), load_tokenizer("byte"))
    eos = load_tokenizer("byte").eos_token_id  # and independently: each document's UTF-8 bytes, then EOS
    assert list(expected) == [t for d in read_documents(str(src)) for t in (*d.encode("utf-8"), eos)]
    assert len(manifest["shards"]) > 3
    assert manifest["dtype"] == "uint16"
    np.testing.assert_array_equal(_shard_tokens(tmp_path / "out"), expected)
    assert manifest["tokens"] == len(expected) and manifest["documents"] == len(read_documents(str(src)))
    corpus = PreparedCorpus(tmp_path / "out", verify=True)
    assert corpus.total_tokens == len(expected)
    np.testing.assert_array_equal(corpus.tokens(0, corpus.total_tokens), expected)
    np.testing.assert_array_equal(corpus.tokens(290, 610), expected[290:610])  # across shard boundaries


def test_validation_split_holds_whole_documents_and_ranges_cover_the_corpus(tmp_path):
    src = _corpus(tmp_path / "src")
    manifest = prepare_corpus(str(src), tmp_path / "out", "byte", val_fraction=0.3, seed=1, shard_tokens=300)
    corpus = PreparedCorpus(tmp_path / "out")
    assert 0 < manifest["validation"]["documents"] < manifest["documents"]
    assert corpus.val_tokens == manifest["validation"]["tokens"] > 0
    assert corpus.train_tokens + corpus.val_tokens == corpus.total_tokens
    eos = load_tokenizer("byte").eos_token_id
    for start, end in np.concatenate([corpus.train_ranges, corpus.val_ranges]):
        assert corpus.tokens(int(end) - 1, int(end))[0] == eos  # every range ends with a document's EOS
        assert start == 0 or corpus.tokens(int(start) - 1, int(start))[0] == eos
    other = prepare_corpus(str(src), tmp_path / "out2", "byte", val_fraction=0.3, seed=2, shard_tokens=300)
    assert other["validation"] != manifest["validation"]  # the seed chooses the documents


@pytest.mark.parametrize(("vocab_size", "dtype"), [(259, np.uint16), (65536, np.uint16), (65537, np.uint32), (151_000, np.uint32)])
def test_token_dtype_is_uint16_when_the_vocabulary_fits(vocab_size, dtype):
    assert token_dtype(vocab_size) == dtype


def _word_tokenizer(directory, n_words):
    """An HF fast tokenizer of `n_words` words (ids 0..n_words-1) plus <unk> and <eos>."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(n_words)}
    vocab.update({"<unk>": n_words, "<eos>": n_words + 1})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>").save_pretrained(directory)
    return str(directory)


def test_a_large_vocabulary_is_written_as_uint32_with_the_hf_batch_encoder(tmp_path):
    spec = _word_tokenizer(tmp_path / "tok", 70_000)
    src = tmp_path / "src"
    src.mkdir()
    docs = [" ".join(f"w{(i * 7919 + j * 104729) % 70_000}" for j in range(50)) for i in range(20)]
    (src / "c.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    manifest = prepare_corpus(str(src), tmp_path / "out", spec, workers=2, shard_tokens=200)
    assert manifest["dtype"] == "uint32"
    tokenizer = load_tokenizer(spec)  # expected through the tokenizer's own call, not the batch encoder under test
    expected = np.concatenate([np.append(tokenizer(d, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id) for d in docs])
    assert expected.max() > 65535
    np.testing.assert_array_equal(_shard_tokens(tmp_path / "out"), expected)


def test_a_pool_of_workers_writes_the_same_shards_as_one_process(tmp_path, monkeypatch):
    spec = _word_tokenizer(tmp_path / "tok", 300)
    src = tmp_path / "src"
    src.mkdir()
    for f in range(3):
        docs = [" ".join(f"w{(i * 31 + j * 17 + f) % 300}" for j in range(5 + i % 40)) for i in range(30)]
        (src / f"c{f}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    monkeypatch.setattr(prep, "BATCH_BYTES", 500)  # many batches in flight
    reports = []
    prepare_corpus(str(src), tmp_path / "one", spec, workers=1, shard_tokens=300)
    prepare_corpus(str(src), tmp_path / "two", spec, workers=2, shard_tokens=300, progress=reports.append)
    assert reports[-1].workers == 2
    assert len(list((tmp_path / "one").glob("shard-*.bin"))) > 3
    assert _shard_bytes(tmp_path / "one") == _shard_bytes(tmp_path / "two")
    np.testing.assert_array_equal(_shard_tokens(tmp_path / "two"), tokenize_documents(read_documents(str(src)), load_tokenizer(spec)))


def test_an_interrupted_preparation_resumes_to_the_same_shards(tmp_path, monkeypatch):
    src = _corpus(tmp_path / "src")
    monkeypatch.setattr(prep, "BATCH_BYTES", 400)
    prepare_corpus(str(src), tmp_path / "whole", "byte", shard_tokens=300)

    real = prep.encode_batch
    calls = {"n": 0}

    def failing(docs, dtype, tokenizer=None):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("worker died")
        return real(docs, dtype, tokenizer)

    monkeypatch.setattr(prep, "encode_batch", failing)
    with pytest.raises(RuntimeError, match="worker died"):
        prepare_corpus(str(src), tmp_path / "cut", "byte", shard_tokens=300)
    cut = tmp_path / "cut"
    assert not (cut / "manifest.json").exists() and not list(cut.glob("*.tmp*"))
    kept = sorted(p.name for p in cut.glob("shard-*.json"))
    assert 0 < len(kept) < len(list((tmp_path / "whole").glob("shard-*.json")))
    monkeypatch.setattr(prep, "encode_batch", real)
    mtimes = {name: (cut / name).stat().st_mtime_ns for name in kept}
    prepare_corpus(str(src), cut, "byte", shard_tokens=300)
    assert _shard_bytes(cut) == _shard_bytes(tmp_path / "whole")
    assert {name: (cut / name).stat().st_mtime_ns for name in kept} == mtimes  # complete shards were kept, not redone


def test_a_preparation_killed_mid_shard_resumes_to_the_same_shards(tmp_path):
    """SIGKILL, not an exception: no clean-up runs, a shard is left half-written under its temporary name."""
    src = _corpus(tmp_path / "src")
    prepare_corpus(str(src), tmp_path / "whole", "byte", shard_tokens=300)
    script = (
        "import os, signal, sys\n"
        "from attnlab.data import prepare as prep\n"
        "prep.BATCH_BYTES = 200\n"
        "def die(state):\n"
        "    if state.shards >= 2 and list(__import__('pathlib').Path(sys.argv[2]).glob('*.bin.tmp')):\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "prep.prepare_corpus(sys.argv[1], sys.argv[2], 'byte', shard_tokens=300, progress=die)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run([sys.executable, "-c", script, str(src), str(tmp_path / "cut")], env=env, timeout=120, check=False)
    assert done.returncode == -9
    cut = tmp_path / "cut"
    assert list(cut.glob("*.bin.tmp")) and not (cut / "manifest.json").exists()
    prepare_corpus(str(src), cut, "byte", shard_tokens=300)
    assert _shard_bytes(cut) == _shard_bytes(tmp_path / "whole")
    assert not list(cut.glob("*.tmp*"))


def test_a_crash_between_the_shards_and_the_manifest_resumes_without_redoing_them(tmp_path, monkeypatch):
    src = _corpus(tmp_path / "src")
    prepare_corpus(str(src), tmp_path / "whole", "byte", shard_tokens=300)

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(prep, "_write_manifest", crash)
    with pytest.raises(KeyboardInterrupt):
        prepare_corpus(str(src), tmp_path / "cut", "byte", shard_tokens=300)
    monkeypatch.undo()
    with pytest.raises(DataError, match="manifest.json"):
        PreparedCorpus(tmp_path / "cut")
    reports = []
    prepare_corpus(str(src), tmp_path / "cut", "byte", shard_tokens=300, progress=reports.append)
    assert reports[0].kept_shards == len(list((tmp_path / "whole").glob("shard-*.json")))
    assert _shard_bytes(tmp_path / "cut") == _shard_bytes(tmp_path / "whole")


def test_a_changed_file_redoes_the_shards_made_from_it(tmp_path):
    src = _corpus(tmp_path / "src")
    out = tmp_path / "out"
    prepare_corpus(str(src), out, "byte", shard_tokens=300)
    (src / "sub" / "doc4.txt").write_text("a new ending", encoding="utf-8")  # read after part*.jsonl: shard 0 stays
    first = (out / "shard-00000.bin").stat().st_mtime_ns
    manifest = prepare_corpus(str(src), out, "byte", shard_tokens=300)
    assert (out / "shard-00000.bin").stat().st_mtime_ns == first
    np.testing.assert_array_equal(_shard_tokens(out), tokenize_documents(read_documents(str(src)), load_tokenizer("byte")))
    assert [fp["size"] for fp in manifest["fingerprint"] if fp["path"].endswith("doc4.txt")] == [len("a new ending")]


def test_a_grown_source_gives_the_shards_of_a_fresh_preparation(tmp_path):
    src = _corpus(tmp_path / "src")
    out = tmp_path / "out"
    prepare_corpus(str(src), out, "byte", shard_tokens=300)
    (src / "sub" / "zz.txt").write_text("one more document, read last", encoding="utf-8")
    prepare_corpus(str(src), out, "byte", shard_tokens=300)
    prepare_corpus(str(src), tmp_path / "fresh", "byte", shard_tokens=300)
    assert _shard_bytes(out) == _shard_bytes(tmp_path / "fresh")


def test_a_bad_json_line_is_reported_with_its_file_and_line(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "c.jsonl").write_text('{"text": "fine"}\n{"text": broken\n')
    with pytest.raises(DataError, match=r"c.jsonl, line 2: not valid JSON"):
        prepare_corpus(str(src), tmp_path / "out", "byte")
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_a_truncated_shard_is_refused_naming_the_file(tmp_path):
    src = _corpus(tmp_path / "src")
    prepare_corpus(str(src), tmp_path / "out", "byte", shard_tokens=300)
    shard = tmp_path / "out" / "shard-00001.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(DataError, match="shard-00001.bin.*truncated"):
        PreparedCorpus(tmp_path / "out")


def test_a_corrupt_shard_is_refused_when_verified(tmp_path):
    src = _corpus(tmp_path / "src")
    prepare_corpus(str(src), tmp_path / "out", "byte", shard_tokens=300)
    shard = tmp_path / "out" / "shard-00000.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match="shard-00000.bin.*sampled blocks"):  # a shard this small is sampled whole
        PreparedCorpus(tmp_path / "out")
    with pytest.raises(DataError, match="shard-00000.bin.*SHA-256"):
        PreparedCorpus(tmp_path / "out", verify=True)


def test_a_different_tokenizer_is_refused_and_overwrite_starts_afresh(tmp_path):
    src = _corpus(tmp_path / "src")
    out = tmp_path / "out"
    prepare_corpus(str(src), out, "byte", shard_tokens=300)
    spec = _word_tokenizer(tmp_path / "tok", 100)
    with pytest.raises(DataError, match="different tokenizer.*--overwrite"):
        prepare_corpus(str(src), out, spec, shard_tokens=300)
    other = _corpus(tmp_path / "other")
    with pytest.raises(DataError, match="different source.*--overwrite"):
        prepare_corpus(str(other), out, "byte", shard_tokens=300)
    manifest = prepare_corpus(str(src), out, spec, shard_tokens=300, overwrite=True)
    assert manifest["tokenizer"]["name"] == spec
    assert PreparedCorpus(out).total_tokens == manifest["tokens"]
    assert sorted(p.name for p in out.glob("shard-*.json")) == [f"shard-{i:05d}.json" for i in range(len(manifest["shards"]))]


def test_cli_prepares_a_corpus_and_prints_a_summary(tmp_path, capsys):
    src = _corpus(tmp_path / "src")
    assert run_cli("data", "prepare", str(src), "--out", str(tmp_path / "out"), "--workers", "1", "--val-fraction", "0.2") == 0
    assert "prepared corpus" in capsys.readouterr().out
    assert PreparedCorpus(tmp_path / "out").val_tokens > 0


def test_cli_holds_out_validation_by_default_as_train_does(tmp_path):
    """`attnlab train` holds out data.val_fraction of a plain corpus: a prepared one had none unless asked."""
    from attnlab.config.schema import DataSection

    src = _corpus(tmp_path / "src")
    assert run_cli("data", "prepare", str(src), "--out", str(tmp_path / "out"), "--workers", "1") == 0
    corpus = PreparedCorpus(tmp_path / "out")
    assert DataSection.model_fields["val_fraction"].default > 0 and corpus.val_tokens > 0


def test_cli_reports_progress_as_lines_when_stdout_is_not_a_terminal(tmp_path, capsys, monkeypatch):
    from attnlab.data import progress

    monkeypatch.setattr(progress, "LOG_EVERY_S", 0.0)
    src = _corpus(tmp_path / "src")
    assert run_cli("data", "prepare", str(src), "--out", str(tmp_path / "out"), "--shard-tokens", "300") == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("prepare:")]
    assert lines and all("MB/s" in line and "tok/s" in line for line in lines)
    assert "shards" in lines[-1]


def test_cli_exits_non_zero_with_one_line_on_a_missing_source(tmp_path, capsys):
    assert run_cli("data", "prepare", str(tmp_path / "missing"), "--out", str(tmp_path / "out")) == 1
    err = capsys.readouterr().err.strip()
    assert "does not exist" in err and "Traceback" not in err
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize("verb", [["data"], ["data", "prepare"]])
def test_data_verbs_have_help(verb, capsys):
    assert run_cli(*verb, "--help") == 0
    out = capsys.readouterr().out
    assert "Usage" in out
    if verb == ["data", "prepare"]:
        for option in ("--out", "--tokenizer", "--workers", "--text-field", "--val-fraction", "--seed", "--shard-tokens", "--overwrite"):
            assert option in out


def test_workers_started_from_a_script_without_a_main_guard_fail_with_one_clear_error(tmp_path):
    """spawn imports the script again in each worker; the call there fails at once, and the script's own
    call reports it instead of waiting for ever on a worker that died while it was being started."""
    import subprocess
    import sys

    spec = _word_tokenizer(tmp_path / "tok", 300)
    src = tmp_path / "src"
    src.mkdir()
    (src / "c.jsonl").write_text("".join(json.dumps({"text": f"w{i} w{i + 1}"}) + "\n" for i in range(50)))
    script = tmp_path / "no_guard.py"
    script.write_text("from attnlab.data.prepare import prepare_corpus\n"
                      f"prepare_corpus({str(src)!r}, {str(tmp_path / 'out')!r}, {spec!r}, workers=2)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert done.returncode != 0
    assert 'call it under `if __name__ == "__main__":`; or pass workers=1' in done.stderr.splitlines()[-1]
