"""Bad input met with one clear message, or bounded: hostile SQL, JSONL with line separators inside
strings, a sweep whose suite changed, YAML keys given twice, sizes and options that do not fit.

Each test reproduces one case of the fault list (issue: every bad input or fault met with one clear
message): `run_cli` returns the exit code, an escaped exception would be the traceback the CLI must
never show, and stderr holds one `error:` line saying what to do.
"""

import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from conftest import run_cli, sets

from attnlab.eval.tasks import BUNDLED
from attnlab.outputs import MANIFEST

SPIDER = BUNDLED["spider"]
LIBRARY_DB = SPIDER / "database" / "library" / "library.sqlite"
LIMIT_S = 2.0  # the time limit the SQL tests give each query


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("error:")]


def assert_one_error(capsys, *needles: str) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert len(error_lines(err)) == 1, err
    for needle in needles:
        assert needle in err, err
    return err


# --- SQL: every scored prediction is bounded in time and memory -------------------------------------

_ISSUE_QUERIES = {
    # one printf builds 100 MB, then 40 replace() calls copy it: 38.8 s and 4.6 GB resident before
    "printf_replace": "WITH s(v) AS (SELECT printf('%.*c',100000000,'x')) SELECT "
                      + ", ".join("length(replace(v,'x','a'))" for _ in range(40)) + " FROM s",
    # the row cap did not cap bytes: 4.2 GB
    "zeroblob": "SELECT zeroblob(999999999) FROM book LIMIT 3",
    # one instruction of SQLite's virtual machine that loops for ~20 s: no progress handler reaches it
    "one_long_instruction": "SELECT printf('%.*c',2147483647,'x') IS NULL",
    # returned the address of a C structure of the process
    "fts3_tokenizer": "SELECT hex(fts3_tokenizer('simple'))",
}

_MEASURE = textwrap.dedent("""
    import json, resource, sys, time
    from attnlab.eval import sql
    db, query, limit = sys.argv[1], sys.argv[2], float(sys.argv[3])
    assert sql.run_query(db, "SELECT 1").ok  # the worker is started: the timing below is the query's own
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.monotonic()
    result = sql.run_query(db, query, timeout_s=limit)
    seconds = time.monotonic() - t0
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    sql._WORKER.stop()
    worker_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    print(json.dumps({"seconds": seconds, "error": result.error, "rows": repr(result.rows)[:200],
                      "grown_mib": grown_kib / 1024, "worker_mib": worker_kib / 1024}))
""")


@pytest.mark.parametrize("name", list(_ISSUE_QUERIES))
def test_hostile_sql_from_the_issue_ends_within_the_limit_and_small_memory(name):
    """Measured in a fresh process: its own peak memory and the query worker's, not the test session's."""
    proc = subprocess.run([sys.executable, "-c", _MEASURE, str(LIBRARY_DB), _ISSUE_QUERIES[name], str(LIMIT_S)],
                          check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    m = json.loads(proc.stdout.strip().splitlines()[-1])
    assert m["seconds"] <= LIMIT_S + 1.0, m
    assert m["grown_mib"] < 64, m  # the evaluating process holds at most one capped result
    assert m["worker_mib"] < 256, m  # the worker never built a value over 1 MB
    if name == "fts3_tokenizer":
        assert m["error"] and "fts3_tokenizer" in m["error"]
    elif name == "zeroblob":
        assert m["error"] and "1,000,000 bytes" in m["error"]
    elif name == "one_long_instruction":
        assert m["error"] and "time limit" in m["error"]
    elif m["error"] is None:  # printf's value is over the length limit: NULL (SQLite's rule) ...
        assert m["rows"].startswith("[(None, None")
    else:  # ... or the time limit
        assert "time limit" in m["error"]


def test_the_query_worker_is_replaced_after_a_kill_and_the_next_query_runs():
    from attnlab.eval.sql import run_query

    stopped = run_query(LIBRARY_DB, _ISSUE_QUERIES["one_long_instruction"], timeout_s=0.5)
    assert not stopped.ok and "time limit" in stopped.error
    assert run_query(LIBRARY_DB, "SELECT 1 + 1").rows == [(2,)]


def test_a_result_over_the_byte_cap_is_refused_although_under_the_row_cap():
    from attnlab.eval.sql import run_query

    wide = "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r LIMIT 40) SELECT randomblob(900000) FROM r"
    result = run_query(LIBRARY_DB, wide, max_rows=10_000)
    assert not result.ok and "result larger than" in result.error


def test_sql_functions_that_reach_outside_the_database_are_refused():
    from attnlab.eval.sql import run_query

    for query in ("SELECT hex(fts3_tokenizer('simple'))", "SELECT load_extension('x')", "SELECT fts3_tokenizer('x', x'00')"):
        result = run_query(LIBRARY_DB, query)
        assert not result.ok and "not authorized" in result.error, query
    assert run_query(LIBRARY_DB, "SELECT upper('a'), length('abc')").rows == [("A", 3)]


def _spider_with_db_id(tmp_path: Path, db_id: str) -> Path:
    """A Spider copy whose one question names `db_id`, described in tables.json too, with a database there."""
    data = Path(shutil.copytree(SPIDER, tmp_path / "spider"))
    outside = tmp_path / "outside" / "o"
    outside.mkdir(parents=True)
    shutil.copy(LIBRARY_DB, outside / "o.sqlite")
    tables = json.loads((data / "tables.json").read_text())
    library = next(t for t in tables if t["db_id"] == "library")
    tables.append({**library, "db_id": db_id})
    (data / "tables.json").write_text(json.dumps(tables))
    (data / "dev.json").write_text(json.dumps([{"db_id": db_id, "question": "How many books?", "query": "SELECT count(*) FROM book"}]))
    return data


@pytest.mark.parametrize("db_id", ["../../outside/o", "ABSOLUTE"])
def test_a_db_id_outside_the_data_directory_is_refused(tmp_path, capsys, db_id):
    if db_id == "ABSOLUTE":
        db_id = str(tmp_path / "outside" / "o")
    data = _spider_with_db_id(tmp_path, db_id)
    preds = tmp_path / "preds.sql"
    preds.write_text("SELECT count(*) FROM book\n")
    assert run_cli("score", "--task", "spider", "--data", str(data), "--predictions", str(preds)) == 1
    assert_one_error(capsys, "is not a database name", "db_id")


# --- files saved with a UTF-8 byte-order mark ------------------------------------------------------------


def test_predictions_saved_with_a_byte_order_mark_score_as_without_it(tmp_path):
    gold = [ex["query"] for ex in json.loads((SPIDER / "dev.json").read_text(encoding="utf-8"))]
    preds = tmp_path / "preds.sql"
    preds.write_text("".join(q + "\n" for q in gold), encoding="utf-8-sig")
    assert preds.read_bytes().startswith(b"\xef\xbb\xbf")
    assert run_cli("score", "--task", "spider", "--predictions", str(preds), "-o", str(tmp_path / "out")) == 0
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())["metrics"]
    assert metrics["exact_match"] == 1.0 and metrics["execution_accuracy"] == 1.0


