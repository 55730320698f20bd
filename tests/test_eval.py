"""Evaluation: task loaders, metrics against hand-computed values, the safe SQL executor, the CLI, during-training eval."""

import hashlib
import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import run_cli

from attnlab.errors import AttnLabError, DataError
from attnlab.eval.metrics import bleu_chrf, clean_prediction, normalize_sql, ratio, rouge, sql_orders_rows
from attnlab.eval.runner import evaluate, evaluate_perplexity, score
from attnlab.eval.sql import results_match, run_query
from attnlab.eval.tasks import BUNDLED, get_task

SPIDER = BUNDLED["spider"]
MUSIC_DB = SPIDER / "database" / "music" / "music.sqlite"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    from attnlab.data import ByteTokenizer
    from attnlab.models import AttnLabConfig, AttnLabForCausalLM

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("tiny-model")
    AttnLabForCausalLM(AttnLabConfig(vocab_size=259, hidden_size=32, num_layers=1, num_heads=2)).save_pretrained(out)
    ByteTokenizer().save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    from attnlab.loading import load

    return load(tiny_model_dir, device="cpu")


@pytest.fixture
def spider_copy(tmp_path) -> Path:
    """A private copy of the Spider fixture whose dev.json a test may rewrite."""
    return Path(shutil.copytree(SPIDER, tmp_path / "spider"))


def write_dev(spider_dir: Path, items: list[tuple[str, str]]) -> None:
    (spider_dir / "dev.json").write_text(json.dumps([{"db_id": "music", "question": q, "query": sql} for q, sql in items]))


# --- fixtures ---------------------------------------------------------------------------------


def test_fixtures_have_the_promised_sizes_and_every_gold_query_runs():
    spider = get_task("spider").load(SPIDER)
    assert len(spider) >= 30
    assert all(run_query(ex.meta["db_path"], ex.references[0]).ok for ex in spider)
    assert len(get_task("dart").load(BUNDLED["dart"])) >= 20
    assert len(get_task("samsum").load(BUNDLED["samsum"])) >= 20


@pytest.mark.parametrize("task", ["spider", "dart", "samsum"])
def test_prompts_never_contain_the_reference(task):
    for ex in get_task(task).load(BUNDLED[task]):
        assert all(ref.strip() not in ex.prompt for ref in ex.references)


def test_a_template_may_not_use_the_reference():
    with pytest.raises(DataError, match=r"\{query\}"):
        get_task("spider", template="{question}\n{query}")


# --- text-to-SQL scoring ----------------------------------------------------------------------


def test_execution_accuracy_excludes_gold_that_fails_to_run(spider_copy):
    write_dev(spider_copy, [
        ("How many singers?", "SELECT count(*) FROM singer"),
        ("Names from France?", "SELECT name FROM singer WHERE country = 'France'"),
        ("Broken gold", "SELECT nonexistent_column FROM singer"),
    ])
    result = score("spider", ["SELECT count(*) FROM singer", "SELECT name FROM singer WHERE age > 100", "SELECT 1"], spider_copy)
    assert result.metrics["execution_accuracy"] == 1 / 2  # 1 right of the 2 whose gold runs
    assert result.metrics["gold_failures"] == 1
    assert result.metrics["execution_counted"] == 2
    assert "no such column" in result.records[2]["scores"]["gold_error"]
    assert result.records[2]["scores"]["execution_match"] is None


def test_execution_match_compares_multisets_when_the_gold_does_not_order(spider_copy):
    write_dev(spider_copy, [("Names?", "SELECT name FROM singer")])
    reordered = score("spider", ["SELECT name FROM singer ORDER BY name DESC"], spider_copy)
    assert reordered.metrics["execution_accuracy"] == 1.0
    duplicated = score("spider", ["SELECT name FROM singer UNION ALL SELECT 'Ana Lima'"], spider_copy)
    assert duplicated.metrics["execution_accuracy"] == 0.0  # a multiset, not a set


