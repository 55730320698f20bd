"""`attnlab train` under torchrun: 2 CPU processes on gloo follow the single-process trajectory;
train.strategy=fsdp shards over CUDA devices, with checkpoints that resume in one process and back."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import run_cli, sets


def _losses(run):
    return [json.loads(line)["loss"] for line in (run / "heartbeat.jsonl").read_text().splitlines() if '"loss"' in line]


def _torchrun(*args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    torchrun = shutil.which("torchrun")
    launcher = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # --standalone: a free port of its own, so that runs launched side by side (pytest -n) do not collide
    return subprocess.run([*launcher, "--standalone", "--nproc_per_node", str(nproc), *args], capture_output=True, text=True,
                          timeout=600, env=env)


def _train_under_torchrun(overrides: list[str], run, *extra: str) -> subprocess.CompletedProcess:
    proc = _torchrun("-m", "attnlab.cli", "train", *sets(overrides), "--run-dir", str(run), *extra)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory, small_corpus):
    from conftest import TINY

    overrides = TINY + [f"data.source={small_corpus}"]
    run = tmp_path_factory.mktemp("ddp") / "run"
    proc = _train_under_torchrun(overrides, run)
    (run.parent / "printed.txt").write_text(proc.stdout + proc.stderr)
    return run, overrides


@pytest.fixture(scope="module")
def single_process_run(tmp_path_factory, small_corpus):
    """The same tiny run in one process: the trajectory that DDP and FSDP must follow."""
    from conftest import TINY

    run = tmp_path_factory.mktemp("single") / "run"
    assert run_cli("train", *sets(TINY + [f"data.source={small_corpus}"]), "--run-dir", str(run)) == 0
    return run


def test_two_gloo_processes_match_the_single_process_loss_trajectory(two_process_run, single_process_run):
    run, _ = two_process_run
    single = single_process_run
    assert _losses(run) == pytest.approx(_losses(single), abs=1e-4)
    assert json.loads((run / "run.json").read_text())["val_loss"] == pytest.approx(json.loads((single / "run.json").read_text())["val_loss"], abs=1e-4)


def test_each_rank_writes_its_own_heartbeat_and_rank_0_writes_the_rest(two_process_run):
    run, _ = two_process_run
    for r in (0, 1):
        beats = [json.loads(line) for line in (run / f"heartbeat_rank{r}.jsonl").read_text().splitlines()]
        assert [b["step"] for b in beats] == [2, 4, 6, 8] and "cpu_rss_mib" in beats[-1]
    assert json.loads((run / "run.json").read_text())["world_size"] == 2
    assert (run / "final" / "model.safetensors").is_file()
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == ["step-0000004", "step-0000008"]


def test_a_two_process_checkpoint_resumes_in_one_process(two_process_run, tmp_path):
    run, _ = two_process_run
    copy = tmp_path / "copy"
    shutil.copytree(run, copy, symlinks=True)
    assert run_cli("train", "--resume", "--run-dir", str(copy), "--set", "train.max_steps=10") == 0
    assert os.readlink(copy / "checkpoints" / "latest") == "step-0000010"


# --- train.strategy=fsdp ---------------------------------------------------------------------------
# FSDP runs as accelerate's FSDP2, which accelerate enables for GPU processes only: for several CPU
# processes (gloo) AcceleratorState keeps DistributedType.MULTI_CPU, drops the FSDP plugin and the model
# is wrapped in DDP; so preflight refuses fsdp on CPU. torch's FSDP2 itself shards over gloo, so on CPU
# the tests lift that one gate of accelerate inside the launched processes (LIFT_CPU_GATE) and run the
# real Trainer path; the tests marked cuda run it unmodified on two GPUs.

LIFT_CPU_GATE = """
import sys
import accelerate.state
from accelerate.utils import DistributedType
import attnlab.config.preflight

init = accelerate.state.AcceleratorState.__init__

def init_with_fsdp_on_cpu(self, *args, fsdp_plugin=None, **kwargs):
    init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
        self.distributed_type = accelerate.state.PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        self.fsdp_plugin = fsdp_plugin

