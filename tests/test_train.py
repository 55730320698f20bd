"""Training end to end on a tiny model: artifacts, telemetry, resume, kills, divergence, bad input."""

import csv
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

from conftest import run_cli, sets
from attnlab.train.checkpoint import verify_checkpoint


def _final_weights(run_dir):
    return load_file(str(run_dir / "final" / "model.safetensors"))


def _run_json(run_dir):
    return json.loads((run_dir / "run.json").read_text())


def test_a_run_writes_config_checkpoints_telemetry_and_a_loadable_final_model(tmp_path, tiny, capsys):
    run = tmp_path / "run"
    assert run_cli("train", *sets(tiny), "--run-dir", str(run)) == 0
    out = capsys.readouterr().out
    assert str(run) in out and "bits/byte" in out

    assert (run / "config.yaml").is_file()
    assert [p.name for p in sorted((run / "checkpoints").glob("step-*"))] == ["step-0000004", "step-0000008"]
    assert os.readlink(run / "checkpoints" / "latest") == "step-0000008"
    assert verify_checkpoint(run / "checkpoints" / "step-0000008") == 8
    assert not (run / "checkpoints" / ".staging").exists()

    beats = [json.loads(line) for line in (run / "heartbeat.jsonl").read_text().splitlines()]
    assert [b["step"] for b in beats] == [2, 4, 6, 8]
    for field in ("loss", "lr", "grad_norm", "tokens_per_s", "elapsed_s", "cpu_rss_mib",
                  "gpu_mem_alloc_mib", "gpu_mem_alloc_gib", "gpu_mem_reserved_mib", "gpu_mem_reserved_gib"):
        assert field in beats[-1]
    rows = list(csv.DictReader(open(run / "metrics.csv")))
    assert [r["val_bpb"] for r in rows if r["val_bpb"]] and all(float(r["val_bpb"]) > 0 for r in rows if r["val_bpb"])
    assert list((run / "tb").glob("events.out.tfevents.*"))
    assert [json.loads(line)["step"] for line in (run / "samples.jsonl").read_text().splitlines()] == [4, 8]

    status = _run_json(run)
    assert status["status"] == "finished" and status["val_bpb"] > 0
    import attnlab.models  # noqa: F401  (registers the Auto classes)

    model = AutoModelForCausalLM.from_pretrained(run / "final")
    weights = _final_weights(run)
    assert torch.equal(model.state_dict()["lm_head.weight"], weights.get("lm_head.weight", weights["model.embeddings.weight"]))


def test_a_run_directory_holding_a_run_is_not_overwritten(tmp_path, tiny, capsys):
    run = tmp_path / "run"
    assert run_cli("train", *sets(tiny), "--run-dir", str(run)) == 0
    before = (run / "final" / "model.safetensors").read_bytes()
    assert run_cli("train", *sets(tiny), "--run-dir", str(run)) == 1
    assert "already holds a run" in capsys.readouterr().out
    assert (run / "final" / "model.safetensors").read_bytes() == before


KILL_DURING_SAVE = textwrap.dedent("""
    import os, signal, sys
    import attnlab.outputs as ckpt
    real = ckpt.write_manifest
    def dying_write_manifest(directory, step):
        if step == {kill_step}:   # model, optimizer and RNG are on disk; the checkpoint is not yet complete
            os.kill(os.getpid(), signal.SIGKILL)
        real(directory, step)
    ckpt.write_manifest = dying_write_manifest
    from attnlab.cli import main
    sys.argv = ["attnlab", "train", *sys.argv[1:]]
    main()
""")