def test_execution_match_is_order_sensitive_when_the_gold_orders(spider_copy):
    write_dev(spider_copy, [("Oldest first?", "SELECT name FROM singer ORDER BY age DESC")])
    assert score("spider", ["SELECT name FROM singer ORDER BY age ASC"], spider_copy).metrics["execution_accuracy"] == 0.0
    assert score("spider", ["SELECT name FROM singer ORDER BY age DESC"], spider_copy).metrics["execution_accuracy"] == 1.0
    assert sql_orders_rows("SELECT a FROM t ORDER BY a") and not sql_orders_rows("SELECT a FROM (SELECT a FROM t ORDER BY a)")
    assert results_match([(1,), (2,)], [(2,), (1,)], ordered=False) and not results_match([(1,), (2,)], [(2,), (1,)], ordered=True)


def test_a_prediction_that_fails_to_run_counts_as_wrong(spider_copy):
    write_dev(spider_copy, [("How many singers?", "SELECT count(*) FROM singer"), ("Ages?", "SELECT age FROM singer")])
    result = score("spider", ["SELEC count(*) FROM singer", ""], spider_copy)
    assert result.metrics["execution_accuracy"] == 0.0
    assert result.metrics["prediction_failures"] == 2


def test_exact_match_is_normalised_by_sqlglot():
    assert normalize_sql("select  COUNT(*)  from Singer ;") == normalize_sql("SELECT count(*) FROM singer")
    assert normalize_sql("SELECT name FROM singer") != normalize_sql("SELECT age FROM singer")
    assert normalize_sql("not sql at all (") is None


def test_spider_prediction_keeps_only_the_first_statement():
    task = get_task("spider")
    assert task.postprocess("SELECT a\nFROM t; DROP TABLE t") == "SELECT a FROM t"
    assert task.postprocess("```sql\nSELECT 1\n```") == "SELECT 1"


# --- the safe executor: model-written SQL cannot change the database --------------------------


@pytest.mark.parametrize("attack", [
    "DROP TABLE singer",
    "DELETE FROM singer",
    "INSERT INTO singer VALUES (99, 'x', 'y', 1, 1)",
    "CREATE TABLE pwned (a)",
    "ATTACH DATABASE 'pwned.sqlite' AS pwned",
    "PRAGMA writable_schema = ON",
    "VACUUM",
])
def test_predicted_statements_that_write_are_refused_and_the_file_is_unchanged(tmp_path, monkeypatch, attack):
    db = Path(shutil.copy(MUSIC_DB, tmp_path / "music.sqlite"))
    monkeypatch.chdir(tmp_path)
    before = sha256(db)
    result = run_query(db, attack)
    assert not result.ok
    assert sha256(db) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["music.sqlite"]  # ATTACH created no file
    assert run_query(db, "SELECT count(*) FROM singer").rows == [(7,)]


def test_an_endless_recursive_cte_is_stopped_by_the_time_limit(tmp_path):
    db = Path(shutil.copy(MUSIC_DB, tmp_path / "music.sqlite"))
    endless = "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r) SELECT count(*) FROM r"
    result = run_query(db, endless, timeout_s=0.2)
    assert not result.ok and "time limit" in result.error


def test_a_huge_result_is_refused_by_the_row_cap(tmp_path):
    db = Path(shutil.copy(MUSIC_DB, tmp_path / "music.sqlite"))
    huge = "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r LIMIT 1000000) SELECT n FROM r"
    result = run_query(db, huge, max_rows=100)
    assert not result.ok and "more than 100 rows" in result.error


def test_evaluation_continues_past_hostile_predictions_and_leaves_the_database_unchanged(spider_copy):
    write_dev(spider_copy, [("How many singers?", "SELECT count(*) FROM singer")] * 6)
    db = spider_copy / "database" / "music" / "music.sqlite"
    before = sha256(db)
    hostile = ["DROP TABLE singer", "ATTACH DATABASE 'x.sqlite' AS x", "PRAGMA writable_schema = 1",
               "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r) SELECT count(*) FROM r",
               "SELECT count(*) FROM singer", "DELETE FROM singer"]
    task = get_task("spider")
    task.timeout_s = 0.2
    result = score(task, hostile, spider_copy)
    assert sha256(db) == before
    assert [r["scores"]["execution_match"] for r in result.records] == [False, False, False, False, True, False]
    assert result.metrics["execution_accuracy"] == 1 / 6


