"""attnlab sweep (suites of runs with skip/resume) and attnlab report (a self-contained HTML comparison)."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import run_cli

# Six tiny jobs: 3 mixers x 2 seeds, seconds each on CPU.
TINY = {
    "model.hidden_size": 32, "model.num_layers": 1, "model.num_heads": 2, "data.seq_len": 32, "train.batch_size": 4,
    "train.max_steps": 6, "train.warmup_steps": 1, "train.eval_every": 3, "train.eval_batches": 2, "train.save_every": 3,
    "train.log_every": 1, "train.sample_tokens": 4, "train.device": "cpu",
}


def write_suite(tmp_path: Path, corpus: Path, grid=None, jobs=None) -> Path:
    suite = {"name": "tiny", "set": {**TINY, "data.source": str(corpus)},
             "grid": grid if grid is not None else {"model.mixer": ["gla", "softmax", "linear"], "train.seed": [0, 1]}}
    if jobs:
        suite["jobs"] = jobs
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump(suite))
    return path


def sweep(suite: Path, out: Path, *extra: str) -> int:
    return run_cli("sweep", str(suite), "--out-dir", str(out), "--parallel", "2", *extra)


def status(run_dir: Path) -> str:
    return json.loads((run_dir / "run.json").read_text())["status"]


@pytest.fixture(scope="module")
def finished_suite(tmp_path_factory, small_corpus):
    """A 6-job suite run once to the end (shared by the tests that only read its results)."""
    tmp = tmp_path_factory.mktemp("sweep")
    suite, out = write_suite(tmp, small_corpus), tmp / "runs"
    assert sweep(suite, out) == 0
    return suite, out


def test_a_suite_of_six_jobs_runs_each_in_its_own_run_directory_with_its_own_log(finished_suite):
    _, out = finished_suite
    names = sorted(p.name for p in out.iterdir() if (p / "config.yaml").exists())
    assert names == sorted(f"{m}-seed{s}" for m in ("gla", "softmax", "linear") for s in (0, 1))
    for name in names:
        assert status(out / name) == "finished"
        assert (out / "logs" / f"{name}.log").read_text().count("run finished") == 1
        assert yaml.safe_load((out / name / "config.yaml").read_text())["model"]["mixer"] == name.split("-")[0]
    record = json.loads((out / "sweep.json").read_text())
    assert [j["state"] for j in record["jobs"]] == ["finished"] * 6


def test_rerunning_a_suite_skips_finished_jobs(finished_suite, capsys):
    suite, out = finished_suite
    before = {p: p.stat().st_mtime for p in out.glob("*/run.json")}
    assert sweep(suite, out) == 0
    assert {p: p.stat().st_mtime for p in out.glob("*/run.json")} == before
    assert capsys.readouterr().out.count("skipped") >= 6


def test_an_interrupted_job_is_resumed_from_its_checkpoint(tmp_path, small_corpus):
    suite = write_suite(tmp_path, small_corpus, grid={"model.mixer": ["gla"]})
    out = tmp_path / "runs"
    run_dir = out / "gla"
    # a run killed after its step-3 checkpoint: run.json says interrupted, checkpoint step-0000003 exists
    overrides = [f"{k}={v}" for k, v in {**TINY, "data.source": small_corpus, "model.mixer": "gla", "train.max_steps": 3}.items()]
    assert run_cli("train", *sum((["--set", o] for o in overrides), []), "--run-dir", str(run_dir)) == 0
    shutil.rmtree(run_dir / "final")
    rec = json.loads((run_dir / "run.json").read_text())
    (run_dir / "run.json").write_text(json.dumps({**rec, "status": "interrupted"}))
    assert sweep(suite, out) == 0
    log = (out / "logs" / "gla.log").read_text()
    assert "--resume" in log and "resuming from" in log
    assert status(run_dir) == "finished"
    steps = [json.loads(line)["step"] for line in (run_dir / "heartbeat.jsonl").read_text().splitlines() if "loss" in line]
    assert max(steps) == 6


def test_a_run_without_a_checkpoint_is_moved_aside_and_started_fresh(tmp_path, small_corpus, capsys):
    suite = write_suite(tmp_path, small_corpus, grid={"model.mixer": ["gla"]})
    out = tmp_path / "runs"
    (out / "gla").mkdir(parents=True)
    (out / "gla" / "config.yaml").write_text("model: {}\n")
    (out / "gla" / "run.json").write_text('{"status": "running"}')
    assert sweep(suite, out) == 0
    assert status(out / "gla") == "finished"
    assert len(list((out / ".aside").iterdir())) == 1
    assert "moved" in capsys.readouterr().out


def test_a_failing_job_is_reported_with_its_log_tail_and_the_others_finish(tmp_path, small_corpus, capsys):
    jobs = [{"name": "ok"}, {"name": "missing-data", "set": {"data.source": str(tmp_path / "nope.txt")}},
            {"name": "bad-key", "set": {"train.learning_rat": 1}}]
    suite = write_suite(tmp_path, small_corpus, grid={}, jobs=jobs)
    out = tmp_path / "runs"
    assert sweep(suite, out) == 1
    printed = capsys.readouterr().out
    assert status(out / "ok") == "finished"
    assert "missing-data: failed" in printed and "nope.txt" in printed  # the log tail names the problem
    assert "bad-key: invalid config" in printed and "train.learning_rat" in printed
    assert not (out / "bad-key").exists()


def test_dry_run_prints_the_plan_and_runs_nothing(tmp_path, small_corpus, capsys):
    suite = write_suite(tmp_path, small_corpus)
    out = tmp_path / "runs"
    assert sweep(suite, out, "--dry-run") == 0
    printed = capsys.readouterr().out
    assert not out.exists()
    assert printed.count("attnlab train") == 6 and "nothing was started" in printed
    assert "--set train.seed=1" in printed and "linear-seed1" in printed


def test_gpu_slots_set_cuda_visible_devices_per_job():
    from attnlab.sweep.runner import make_slots

    slots = make_slots(["0", "2"], per_gpu=2, parallel=1)
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in slots] == ["0", "0", "2", "2"]
    assert len(make_slots(None, per_gpu=1, parallel=3)) == 3


def test_the_built_in_mixer_suite_expands_to_valid_configs_of_registered_mixers():
    from attnlab.config import load_config
    from attnlab.models import MIXERS
    from attnlab.sweep import expand, load_suite, resolve_suite_path

    jobs = expand(load_suite(resolve_suite_path("mixers-shakespeare")))
    assert len(jobs) >= 6
    for job in jobs:
        assert load_config(None, job.overrides).model.mixer in MIXERS
        assert job.name == job.varying["model.mixer"]


def test_report_writes_html_with_embedded_plots_a_png_and_a_markdown_table(finished_suite, tmp_path):
    _, out = finished_suite
    page = tmp_path / "report.html"
    assert run_cli("report", str(out), "--out", str(page)) == 0
    text = page.read_text()
    assert len(re.findall(r'<img class="plot"[^>]*src="data:image/png;base64,', text)) == 3
    assert "http://" not in text and "https://" not in text and "<script" not in text  # nothing fetched, nothing run
    assert "train.seed" in text and "model.mixer" in text  # the config differences
    assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (tmp_path / "report.md").read_text().splitlines()
    assert md[0].startswith("| run | mixer |") and len(md) == 2 + 6


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(_chromium() is None, reason="chromium is not installed (apt-get install -y chromium)")
def test_report_renders_in_headless_chromium_with_every_plot_loaded_and_no_console_errors(finished_suite, tmp_path):
    _, out = finished_suite
    page = tmp_path / "report.html"
    assert run_cli("report", str(out), "--out", str(page)) == 0
    # a test harness beside the page (the page itself has no scripts): record whether every image decoded
    probe = tmp_path / "probe.html"
    probe.write_text(page.read_text().replace("</body>", """<script>
window.addEventListener('load', () => {
  const imgs = [...document.images];
  document.body.setAttribute('data-images', imgs.length);
  document.body.setAttribute('data-decoded', imgs.filter(i => i.complete && i.naturalWidth > 100).length);
});</script></body>"""))
    result = subprocess.run(
        [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run",
         "--disable-component-update", "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr",
         "--v=0", "--virtual-time-budget=5000", "--dump-dom", probe.as_uri()],
        capture_output=True, text=True, timeout=90,
    )
    dom = result.stdout
    assert 'data-images="3"' in dom and 'data-decoded="3"' in dom, result.stderr[-2000:]
    console = [line for line in result.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert not console, console