def test_task_data_saved_with_a_byte_order_mark_is_read(tmp_path):
    data = Path(shutil.copytree(SPIDER, tmp_path / "spider"))
    for name in ("dev.json", "tables.json"):
        (data / name).write_text((SPIDER / name).read_text(encoding="utf-8"), encoding="utf-8-sig")
    gold = [ex["query"] for ex in json.loads((SPIDER / "dev.json").read_text(encoding="utf-8"))]
    preds = tmp_path / "preds.sql"
    preds.write_text("".join(q + "\n" for q in gold), encoding="utf-8")
    assert run_cli("score", "--task", "spider", "--data", str(data), "--predictions", str(preds), "-o", str(tmp_path / "out")) == 0
    assert json.loads((tmp_path / "out" / "metrics.json").read_text())["metrics"]["exact_match"] == 1.0


def test_a_spider_database_linked_from_outside_the_data_directory_is_refused(tmp_path, capsys):
    data = Path(shutil.copytree(SPIDER, tmp_path / "spider"))
    outside = tmp_path / "outside"
    (data / "database" / "library").rename(outside)
    (data / "database" / "library").symlink_to(outside, target_is_directory=True)
    preds = tmp_path / "preds.sql"
    preds.write_text("SELECT count(*) FROM book\n" * len(json.loads((data / "dev.json").read_text())))
    assert run_cli("score", "--task", "spider", "--data", str(data), "--predictions", str(preds)) == 1
    assert_one_error(capsys, "outside the data directory", "library")


# --- paths that stay under their roots: sweep run directories, prepared shards ------------------------


def test_a_sweep_suite_name_that_leaves_the_runs_directory_is_refused_naming_the_field(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump({"name": "../../x", "jobs": [{"name": "job"}]}))
    assert run_cli("sweep", str(path), "--dry-run") == 1
    assert_one_error(capsys, "name", "'../../x' is not a directory name")


def test_sweep_jobs_named_a_a2_and_a_get_three_directories(tmp_path):
    from attnlab.sweep.suite import expand, load_suite

    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump({"name": "s", "jobs": [{"name": "a"}, {"name": "a-2"}, {"name": "a"}]}))
    names = [job.name for job in expand(load_suite(path))]
    assert names[:2] == ["a", "a-2"] and len(set(names)) == 3


@pytest.mark.parametrize("where", ["absolute", "dotdot"])
def test_a_prepared_corpus_manifest_naming_a_shard_outside_its_directory_is_refused(tmp_path, where):
    from attnlab.data.prepare import prepare_corpus
    from attnlab.data.prepared import PreparedCorpus
    from attnlab.errors import DataError

    src = tmp_path / "plays.txt"
    src.write_text("To be, or not to be, that is the question.\n" * 20)
    out = tmp_path / "corpus"
    prepare_corpus(str(src), out, "byte")
    manifest = json.loads((out / "manifest.json").read_text())
    shard = manifest["shards"][0]["file"]
    (tmp_path / "elsewhere").mkdir()
    shutil.copy(out / shard, tmp_path / "elsewhere" / shard)
    named = str(tmp_path / "elsewhere" / shard) if where == "absolute" else f"../elsewhere/{shard}"
    manifest["shards"][0]["file"] = named
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=rf"manifest\.json.*{re.escape(repr(named))}.*outside the corpus directory"):
        PreparedCorpus(out)


def _prepared_big_shard(tmp_path) -> Path:
    """A corpus of one shard of about 1.3 MB of uint16 ids: more than the 16 sampled blocks of 64 KiB."""
    from attnlab.data.prepare import SAMPLE_BLOCKS, SAMPLE_BYTES, prepare_corpus

    src = tmp_path / "plays.txt"
    src.write_text("".join(f"Line {i}: to be, or not to be, that is the question.\n" for i in range(12_000)))
    out = tmp_path / "corpus"
    prepare_corpus(str(src), out, "byte", shard_tokens=10**7)
    assert (out / "shard-00000.bin").stat().st_size > SAMPLE_BLOCKS * SAMPLE_BYTES
    return out


def _overwrite_in_place_with_valid_ids(shard: Path) -> None:
    ids = np.fromfile(shard, dtype=np.uint16)
    ids[::-1].tofile(shard)  # the same ids reversed: every one valid, the size unchanged


def test_a_shard_overwritten_in_place_with_valid_ids_is_refused_when_the_corpus_is_opened(tmp_path, tiny, capsys):
    out = _prepared_big_shard(tmp_path)
    _overwrite_in_place_with_valid_ids(out / "shard-00000.bin")
    overrides = [o for o in tiny if not o.startswith("data.source")] + [f"data.source={out}"]
    assert run_cli("train", *sets(overrides), "--run-dir", str(tmp_path / "run")) == 1
    err = capsys.readouterr()
    text = " ".join((err.out + err.err).split())
    assert "Traceback" not in text and "shard-00000.bin" in text and "changed after it was prepared" in text
    assert "attnlab data prepare" in text and "data.verify_shards" in text