# --- text metrics against hand-computed and library values ------------------------------------


def test_bleu_and_chrf_equal_sacrebleu_corpus_scores_with_all_references():
    import sacrebleu

    predictions = ["the cat sat on the mat", "a dog runs in the park"]
    references = [["the cat sat on the mat", "a cat was on the mat"], ["the dog runs in a park"]]
    ours = bleu_chrf(predictions, references)
    streams = [["the cat sat on the mat", "the dog runs in a park"], ["a cat was on the mat", None]]
    assert ours["bleu"] == pytest.approx(sacrebleu.corpus_bleu(predictions, streams).score)
    assert ours["chrf"] == pytest.approx(sacrebleu.corpus_chrf(predictions, streams).score)
    assert bleu_chrf(["the same five words here"], [["x", "the same five words here"]])["bleu"] == pytest.approx(100.0)


def test_rouge_matches_hand_computed_values():
    scores = rouge("the cat sat on the mat", "the cat is on the mat")
    assert scores["rouge1"] == pytest.approx(100 * 5 / 6)  # 5 of 6 unigrams shared both ways
    assert scores["rouge2"] == pytest.approx(100 * 3 / 5)  # the cat, on the, the mat of 5 bigrams
    assert scores["rougeL"] == pytest.approx(100 * 5 / 6)  # LCS: the cat on the mat
    assert rouge("cats running", "cat runs")["rouge1"] == pytest.approx(100.0)  # Porter stemming


def test_an_empty_prediction_scores_zero_and_is_counted():
    samsum = get_task("samsum")
    examples = samsum.load(BUNDLED["samsum"], limit=2)
    metrics, per_example = samsum.score(examples, ["", examples[1].references[0]])
    assert per_example[0]["rouge1"] == 0.0
    assert metrics["rouge1"] == pytest.approx(50.0)
    assert metrics["empty_predictions"] == 1
    dart = get_task("dart")
    d_examples = dart.load(BUNDLED["dart"], limit=2)
    d_metrics, _ = dart.score(d_examples, ["", ""])
    assert d_metrics["bleu"] == 0.0 and d_metrics["empty_predictions"] == 2


def test_an_empty_reference_is_excluded_and_reported(tmp_path):
    (tmp_path / "val.json").write_text(json.dumps([{"id": "a", "dialogue": "A: hi", "summary": "A says hi."},
                                                   {"id": "b", "dialogue": "B: yo", "summary": "  "}]))
    result = score("samsum", ["A says hi.", "anything"], tmp_path)
    assert result.metrics["rouge1"] == pytest.approx(100.0)
    assert result.metrics["empty_references"] == 1 and result.metrics["scored"] == 1
    assert result.records[1]["scores"]["rouge1"] is None


def test_no_scorable_examples_give_none_never_one(tmp_path, spider_copy):
    assert ratio(0, 0) is None
    (tmp_path / "val.json").write_text(json.dumps([{"dialogue": "A: hi", "summary": ""}]))
    assert score("samsum", [""], tmp_path).metrics["rouge1"] is None
    (tmp_path / "dart.json").write_text(json.dumps([{"tripleset": [["a", "b", "c"]], "annotations": [{"text": ""}]}]))
    assert score("dart", [""], tmp_path / "dart.json").metrics["bleu"] is None
    write_dev(spider_copy, [("Broken", "SELECT nope FROM singer")])
    assert score("spider", ["SELECT nope FROM singer"], spider_copy).metrics["execution_accuracy"] is None


def test_predictions_are_stripped_of_the_prompt_and_special_tokens():
    assert clean_prediction("Q: hi\nA: hello<|im_end|>", prompt="Q: hi\nA:") == "hello"
    assert clean_prediction("<s> SELECT 1</s><pad><pad>") == "SELECT 1"
    assert clean_prediction("text [SEP]", special_tokens=["[SEP]"]) == "text"