accelerate.state.AcceleratorState.__init__ = init_with_fsdp_on_cpu
attnlab.config.preflight._check_strategy = lambda cfg, report: None  # it refuses fsdp on CPU, rightly
from attnlab.cli import main
sys.argv = ["attnlab", *sys.argv[1:]]
main()
"""


def _run_worker(tmp_path, source: str, *args: str) -> str:
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(source))
    proc = _torchrun(str(script), *args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (tmp_path / "printed.txt").write_text(proc.stdout + proc.stderr)
    return proc.stdout


def _train_fsdp_on_gloo(tmp_path, *args: str) -> None:
    _run_worker(tmp_path, LIFT_CPU_GATE, "train", *args, "--set", "train.strategy=fsdp")


@pytest.fixture(scope="module")
def fsdp_gloo_run(tmp_path_factory, small_corpus):
    from conftest import TINY

    root = tmp_path_factory.mktemp("fsdp")
    _train_fsdp_on_gloo(root, *sets(TINY + [f"data.source={small_corpus}"]), "--run-dir", str(root / "run"))
    return root / "run"


def test_ddp_and_fsdp_on_two_processes_print_no_warning(two_process_run, fsdp_gloo_run):
    for printed in (two_process_run[0].parent / "printed.txt", fsdp_gloo_run.parent / "printed.txt"):
        text = printed.read_text()
        assert "Warning" not in text and "warn(" not in text, text[-3000:]


def test_fsdp_on_two_gloo_processes_matches_the_single_process_loss_trajectory(fsdp_gloo_run, single_process_run):
    assert _losses(fsdp_gloo_run) == pytest.approx(_losses(single_process_run), abs=1e-5)
    val = [json.loads((run / "run.json").read_text())["val_loss"] for run in (fsdp_gloo_run, single_process_run)]
    assert val[0] == pytest.approx(val[1], abs=1e-5)


def test_fsdp_checkpoints_hold_the_one_process_files_and_the_final_model_is_whole(fsdp_gloo_run, single_process_run):
    import attnlab

    latest = fsdp_gloo_run / "checkpoints" / "latest"
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt"} <= {p.name for p in latest.iterdir()}
    assert not [p.name for p in latest.iterdir() if "fsdp" in p.name or p.name.startswith("optimizer.bin")]
    sharded, _ = attnlab.load(fsdp_gloo_run, device="cpu")
    alone, _ = attnlab.load(single_process_run, device="cpu")
    for (name, p), q in zip(sharded.state_dict().items(), alone.state_dict().values()):
        assert p.shape == q.shape and torch.allclose(p, q, atol=1e-5), name


def test_an_fsdp_checkpoint_resumes_in_one_process_as_the_one_process_run_does(fsdp_gloo_run, single_process_run, tmp_path):
    sharded, alone = tmp_path / "sharded", tmp_path / "alone"
    shutil.copytree(fsdp_gloo_run, sharded, symlinks=True)
    shutil.copytree(single_process_run, alone, symlinks=True)
    for run in (sharded, alone):
        assert run_cli("train", "--resume", "--run-dir", str(run), "--set", "train.max_steps=10", "--set", "train.strategy=ddp") == 0
    assert os.readlink(sharded / "checkpoints" / "latest") == "step-0000010"
    assert _losses(sharded)[-1] == pytest.approx(_losses(alone)[-1], abs=1e-5)


def test_a_one_process_checkpoint_resumes_under_fsdp_as_in_one_process(single_process_run, tmp_path):
    sharded, alone = tmp_path / "sharded", tmp_path / "alone"
    shutil.copytree(single_process_run, sharded, symlinks=True)
    shutil.copytree(single_process_run, alone, symlinks=True)
    _train_fsdp_on_gloo(tmp_path, "--resume", "--run-dir", str(sharded), "--set", "train.max_steps=10")
    assert run_cli("train", "--resume", "--run-dir", str(alone), "--set", "train.max_steps=10") == 0
    assert _losses(sharded)[-1] == pytest.approx(_losses(alone)[-1], abs=1e-5)
    assert json.loads((sharded / "run.json").read_text())["world_size"] == 2


def test_fsdp_reaches_accelerate_as_fsdp2_sharding_each_decoder_block(tmp_path):
    out = _run_worker(tmp_path, """
        from pathlib import Path
        from accelerate import Accelerator
        from accelerate.utils import FullyShardedDataParallelPlugin
        from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
        from attnlab.config import load_config
        from attnlab.config.preflight import PreflightReport
        from attnlab.models import AttnLabConfig, AttnLabForCausalLM
        from attnlab.train.loop import training_arguments

        cfg = load_config(None, ["train.strategy=fsdp", "train.batch_size=4"])
        args = training_arguments(cfg, PreflightReport(device="cpu"), Path("staging"), has_val=True)
        assert args.per_device_train_batch_size == 2
        plugin_args = args.fsdp_plugin_args
        assert plugin_args["fsdp_version"] == 2 and plugin_args["reshard_after_forward"] is True, plugin_args
        assert plugin_args["state_dict_type"] == "FULL_STATE_DICT", plugin_args
        plugin = FullyShardedDataParallelPlugin(**plugin_args)
        model = AttnLabForCausalLM(AttnLabConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2))
        wrap = fsdp2_prepare_auto_wrap_policy(plugin, model)
        assert [name for name, module in model.named_modules() if wrap(module)] == ["model.layers.0", "model.layers.1"]
        # Why preflight refuses fsdp on CPU: accelerate keeps CPU processes on DDP and drops the plugin.
        state = Accelerator(cpu=True, fsdp_plugin=plugin).state
        if state.process_index == 0:  # one process prints: two would interleave their words on the shared pipe
            print("distributed type on CPU:", state.distributed_type.value, "fsdp plugin:", getattr(state, "fsdp_plugin", None))
    """)
    assert "distributed type on CPU: MULTI_CPU fsdp plugin: None" in out


def test_preflight_refuses_fsdp_across_cpu_processes(monkeypatch):
    from attnlab.config import load_config
    from attnlab.train.preflight import run_preflight

    monkeypatch.setenv("WORLD_SIZE", "2")
    report = run_preflight(load_config(None, ["train.strategy=fsdp", "train.device=cpu", "train.batch_size=4"]), load_data=False)
    assert [(p.key, "needs CUDA devices" in p.message) for p in report.errors] == [("train.strategy", True)]


def test_preflight_refuses_fsdp_with_evaluation_tasks_during_training(monkeypatch):
    from attnlab.config import load_config
    from attnlab.train.preflight import run_preflight

    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = load_config(None, ["train.strategy=fsdp", "train.batch_size=4", "eval.tasks=[{task: perplexity, limit: 2}]"])
    assert "eval.tasks" in [p.key for p in run_preflight(cfg, load_data=False).errors]


def test_fsdp_computes_and_reduces_as_ddp_does_unless_told(monkeypatch):
    """fp32 parameters gathered (autocast casts them, as in one process and under DDP), gradients reduce-scattered in
    fp32 unless train.grad_reduce_dtype says bf16: not accelerate's own bf16 policy, which gathers bf16 parameters,
    reduces in bf16 and casts every output, the loss too, to bf16."""
    from attnlab.config import load_config
    from attnlab.train.loop import fsdp_precision
    from attnlab.train.preflight import run_preflight

    policy = fsdp_precision()
    assert (policy.param_dtype, policy.reduce_dtype, policy.output_dtype) == (None, torch.float32, None)
    assert fsdp_precision(torch.bfloat16).reduce_dtype == torch.bfloat16 and fsdp_precision(torch.bfloat16).param_dtype is None
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = load_config(None, ["train.strategy=fsdp", "train.batch_size=4", "train.grad_reduce_dtype=bf16"])
    assert "train.grad_reduce_dtype" not in [p.key for p in run_preflight(cfg, load_data=False).errors]


def test_ddp_on_two_gloo_processes_averages_gradients_in_bf16_when_asked(two_process_run, tmp_path):
    run, overrides = two_process_run
    proc = _train_under_torchrun(overrides + ["train.grad_reduce_dtype=bf16"], tmp_path / "bf16")
    assert "gradients averaged over the processes in bfloat16" in proc.stdout + proc.stderr
    assert "UserWarning" not in proc.stdout + proc.stderr
    losses, reference = _losses(tmp_path / "bf16"), _losses(run)
    assert losses == pytest.approx(reference, abs=2e-2) and losses != reference  # bf16's rounding, nothing more


def test_fsdp_in_one_process_trains_as_one_process_with_a_warning():
    from attnlab.config import load_config
    from attnlab.train.preflight import run_preflight
    from attnlab.train.loop import fsdp_active

    cfg = load_config(None, ["train.strategy=fsdp", "train.device=cpu"])
    report = run_preflight(cfg, load_data=False)
    assert not report.errors and [p.key for p in report.problems] == ["train.strategy"]
    assert not fsdp_active(cfg)


two_cuda_devices = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


@pytest.fixture(scope="module")
def fsdp_cuda_runs(tmp_path_factory, small_corpus):
    """The tiny run in fp32 on CUDA: under FSDP on 2 GPUs (its step captured, as by default), and in one process;
    with what the FSDP run printed."""
    from conftest import TINY

    overrides = TINY + [f"data.source={small_corpus}", "train.device=cuda", "train.precision=fp32"]
    root = tmp_path_factory.mktemp("fsdp")
    proc = _train_under_torchrun(overrides, root / "fsdp", "--set", "train.strategy=fsdp")
    (root / "fsdp-printed.txt").write_text(proc.stdout + proc.stderr)
    assert run_cli("train", *sets(overrides), "--run-dir", str(root / "single")) == 0
    return root / "fsdp", root / "single", overrides


@pytest.mark.cuda
@two_cuda_devices
def test_fsdp_captured_follows_fsdp_eager_and_prints_no_warning(fsdp_cuda_runs, tmp_path):
    """FSDP's all-gathers and reduce-scatters captured with the step and replayed, against FSDP's eager step."""
    fsdp, _, overrides = fsdp_cuda_runs
    printed = (fsdp.parent / "fsdp-printed.txt").read_text()
    assert "training step captured as CUDA graphs" in printed, printed[-2000:]
    assert "UserWarning" not in printed and "FutureWarning" not in printed, printed[-2000:]
    _train_under_torchrun(overrides + ["train.cuda_graphs=false"], tmp_path / "eager", "--set", "train.strategy=fsdp")
    assert _losses(fsdp) == pytest.approx(_losses(tmp_path / "eager"), abs=1e-5)


@pytest.mark.cuda
@two_cuda_devices
def test_fsdp_with_gradient_accumulation_captured_follows_fsdp_eager_and_one_process(small_corpus, tmp_path):
    """Two micro-batches a step: the captured backward reduce-scatters each micro-batch and sums the shards;
    FSDP's eager step under accelerate's no_sync keeps the unsharded gradients until the last. Same sum."""
    from conftest import TINY

    overrides = TINY + [f"data.source={small_corpus}", "train.device=cuda", "train.precision=fp32", "train.grad_accum=2"]
    proc = _train_under_torchrun(overrides, tmp_path / "captured", "--set", "train.strategy=fsdp")
    printed = proc.stdout + proc.stderr
    assert "training step captured as CUDA graphs" in printed, printed[-2000:]
    assert "UserWarning" not in printed and "FutureWarning" not in printed, printed[-2000:]
    _train_under_torchrun(overrides + ["train.cuda_graphs=false"], tmp_path / "eager", "--set", "train.strategy=fsdp")
    assert run_cli("train", *sets(overrides), "--run-dir", str(tmp_path / "one")) == 0
    assert _losses(tmp_path / "captured") == pytest.approx(_losses(tmp_path / "eager"), abs=1e-5)
    assert _losses(tmp_path / "captured") == pytest.approx(_losses(tmp_path / "one"), abs=1e-4)


@pytest.mark.cuda
@two_cuda_devices
def test_fsdp_with_gradient_checkpointing_captured_follows_fsdp_eager(small_corpus, tmp_path):
    """The recomputed blocks gather their parameters again inside the captured backward."""
    from conftest import TINY

    overrides = TINY + [f"data.source={small_corpus}", "train.device=cuda", "train.precision=fp32",
                        "train.gradient_checkpointing=true"]
    proc = _train_under_torchrun(overrides, tmp_path / "captured", "--set", "train.strategy=fsdp")
    printed = proc.stdout + proc.stderr
    assert "training step captured as CUDA graphs" in printed, printed[-2000:]
    assert "UserWarning" not in printed and "FutureWarning" not in printed, printed[-2000:]
    _train_under_torchrun(overrides + ["train.cuda_graphs=false"], tmp_path / "eager", "--set", "train.strategy=fsdp")
    assert _losses(tmp_path / "captured") == pytest.approx(_losses(tmp_path / "eager"), abs=1e-5)


@pytest.fixture(scope="module")
def ddp_cuda_runs(tmp_path_factory, small_corpus):
    """The tiny run in fp32 on CUDA with two micro-batches a step: DDP on 2 GPUs captured and eager, and
    one process with the same global batch captured and eager; with what each DDP run printed."""
    from conftest import TINY

    overrides = TINY + [f"data.source={small_corpus}", "train.device=cuda", "train.precision=fp32", "train.grad_accum=2"]
    root, runs = tmp_path_factory.mktemp("ddp-cuda"), {}
    for graphs in ("true", "false"):
        proc = _train_under_torchrun(overrides + [f"train.cuda_graphs={graphs}"], root / f"ddp-{graphs}")
        runs[f"ddp-{graphs}"] = (root / f"ddp-{graphs}", proc.stdout + proc.stderr)
        assert run_cli("train", *sets(overrides + [f"train.cuda_graphs={graphs}"]), "--run-dir", str(root / f"one-{graphs}")) == 0
        runs[f"one-{graphs}"] = (root / f"one-{graphs}", "")
    return runs


@pytest.fixture(scope="module")
def ddp_reduce_runs(tmp_path_factory, small_corpus):
    """One micro-batch a step, a model of 19M parameters (about 76 MB of fp32 gradients, more than two of DDP's
    buckets) under DDP on 2 GPUs, captured and eager, and in one process; with what the captured run printed."""
    from conftest import TINY

    overrides = TINY + [f"data.source={small_corpus}", "train.device=cuda", "train.precision=fp32",
                        "model.hidden_size=512", "model.num_layers=6", "model.num_heads=8"]
    root = tmp_path_factory.mktemp("ddp-reduce")
    proc = _train_under_torchrun(overrides + ["train.cuda_graphs=true"], root / "ddp")
    _train_under_torchrun(overrides + ["train.cuda_graphs=false"], root / "ddp-eager")
    assert run_cli("train", *sets(overrides + ["train.cuda_graphs=true"]), "--run-dir", str(root / "one")) == 0
    return root / "ddp", root / "ddp-eager", root / "one", proc.stdout + proc.stderr


@pytest.mark.cuda
@two_cuda_devices
def test_ddp_captured_with_one_micro_batch_and_gradients_beyond_a_bucket_follows_ddp_eager(ddp_reduce_runs):
    """The gradients averaged inside the captured backward, bucket by bucket, against DDP's own reducer.

    At this size the one-process trajectory is no reference past the first steps: DDP's eager step on CPU
    (gloo) leaves it too, by 1e-6 at step 2, 2.5e-4 at step 6 and 2.2e-3 at step 8 at lr 3e-3, and
    by 2.7e-4 and 1.8e-3 at lr 3e-4; the two halves' gradients are summed in another order than the whole batch's, and AdamW turns
    rounding-sized differences of small gradients into updates. With two processes the captured and the eager
    step add the same two halves, so they agree."""
    from attnlab.train.graphs import BUCKET_BYTES

    captured, eager, single, printed = ddp_reduce_runs
    assert "training step captured as CUDA graphs" in printed
    assert "find_unused_parameters" not in printed and "UserWarning" not in printed, printed[-2000:]
    parameters = json.loads((single / "run.json").read_text())["parameters"]
    assert parameters * 4 > 2 * BUCKET_BYTES
    assert _losses(captured) == pytest.approx(_losses(eager), abs=1e-4)
    assert _losses(captured)[0] == pytest.approx(_losses(single)[0], abs=1e-4)


@pytest.mark.cuda
@two_cuda_devices
def test_ddp_prints_no_warning_from_torch_about_unused_parameters_or_buffers(ddp_cuda_runs):
    for name in ("ddp-true", "ddp-false"):
        printed = ddp_cuda_runs[name][1]
        assert "find_unused_parameters" not in printed and "UserWarning" not in printed, printed[-2000:]


@pytest.mark.cuda
@two_cuda_devices
def test_fsdp_on_two_gpus_matches_the_single_process_loss_trajectory(fsdp_cuda_runs):
    fsdp, single, _ = fsdp_cuda_runs
    assert _losses(fsdp) == pytest.approx(_losses(single), abs=1e-4)
    assert json.loads((fsdp / "run.json").read_text())["val_loss"] == pytest.approx(json.loads((single / "run.json").read_text())["val_loss"], abs=1e-4)


@pytest.mark.cuda
@two_cuda_devices
def test_fsdp_final_model_is_whole_and_loads(fsdp_cuda_runs):
    import attnlab

    fsdp, single, _ = fsdp_cuda_runs
    model, _ = attnlab.load(fsdp, device="cpu")
    reference, _ = attnlab.load(single, device="cpu")
    for (name, p), (_, q) in zip(model.state_dict().items(), reference.state_dict().items()):
        assert p.shape == q.shape and torch.allclose(p, q, atol=1e-4), name


@pytest.mark.cuda
@two_cuda_devices
def test_an_fsdp_checkpoint_resumes_in_one_process(fsdp_cuda_runs, tmp_path):
    fsdp, _, _ = fsdp_cuda_runs
    copy = tmp_path / "copy"
    shutil.copytree(fsdp, copy, symlinks=True)
    assert sorted(p.name for p in (copy / "checkpoints" / "latest").iterdir() if p.suffix in (".pt", ".safetensors")) == [
        "model.safetensors", "optimizer.pt", "scheduler.pt"]
    assert run_cli("train", "--resume", "--run-dir", str(copy), "--set", "train.max_steps=10") == 0
    assert os.readlink(copy / "checkpoints" / "latest") == "step-0000010"


@pytest.mark.cuda
@two_cuda_devices
def test_a_one_process_checkpoint_resumes_under_fsdp_and_follows_the_one_process_run(fsdp_cuda_runs, tmp_path):
    _, single, _ = fsdp_cuda_runs
    sharded, alone = tmp_path / "sharded", tmp_path / "alone"
    shutil.copytree(single, sharded, symlinks=True)
    shutil.copytree(single, alone, symlinks=True)
    _train_under_torchrun([], sharded, "--resume", "--set", "train.max_steps=10", "--set", "train.strategy=fsdp")
    assert run_cli("train", "--resume", "--run-dir", str(alone), "--set", "train.max_steps=10") == 0
    assert _losses(sharded)[-1] == pytest.approx(_losses(alone)[-1], abs=1e-4)


def test_one_process_with_several_gpus_visible_trains_on_one_with_the_batch_it_was_given(monkeypatch):
    """The Trainer wraps one process's model in nn.DataParallel when several GPUs are visible and
    multiplies the batch by their count; attnlab keeps one process on one device and says how to use all."""
    from pathlib import Path

    from attnlab.config import load_config
    from attnlab.config.preflight import PreflightReport
    from attnlab.train.preflight import run_preflight
    from attnlab.train.loop import training_arguments

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    cfg = load_config(None, ["train.batch_size=4", "train.device=cuda", "train.precision=fp32"])
    args = training_arguments(cfg, PreflightReport(device="cuda", precision="fp32"), Path("staging"), has_val=True)
    assert args.n_gpu == 1 and args.train_batch_size == 4
    # each batch reaches the GPU from pinned memory without the host waiting for the copy (and the step before it)
    assert args.dataloader_pin_memory and args.accelerator_config.non_blocking

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    report = run_preflight(cfg, load_data=False)
    assert [p.key for p in report.problems if "2 GPUs are visible" in p.message] == ["train.device"]
    assert "torchrun --nproc_per_node 2" in next(p.message for p in report.problems if p.key == "train.device")