def test_a_shard_changed_only_between_its_sampled_blocks_is_caught_by_verify_shards(tmp_path):
    from attnlab.data.prepare import SAMPLE_BYTES
    from attnlab.data.prepared import PreparedCorpus
    from attnlab.errors import DataError

    out = _prepared_big_shard(tmp_path)
    shard = out / "shard-00000.bin"
    data = bytearray(shard.read_bytes())
    data[SAMPLE_BYTES + 10] ^= 1  # inside the gap after the first sampled block
    shard.write_bytes(bytes(data))
    PreparedCorpus(out)  # the cheap check reads 16 blocks, not this byte
    with pytest.raises(DataError, match="shard-00000.bin.*SHA-256"):
        PreparedCorpus(out, verify=True)


def test_a_manifest_written_before_sampled_checksums_still_loads(tmp_path):
    from attnlab.data.prepared import PreparedCorpus

    out = _prepared_big_shard(tmp_path)
    manifest = json.loads((out / "manifest.json").read_text())
    for entry in manifest["shards"]:
        del entry["sampled_sha256"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert PreparedCorpus(out).total_tokens == manifest["tokens"]


def test_preparing_again_remakes_a_shard_overwritten_in_place(tmp_path):
    from attnlab.data.prepare import prepare_corpus
    from attnlab.data.prepared import PreparedCorpus

    out = _prepared_big_shard(tmp_path)
    before = (out / "shard-00000.bin").read_bytes()
    _overwrite_in_place_with_valid_ids(out / "shard-00000.bin")
    prepare_corpus(str(tmp_path / "plays.txt"), out, "byte", shard_tokens=10**7)
    assert (out / "shard-00000.bin").read_bytes() == before
    PreparedCorpus(out)


# --- data prepare: two at once on one --out, a full disk --------------------------------------------------


def _small_source(tmp_path) -> Path:
    src = tmp_path / "plays.txt"
    src.write_text("".join(f"Line {i}: to be, or not to be, that is the question.\n\n" for i in range(400)))
    return src


def test_a_second_data_prepare_on_the_same_out_is_refused_while_the_first_runs(tmp_path, capsys):
    import fcntl
    import os

    from attnlab.outputs import open_lock_file

    src, out = _small_source(tmp_path), tmp_path / "corpus"
    out.mkdir()
    fd = open_lock_file(out / ".prepare.lock")  # a first preparation, holding the directory
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.pwrite(fd, b"4242\n", 0)
        assert run_cli("data", "prepare", str(src), "--out", str(out)) == 1
        assert_one_error(capsys, "another attnlab data prepare (process 4242) is writing to", str(out), "--out")
        assert sorted(p.name for p in out.iterdir()) == [".prepare.lock"]
    finally:
        os.close(fd)
    assert run_cli("data", "prepare", str(src), "--out", str(out)) == 0  # once the first is done
    assert (out / "manifest.json").is_file()


def test_two_data_prepare_processes_on_one_out_end_with_one_corpus_and_at_most_one_error(tmp_path):
    src, out = _small_source(tmp_path), tmp_path / "corpus"
    cmd = [sys.executable, "-m", "attnlab.cli", "data", "prepare", str(src), "--out", str(out), "--shard-tokens", "2000"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    assert all(code == 0 or (code == 1 and "another attnlab data prepare" in err and "Traceback" not in err) for code, err in results), results
    from attnlab.data.prepared import PreparedCorpus

    assert PreparedCorpus(out, verify=True).total_tokens > 0


def test_data_prepare_on_a_full_disk_says_so_once_and_leaves_no_temporary_file(tmp_path, capsys, monkeypatch):
    import errno

    from attnlab.data import prepare

    opened = prepare._open_for_writing

    class FullDisk:
        """A shard file on a disk that fills after 3000 bytes."""

        def __init__(self, path):
            self.file, self.written = opened(path), 0

        def write(self, data):
            if self.written + len(data) > 3000:
                self.file.write(data[: 3000 - self.written])
                self.written = 3000
                raise OSError(errno.ENOSPC, "No space left on device")
            self.written += len(data)
            return self.file.write(data)

        def __getattr__(self, name):
            return getattr(self.file, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

    monkeypatch.setattr(prepare, "_open_for_writing", FullDisk)
    src, out = _small_source(tmp_path), tmp_path / "corpus"
    assert run_cli("data", "prepare", str(src), "--out", str(out), "--shard-tokens", "1000") == 1
    assert_one_error(capsys, "No space left on device", str(out), "run the same command again")
    left = sorted(p.name for p in out.iterdir())
    assert not [name for name in left if "tmp" in name], left
    assert "manifest.json" not in left
    monkeypatch.undo()
    assert run_cli("data", "prepare", str(src), "--out", str(out), "--shard-tokens", "1000") == 0  # continues
    from attnlab.data.prepared import PreparedCorpus

    PreparedCorpus(out, verify=True)


# --- JSONL: U+2028 and U+0085 inside strings ----------------------------------------------------------


def test_eval_predictions_with_line_separators_inside_strings_read_back_in_score(tmp_path, capsys):
    from attnlab.data import ByteTokenizer
    from attnlab.models import AttnLabConfig, AttnLabForCausalLM

    torch.manual_seed(0)
    model_dir = tmp_path / "model"
    AttnLabForCausalLM(AttnLabConfig(vocab_size=259, hidden_size=32, num_layers=1, num_heads=2)).save_pretrained(model_dir)
    ByteTokenizer().save_pretrained(model_dir)
    data = Path(shutil.copytree(SPIDER, tmp_path / "spider"))
    questions = ["How many singers?\u2028Count them.", "Names\u0085of singers?", "Ages\u2029?"]
    (data / "dev.json").write_text(json.dumps([{"db_id": "music", "question": q, "query": "SELECT count(*) FROM singer"}
                                               for q in questions], ensure_ascii=False), encoding="utf-8")
    out = tmp_path / "out"
    assert run_cli("eval", str(model_dir), "--task", "spider", "--data", str(data), "--max-new-tokens", "4",
                   "--device", "cpu", "--output-dir", str(out)) == 0
    written = (out / "predictions.jsonl").read_text(encoding="utf-8")
    assert "\u2028" in written and "\u0085" in written  # raw inside the JSON strings, as json.dumps(ensure_ascii=False) writes
    capsys.readouterr()
    assert run_cli("score", "--task", "spider", "--data", str(data), "--predictions", str(out / "predictions.jsonl"),
                   "-o", str(tmp_path / "rescored")) == 0
    rescored = [json.loads(line) for line in (tmp_path / "rescored" / "predictions.jsonl").read_text(encoding="utf-8").split("\n") if line]
    assert [r["prompt"] for r in rescored] == [json.loads(line)["prompt"] for line in written.split("\n") if line]


def test_jsonl_records_split_on_newlines_only(tmp_path):
    from attnlab.data.corpus import jsonl_records

    rows = [{"text": "a\u2028b"}, {"text": "c\u0085d\x1ce"}]
    content = "".join(json.dumps(r, ensure_ascii=False) + "\r\n" for r in rows)
    assert [r for _, r in jsonl_records(content, tmp_path / "x.jsonl")] == rows


# --- sweep: a finished run made with another config is not "done" -------------------------------------


def test_a_sweep_rerun_after_the_suite_changed_a_finished_job_refuses_it(tmp_path, small_corpus, tiny, capsys):
    out = tmp_path / "runs"
    tiny_set = {k: v for k, v in (o.split("=", 1) for o in tiny)}
    assert run_cli("train", *sets(tiny), "--run-dir", str(out / "job")) == 0
    suite = {"name": "s", "set": {**tiny_set, "model.hidden_size": 48}, "jobs": [{"name": "job"}]}
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump(suite))
    before = {p: p.stat().st_mtime_ns for p in (out / "job").rglob("*") if p.is_file()}
    capsys.readouterr()
    assert run_cli("sweep", str(path), "--out-dir", str(out)) == 1
    printed = capsys.readouterr().out
    assert "skip" not in printed and "finished earlier" not in printed
    # the panel's words without its frame (where its lines wrap depends on the length of the temporary path)
    words = " ".join(re.sub("[\u2500-\u257f]", " ", printed).split())
    assert "changed" in printed and "model.hidden_size: 32 -> 48" in words
    assert {p: p.stat().st_mtime_ns for p in (out / "job").rglob("*") if p.is_file()} == before
    assert json.loads((out / "sweep.json").read_text())["jobs"][0]["state"] == "changed"
    # the suite as it was: skipped as finished
    path.write_text(yaml.safe_dump({**suite, "set": tiny_set}))
    assert run_cli("sweep", str(path), "--out-dir", str(out)) == 0
    assert "finished earlier" in capsys.readouterr().out


def test_a_sweep_dry_run_says_a_job_that_preflight_refuses_would_be_refused_and_why(tmp_path, tiny, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # the plan table's note on one line
    tiny_set = {k: v for k, v in (o.split("=", 1) for o in tiny)}
    suite = {"name": "s", "set": tiny_set, "jobs": [{"name": "fits"},
                                                   {"name": "short", "set": {"model.max_position_embeddings": 16}}]}
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump(suite))
    out = tmp_path / "runs"
    assert run_cli("sweep", str(path), "--out-dir", str(out), "--dry-run") == 0
    printed = capsys.readouterr().out
    words = " ".join(re.sub("[\u2500-\u257f]", " ", printed).split())
    rows = {line.split()[0]: line for line in (" ".join(re.sub("[\u2500-\u257f]", " ", row).split())
                                                  for row in printed.splitlines()) if line.split() and line.split()[0] in ("fits", "short")}
    assert "start" in rows["fits"] and "refused" in rows["short"] and "start" not in rows["short"].split()[:2]
    assert "model.max_position_embeddings" in words and "preflight refuses" in words
    commands = [line for line in printed.splitlines() if line.startswith(("fits:", "short:"))]
    assert [c.split(":")[0] for c in commands] == ["fits"]  # no command printed for the refused job
    assert not out.exists()


# --- configs: keys given twice, sizes that do not fit -------------------------------------------------


def test_a_yaml_key_given_twice_is_refused_with_both_lines(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  hidden_size: 64\ntrain:\n  lr: 0.001\n  max_steps: 20\n  lr: 0.01\n")
    assert run_cli("preflight", str(path)) == 1
    assert_one_error(capsys, "'train.lr'", "lines 4 and 6")


def test_a_yaml_section_given_twice_is_refused(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  lr: 0.001\nmodel:\n  hidden_size: 64\ntrain:\n  max_steps: 20\n")
    assert run_cli("preflight", str(path)) == 1
    assert_one_error(capsys, "'train'", "lines 1 and 5")


def test_the_duplicate_key_check_follows_aliases_and_merge_keys(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("defaults: &d {lr: 0.001}\ntrain:\n  <<: *d\n  lr: 0.002\nloop: &l [*l]\n")
    assert run_cli("preflight", str(path)) == 1  # unknown keys 'defaults' and 'loop', not a RecursionError
    assert_one_error(capsys, "unknown config key 'defaults'")


def test_a_suite_key_given_twice_is_refused(tmp_path, capsys):
    path = tmp_path / "suite.yaml"
    path.write_text("name: s\ngrid:\n  train.seed: [0, 1]\n  train.seed: [2]\n")
    assert run_cli("sweep", str(path), "--dry-run") == 1
    assert_one_error(capsys, "'grid.train.seed'", "lines 3 and 4")


@pytest.mark.parametrize("override", ["train.max_steps=true", "model.hidden_size=true", "train.lr=false", "train.eval_every=false"])
def test_a_boolean_for_a_number_setting_is_refused_not_read_as_one(tiny, capsys, override):
    assert run_cli("preflight", *sets(tiny + [override])) == 1
    assert_one_error(capsys, override.split("=")[0], "not a boolean")


@pytest.mark.parametrize("override", ["train.lr=nan", "train.weight_decay=inf", "train.grad_clip=.inf", "model.rope_theta=-inf",
                                      "train.progress_every_s=.nan", "data.val_fraction=nan"])
def test_a_non_finite_number_for_a_float_setting_is_refused_naming_it(tiny, capsys, override):
    assert run_cli("preflight", *sets(tiny + [override])) == 1
    assert_one_error(capsys, override.split("=")[0], "finite number")


@pytest.mark.parametrize("seed", ["-1", str(2**32)])
def test_a_train_seed_outside_numpys_range_is_refused_by_preflight(tiny, capsys, seed):
    assert run_cli("preflight", *sets(tiny + [f"train.seed={seed}"])) == 1
    assert_one_error(capsys, "train.seed")


def test_a_non_finite_generation_setting_in_the_eval_section_is_refused(tiny, capsys):
    assert run_cli("preflight", *sets(tiny + ["eval.generation.length_penalty=nan"])) == 1
    assert_one_error(capsys, "length_penalty", "finite number")


def test_max_position_embeddings_below_seq_len_is_refused_by_preflight(tiny, capsys):
    assert run_cli("preflight", *sets(tiny + ["model.max_position_embeddings=16"])) == 1
    err = capsys.readouterr()
    assert "model.max_position_embeddings" in err.out + err.err and "data.seq_len" in err.out + err.err


def test_a_prompt_longer_than_the_models_positions_is_refused_by_generate(tmp_path, capsys):
    from attnlab.data import ByteTokenizer
    from attnlab.errors import ConfigError
    from attnlab.generation import generate
    from attnlab.models import AttnLabConfig, AttnLabForCausalLM

    model = AttnLabForCausalLM(AttnLabConfig(vocab_size=259, hidden_size=32, num_layers=1, num_heads=2, max_position_embeddings=16))
    tokenizer = ByteTokenizer()
    with pytest.raises(ConfigError, match="longer than the model's 16 positions"):
        generate(model, tokenizer, ["short", "x" * 40], max_new_tokens=2)
    assert len(generate(model, tokenizer, "short", max_new_tokens=2)[0].token_ids) == 2
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    assert run_cli("generate", str(tmp_path / "model"), "-p", "x" * 40, "--device", "cpu") == 1
    assert_one_error(capsys, "longer than the model's 16 positions", "shorten the prompt")


# --- messages that point at the right key --------------------------------------------------------------


@pytest.mark.parametrize("mixer", ["nsa", "softmax"])
def test_a_mixer_option_of_the_wrong_type_fails_in_preflight_naming_the_key(tiny, capsys, mixer):
    assert run_cli("preflight", *sets(tiny + [f"model.mixer={mixer}", "model.mixer_options.num_kv_heads=abc"])) == 1
    err = capsys.readouterr()
    assert "model.mixer_options.num_kv_heads" in err.out and "'abc'" in err.out
    assert "Traceback" not in err.err and len(error_lines(err.err)) == 1


@pytest.mark.parametrize("value", ["nan", ".inf", "-inf"])
def test_a_non_finite_float_mixer_option_fails_in_preflight_naming_the_key(tiny, capsys, value):
    assert run_cli("preflight", *sets(tiny + ["model.mixer=gla", f"model.mixer_options.expand_k={value}"])) == 1
    err = capsys.readouterr()
    assert "model.mixer_options.expand_k" in err.out and "finite number" in err.out
    assert "Traceback" not in err.err and len(error_lines(err.err)) == 1


def test_a_misspelled_mixer_lists_the_closest_names_not_all(tiny, capsys):
    assert run_cli("preflight", *sets(tiny + ["model.mixer=glaa"])) == 1
    out = capsys.readouterr().out
    assert "did you mean 'gla'" in out
    assert "linear__output_norm" not in out and "2mamba" not in out


def test_max_steps_below_the_default_warmup_names_warmup_steps_and_not_the_default_file(capsys):
    assert run_cli("preflight", "--set", "train.max_steps=10") == 1
    err = assert_one_error(capsys, "train.warmup_steps", "--set train.max_steps=10")
    assert "default.yaml" not in err


def test_a_misspelled_generate_setting_suggests_the_generation_key():
    from attnlab.data import ByteTokenizer
    from attnlab.errors import ConfigError
    from attnlab.generation import generate
    from attnlab.models import AttnLabConfig, AttnLabForCausalLM

    model = AttnLabForCausalLM(AttnLabConfig(vocab_size=259, hidden_size=32, num_layers=1, num_heads=2))
    with pytest.raises(ConfigError) as info:
        generate(model, ByteTokenizer(), "hi", max_new_token=5)
    assert "did you mean 'max_new_tokens'" in str(info.value) and "sample_tokens" not in str(info.value)


# --- generate: settings, prompts and model files refused before anything is allocated ----------------


@pytest.mark.parametrize("setting", [
    ["--num-beams", "2", "--length-penalty", "nan"], ["--num-beams", "2", "--length-penalty", "inf"],
    ["--do-sample", "--temperature", "nan"], ["--do-sample", "--temperature", "inf"],
    ["--repetition-penalty", "nan"], ["--do-sample", "--top-p", "nan"],
])
def test_generate_refuses_a_non_finite_float_setting_naming_it(attnlab_dir, capsys, monkeypatch, setting):
    import attnlab.loading

    monkeypatch.setattr(attnlab.loading, "load", lambda *a, **k: pytest.fail("the model must not load"))
    assert run_cli("generate", str(attnlab_dir), "--prompt", "x", *setting) == 1
    assert_one_error(capsys, setting[-2].removeprefix("--").replace("-", "_"), "finite number")


@pytest.mark.parametrize("seed", [str(2**64), str(-1), str(10**30)])
def test_generate_refuses_a_seed_beyond_64_bits(attnlab_dir, capsys, seed):
    assert run_cli("generate", str(attnlab_dir), "--prompt", "x", "--do-sample", "--seed", seed, "--max-new-tokens", "2") == 1
    assert_one_error(capsys, "seed")


def test_generate_reads_a_prompt_file_saved_with_a_byte_order_mark_without_the_mark(attnlab_dir, tmp_path):
    prompts, out = tmp_path / "prompts.txt", tmp_path / "out.jsonl"
    prompts.write_text("Hello\nWorld\n", encoding="utf-8-sig")
    assert run_cli("generate", str(attnlab_dir), "--input", str(prompts), "--output", str(out), "--max-new-tokens", "2") == 0
    assert [json.loads(line)["prompt"] for line in out.read_text(encoding="utf-8").splitlines()] == ["Hello", "World"]


def _copy_model(src: Path, dst: Path, **config_changes) -> Path:
    shutil.copytree(src, dst)
    if config_changes:
        config = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**config, **config_changes}))
    return dst


def _never_build(monkeypatch):
    import transformers

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: pytest.fail("the model must not be built from these files"))


@pytest.mark.parametrize("field, value, words", [
    ("num_layers", 10_000_000, ["layers"]), ("vocab_size", -5, ["positive"]), ("vocab_size", 10_000_000_000, ["parameters"]),
    ("hidden_size", 1_000_000_000, ["parameters"]), ("num_layers", "4", ["not an integer"]), ("hidden_size", True, ["not an integer"]),
    ("intermediate_size", -1, ["at least 0"]),
])
def test_generate_refuses_a_model_config_with_impossible_sizes_before_building_it(attnlab_dir, tmp_path, capsys, monkeypatch,
                                                                                   field, value, words):
    broken = _copy_model(attnlab_dir, tmp_path / "m", **{field: value})
    _never_build(monkeypatch)
    assert run_cli("generate", str(broken), "--prompt", "x", "--device", "cpu") == 1
    assert_one_error(capsys, "config.json", field, *words)


def _rewrite_header(path: Path, change) -> None:
    """`path`'s safetensors header passed through `change` (a function of the parsed header), the data kept."""
    import struct

    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    change(header)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length:])