def test_generated_predictions_hold_no_prompt_and_no_special_tokens(tiny_model):
    model, tokenizer = tiny_model
    result = evaluate(model, tokenizer, "dart", BUNDLED["dart"], limit=3, generation={"max_new_tokens": 12})
    for record in result.records:
        assert not record["prediction"].startswith(record["prompt"])
        assert all(tok not in record["prediction"] for tok in ("<eos>", "<pad>", "<bos>"))
        assert record["finish_reason"] in ("eos", "stop", "length")
        assert record["references"] and "scores" in record


# --- perplexity -------------------------------------------------------------------------------


@pytest.mark.parametrize("seq_len", [1024, 5])
def test_perplexity_and_bits_per_byte_equal_a_hand_computation(tiny_model, tmp_path, seq_len):
    model, tokenizer = tiny_model
    text = "héllo, world\n"
    (tmp_path / "t.txt").write_text(text, encoding="utf-8")
    ids = list(text.encode("utf-8")) + [tokenizer.eos_token_id]  # bytes, then EOS as in training
    nll, predicted, start = 0.0, 0, 0
    while start < len(ids) - 1:  # windows overlap by one token, so every token after the first is predicted once
        window = torch.tensor([ids[start:start + seq_len]])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=window).logits[0].float(), -1)
        for t in range(1, window.shape[1]):
            nll -= float(logp[t - 1, window[0, t]])
            predicted += 1
        start += seq_len - 1
    assert predicted == len(ids) - 1
    loss = nll / predicted
    bpb = loss / math.log(2) / (len(text.encode("utf-8")) / len(ids))
    metrics = evaluate_perplexity(model, tokenizer, tmp_path / "t.txt", seq_len=seq_len, batch_size=2).metrics
    assert metrics["loss"] == pytest.approx(loss, rel=1e-5)
    assert metrics["perplexity"] == pytest.approx(math.exp(loss), rel=1e-5)
    assert metrics["bits_per_byte"] == pytest.approx(bpb, rel=1e-5)


# --- the CLI ----------------------------------------------------------------------------------


@pytest.mark.parametrize("task", ["spider", "dart", "samsum", "perplexity"])
def test_eval_cli_runs_each_task_on_its_fixture(tiny_model_dir, tmp_path, task, capsys):
    out = tmp_path / "out"
    assert run_cli("eval", str(tiny_model_dir), "--task", task, "--data", str(BUNDLED[task]), "--limit", "4",
                   "--max-new-tokens", "8", "--device", "cpu", "--output-dir", str(out)) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["task"] == task
    key = {"spider": "execution_accuracy", "dart": "bleu", "samsum": "rouge1", "perplexity": "bits_per_byte"}[task]
    assert key in metrics["metrics"] and key in capsys.readouterr().out
    if task != "perplexity":
        rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
        assert len(rows) == 4
        assert {"prompt", "prediction", "references", "scores", "finish_reason"} <= set(rows[0])


def test_score_cli_reads_one_prediction_per_line(spider_copy, tmp_path, capsys):
    write_dev(spider_copy, [("How many singers?", "SELECT count(*) FROM singer"), ("Ages?", "SELECT age FROM singer")])
    preds = tmp_path / "preds.sql"
    preds.write_text("SELECT count(*) FROM singer\tmusic\nSELECT name FROM singer\n")
    out = tmp_path / "scored"
    assert run_cli("score", "--task", "spider", "--data", str(spider_copy), "--predictions", str(preds), "-o", str(out)) == 0
    assert json.loads((out / "metrics.json").read_text())["metrics"]["execution_accuracy"] == 0.5
    assert "execution_accuracy" in capsys.readouterr().out


def test_score_cli_matches_jsonl_predictions_by_id(tmp_path, capsys):
    examples = get_task("samsum").load(BUNDLED["samsum"], limit=3)
    rows = [{"id": ex.id, "prediction": ex.references[0]} for ex in reversed(examples)]
    preds = tmp_path / "preds.jsonl"
    preds.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "scored"
    assert run_cli("score", "--task", "samsum", "--predictions", str(preds), "--limit", "3", "-o", str(out)) == 0
    assert json.loads((out / "metrics.json").read_text())["metrics"]["rouge1"] == pytest.approx(100.0)


