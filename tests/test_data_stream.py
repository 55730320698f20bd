"""Training on a prepared corpus: blocks read lazily in a seeded order, exact resume, disjoint rank
shares, damaged shards and a tokenizer mismatch refused, large raw sources prepared once into a cache."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from conftest import TINY, run_cli, sets

from attnlab.data.blocks import BlockOrder, PreparedBlocks
from attnlab.data.corpus import read_documents
from attnlab.data.packing import pack_documents
from attnlab.data.prepare import prepare_corpus
from attnlab.data.prepared import PreparedCorpus
from attnlab.data.tokenizer import load_tokenizer
from attnlab.errors import DataError


def _jsonl(path, n_docs=60, seed=0):
    """`n_docs` documents of 100-1500 characters of words, as JSON Lines."""
    rng = np.random.default_rng(seed)
    words = ["thou", "art", "more", "lovely", "and", "temperate", "rough", "winds", "do", "shake", "\n"]
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n_docs):
            text = " ".join(rng.choice(words, size=rng.integers(20, 250)))
            f.write(json.dumps({"text": text}) + "\n")
    return path


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("prepared")
    src = _jsonl(root / "src" / "corpus.jsonl")
    prepare_corpus(str(src), root / "prep", "byte", val_fraction=0.2, seed=0, shard_tokens=5_000)
    return root / "prep"


def test_block_order_takes_every_block_once_per_epoch_in_an_order_set_by_the_seed_and_epoch():
    for n in (1, 2, 7, 1000, 4097):
        order = BlockOrder(n, seed=3)
        first, second = order.blocks(np.arange(n)), order.blocks(np.arange(n, 2 * n))
        assert sorted(first) == list(range(n)) and sorted(second) == list(range(n))
        if n >= 7:
            assert not np.array_equal(first, second)  # each epoch has its own order
            assert not np.array_equal(first, BlockOrder(n, seed=4).blocks(np.arange(n)))
            assert not np.array_equal(first, np.arange(n))
        assert [order.block(p) for p in range(0, 2 * n, max(1, n // 5))] == list(order.blocks(np.arange(0, 2 * n, max(1, n // 5))))


def test_blocks_are_the_packed_blocks_of_the_training_documents(tmp_path):
    src = _jsonl(tmp_path / "src" / "c.jsonl", n_docs=30)
    prepare_corpus(str(src), tmp_path / "prep", "byte", shard_tokens=2_000)  # several shards: blocks cross them
    blocks = PreparedBlocks(PreparedCorpus(tmp_path / "prep"), seq_len=48, seed=0)
    packed = pack_documents(read_documents(str(src)), load_tokenizer("byte"), 48)
    assert len(blocks) == packed.shape[0]
    assert torch.equal(torch.stack([torch.from_numpy(blocks.block(i)) for i in range(len(blocks))]), packed)


def test_training_blocks_hold_no_validation_document(prepared):
    corpus = PreparedCorpus(prepared)
    blocks = PreparedBlocks(corpus, seq_len=16, seed=0)
    train = np.concatenate([corpus.tokens(s, e) for s, e in corpus.train_ranges])
    read = np.concatenate([blocks.block(i) for i in range(len(blocks))])
    assert np.array_equal(read, train[: len(read)]) and corpus.val_tokens > 0


def _record_batches(monkeypatch):
    """The input_ids of every training step, as lists, in order."""
    import attnlab.train.loop as loop

    seen = []
    real = loop.AttnLabTrainer.training_step

    def recording(self, model, inputs, *args, **kwargs):
        seen.append(inputs["input_ids"].tolist())
        return real(self, model, inputs, *args, **kwargs)

    monkeypatch.setattr(loop.AttnLabTrainer, "training_step", recording)
    return seen


def test_a_resumed_run_reads_exactly_the_batches_of_the_uninterrupted_run(tmp_path, prepared, monkeypatch):
    seen = _record_batches(monkeypatch)
    overrides = TINY + [f"data.source={prepared}", "train.sample_tokens=0", "data.val_fraction=0.2"]
    full = tmp_path / "full"
    assert run_cli("train", *sets(overrides), "--run-dir", str(full)) == 0
    uninterrupted = list(seen)
    assert len(uninterrupted) == 8 and len({json.dumps(b) for b in uninterrupted}) == 8
    state = json.loads((full / "checkpoints" / "step-0000004" / "data_state.json").read_text())
    assert state["position"] == 4 * 4 and state["seed"] == 0

    cut = tmp_path / "cut"  # the run as a crash after step 4 leaves it
    shutil.copytree(full, cut, symlinks=True)
    shutil.rmtree(cut / "checkpoints" / "step-0000008")
    shutil.rmtree(cut / "final")
    (cut / "checkpoints" / "latest").unlink()
    (cut / "checkpoints" / "latest").symlink_to("step-0000004")
    seen.clear()
    assert run_cli("train", "--resume", "--run-dir", str(cut)) == 0
    assert seen == uninterrupted[4:]
    assert json.loads((cut / "run.json").read_text())["val_loss"] == pytest.approx(json.loads((full / "run.json").read_text())["val_loss"], abs=1e-6)


RECORDING_RANK = textwrap.dedent("""
    import json, os, sys
    import attnlab.train.loop as loop
    seen = []
    real = loop.AttnLabTrainer.training_step
    def recording(self, model, inputs, *args, **kwargs):
        seen.append(inputs["input_ids"].tolist())
        return real(self, model, inputs, *args, **kwargs)
    loop.AttnLabTrainer.training_step = recording
    out = sys.argv[1]
    sys.argv = ["attnlab", "train", *sys.argv[2:]]
    from attnlab.cli import main
    try:
        main()
    finally:
        with open(os.path.join(out, f"rank{os.environ['RANK']}.json"), "w") as f:
            json.dump(seen, f)