def _first_tensor(header: dict) -> dict:
    return header[next(k for k in header if k != "__metadata__")]


def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def header_length_2_62(path):
    path.write_bytes((2**62).to_bytes(8, "little") + path.read_bytes()[8:])


def header_length_past_the_end(path):
    path.write_bytes((path.stat().st_size).to_bytes(8, "little") + path.read_bytes()[8:])


def too_short(path):
    path.write_bytes(b"\x01\x02")


def header_not_json(path):
    path.write_bytes((16).to_bytes(8, "little") + b"\xff" * 16 + path.read_bytes())


def absurd_offsets(path):
    _rewrite_header(path, lambda h: _first_tensor(h).update(data_offsets=[0, 10**15]))


def negative_offsets(path):
    _rewrite_header(path, lambda h: _first_tensor(h).update(data_offsets=[-8, 0]))


def shape_bigger_than_its_bytes(path):
    _rewrite_header(path, lambda h: _first_tensor(h).update(shape=[10**6, 10**6]))


@pytest.mark.parametrize("damage, words", [
    (truncate, ["lie outside"]), (header_length_2_62, ["header length"]), (header_length_past_the_end, ["header length"]),
    (too_short, ["less than a safetensors header"]), (header_not_json, ["not valid JSON"]), (absurd_offsets, ["lie outside"]),
    (negative_offsets, ["lie outside"]), (shape_bigger_than_its_bytes, ["bytes for a"]),
])
def test_generate_refuses_a_damaged_safetensors_file_before_loading_it(attnlab_dir, tmp_path, capsys, monkeypatch, damage, words):
    broken = _copy_model(attnlab_dir, tmp_path / "m")
    assert not (broken / "manifest.json").exists()
    damage(broken / "model.safetensors")
    _never_build(monkeypatch)
    assert run_cli("generate", str(broken), "--prompt", "x", "--device", "cpu") == 1
    assert_one_error(capsys, "model.safetensors", *words)