def test_score_cli_reports_predictions_missing_an_id(tmp_path, capsys):
    preds = tmp_path / "preds.jsonl"
    preds.write_text(json.dumps({"id": "fx000", "prediction": "x"}) + "\n")
    assert run_cli("score", "--task", "samsum", "--predictions", str(preds), "--limit", "2") == 1
    assert "no prediction for 1 of 2 examples" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--task", "spider", "--data", "/nonexistent/spider"], "spider data must be a directory"),
    (["--task", "samsum", "--data", "/nonexistent/val.json"], "samsum data not found"),
    (["--task", "sumarise"], "unknown task 'sumarise'"),
    (["--task", "perplexity", "--data", "/nonexistent.txt"], "perplexity data not found"),
])
def test_bad_input_is_one_clear_error(tiny_model_dir, args, message, capsys):
    assert run_cli("eval", str(tiny_model_dir), *args) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_data_in_the_wrong_layout_is_one_clear_error(tiny_model_dir, tmp_path, capsys):
    (tmp_path / "val.json").write_text(json.dumps([{"text": "a dialogue without the SAMSum fields"}]))
    assert run_cli("eval", str(tiny_model_dir), "--task", "samsum", "--data", str(tmp_path)) == 1
    assert "does not look like the SAMSum layout" in capsys.readouterr().err
    assert run_cli("eval", str(tiny_model_dir), "--task", "spider", "--data", str(tmp_path)) == 1
    assert "expected dev.json" in capsys.readouterr().err


def test_lm_eval_without_the_extra_names_the_extra(tiny_model_dir, capsys):
    import importlib.util

    if importlib.util.find_spec("lm_eval") is not None:
        pytest.skip("lm-eval is installed")
    assert run_cli("eval", str(tiny_model_dir), "--lm-eval", "hellaswag") == 1
    assert "pip install 'attnlab[lmeval]'" in capsys.readouterr().err


@pytest.mark.parametrize("verb", ["eval", "score"])
def test_eval_verbs_have_help(verb, capsys):
    assert run_cli(verb, "--help") == 0
    assert "Usage" in capsys.readouterr().out


# --- during training --------------------------------------------------------------------------


class FakeLogger:
    def __init__(self, run_dir):
        self.run_dir = run_dir
        self.calls = []

    def validation_metrics(self, step, metrics):
        self.calls.append((step, metrics))


def test_eval_section_rejects_unknown_keys_tasks_and_best_metrics():
    from pydantic import ValidationError

    from attnlab.config.schema import EvalSection

    with pytest.raises(ValidationError):
        EvalSection(tasks=[{"task": "spider"}], evry=10)
    with pytest.raises(ValidationError, match="unknown task"):
        EvalSection(tasks=[{"task": "squad"}])
    with pytest.raises(ValidationError, match="max_new_token"):
        EvalSection(tasks=[{"task": "dart"}], generation={"max_new_token": 8})
    with pytest.raises(ValidationError, match="not in eval.tasks"):
        EvalSection(tasks=[{"task": "dart"}], best_metric="spider/execution_accuracy")


def test_every_generation_task_a_config_can_name_is_implemented():
    from attnlab.config.tasks import GENERATION_TASK_NAMES
    from attnlab.eval.tasks import GENERATION_TASKS

    assert tuple(GENERATION_TASKS) == GENERATION_TASK_NAMES