""")


def test_two_gloo_ranks_read_disjoint_shares_that_make_up_the_single_process_batch(tmp_path, prepared):
    script = tmp_path / "record.py"
    script.write_text(RECORDING_RANK)
    overrides = TINY + [f"data.source={prepared}", "train.max_steps=2", "train.save_every=0", "train.eval_every=0",
                        "train.sample_tokens=0", "data.val_fraction=0.2"]
    torchrun = shutil.which("torchrun")
    launcher = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    proc = subprocess.run([*launcher, "--nproc_per_node", "2", str(script), str(tmp_path), *sets(overrides), "--run-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    blocks = PreparedBlocks(PreparedCorpus(prepared), seq_len=32, seed=0)
    for step in range(2):
        share0, share1 = ranks[0][step], ranks[1][step]
        assert len(share0) == len(share1) == 2
        assert not {json.dumps(row) for row in share0} & {json.dumps(row) for row in share1}
        single = [blocks[p]["input_ids"].tolist() for p in range(4 * step, 4 * step + 4)]  # batch_size 4 in one process
        assert share0 + share1 == single


def test_a_truncated_shard_fails_preflight_naming_the_file(tmp_path, prepared, capsys):
    copy = tmp_path / "prep"
    shutil.copytree(prepared, copy)
    shard = copy / "shard-00001.bin"
    shard.write_bytes(shard.read_bytes()[:-4])
    assert run_cli("train", *sets(TINY + [f"data.source={copy}"]), "--run-dir", str(tmp_path / "run")) == 1
    out = capsys.readouterr().out.replace("\n", "")
    assert "shard-00001.bin is" in out and "truncated or corrupt" in out
    assert not (tmp_path / "run").exists()


def test_a_corrupt_shard_is_refused_by_its_checksum_or_when_a_block_holds_ids_outside_the_vocabulary(tmp_path, prepared, capsys):
    copy = tmp_path / "prep"
    shutil.copytree(prepared, copy)
    shard = copy / "shard-00000.bin"
    tokens = np.fromfile(shard, dtype=np.uint16)
    tokens[:] = 60_000  # not a byte tokenizer id
    tokens.tofile(shard)
    assert run_cli("preflight", *sets(TINY + [f"data.source={copy}", "data.verify_shards=true"])) == 1
    assert "shard-00000.bin does not match the SHA-256" in capsys.readouterr().out
    with pytest.raises(DataError, match="shard-00000.bin does not match the checksum of its sampled blocks"):
        PreparedCorpus(copy)  # opening the corpus checks the sampled blocks
    manifest = json.loads((copy / "manifest.json").read_text())
    for entry in manifest["shards"]:
        del entry["sampled_sha256"]  # as a manifest written before they were recorded
    (copy / "manifest.json").write_text(json.dumps(manifest))
    blocks = PreparedBlocks(PreparedCorpus(copy), seq_len=32, seed=0)
    with pytest.raises(DataError, match=r"token id 60000 in shard-00000.bin.*corrupt"):
        blocks.block(0)


def test_preflight_refuses_a_prepared_corpus_of_another_tokenizer_naming_both(tmp_path, prepared, capsys):
    from test_data_prepare import _word_tokenizer

    spec = _word_tokenizer(tmp_path / "tok", 50)
    assert run_cli("preflight", *sets(TINY + [f"data.source={prepared}", f"data.tokenizer={spec}"])) == 1
    out = capsys.readouterr().out
    assert "data.tokenizer" in out and "'byte'" in out and spec in out and "prepare the corpus again" in out


def test_a_raw_source_above_the_threshold_is_prepared_once_into_the_cache_and_reused(tmp_path, monkeypatch, capsys):
    from attnlab.data import prepare as prep

    src = _jsonl(tmp_path / "src" / "big.jsonl", n_docs=40)
    cache = tmp_path / "cache"
    overrides = TINY + [f"data.source={src}", "data.prepare_above_mb=0.01", f"data.cache_dir={cache}", "data.val_fraction=0.2"]
    assert run_cli("preflight", *sets(overrides)) == 0
    out = capsys.readouterr().out
    assert "preparing" in out and str(cache) in out
    (prepared_dir,) = [p for p in cache.iterdir() if p.is_dir()]
    assert PreparedCorpus(prepared_dir).manifest["validation"]["fraction"] == 0.2

    def no_second_preparation(*args, **kwargs):
        raise AssertionError("the cached preparation was not reused")

    monkeypatch.setattr(prep, "prepare_corpus", no_second_preparation)
    assert run_cli("preflight", *sets(overrides)) == 0
    assert f"reusing the prepared corpus {prepared_dir}" in capsys.readouterr().out.replace("\n", "")

    assert run_cli("preflight", *sets(TINY + [f"data.source={src}", f"data.cache_dir={cache}"])) == 0  # under the threshold: in memory
    assert "prepar" not in capsys.readouterr().out


def test_validation_comes_from_the_manifest_split_or_from_a_separate_validation_source(tmp_path, prepared):
    from attnlab.config import load_config
    from attnlab.train.preflight import run_preflight

    report = run_preflight(load_config(None, TINY + [f"data.source={prepared}", "data.val_fraction=0.2"]))
    assert not report.errors and not report.problems
    corpus = PreparedCorpus(prepared)
    held_out = np.concatenate([corpus.tokens(s, e) for s, e in corpus.val_ranges])
    assert torch.equal(report.data.val.reshape(-1), torch.from_numpy(held_out[: report.data.val.numel()].astype(np.int64)))
    assert report.data.val.shape == (2 * 4, 32) and 0.9 < report.data.stats["val_bytes_per_token"] <= 1.0

    val = _jsonl(tmp_path / "val.jsonl", n_docs=5, seed=1)
    report = run_preflight(load_config(None, TINY + [f"data.source={prepared}", f"data.val_source={val}"]))
    assert not report.errors
    assert torch.equal(report.data.val, pack_documents(read_documents(str(val)), load_tokenizer("byte"), 32)[: 2 * 4])


def test_a_preparation_that_did_not_finish_is_refused_not_read_as_raw_files(tmp_path, prepared, capsys):
    copy = tmp_path / "prep"
    shutil.copytree(prepared, copy)
    (copy / "manifest.json").unlink()
    assert run_cli("preflight", *sets(TINY + [f"data.source={copy}"])) == 1
    assert "preparation did not finish" in capsys.readouterr().out.replace("\n", " ")