@pytest.mark.parametrize("how", ["argument", "jsonl"])
def test_generate_refuses_a_prompt_holding_a_lone_surrogate_before_loading_the_model(attnlab_dir, tmp_path, capsys, monkeypatch, how):
    import attnlab.loading

    monkeypatch.setattr(attnlab.loading, "load", lambda *a, **k: pytest.fail("the model must not load"))
    if how == "argument":
        args = ["--prompt", "ok", "--prompt", "a\ud800b"]
    else:
        prompts = tmp_path / "prompts.jsonl"
        prompts.write_text('{"prompt": "ok"}\n{"prompt": "a\\ud800b"}\n')
        args = ["--input", str(prompts)]
    assert run_cli("generate", str(attnlab_dir), *args) == 1
    assert_one_error(capsys, "surrogate", "prompts.jsonl, line 2" if how == "jsonl" else "--prompt 2")


def test_the_generation_api_refuses_a_prompt_holding_a_lone_surrogate():
    from attnlab.data import ByteTokenizer
    from attnlab.errors import DataError
    from attnlab.generation import generate
    from attnlab.models import AttnLabConfig, AttnLabForCausalLM

    model = AttnLabForCausalLM(AttnLabConfig(vocab_size=259, hidden_size=32, num_layers=1, num_heads=2))
    with pytest.raises(DataError, match="surrogate"):
        generate(model, ByteTokenizer(), ["fine", "\udced\udca0"], max_new_tokens=2)