def test_eval_callback_runs_every_n_steps_logs_and_records_the_best(tiny_model_dir, tmp_path):
    from attnlab.eval.callback import EvalDuringTraining
    from attnlab.config.schema import EvalSection
    from attnlab.loading import load

    model, tokenizer = load(tiny_model_dir, device="cpu")
    section = EvalSection(tasks=[{"task": "spider", "limit": 2}, {"task": "perplexity", "limit": 1}], every=2,
                          generation={"max_new_tokens": 6}, best_metric="perplexity/bits_per_byte", best_mode="min")
    logger = FakeLogger(tmp_path)
    callback = EvalDuringTraining(section, tokenizer, logger)
    model.train()
    for step in range(1, 6):
        state = SimpleNamespace(global_step=step, max_steps=5, is_world_process_zero=True)
        callback.on_step_end(None, state, SimpleNamespace(), model=model)
        with torch.no_grad():  # stands in for the optimizer: later evaluations see a different model
            model.get_output_embeddings().weight.mul_(0.5)
    assert model.training
    assert [step for step, _ in logger.calls] == [2, 4, 5]
    assert {"spider/execution_accuracy", "perplexity/bits_per_byte"} <= set(logger.calls[0][1])
    best = json.loads((tmp_path / "best.json").read_text())
    values = {step: m["perplexity/bits_per_byte"] for step, m in logger.calls}
    assert best["metric"] == "perplexity/bits_per_byte" and best["value"] == min(values.values())
    assert best["step"] == min(values, key=values.get)
    assert (tmp_path / "eval" / "step-0000002" / "spider.jsonl").is_file()


def test_eval_callback_works_inside_a_short_trainer_run(tiny_model_dir, tmp_path):
    import transformers

    from attnlab.data import BlockDataset
    from attnlab.eval.callback import EvalDuringTraining
    from attnlab.config.schema import EvalSection
    from attnlab.loading import load

    model, tokenizer = load(tiny_model_dir, device="cpu")
    section = EvalSection(tasks=[{"task": "dart", "limit": 2}], every=1, generation={"max_new_tokens": 4}, best_metric="dart/chrf")
    logger = FakeLogger(tmp_path)
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "hf"), max_steps=2, per_device_train_batch_size=2,
                                          report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=BlockDataset(torch.randint(0, 256, (4, 16))),
                                   callbacks=[EvalDuringTraining(section, tokenizer, logger)])
    trainer.train()
    assert [step for step, _ in logger.calls] == [1, 2]
    assert json.loads((tmp_path / "best.json").read_text())["metric"] == "dart/chrf"


def test_callback_fails_before_training_when_task_data_is_missing(tiny_model, tmp_path):
    from attnlab.eval.callback import EvalDuringTraining
    from attnlab.config.schema import EvalSection

    with pytest.raises(AttnLabError, match="not found"):
        EvalDuringTraining(EvalSection(tasks=[{"task": "dart", "data": str(tmp_path / "missing.json")}]), tiny_model[1], FakeLogger(tmp_path))


def test_prompts_carrying_a_control_token_decode_with_its_preset(monkeypatch):
    import attnlab.generation
    from attnlab.data import ByteTokenizer
    from attnlab.eval.runner import evaluate
    from attnlab.eval.tasks import get_task
    from attnlab.eval.tasks.base import Example
    from attnlab.models import AttnLabConfig, AttnLabForCausalLM

    real, seen = attnlab.generation.generate, {}

    def spy(model, tokenizer, prompts, config=None, **kw):
        for p in prompts:
            seen[p.split()[0]] = (config.min_new_tokens, config.max_new_tokens)
        return real(model, tokenizer, prompts, config, **kw)

    monkeypatch.setattr(attnlab.generation, "generate", spy)
    torch.manual_seed(0)
    model = AttnLabForCausalLM(AttnLabConfig(vocab_size=259, hidden_size=32, num_layers=1, num_heads=2)).eval()
    model.attnlab_generation_presets = {"<T>": {"max_new_tokens": 2}, "<V>": {"min_new_tokens": 9, "max_new_tokens": 12}}
    examples = [Example(id=str(i), prompt=f"{tag} Speaker A: hi", references=["hi"]) for i, tag in enumerate(["<T>", "<V>", "plain"])]
    result = evaluate(model, ByteTokenizer(), "samsum", examples=examples)
    assert len(result.records) == 3
    task_default = get_task("samsum").generation_defaults["max_new_tokens"]
    assert seen == {"<T>": (0, 2), "<V>": (9, 12), "plain": (0, task_default)}