def test_resume_after_sigkill_during_a_checkpoint_write_matches_an_uninterrupted_run(tmp_path, tiny):
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert run_cli("train", *sets(tiny), "--run-dir", str(full)) == 0

    script = tmp_path / "kill.py"
    script.write_text(KILL_DURING_SAVE.format(kill_step=8))
    proc = subprocess.run([sys.executable, str(script), *sets(tiny), "--run-dir", str(cut)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert os.readlink(cut / "checkpoints" / "latest") == "step-0000004"
    assert not (cut / "checkpoints" / "step-0000008").exists()
    assert not (cut / "final").exists()

    assert run_cli("train", "--resume", "--run-dir", str(cut)) == 0
    full_w, cut_w = _final_weights(full), _final_weights(cut)
    assert full_w.keys() == cut_w.keys()
    for name in full_w:
        torch.testing.assert_close(cut_w[name], full_w[name], rtol=0, atol=1e-6)
    assert _run_json(cut)["val_loss"] == pytest.approx(_run_json(full)["val_loss"], abs=1e-6)
    losses = lambda run: [json.loads(line)["loss"] for line in (run / "heartbeat.jsonl").read_text().splitlines()]  # noqa: E731
    assert losses(cut) == pytest.approx(losses(full), abs=1e-6)


def test_sigkill_during_the_first_checkpoint_leaves_nothing_to_resume_and_resume_refuses(tmp_path, tiny, capsys):
    run = tmp_path / "run"
    script = tmp_path / "kill.py"
    script.write_text(KILL_DURING_SAVE.format(kill_step=4))
    proc = subprocess.run([sys.executable, str(script), *sets(tiny), "--run-dir", str(run)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL
    assert run_cli("train", "--resume", "--run-dir", str(run)) == 1
    captured = capsys.readouterr()
    assert "nothing to resume" in captured.out + captured.err


def test_resume_extends_a_finished_run_to_more_steps(tmp_path, tiny):
    run = tmp_path / "run"
    assert run_cli("train", *sets(tiny), "--run-dir", str(run)) == 0
    assert run_cli("train", "--resume", "--run-dir", str(run), "--set", "train.max_steps=12") == 0
    assert os.readlink(run / "checkpoints" / "latest") == "step-0000012"


def test_resume_of_a_finished_run_without_more_steps_says_how_to_continue(tmp_path, tiny, capsys):
    run = tmp_path / "run"
    assert run_cli("train", *sets(tiny), "--run-dir", str(run)) == 0
    assert run_cli("train", "--resume", "--run-dir", str(run)) == 1
    assert "train.max_steps" in capsys.readouterr().out


def test_resume_refuses_a_config_that_changes_the_model(tmp_path, tiny, capsys):
    run = tmp_path / "run"
    assert run_cli("train", *sets(tiny), "--run-dir", str(run)) == 0
    assert run_cli("train", "--resume", "--run-dir", str(run), "--set", "model.hidden_size=64", "--set", "train.max_steps=12") == 1
    assert "model.hidden_size: 32 -> 64" in capsys.readouterr().out


def test_resume_with_no_run_refuses(tmp_path, capsys):
    assert run_cli("train", "--resume", "--run-dir", str(tmp_path / "empty")) == 1
    assert "nothing to resume" in capsys.readouterr().err


def test_resume_from_a_truncated_checkpoint_refuses_and_keeps_the_older_one(tmp_path, tiny, capsys):
    run = tmp_path / "run"
    assert run_cli("train", *sets(tiny), "--run-dir", str(run)) == 0
    newest = run / "checkpoints" / "step-0000008" / "model.safetensors"
    newest.write_bytes(newest.read_bytes()[:100])
    assert run_cli("train", "--resume", "--run-dir", str(run), "--set", "train.max_steps=12") == 1
    assert "model.safetensors has 100 bytes" in capsys.readouterr().out
    assert verify_checkpoint(run / "checkpoints" / "step-0000004") == 4


def test_nan_loss_stops_with_a_message_and_keeps_the_last_good_checkpoint(tmp_path, tiny, monkeypatch, capsys):
    from attnlab.train.loop import AttnLabTrainer

    real = AttnLabTrainer.compute_loss

    def poisoned(self, model, inputs, *args, **kwargs):
        loss = real(self, model, inputs, *args, **kwargs)
        return loss * float("nan") if self.state.global_step >= 5 else loss

    monkeypatch.setattr(AttnLabTrainer, "compute_loss", poisoned)
    run = tmp_path / "run"
    assert run_cli("train", *sets(tiny), "--run-dir", str(run)) == 1
    err = capsys.readouterr().err
    assert "the loss became nan at step 6" in err and "step-0000004" in err
    assert [p.name for p in (run / "checkpoints").glob("step-*")] == ["step-0000004"]
    assert verify_checkpoint(run / "checkpoints" / "step-0000004") == 4
    assert _run_json(run)["status"] == "diverged"


@pytest.mark.parametrize("problem, overrides, message", [
    ("empty corpus", lambda d: [f"data.source={d / 'empty.txt'}"], "empty"),
    ("missing corpus", lambda d: [f"data.source={d / 'nope.txt'}"], "nope.txt"),
    ("sequence longer than the data", lambda d: [f"data.source={d / 'short.txt'}", "data.seq_len=4096"], "4096"),
    ("tokenizer larger than the model", lambda d: ["model.vocab_size=100"], "model.vocab_size"),
])
def test_bad_data_fails_preflight_with_one_clear_message_and_writes_nothing(tmp_path, tiny, capsys, problem, overrides, message):
    (tmp_path / "empty.txt").write_text("   \n")
    (tmp_path / "short.txt").write_text("To be, or not to be, that is the question.\n" * 20)
    run = tmp_path / "run"
    assert run_cli("train", *sets(tiny + overrides(tmp_path)), "--run-dir", str(run)) == 1
    captured = capsys.readouterr()
    assert message in captured.out + captured.err
    assert not run.exists()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_run_trains_in_bf16_reports_gpu_memory_and_resumes(tmp_path, tiny):
    run = tmp_path / "run"
    on_gpu = [o for o in tiny if not o.startswith("train.device")] + ["train.device=cuda"]
    assert run_cli("train", *sets(on_gpu), "--run-dir", str(run)) == 0
    assert _run_json(run)["precision"] == "bf16"
    beat = json.loads((run / "heartbeat.jsonl").read_text().splitlines()[-1])
    assert beat["gpu_mem_alloc_mib"] > 0 and beat["gpu_mem_alloc_gib"] == pytest.approx(beat["gpu_mem_alloc_mib"] / 1024, abs=1e-3)
    assert run_cli("train", "--resume", "--run-dir", str(run), "--set", "train.max_steps=12") == 0
    assert os.readlink(run / "checkpoints" / "latest") == "step-0000012"


def test_evaluation_during_training_reaches_heartbeat_tensorboard_and_best_json(tmp_path, tiny):
    run = tmp_path / "run"
    evaluated = tiny + [
        "eval.tasks=[{task: perplexity, limit: 2}, {task: spider, limit: 2}]", "eval.every=4",
        "eval.generation={max_new_tokens: 4}", "eval.best_metric=perplexity/bits_per_byte", "eval.best_mode=min",
    ]
    assert run_cli("train", *sets(evaluated), "--run-dir", str(run)) == 0
    events = [json.loads(line) for line in (run / "heartbeat.jsonl").read_text().splitlines() if '"event": "eval"' in line]
    assert [e["step"] for e in events] == [4, 8]
    assert "perplexity/bits_per_byte" in events[-1] and "spider/execution_accuracy" in events[-1]
    best = json.loads((run / "best.json").read_text())
    assert best["step"] in (4, 8) and (run / best["checkpoint"]).is_dir()


def test_the_loss_check_names_the_first_non_finite_step_and_waits_for_the_latest_only_when_asked():
    from attnlab.train.loop import FiniteLossCheck

    check = FiniteLossCheck()
    for step, losses in ((1, [2.0, 2.1]), (2, [1.9, float("inf")]), (3, [float("nan")])):
        for value in losses:
            check.add(torch.tensor(value), step)
    assert check.check(all_steps=False) == (2, float("inf"))  # step 3, the latest, is left for later
    assert [step for step, _ in check.pending] == [3]
    step, value = check.check(all_steps=True)
    assert step == 3 and value != value
    assert check.pending == [] and check.check(all_steps=True) is None


class HostReads(TorchDispatchMode):
    """Counts reads of a tensor's value on the host (`aten::_local_scalar_dense`: `.item()`, `bool()`, indexing with a
    tensor) while on; each is a wait for the GPU under CUDA."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.reads += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def _count_host_reads_per_run(monkeypatch) -> list[int]:
    """The device values each training run reads on the host (`HostReads` over the Trainer's whole loop), one count per
    run, appended as each run ends."""
    from transformers import Trainer

    inner = Trainer._inner_training_loop
    counted = []

    def counting(self, *args, **kwargs):
        with HostReads() as host:
            try:
                return inner(self, *args, **kwargs)
            finally:
                counted.append(host.reads)

    monkeypatch.setattr(Trainer, "_inner_training_loop", counting)
    return counted


def test_the_loss_check_never_reads_a_value_on_the_host_before_it_is_asked():
    from attnlab.train.loop import FiniteLossCheck

    check = FiniteLossCheck()
    with HostReads() as host:
        for step in (1, 2, 3):
            check.add(torch.tensor([2.0, float("nan"), 1.0])[step - 1], step)
    assert host.reads == 0
    step, value = check.check(all_steps=True)
    assert step == 2 and value != value


def test_the_trainers_steps_read_nothing_on_the_host_between_logs(tmp_path, tiny, monkeypatch):
    """The whole cycle (batch, forward, backward, clipping, optimizer, callbacks) of steps that log, save and validate
    nothing reads no device value on the host: runs of 4 and 12 steps make the same number of reads."""
    counted = _count_host_reads_per_run(monkeypatch)
    quiet = ["train.log_every=100", "train.eval_every=100", "train.save_every=0", "train.sample_tokens=0"]
    for steps in (4, 12):
        run = tmp_path / f"run{steps}"
        assert run_cli("train", *sets(tiny + quiet + [f"train.max_steps={steps}"]), "--run-dir", str(run)) == 0
    assert len(counted) == 2 and counted[0] == counted[1], counted


def test_logs_between_checkpoints_read_nothing_on_the_host_and_log_what_the_trainer_would(tmp_path, tiny, monkeypatch):
    """A log at every step is taken on the device and written one step later (`PendingLog`): the trainer's reads of
    device values do not grow with the steps logged, and the records (step, loss, gradient norm, learning rate) are those
    of logs written at their step (the same run saving at every step, which logs as it goes)."""
    counted = _count_host_reads_per_run(monkeypatch)
    every_step = ["train.log_every=1", "train.eval_every=100", "train.sample_tokens=0"]
    for steps in (4, 12):
        run = tmp_path / f"run{steps}"
        assert run_cli("train", *sets(tiny + every_step + ["train.save_every=0", f"train.max_steps={steps}"]),
                       "--run-dir", str(run)) == 0
    assert len(counted) == 2 and counted[0] == counted[1], counted

    saving = tmp_path / "saving"
    assert run_cli("train", *sets(tiny + every_step + ["train.save_every=1", "train.keep_last=1", "train.max_steps=12"]),
                   "--run-dir", str(saving)) == 0
    records = lambda run: [{k: b[k] for k in ("step", "loss", "grad_norm", "lr")}  # noqa: E731
                           for b in map(json.loads, (run / "heartbeat.jsonl").read_text().splitlines())]
    deferred, at_once = records(tmp_path / "run12"), records(saving)
    assert [r["step"] for r in deferred] == list(range(1, 13))
    assert deferred == at_once


def test_nsas_health_statistics_are_logged_as_of_their_step(tmp_path, tiny):
    """NSA's statistics, taken with a log written one step late, are the logged step's: the same as a run that logs
    every step as it goes (saving at every step)."""
    nsa = tiny + ["model.mixer=nsa", "train.log_every=1", "train.eval_every=100", "train.sample_tokens=0", "train.max_steps=5"]
    runs = {"deferred": ["train.save_every=0"], "at_once": ["train.save_every=1", "train.keep_last=1"]}
    stats = {}
    for name, extra in runs.items():
        assert run_cli("train", *sets(nsa + extra), "--run-dir", str(tmp_path / name)) == 0
        beats = [json.loads(line) for line in (tmp_path / name / "heartbeat.jsonl").read_text().splitlines()]
        stats[name] = [{k: v for k, v in b.items() if k == "step" or k.startswith("nsa_")} for b in beats]
    assert [b["step"] for b in stats["deferred"]] == [1, 2, 3, 4, 5]
    assert all(len(b) > 3 for b in stats["deferred"])  # the statistics are there
    assert stats["deferred"] == stats["at_once"]


def test_weight_decay_applies_to_matrices_only():
    from attnlab.models import AttnLabConfig, AttnLabForCausalLM
    from attnlab.train.loop import AttnLabTrainer

    model = AttnLabForCausalLM(AttnLabConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=2, mixer="mamba2"))
    decayed = set(AttnLabTrainer.get_decay_parameter_names(None, model))
    names = dict(model.named_parameters())
    assert "model.layers.0.mlp.up_proj.weight" in decayed
    assert not any(names[n].dim() < 2 for n in decayed)
    assert not any(n.endswith(("A_log", "D", "norm.weight", "dt_bias")) for n in decayed)


def test_gradient_accumulation_follows_the_same_trajectory_as_one_larger_batch(tmp_path, tiny):
    big, accumulated = tmp_path / "big", tmp_path / "accumulated"
    assert run_cli("train", *sets(tiny), "--run-dir", str(big)) == 0
    assert run_cli("train", *sets(tiny + ["train.batch_size=2", "train.grad_accum=2"]), "--run-dir", str(accumulated)) == 0
    losses = lambda run: [json.loads(line)["loss"] for line in (run / "heartbeat.jsonl").read_text().splitlines()]  # noqa: E731
    assert losses(accumulated) == pytest.approx(losses(big), abs=1e-5)


def test_grad_clip_0_trains_without_clipping(tmp_path, tiny):
    off, unreached = tmp_path / "off", tmp_path / "unreached"
    assert run_cli("train", *sets(tiny + ["train.grad_clip=0"]), "--run-dir", str(off)) == 0
    assert run_cli("train", *sets(tiny + ["train.grad_clip=1e9"]), "--run-dir", str(unreached)) == 0
    losses = lambda run: [json.loads(line)["loss"] for line in (run / "heartbeat.jsonl").read_text().splitlines()]  # noqa: E731
    assert losses(off) == pytest.approx(losses(unreached), abs=1e-6)


def test_a_run_killed_after_its_last_checkpoint_resumes_to_write_its_final_model(tmp_path, tiny):
    run = tmp_path / "run"
    assert run_cli("train", *sets(tiny), "--run-dir", str(run)) == 0
    import shutil

    from safetensors.torch import load_file

    expected = load_file(str(run / "final" / "model.safetensors"))
    shutil.rmtree(run / "final")  # as if killed between the last checkpoint and the final save
    assert run_cli("train", "--resume", "--run-dir", str(run)) == 0
    assert (run / "final" / "model.safetensors").is_file() and _run_json(run)["status"] == "finished"
    final = load_file(str(run / "final" / "model.safetensors"))
    assert all(torch.equal(final[name], expected[name]) for name in expected)  # no step beyond max_steps
    assert max(json.loads(line)["step"] for line in (run / "heartbeat.jsonl").read_text().splitlines()) == 8


@pytest.mark.parametrize("mixer, checkpointing, sharded, reason", [
    ("nsa", None, False, "not verified for capture"),
    ("gla", "reentrant", False, "gradient checkpointing is not in its capturable form"),
    ("gla", "capturable", False, "not on a CUDA device"),  # checkpointing itself no longer blocks capture
    ("gla", None, True, "not on a CUDA device"),  # FSDP's step is captured with its collectives
    ("gla", "capturable", True, "not on a CUDA device"),  # nor under FSDP
    ("gla", None, False, "not on a CUDA device"),
    ("softmax", None, False, "not on a CUDA device"),
])
def test_a_training_step_that_cannot_be_captured_says_why(mixer, checkpointing, sharded, reason, monkeypatch):
    from attnlab.models import AttnLabConfig, AttnLabForCausalLM
    from attnlab.models.mixers import MIXERS
    from attnlab.train.graphs import CHECKPOINT_KWARGS, graph_blocker

    if reason == "not verified for capture":  # every built-in mixer is verified: one that is not
        monkeypatch.setattr(MIXERS[mixer], "train_graph_safe", False)

    model = AttnLabForCausalLM(AttnLabConfig(vocab_size=64, hidden_size=64, num_layers=1, num_heads=4, mixer=mixer))
    if checkpointing == "reentrant":
        model.activation_checkpointing_enable()
    elif checkpointing == "capturable":
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=CHECKPOINT_KWARGS)
    blocker = graph_blocker(model, sharded=sharded)
    assert reason in blocker and (checkpointing != "capturable" or "checkpointing" not in blocker)


def test_flat_gradient_views_tile_one_buffer_per_dtype():
    from attnlab.train.graphs import flat_views

    params = [torch.randn(3, 4), torch.randn(5), torch.randn(2, dtype=torch.float64), torch.randn(2, 2)]
    flats, views = flat_views(params)
    assert [f.numel() for f in flats] == [21, 2] and all(f.eq(0).all() for f in flats)
    assert [v.shape for v in views] == [p.shape for p in params]
    for v in views:
        v.fill_(1.0)
    assert all(f.eq(1).all() for f in flats)  # the views cover each buffer exactly, without overlap



def test_gradient_buckets_follow_the_reverse_parameter_order_split_by_dtype_and_size():
    from attnlab.train.graphs import bucket_layout, flat_views

    params = [torch.randn(10), torch.randn(10), torch.randn(30), torch.randn(4, dtype=torch.float64), torch.randn(5), torch.randn(5)]
    assert bucket_layout(params, 80) == [[5, 4], [3], [2], [1, 0]]  # 4-byte floats: 5 + 5 fit 80 bytes, 30 alone exceeds it
    flats, views = flat_views(params, 80)
    assert [f.numel() for f in flats] == [10, 4, 30, 20] and [v.shape for v in views] == [p.shape for p in params]
    for v in views:
        v.fill_(1.0)
    assert all(f.eq(1).all() for f in flats)


_BUCKETS_WORKER = """
import sys, torch, torch.distributed as dist
from attnlab.train.graphs import GradientBuckets
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
layers = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
unused = torch.nn.Parameter(torch.ones(2))
params = [*layers.parameters(), unused]
x = torch.randn(4, 6) * (rank + 1)
buckets = GradientBuckets(params, bucket_bytes=64)
assert len(buckets.layout) > 2
for view in buckets.views:
    view.fill_(7.0)  # a stale gradient from an earlier step is overwritten, never summed
with buckets.reducing():
    grads = torch.autograd.grad(layers(x).pow(2).sum(), params, allow_unused=True, materialize_grads=True)
mean = [g.clone() for g in grads]
for g in mean:
    dist.all_reduce(g)
    g.div_(dist.get_world_size())
assert all(torch.allclose(v, g, atol=1e-6) for v, g in zip(buckets.views, mean)), [(v, g) for v, g in zip(buckets.views, mean)]
assert buckets.views[-1].eq(0).all()
assert not any(p._backward_hooks for p in params)  # the hooks are gone after the backward
# reduce_dtype=bf16: the buckets travel in bf16 (the gradients divided, then rounded, then summed, as DDP's
# bf16_compress_hook does) and come back into the fp32 buffers
buckets = GradientBuckets(params, bucket_bytes=64, reduce_dtype=torch.bfloat16)
assert all(w.dtype == torch.bfloat16 for w in buckets.wire) and all(f.dtype == torch.float32 for f in buckets.flats)
with buckets.reducing():
    grads = torch.autograd.grad(layers(x).pow(2).sum(), params, allow_unused=True, materialize_grads=True)
wire = [g.div(dist.get_world_size()).to(torch.bfloat16) for g in grads]
for w in wire:
    dist.all_reduce(w)
assert all(torch.equal(v, w.float()) for v, w in zip(buckets.views, wire))
assert all(torch.allclose(v, g, rtol=1e-2, atol=1e-2) for v, g in zip(buckets.views, mean))
open(sys.argv[1] + f"/ok-{rank}", "w").close()  # one file per process: two processes' prints can interleave
"""


def test_gradient_buckets_average_over_two_gloo_processes_while_the_backward_runs(tmp_path):
    """What the captured step under DDP does inside its backward graph, run eagerly on CPU."""
    _run_two_gloo_processes(tmp_path, _BUCKETS_WORKER)

_FSDP_WORKER = """
import sys, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from attnlab.models import AttnLabConfig, AttnLabForCausalLM
from attnlab.models.weights import local_part, weights_fingerprint
dist.init_process_group("gloo")
torch.manual_seed(0)
model = AttnLabForCausalLM(AttnLabConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, mixer="gla"))
for block in model.model.layers:
    fully_shard(block)
fully_shard(model)
def sharded():
    return all(hasattr(p, "to_local") for p in model.parameters())
assert sharded()
shards = [p.to_local() for p in model.parameters()]
assert all(local_part(p).data_ptr() == s.data_ptr() and local_part(p).shape == s.shape for p, s in zip(model.parameters(), shards))
before = weights_fingerprint(model)
x = torch.randint(0, 64, (2, 8))
with torch.no_grad():
    model(input_ids=x)  # an evaluation's forward: the root may keep its parameters gathered
model.reshard()  # what CapturedLoss does before it compares (its _resharded)
assert sharded() and weights_fingerprint(model) == before
model(input_ids=x, labels=x).loss.backward()
assert all(hasattr(p.grad, "to_local") and local_part(p.grad).shape == local_part(p).shape for p in model.parameters())
# the trainer's norm and clipping from the shards, against torch's on the DTensors
from attnlab.train.loop import sharded_grad_norm_
params = list(model.parameters())
saved = [local_part(p.grad).clone() for p in params]
norm = torch.nn.utils.clip_grad_norm_(params, 0.1)
norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
clipped = [local_part(p.grad).clone() for p in params]
for p, g in zip(params, saved):
    local_part(p.grad).copy_(g)
assert torch.allclose(sharded_grad_norm_(params, float("inf")), norm, rtol=1e-6)
assert all(torch.equal(local_part(p.grad), g) for p, g in zip(params, saved))  # no clipping without a finite bound
assert norm > 0.1 and torch.allclose(sharded_grad_norm_(params, 0.1), norm, rtol=1e-6)
assert all(torch.allclose(local_part(p.grad), c, rtol=1e-5, atol=1e-8) for p, c in zip(params, clipped))
open(sys.argv[1] + f"/ok-{dist.get_rank()}", "w").close()
"""


def test_fsdp_shards_are_what_the_captured_step_fingerprints_reads_and_clips(tmp_path):
    """Under FSDP (two gloo processes on CPU) the weights' fingerprint and the gradients' checks read each DTensor's
    local shard; after an evaluation's forward the model holds its shards again; the trainer's gradient norm and
    clipping from the shards equal torch's clip_grad_norm_ on the DTensors."""
    _run_two_gloo_processes(tmp_path, _FSDP_WORKER)


def _run_two_gloo_processes(tmp_path, worker: str) -> None:
    import os
    import shutil
    import subprocess
    import sys

    script = tmp_path / "worker.py"
    script.write_text(worker)
    torchrun = shutil.which("torchrun")
    launcher = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    proc = subprocess.run([*launcher, "--standalone", "--nproc_per_node", "2", str(script), str(tmp_path)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.glob("ok-*")) == ["ok-0", "ok-1"]


def _tiny_hf(name: str, **options):
    import transformers

    config = getattr(transformers, name.replace("ForCausalLM", "Config"))(
        vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, **options)
    return getattr(transformers, name)(config)


@pytest.mark.parametrize("name, options, hf, reason", [
    ("LlamaForCausalLM", {}, False, "is not an attnlab model"),  # the benchmarks' HF peers train as HF trains them
    ("LlamaForCausalLM", {}, True, "not on a CUDA device"),  # attnlab train captures it on CUDA
    ("LlamaForCausalLM", {"attention_dropout": 0.1}, True, "dropout"),
    ("Qwen2ForCausalLM", {}, True, "nor an HF model verified for capture"),
])
def test_which_hf_models_attnlab_train_may_capture(name, options, hf, reason):
    from attnlab.train.graphs import graph_blocker

    model = _tiny_hf(name, **options)
    model.config._attn_implementation = "sdpa"
    assert reason in graph_blocker(model, hf=hf)
    if reason == "not on a CUDA device":
        model.config._attn_implementation = "flex_attention"
        assert "flex_attention attention is not verified" in graph_blocker(model, hf=True)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_an_hf_llama_trained_by_attnlab_is_captured_and_follows_its_eager_trajectory(tmp_path, tiny, capsys):
    init = tmp_path / "llama"
    torch.manual_seed(0)
    _tiny_hf("LlamaForCausalLM", tie_word_embeddings=False).save_pretrained(init)
    on_gpu = ([o for o in tiny if not o.startswith(("train.device", "model."))]
              + ["train.device=cuda", "train.batch_size=2", "train.grad_accum=2", f"train.init_from={init}"])
    runs = {}
    for graphs in ("false", "true"):
        run = tmp_path / f"graphs-{graphs}"
        assert run_cli("train", *sets(on_gpu + [f"train.cuda_graphs={graphs}"]), "--run-dir", str(run)) == 0
        runs[graphs] = [json.loads(line)["loss"] for line in (run / "heartbeat.jsonl").read_text().splitlines()]
    assert "captured as CUDA graphs" in capsys.readouterr().out
    # 1.1e-4 apart at step 4 on an H100 (relative 2e-5), against 1e-4 for attnlab's models. Not traced; the likely
    # cause: the captured step sums the loss inside the graph and divides by the token count outside it, where HF's
    # eager loss divides inside, the same arithmetic up to fp32 rounding that bf16 weights carry into later steps.
    assert runs["true"] == pytest.approx(runs["false"], abs=3e-4)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("checkpointing", ["false", "true"])
def test_cuda_graph_training_follows_the_eager_trajectory(tmp_path, tiny, capsys, checkpointing):
    on_gpu = [o for o in tiny if not o.startswith("train.device")] + ["train.device=cuda", "train.batch_size=2", "train.grad_accum=2"]
    runs = {}
    for graphs in ("false", "true"):
        run = tmp_path / f"graphs-{graphs}"
        settings = on_gpu + [f"train.cuda_graphs={graphs}", f"train.gradient_checkpointing={checkpointing if graphs == 'true' else 'false'}"]
        assert run_cli("train", *sets(settings), "--run-dir", str(run)) == 0
        runs[graphs] = [json.loads(line)["loss"] for line in (run / "heartbeat.jsonl").read_text().splitlines()]
    assert "captured as CUDA graphs" in capsys.readouterr().out  # with gradient checkpointing too
    assert runs["true"] == pytest.approx(runs["false"], abs=1e-4)