# --- convert: configs of the wrong types, files that are not JSON --------------------------------------


def _fla_checkpoint(path: Path, **config_changes) -> Path:
    from safetensors.torch import save_file

    from test_convert import FLA_CONFIG, fla_gla_tensors

    path.mkdir()
    (path / "config.json").write_text(json.dumps({**FLA_CONFIG, **config_changes}))
    save_file(fla_gla_tensors(), str(path / "model.safetensors"))
    return path


@pytest.mark.parametrize("changes, words", [
    ({"hidden_size": "64"}, ["hidden_size", "not an integer"]), ({"num_heads": 4.0}, ["num_heads", "not an integer"]),
    ({"expand_k": "half"}, []), ({"num_hidden_layers": None, "vocab_size": None}, []), ({"num_hidden_layers": 10**9}, ["layers"]),
    ({"vocab_size": 10**13}, ["parameters"]),
])
def test_convert_refuses_a_config_of_the_wrong_types_naming_the_file(tmp_path, capsys, changes, words):
    src = _fla_checkpoint(tmp_path / "gla", **changes)
    assert run_cli("convert", str(src), str(tmp_path / "out")) == 1
    assert_one_error(capsys, "config.json", *words)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("content", [bytes(range(256)) * 4, b"[1, 2, 3]"], ids=["random_bytes", "a_list"])
def test_convert_refuses_a_config_json_that_is_not_a_json_object(tmp_path, capsys, content):
    src = _fla_checkpoint(tmp_path / "gla")
    (src / "config.json").write_bytes(content)
    assert run_cli("convert", str(src), str(tmp_path / "out")) == 1
    assert_one_error(capsys, "config.json")
    assert not (tmp_path / "out").exists()


def test_convert_refuses_a_truncated_safetensors_file(tmp_path, capsys):
    src = _fla_checkpoint(tmp_path / "gla")
    truncate(src / "model.safetensors")
    assert run_cli("convert", str(src), str(tmp_path / "out")) == 1
    assert_one_error(capsys, "model.safetensors", "truncated")
    assert not (tmp_path / "out").exists()


def test_train_refuses_an_init_from_model_with_a_truncated_safetensors_file(tmp_path, tiny, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    from attnlab.data import ByteTokenizer

    hf = tmp_path / "llama"
    LlamaForCausalLM(LlamaConfig(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=1)).save_pretrained(hf)
    ByteTokenizer().save_pretrained(hf)
    truncate(hf / "model.safetensors")
    overrides = [o for o in tiny if not o.startswith("model.")] + [f"train.init_from={hf}"]
    assert run_cli("train", *sets(overrides), "--run-dir", str(tmp_path / "run")) == 1
    assert_one_error(capsys, "model.safetensors", "truncated")


# --- finetune's base, adapters and resumed checkpoints: checked before anything is allocated ----------------

FT_ROWS = [{"prompt": f"<T> what is {w}?\n", "completion": f"{w}."} for w in ("red", "sky")] + \
          [{"prompt": f"<V> what is {w}?\n", "completion": f"{w} is a thing we know."} for w in ("red", "sky")]
FT_QUICK = ["train.max_steps=1", "train.warmup_steps=0", "train.batch_size=4", "train.log_every=1", "train.device=cpu",
            "finetune.r=4", "finetune.dropout=0.0", "data.max_len=48", "finetune.eval_prompts=null"]


def _finetune_args(tmp_path: Path, base: Path, run: Path) -> list[str]:
    data = tmp_path / "ft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in FT_ROWS))
    cfg = tmp_path / "ft.yaml"
    cfg.write_text("finetune:\n  control_tokens: ['<T>', '<V>']\n")
    return ["finetune", str(cfg), *sets([f"base.path={base}", f"data.train={data}", *FT_QUICK]), "--run-dir", str(run)]


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory, attnlab_dir) -> Path:
    tmp = tmp_path_factory.mktemp("adapter")
    assert run_cli(*_finetune_args(tmp, attnlab_dir, tmp / "run")) == 0
    return tmp / "run" / "final"


@pytest.mark.parametrize("field, value, words", [("num_layers", 10_000_000, ["layers"]), ("vocab_size", -5, ["positive"])])
def test_finetune_refuses_a_base_config_with_impossible_sizes_before_building_it(attnlab_dir, tmp_path, capsys, monkeypatch,
                                                                                 field, value, words):
    base = _copy_model(attnlab_dir, tmp_path / "base", **{field: value})
    _never_build(monkeypatch)
    assert run_cli(*_finetune_args(tmp_path, base, tmp_path / "run")) == 1
    assert_one_error(capsys, "config.json", field, *words)


def test_finetune_refuses_a_base_with_a_damaged_safetensors_file_before_loading_it(attnlab_dir, tmp_path, capsys, monkeypatch):
    base = _copy_model(attnlab_dir, tmp_path / "base")
    header_length_2_62(base / "model.safetensors")
    _never_build(monkeypatch)
    assert run_cli(*_finetune_args(tmp_path, base, tmp_path / "run")) == 1
    assert_one_error(capsys, "model.safetensors", "header length")


@pytest.mark.parametrize("name", ["adapter_model.safetensors", "control_tokens.safetensors"])
@pytest.mark.parametrize("damage, words", [(truncate, ["truncated"]), (header_length_2_62, ["checksum"])])
def test_an_adapter_with_a_damaged_safetensors_file_is_refused_before_its_base_loads(adapter_dir, tmp_path, capsys, monkeypatch,
                                                                                      name, damage, words):
    broken = tmp_path / "adapter"
    shutil.copytree(adapter_dir, broken)
    damage(broken / name)
    _never_build(monkeypatch)
    assert run_cli("generate", str(broken), "--prompt", "x", "--device", "cpu") == 1
    assert_one_error(capsys, name, *words, "write the directory again")  # the adapter's manifest finds the damage


@pytest.mark.parametrize("damage, words", [(truncate, ["lie outside"]), (header_length_2_62, ["header length"])])
def test_an_adapter_without_a_manifest_and_a_damaged_safetensors_file_is_refused_before_its_base_loads(
        adapter_dir, tmp_path, capsys, monkeypatch, damage, words):
    """An adapter written before adapters had manifests: the safetensors checks find the damage."""
    broken = tmp_path / "adapter"
    shutil.copytree(adapter_dir, broken)
    (broken / MANIFEST).unlink()
    damage(broken / "adapter_model.safetensors")
    _never_build(monkeypatch)
    assert run_cli("generate", str(broken), "--prompt", "x", "--device", "cpu") == 1
    assert_one_error(capsys, "adapter_model.safetensors", *words)


@pytest.mark.parametrize("content", [b"\xff\xfe{", b"[1]"], ids=["not_utf8", "a_list"])
def test_an_adapter_whose_adapter_config_is_not_a_json_object_is_refused_naming_it(adapter_dir, tmp_path, capsys, content):
    broken = tmp_path / "adapter"
    shutil.copytree(adapter_dir, broken)
    (broken / "adapter_config.json").write_bytes(content)
    assert run_cli("generate", str(broken), "--prompt", "x", "--device", "cpu") == 1
    assert_one_error(capsys, "adapter_config.json")


def test_an_adapter_whose_metadata_gives_an_absurd_vocabulary_is_refused_naming_the_field(adapter_dir, tmp_path, capsys):
    broken = tmp_path / "adapter"
    shutil.copytree(adapter_dir, broken)
    (broken / MANIFEST).unlink()  # past the manifest (it would refuse the edited file): the metadata's own checks
    meta = json.loads((broken / "attnlab_adapter.json").read_text())
    (broken / "attnlab_adapter.json").write_text(json.dumps({**meta, "embedding_rows": 10**12}))
    assert run_cli("generate", str(broken), "--prompt", "x", "--device", "cpu") == 1
    assert_one_error(capsys, "attnlab_adapter.json", "embedding_rows")


@pytest.mark.parametrize("damage, words", [(header_length_2_62, ["header length"]), (absurd_offsets, ["lie outside"])])
def test_resuming_from_a_checkpoint_whose_safetensors_header_is_damaged_is_refused_before_loading(attnlab_dir, tmp_path,
                                                                                                  damage, words):
    """The manifest's checksums catch a damaged checkpoint first; the loader itself also refuses the header
    (a checkpoint written with a matching manifest, or loaded without one)."""
    from attnlab.errors import CheckpointError
    from attnlab.models import AttnLabForCausalLM
    from attnlab.train.checkpoint import load_model_state

    checkpoint = _copy_model(attnlab_dir, tmp_path / "checkpoint-4")
    model = AttnLabForCausalLM.from_pretrained(checkpoint)
    damage(checkpoint / "model.safetensors")
    with pytest.raises(CheckpointError) as refused:
        load_model_state(model, checkpoint)
    assert "model.safetensors" in str(refused.value) and all(w in str(refused.value) for w in words)


# --- adapters: a portable base reference ------------------------------------------------------------------


def test_an_adapter_records_its_base_relative_to_itself_and_reloads_after_both_move_together(attnlab_dir, tmp_path, capsys):
    """The adapter recorded its base as an absolute path in the user's cache: it did not move to another machine or user."""
    home = tmp_path / "home"
    shutil.copytree(attnlab_dir, home / "models" / "base")
    assert run_cli(*_finetune_args(tmp_path, home / "models" / "base", home / "runs" / "ft")) == 0
    meta = json.loads((home / "runs" / "ft" / "final" / "attnlab_adapter.json").read_text())
    assert meta["base_model"] == "../../../models/base" and meta["base_model_hint"] == str((home / "models" / "base").resolve())
    capsys.readouterr()
    assert run_cli("generate", str(home / "runs" / "ft" / "final"), "--prompt", "<T> what is red?", "--max-new-tokens", "3",
                   "--device", "cpu") == 0
    before = capsys.readouterr().out
    moved = tmp_path / "elsewhere" / "another-user"
    moved.parent.mkdir()
    home.rename(moved)  # the base and the adapter, together; the old absolute path is gone
    assert run_cli("generate", str(moved / "runs" / "ft" / "final"), "--prompt", "<T> what is red?", "--max-new-tokens", "3",
                   "--device", "cpu") == 0
    captured = capsys.readouterr()
    assert captured.out == before
    assert str((moved / "models" / "base").resolve()) in captured.err  # "loading adapter ... on <the moved base>"


def test_an_adapter_moved_alone_finds_its_base_by_the_recorded_absolute_path(adapter_dir, attnlab_dir, tmp_path, capsys):
    moved = tmp_path / "adapter"
    shutil.copytree(adapter_dir, moved)
    assert run_cli("generate", str(moved), "--prompt", "<T> what is red?", "--max-new-tokens", "3", "--device", "cpu") == 0
    assert str(Path(attnlab_dir).resolve()) in capsys.readouterr().err


def test_an_adapter_whose_base_is_in_neither_place_is_refused_naming_both(attnlab_dir, tmp_path, capsys):
    base = tmp_path / "base"
    shutil.copytree(attnlab_dir, base)
    assert run_cli(*_finetune_args(tmp_path, base, tmp_path / "run")) == 0
    shutil.rmtree(base)
    capsys.readouterr()
    assert run_cli("generate", str(tmp_path / "run" / "final"), "--prompt", "x", "--device", "cpu") == 1
    assert_one_error(capsys, "is not where it records it", str(tmp_path / "run" / "final" / ".." / ".." / "base"), str(base.resolve()))


def test_an_adapter_written_with_an_absolute_base_path_still_loads(adapter_dir, attnlab_dir, tmp_path):
    old = tmp_path / "old-adapter"
    shutil.copytree(adapter_dir, old)
    (old / MANIFEST).unlink()  # adapters of that time had no manifest
    meta = json.loads((old / "attnlab_adapter.json").read_text())
    meta["base_model"] = str(Path(attnlab_dir).resolve())
    del meta["base_model_hint"]
    (old / "attnlab_adapter.json").write_text(json.dumps(meta))
    assert run_cli("generate", str(old), "--prompt", "<T> what is red?", "--max-new-tokens", "3", "--device", "cpu") == 0
