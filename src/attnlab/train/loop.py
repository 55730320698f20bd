"""`attnlab train`: one short function wiring the pieces onto transformers.Trainer.

Pieces, one job each: preflight (config/preflight.py), checkpoints (checkpoint.py),
telemetry (telemetry.py), the validation sample (sampling.py). The Trainer subclass only
redirects checkpoint writes through the atomic publisher and stops on a non-finite loss.
"""

from __future__ import annotations

import json
import math
import os
import platform
import signal
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from transformers import Trainer, TrainerCallback, TrainingArguments, default_data_collator
from transformers.trainer_pt_utils import nested_gather

import attnlab
from attnlab.config import RunConfig, config_to_yaml, save_config
from attnlab.config.preflight import PreflightReport
from attnlab.console import make_console
from attnlab.data import BlockDataset
from attnlab.data.blocks import DATA_STATE, PositionSampler, PreparedBlocks
from attnlab.errors import CheckpointError, ConfigError, RunDirError, RunInterrupted, TrainingDivergedError
from attnlab.eval.callback import EvalDuringTraining
from attnlab.launch import rank, world_size
from attnlab.models import AttnLabForCausalLM
from attnlab.models.modeling import AttnLabBlock
from attnlab.models.weights import local_part
from attnlab.outputs import publishing, replace_file

from .build import build_model
from .checkpoint import (
    OPTIMIZER_FILE, CheckpointManager, full_optimizer_state, load_full_model_state, load_full_optimizer_state, load_model_state,
    torch_load_checked,
)
from .graphs import CHECKPOINT_KWARGS, CapturedLoss, compressing_gradients, graph_blocker, on_capture_stream
from .profiling import ProfileSteps
from .sampling import sample_continuation
from .schedule import scheduler_spec
from .telemetry import RunLogger, Throughput, read_jsonl

LN2 = math.log(2.0)
SCHEDULER_FILE = "scheduler.pt"  # transformers.Trainer's name for it


@dataclass
class TrainResult:
    run_dir: Path
    steps: int
    wall_s: float
    val_loss: float | None
    val_bpb: float | None
    sample: str | None
    segment_wall_s: float | None = None  # this process's part of wall_s (which counts every segment of a resumed run)
    parameters: int | None = None


class AttnLabTrainer(Trainer):
    """Trainer whose checkpoints are published atomically and which stops on a NaN/inf loss.

    Under FSDP a checkpoint holds the same files as under DDP or in one process: the whole model
    (model.safetensors) and the whole optimizer state (optimizer.pt, keyed as torch.optim keys it),
    gathered from the shards by every rank and written by rank 0; a resume scatters them again.
    So any checkpoint resumes with either strategy and on any number of processes.
    """

    def __init__(self, *args, checkpoints: CheckpointManager, run_config_yaml: str, cuda_graphs: bool = False,
                 compile_blocks: bool | str = False, grad_reduce_dtype: torch.dtype | None = None, say=print, train_sampler=None,
                 data_state=None, **kwargs):
        self.train_sampler = train_sampler  # the block stream of a prepared corpus (data/blocks.py), else the Trainer's
        self.data_state = data_state  # step -> the data state a checkpoint records (data_state.json), or None
        super().__init__(*args, **kwargs)
        self.checkpoints = checkpoints
        self.run_config_yaml = run_config_yaml
        self.cuda_graphs = cuda_graphs  # capture the step's forward and backward (train/graphs.py)
        # where the step runs eagerly on CUDA: the blocks under torch.compile (once); "auto": where they compile whole
        self.compile_blocks = compile_blocks
        self.say = say
        self.captured: CapturedLoss | None = None
        self.graph_note: str | None = None  # why the step runs eagerly, once decided
        self.replayed = False  # this micro-batch ran through the captured graphs (its gradients bypassed DDP)
        self.finite = FiniteLossCheck()
        self.pending_log: PendingLog | None = None  # the latest log, its values on their way to the host
        self.flop_parameters: int | None = None  # the parameters outside the embeddings, counted once (floating_point_ops)
        self.grad_reduce_dtype = grad_reduce_dtype  # the dtype DDP's processes average their gradients in (None: fp32)
        self._one_mesh: bool | None = None  # under FSDP: every gradient a DTensor of one mesh (`_sharded_params`)
        if cuda_graphs and world_size() > 1 and graph_blocker(self.model, sharded=self.is_fsdp_enabled, hf=True) is None:
            # only a step that will be captured: DDP on the capture stream makes an eager backward wait across streams
            self.accelerator.prepare_model = on_capture_stream(self.accelerator.prepare_model)
        if grad_reduce_dtype is not None and world_size() > 1 and not self.is_fsdp_enabled:
            self.accelerator.prepare_model = compressing_gradients(self.accelerator.prepare_model, grad_reduce_dtype, say)
        if self.is_fsdp_enabled:  # read when the model is prepared (sharded), at the start of training
            policy = fsdp_precision(grad_reduce_dtype)
            self.accelerator.state.fsdp_plugin.mixed_precision_policy = policy
            if grad_reduce_dtype is not None:
                say(f"gradients reduce-scattered over the processes in {str(grad_reduce_dtype).removeprefix('torch.')} "
                    "(train.grad_reduce_dtype)")

    def _get_train_sampler(self, train_dataset=None):
        if self.train_sampler is not None:
            return self.train_sampler
        return super()._get_train_sampler(train_dataset)

    def _captured_loss(self, model, inputs) -> CapturedLoss | None:
        """The captured loss for this batch, capturing it on first use; None where the step runs eagerly."""
        if not self.cuda_graphs or not model.training or set(inputs) != {"input_ids", "labels"}:
            return None
        if self.captured is not None:
            if self.captured.matches(inputs["input_ids"], inputs["labels"]):
                return self.captured
            if inputs["input_ids"].shape != self.captured.static_ids.shape:
                return None  # another shape runs eagerly; moved weights (below) are captured again
        if self.graph_note is not None:
            return None
        model = self.accelerator.unwrap_model(model)
        sharded = self.is_fsdp_enabled
        blocker = graph_blocker(model, sharded=sharded, hf=True)
        failed = False  # a capture was tried and failed, here or on another process
        if blocker is None:
            autocast_dtype = torch.bfloat16 if self.args.bf16 else None
            self.captured = None  # moved weights: the old graphs' memory goes first
            try:
                if sharded:  # FSDP's own hooks gather the weights and reduce-scatter the gradients inside the graphs
                    self.captured = CapturedLoss(model, inputs["input_ids"], inputs["labels"], autocast_dtype, sharded=True)
                else:
                    # one micro-batch a step: the backward graph averages the gradients over the processes as it runs
                    reduce = world_size() > 1 and self.args.gradient_accumulation_steps == 1
                    self.captured = CapturedLoss(model, inputs["input_ids"], inputs["labels"], autocast_dtype,
                                                 flat=world_size() > 1, reduce=reduce, reduce_dtype=self.grad_reduce_dtype)
            except (RuntimeError, torch.cuda.OutOfMemoryError) as err:
                blocker, failed = f"capture failed ({first_error(err)})", True
                torch.cuda.empty_cache()
        if world_size() > 1 and not _all_ranks(blocker is None, self.args.device):
            # every process reduces its gradients the same way: all captured, or all through DDP
            self.captured = None
            if blocker is None:
                blocker, failed = "capture failed on another process", True
        if sharded and failed:
            # FSDP's streams and events may hold what the failed capture left: no eager step after it
            raise ConfigError(f"the training step under FSDP could not be captured as CUDA graphs: {blocker}. "
                              "Train with train.cuda_graphs=false.")
        if blocker is None:
            self.say(f"training step captured as CUDA graphs (batch {tuple(inputs['input_ids'].shape)}; other shapes run eagerly)")
            if sharded and self.args.gradient_accumulation_steps > 1:
                # the backward graph reduce-scatters every micro-batch it replays: a micro-batch of another shape
                # (eager) must too, rather than keep its unsharded gradients under no_sync for a last backward
                # that a replay would never add them to (the Trainer reads this before each micro-batch)
                self.accelerator.gradient_state.plugin_kwargs["sync_each_batch"] = True
            return self.captured
        self.graph_note = blocker
        self.say(f"training step runs eagerly: {blocker} (train.cuda_graphs)")
        return None

    def _compile_eager_step(self, model, seq_len: int) -> None:
        """Once the training step is known to run eagerly for good (capture off, or refused), compile the blocks
        of an attnlab model (`train.compile`, which `run_training` passes on for CUDA only), or say why not. In one
        process a model that compiles whole at this length compiles as one graph (`compile_blocks(stack=True)`);
        under several, block by block, so that each block's gradients are ready for their reduction as its backward
        ends."""
        setting, self.compile_blocks = self.compile_blocks, False  # decided once
        model = self.accelerator.unwrap_model(model)
        if not isinstance(model, AttnLabForCausalLM):
            return
        if getattr(model, "is_activation_checkpointing", False):
            self.say("blocks not compiled: gradient checkpointing recomputes them outside torch.compile (train.compile)")
            return
        whole = model.compiles_whole(seq_len)
        if setting == "auto" and not whole:
            self.say("blocks not compiled: the mixer's kernels would break each block's graph under torch.compile "
                     "(train.compile=true compiles them anyway)")
            return
        stack = whole and world_size() == 1
        model.compile_blocks(stack=stack)
        if stack:
            self.say(f"eager training step: the {len(model.model.layers)} blocks compiled with torch.compile as one "
                     "graph on the first step (train.compile; compiling takes a minute or two)")
        else:
            self.say("eager training step: each block compiled with torch.compile on its first steps (train.compile)")

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        captured = None if return_outputs else self._captured_loss(model, inputs)
        self.replayed = captured is not None
        if (self.compile_blocks and captured is None and model.training and not return_outputs
                and (not self.cuda_graphs or self.graph_note is not None)):
            self._compile_eager_step(model, inputs["input_ids"].shape[1])
        if captured is not None:
            # the Trainer's own loss arithmetic (its scaling under several processes) around the replay
            model = lambda input_ids, labels, num_items_in_batch=None: {  # noqa: E731
                "loss": captured.loss(input_ids, labels, num_items_in_batch)}
        return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

    def train_or_finish(self, resume_from: Path | None) -> None:
        """Train, or, for a run resumed at the step it was to end at (stopped after its last checkpoint, before
        its final model), take no step: the checkpoint's weights and Trainer state as they are. The Trainer
        itself would take one step more."""
        if resume_from is None or int(resume_from.name.split("-")[1]) < self.args.max_steps:
            self.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
            return
        self._load_from_checkpoint(str(resume_from))
        self.state = transformers.TrainerState.load_from_json(str(resume_from / "trainer_state.json"))

    def _save_checkpoint(self, model, trial):
        # args.output_dir is the staging directory; every rank writes its part (rank 0 the weights and
        # optimizer, each rank its RNG state), then rank 0 alone publishes the complete checkpoint.
        step = self.state.global_step
        try:
            if self.is_world_process_zero():
                self.checkpoints.clear_staging()
            self.accelerator.wait_for_everyone()
            super()._save_checkpoint(model, trial)
            self.accelerator.wait_for_everyone()
            if self.is_world_process_zero():
                staged = self.checkpoints.staging / f"checkpoint-{step}"
                extra = {"run_config.yaml": self.run_config_yaml}
                if self.data_state is not None:
                    extra[DATA_STATE] = json.dumps(self.data_state(step), indent=1) + "\n"
                self.checkpoints.publish(staged, step, extra_files=extra)
        except (OSError, RuntimeError) as e:
            if isinstance(e, RuntimeError) and not _is_write_failure(e):
                raise
            try:
                self.checkpoints.clear_staging()
            except OSError:
                pass
            last = self.checkpoints.newest()
            intact = (f"the last good checkpoint, {last}, is intact" if last is not None else "no checkpoint was published before it")
            reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            raise CheckpointError(
                f"writing the checkpoint of step {step} failed ({reason}); nothing of it was published and {intact}. "
                "Free space on the device (or fix the file system), then continue with: attnlab train --resume --run-dir "
                f"{self.checkpoints.root.parent}"
            ) from None
        self.accelerator.wait_for_everyone()

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self.is_fsdp_enabled:
            return super()._save_optimizer_and_scheduler(output_dir)
        # Trainer's own FSDP files (pytorch_model_fsdp.bin, optimizer.bin) resume only under FSDP:
        # write what one process writes instead. model.safetensors came from save_model (full state dict).
        optimizer_state = full_optimizer_state(self.model, self.optimizer)  # every rank takes part
        if self.args.should_save:
            torch.save(optimizer_state, os.path.join(output_dir, OPTIMIZER_FILE))
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_FILE))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        model = model if model is not None else self.model
        if not self.is_fsdp_enabled:
            # strict, tied weights understood (no "missing keys ['lm_head.weight']"), another model's weights refused
            load_model_state(model, Path(resume_from_checkpoint))
            return
        load_full_model_state(model, Path(resume_from_checkpoint))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        checkpoint = Path(checkpoint)
        scheduler_state = torch_load_checked(checkpoint / SCHEDULER_FILE)  # a bad pickle: CheckpointError, not a traceback
        if self.is_fsdp_enabled:
            load_full_optimizer_state(self.model, self.optimizer, checkpoint)
        else:
            optimizer_state = torch_load_checked(checkpoint / OPTIMIZER_FILE, map_location="cpu")
            try:
                self.optimizer.load_state_dict(optimizer_state)
            except (ValueError, KeyError, RuntimeError) as e:
                raise CheckpointError(f"{checkpoint / OPTIMIZER_FILE} does not fit this run's optimizer ({e}). "
                                      "Resume with the config the run was trained with.") from None
        self.lr_scheduler.load_state_dict(scheduler_state)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        name = f"rng_state_{self.args.process_index}.pth" if self.args.world_size > 1 else "rng_state.pth"
        if (Path(checkpoint) / name).is_file():
            torch_load_checked(Path(checkpoint) / name)  # refuse a bad pickle as a CheckpointError before the Trainer reads it
        return super()._load_rng_state(checkpoint)

    def get_decay_parameter_names(self, model) -> list[str]:
        """Weight decay on matrices only (as nanoGPT): never on norms, biases, or 1-D SSM parameters
        (A_log, D, dt_bias), nor on any parameter flagged `_no_weight_decay`."""
        return [name for name, p in model.named_parameters() if p.dim() >= 2 and not getattr(p, "_no_weight_decay", False)]

    def floating_point_ops(self, inputs) -> int:
        """The Trainer's estimate, 6 x tokens x parameters outside the embeddings, with the parameters counted once:
        the Trainer counts them again at every micro-batch, a walk over every module on the host at every step."""
        main_input = getattr(self.model, "main_input_name", "input_ids")
        if main_input not in inputs or not hasattr(self.model, "num_parameters"):
            return 0
        if self.flop_parameters is None:
            self.flop_parameters = self.model.num_parameters(exclude_embeddings=True)
        return 6 * inputs[main_input].numel() * self.flop_parameters

    def _sharded_params(self, model) -> list | None:
        """Under FSDP, the parameters when every gradient is a DTensor of one mesh (decided once: the sharding is
        fixed), else None."""
        if not self.is_fsdp_enabled:
            return None
        params = list(model.parameters())
        if self._one_mesh is None:
            meshes = {id(p.grad.device_mesh) if hasattr(p.grad, "device_mesh") else None for p in params if p.grad is not None}
            self._one_mesh = len(meshes) == 1 and None not in meshes
        return params if self._one_mesh else None

    def _clip_grad_norm(self, model):
        params = self._sharded_params(model)
        if params is None:
            return super()._clip_grad_norm(model)
        return sharded_grad_norm_(params, self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None:  # not clipped: the norm for the logs alone
            params = self._sharded_params(model)
            if params is not None:
                grad_norm = sharded_grad_norm_(params, float("inf"))
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    def training_step(self, model, inputs, *args, **kwargs):
        loss = super().training_step(model, inputs, *args, **kwargs)
        if self.replayed and world_size() > 1 and self.accelerator.sync_gradients:
            self.captured.all_reduce_grads()  # what DDP's hooks do in an eager backward
        self.finite.add(loss, self.state.global_step + 1)
        return loss

    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, model, *args, **kwargs):
        # Before anything reads or writes the weights of this step (a checkpoint, a validation, the end), its losses
        # are checked now; otherwise a step's check waits until the next step has been issued, so the host never stops
        # to wait for the GPU (one wait per step would leave the GPU idle while the host issues the optimizer and the
        # next step). A log in between is written one step late for the same reason (`PendingLog`).
        c = self.control
        due = c.should_save or c.should_evaluate or c.should_training_stop or self.state.global_step >= self.state.max_steps
        failed = self.finite.check(all_steps=due)
        if failed is not None:
            step, value = failed
            last = self.checkpoints.newest()
            where = f"The last good checkpoint is {last}; resume from it with --resume after the change." if last else "No checkpoint was written."
            raise TrainingDivergedError(
                f"the loss became {value} at step {step}; training stopped before any checkpoint held its update. "
                f"Lower train.lr (now {self.args.learning_rate:g}), raise train.warmup_steps, or keep train.grad_clip > 0. {where}"
            )
        self._write_pending_log()
        if c.should_log and not due and self.state.global_step > self._globalstep_last_logged:
            self.pending_log = PendingLog(self, tr_loss, grad_norm, model, kwargs.get("learning_rate"))
            c.should_log = False  # taken over: the Trainer's own log would read the loss on the host now
        return super()._maybe_log_save_evaluate(tr_loss, grad_norm, model, *args, **kwargs)

    def _write_pending_log(self) -> None:
        if self.pending_log is not None:
            pending, self.pending_log = self.pending_log, None
            asked = self.control.should_log  # whether this step logs too: the callbacks clear it on any log
            pending.write(self)
            self.control.should_log = asked

    def log(self, logs, start_time=None):
        self._write_pending_log()  # the logs in the order of their steps, whoever logs (a validation's metrics)
        super().log(logs, start_time)


class PendingLog:
    """A training log the Trainer would write at a step (its mean loss since the last log, the gradients' norm, the
    learning rate, the mixers' health statistics), taken without waiting for the GPU: the values are gathered on the
    device and copied to the host as the step's work finishes, and written (`write`) at the next step, once that step's
    work has been issued, as the Trainer writes them (the state's step and epoch those of the logged step)."""

    def __init__(self, trainer: "AttnLabTrainer", tr_loss: torch.Tensor, grad_norm, model, learning_rate: float | None):
        state = trainer.state
        self.step, self.epoch = state.global_step, state.epoch
        self.steps = state.global_step - trainer._globalstep_last_logged
        self.learning_rate = learning_rate if learning_rate is not None else trainer._get_learning_rate()
        loss = nested_gather(tr_loss, trainer.args.parallel_mode).mean().float().reshape(1)
        tr_loss -= tr_loss  # as the Trainer's log: the loss sums again from zero
        values = [loss]
        self.norm_on_device = isinstance(grad_norm, torch.Tensor)
        self.norm = None if self.norm_on_device else grad_norm  # a float or None; else read with the loss
        if self.norm_on_device:
            if hasattr(grad_norm, "full_tensor"):  # a DTensor (FSDP's clipping): the whole value, on every process
                grad_norm = grad_norm.full_tensor()
            values.append(grad_norm.detach().float().reshape(1))
        table = getattr(trainer.accelerator.unwrap_model(model), "health_stats_table", None)
        self.health_keys, health = table() if callable(table) else ([], None)
        if health is not None:
            values.append(health.float().reshape(-1))
        self.values = HostCopy(torch.cat([v.to(loss.device) for v in values]))
        # (the Trainer's floating-point count is stored at checkpoints and at the end: under several processes storing
        # it reads a gathered value on the host)
        trainer._globalstep_last_logged = state.global_step

    def write(self, trainer: "AttnLabTrainer") -> None:
        values = self.values.read()
        loss = values.pop(0)
        logs = {"loss": loss / self.steps}
        trainer._total_loss_scalar += loss
        norm = values.pop(0) if self.norm_on_device else self.norm
        if norm is not None:
            logs["grad_norm"] = norm
        logs["learning_rate"] = self.learning_rate
        if self.health_keys:
            logs["health"] = dict(zip(self.health_keys, values))
        state = trainer.state
        now = state.global_step, state.epoch
        state.global_step, state.epoch = self.step, self.epoch
        try:
            Trainer.log(trainer, logs)
        finally:
            state.global_step, state.epoch = now


class HostCopy:
    """A device tensor copied to the host without waiting for it: `read()` waits only if the copy (and the work
    before it) has not finished, then gives the values as a list."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.copied = None
        if tensor.is_cuda:
            self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self.host.copy_(tensor, non_blocking=True)
            self.copied = torch.cuda.Event()
            self.copied.record()
        else:
            self.host = tensor

    def read(self) -> list:
        if self.copied is not None:
            self.copied.synchronize()
        return self.host.tolist()


class FiniteLossCheck:
    """Whether every micro-batch's loss was finite, step by step, without stopping the host to wait for the GPU:
    each step's verdict is one flag on the device, copied to pinned host memory as the step's work finishes and
    read when asked (`check`), by then usually already there."""

    def __init__(self) -> None:
        self.pending: list[tuple[int, HostCopy]] = []  # (step, its verdict on its way to the host)
        self.step: int | None = None
        self.losses: list[torch.Tensor] = []

    def add(self, loss: torch.Tensor, step: int) -> None:
        if self.step is not None and step != self.step:
            self._close()
        self.step = step
        self.losses.append(loss.detach().reshape(-1)[:1])

    def _close(self) -> None:
        losses = torch.cat(self.losses)
        # the first non-finite loss of the step, else its first loss: one value to name in the error (gathered: indexing
        # with a tensor would read the index on the host, waiting for the GPU at every step)
        bad = ~torch.isfinite(losses)
        first = losses.gather(0, bad.int().argmax().reshape(1)).float()
        self.pending.append((self.step, HostCopy(torch.cat([bad.any().float().reshape(1), first]))))
        self.step, self.losses = None, []

    def check(self, all_steps: bool) -> tuple[int, float] | None:
        """(step, loss) of the first step whose loss was not finite, or None. `all_steps`: every step
        added so far, waiting for the GPU if needed; else all but the latest."""
        if self.losses:
            self._close()
        ready = self.pending if all_steps else self.pending[:-1]
        self.pending = [] if all_steps else self.pending[-1:]
        for step, verdict in ready:
            bad, value = verdict.read()
            if bad:
                return step, value
        return None


def sharded_grad_norm_(params: list, max_norm: float) -> torch.Tensor:
    """The 2-norm of FSDP's gradients (DTensors of one mesh) and, where `max_norm` is finite, the gradients clipped
    to it in place, as torch.nn.utils.clip_grad_norm_ computes them, but from each process's shards: their squared
    norms, summed over the processes, are the whole gradients'. clip_grad_norm_ on the DTensors themselves spent 46 ms
    of host time a call on 283 parameters (2 gloo processes on CPU), this about 1 ms; a captured FSDP step of the
    300M `2mamba` model replays in 58 ms (2 x H200)."""
    import torch.distributed as dist

    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    shards = [local_part(g) for g in grads]
    total = torch.stack(torch._foreach_norm(shards)).float().square().sum()
    dist.all_reduce(total, group=grads[0].device_mesh.get_group())
    total = total.sqrt()
    if math.isfinite(max_norm):
        torch._foreach_mul_(shards, (max_norm / (total + 1e-6)).clamp(max=1.0))
    return total


def first_error(err: BaseException) -> str:
    """The first line of the error that started `err`'s chain: a failed CUDA graph capture ends in "operation failed
    due to a previous error during capture", raised while the error that broke it unwinds."""
    while (err.__cause__ or err.__context__) is not None:
        err = err.__cause__ or err.__context__
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:200]


def _all_ranks(ok: bool, device) -> bool:
    """Whether `ok` holds on every process."""
    import torch.distributed as dist

    flag = torch.tensor([int(ok)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


class StopOnSignal(TrainerCallback):
    """SIGINT (Ctrl-C) and SIGTERM (Slurm preemption, `timeout`, `kill`): finish the step under way, save a
    checkpoint and stop. The time this takes is bounded by one step (two under several processes) and one checkpoint write; a second
    signal stops at once (the previous checkpoint stays the resume point). Under several processes the
    ranks agree, one step after the signal, so that all of them save the same step."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum: int | None = None
        self.stopped_at: int | None = None
        self._previous: dict = {}
        self._reduced: HostCopy | None = None  # the ranks' flags reduced at the last step, on their way to the host

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt  # the second signal: stop now
        self.signum = signum

    def _requested(self, args) -> bool:
        """Whether to stop at this step. Under several processes, the ranks' flags are reduced each step without
        the host waiting for it: the reduction launched at one step is read at the next (done by then), so every
        rank stops at the same step, one step after the signal came."""
        import torch.distributed as dist

        if not (world_size() > 1 and dist.is_available() and dist.is_initialized()):
            return self.signum is not None
        agreed = self._reduced.read()[0] if self._reduced is not None else 0
        flag = torch.tensor([0 if self.signum is None else self.signum], device=args.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self._reduced = HostCopy(flag)
        if agreed:
            self.signum = self.signum or agreed
            return True
        return False

    def on_step_end(self, args, state, control, **kw):
        if self._requested(args):
            self.stopped_at = state.global_step
            control.should_save = True
            control.should_training_stop = True

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "a signal"


class TelemetryCallback(TrainerCallback):
    """Heartbeat, metrics, TensorBoard, validation bits per byte, samples, and progress: a bar on a terminal,
    a plain line every train.progress_every_s seconds otherwise (nohup, tmux logs, job logs)."""

    def __init__(self, cfg: RunConfig, logger: RunLogger, tokenizer, val_bytes_per_token: float | None,
                 console: Console, tokens_per_step: int, elapsed_offset_s: float, start_step: int, on_heartbeat=None):
        self.cfg, self.logger, self.tokenizer, self.console = cfg, logger, tokenizer, console
        self.val_bytes_per_token = val_bytes_per_token
        self.tokens_per_step = tokens_per_step
        self.elapsed_offset_s = elapsed_offset_s
        self.t0 = time.perf_counter()
        self.start_step = start_step
        self.throughput = Throughput()
        self.last: dict | None = None  # the latest logged record: its loss is what progress shows
        # plain lines waiting for a log, in order: (step, whether that step logs). A logging step's line waits for its
        # log (the Trainer logs after on_step_end, and between checkpoints one step later still: PendingLog), and every
        # line after it waits too, so that the lines come in the order of their steps
        self.waiting_lines: list[tuple[int, bool]] = []
        self.val_loss: float | None = None
        self.val_bpb: float | None = None
        self.sample: str | None = None
        self.on_heartbeat = on_heartbeat  # called with each heartbeat record (run.json keeps its wall time current)
        self.plain = not console.is_terminal
        self.last_line = -math.inf
        self.segment_t0 = time.perf_counter()
        self.progress = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[loss]}"), TextColumn("{task.fields[tps]:,.0f} tok/s"),
            TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=False,
        )
        self.task = None

    def elapsed(self) -> float:
        return self.elapsed_offset_s + time.perf_counter() - self.t0

    def on_train_begin(self, args, state, control, **kw):
        if not self.plain:
            self.progress.start()
        self.task = self.progress.add_task("train", total=state.max_steps, completed=self.start_step, loss="loss -", tps=0.0)
        self.throughput = Throughput()
        self.segment_t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        self.throughput.add(self.tokens_per_step)
        self.progress.update(self.task, completed=state.global_step)
        if self.plain and self._line_due(state.global_step, state.max_steps):
            if control.should_log or self.waiting_lines:  # this step's loss, or an earlier one's, is still to be logged
                self.waiting_lines.append((state.global_step, control.should_log))
            else:
                self._plain_line(state.global_step, state.max_steps)
        if state.global_step >= state.max_steps:  # always validate and checkpoint at the end
            control.should_evaluate = self.val_bytes_per_token is not None
            control.should_save = self.cfg.train.save_every > 0

    def on_log(self, args, state, control, logs=None, model=None, **kw):
        if not logs or "loss" not in logs:
            return
        stats = logs.get("health")  # mixers that report training-health statistics (NSA): as of the logged step
        if stats is None:
            health = getattr(model, "health_stats", None)
            stats = health() if callable(health) else {}
        record = {
            "step": state.global_step,
            "loss": float(logs["loss"]),
            "lr": float(logs.get("learning_rate", 0.0)),
            "grad_norm": float(logs["grad_norm"]) if logs.get("grad_norm") is not None else None,
            "tokens_per_s": round(self.throughput.read(), 1),
            "elapsed_s": round(self.elapsed(), 2),
            **stats,
        }
        self.logger.heartbeat(record)
        self.last = record
        self.progress.update(self.task, loss=self._loss_field(state.global_step), tps=record["tokens_per_s"])
        if self.on_heartbeat is not None and state.is_world_process_zero:
            self.on_heartbeat(record)
        logged = state.global_step
        # the lines up to the logged step, and the ones after it that wait only for their turn (a later logging step's
        # line waits for its own log)
        while self.waiting_lines and (self.waiting_lines[0][0] <= logged or not self.waiting_lines[0][1]):
            self._plain_line(self.waiting_lines.pop(0)[0], state.max_steps)

    def _loss_field(self, step: int) -> str:
        """The latest logged loss, with its step when that is not `step`; no value before the first log."""
        if self.last is None:
            return "loss -"
        at = "" if self.last["step"] == step else f" (step {self.last['step']})"
        return f"loss {self.last['loss']:.4f}{at}"

    def _line_due(self, step: int, max_steps: int) -> bool:
        now = time.perf_counter()
        if now - self.last_line < self.cfg.train.progress_every_s and step < max_steps:
            return False
        self.last_line = now
        return True

    def _plain_line(self, step: int, max_steps: int) -> None:
        done = step - self.start_step
        seconds = max(time.perf_counter() - self.segment_t0, 1e-9)
        rate = done / seconds
        eta = _clock((max_steps - step) / rate) if rate > 0 else "?"
        self.console.print(
            f"step {step}/{max_steps} ({100 * step / max(max_steps, 1):.0f}%)  {self._loss_field(step)}  "
            f"{done * self.tokens_per_step / seconds:,.0f} tok/s  elapsed {_clock(self.elapsed())}  ETA {eta}",
            highlight=False, markup=False, soft_wrap=True,
        )

    def on_evaluate(self, args, state, control, metrics=None, model=None, **kw):
        if not metrics or "eval_loss" not in metrics:
            return
        sampling = self.cfg.train.sample_tokens > 0 and model is not None
        prompt = self.cfg.train.sample_prompt
        if sampling and (state.is_world_process_zero or fsdp_active(self.cfg)):
            # A sharded model runs forward only with every rank: all of them sample, in step (same seed, same tokens).
            self.sample = sample_continuation(model, self.tokenizer, prompt, self.cfg.train.sample_tokens, seed=self.cfg.train.seed)
        if not state.is_world_process_zero:
            return
        self.val_loss = float(metrics["eval_loss"])
        self.val_bpb = self.val_loss / LN2 / self.val_bytes_per_token
        self.logger.validation(state.global_step, round(self.elapsed(), 2), self.val_loss, self.val_bpb)
        line = f"step {state.global_step}: val loss {self.val_loss:.4f} nats/token, {self.val_bpb:.3f} bits/byte"
        if sampling:
            self.logger.sample(state.global_step, prompt, self.sample)
            self.console.print(line)
            self.console.print(f"[dim]{prompt}[/dim]{_escape(self.sample)}", highlight=False)
        else:
            self.console.print(line)

    def on_train_end(self, args, state, control, **kw):
        while self.waiting_lines:  # a log that never came (the run ended without it): the lines with the latest loss
            self._plain_line(self.waiting_lines.pop(0)[0], state.max_steps)
        self.progress.stop()


def _is_write_failure(err: RuntimeError) -> bool:
    """torch.save's writer reports a failed write (a full disk) as a RuntimeError, not an OSError."""
    text = str(err)
    return any(s in text for s in ("inline_container", "PytorchStreamWriter", "file write failed", "No space left"))


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}"


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


def training_arguments(cfg: RunConfig, report: PreflightReport, staging: Path, has_val: bool, stream: bool = False,
                       block_classes: list[str] | None = None) -> TrainingArguments:
    """`stream`: the training data is a prepared corpus's block stream, whose sampler starts a resume at the
    recorded position itself: the Trainer must not skip batches by reading them. `block_classes`: the decoder
    block classes FSDP wraps one by one (attnlab's by default; an HF model's `_no_split_modules`)."""
    t = cfg.train
    scheduler, scheduler_kwargs = scheduler_spec(t)
    args = TrainingArguments(
        output_dir=str(staging),
        max_steps=t.max_steps,
        per_device_train_batch_size=t.batch_size // world_size(),
        per_device_eval_batch_size=t.batch_size // world_size(),
        ddp_backend=("gloo" if report.device == "cpu" else "nccl") if world_size() > 1 else None,
        # attnlab and HF causal LMs use every parameter on every forward (tests/test_models.py holds every mixer
        # to it): no search for unused ones after each backward.
        ddp_find_unused_parameters=False,
        ddp_broadcast_buffers=_broadcast_buffers_argument(),
        gradient_accumulation_steps=t.grad_accum,
        learning_rate=t.lr,
        weight_decay=t.weight_decay,
        adam_beta1=t.beta1,
        adam_beta2=t.beta2,
        warmup_steps=t.warmup_steps,
        lr_scheduler_type=scheduler,
        lr_scheduler_kwargs=scheduler_kwargs,
        max_grad_norm=t.grad_clip,  # 0 = off (the Trainer clips only above 0; None fails in its step)
        bf16=report.precision == "bf16",
        use_cpu=report.device == "cpu",
        eval_strategy="steps" if (has_val and t.eval_every > 0) else "no",
        eval_steps=t.eval_every if t.eval_every > 0 else None,
        save_strategy="steps" if t.save_every > 0 else "no",
        save_steps=t.save_every if t.save_every > 0 else None,
        logging_strategy="steps",
        logging_steps=t.log_every,
        logging_nan_inf_filter=False,
        report_to="none",  # telemetry.RunLogger writes TensorBoard (and W&B when train.wandb is on)
        disable_tqdm=True,
        seed=t.seed,
        data_seed=t.seed,
        ignore_data_skip=stream,
        dataloader_drop_last=True,
        dataloader_num_workers=0,
        # each batch copied to the GPU from pinned memory without waiting (accelerate's loader copies the next batch
        # while the step before it may still run: a blocking copy would make the host wait for that step to finish)
        dataloader_pin_memory=report.device == "cuda",
        accelerator_config={"non_blocking": report.device == "cuda"},
        remove_unused_columns=False,
        prediction_loss_only=True,
        **_strategy_arguments(cfg, block_classes),
    )
    # One process trains on one device. With several GPUs visible and no torchrun, the Trainer would
    # wrap the model in nn.DataParallel and multiply the batch by the GPU count: train.batch_size would
    # silently mean something else, and the run would leave the trajectory of the same config elsewhere.
    if args.n_gpu > 1:
        args._n_gpu = 1  # as the Trainer itself does for model-parallel models
    return args


def _broadcast_buffers_argument() -> bool | None:
    """DDP's `broadcast_buffers`: False (buffers are constants: attnlab models have none, HF models' rotary tables
    never change) where DDP takes it; None (DDP's default) where torch has deprecated it for `forward_sync_buffers`,
    which accelerate does not pass: passing it there prints a FutureWarning on every rank, and the buffers an HF
    model broadcasts are a few hundred values."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    return None if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters else False


def fsdp_precision(reduce_dtype: torch.dtype | None = None):
    """FSDP2's mixed precision for a run: the fp32 parameters gathered as they are, so that under bf16 autocast casts
    them for the matrix products and every other use (norm weights, decay rates) reads fp32, as in one process and
    under DDP; the gradients reduce-scattered in fp32, as DDP averages them, or in `reduce_dtype`
    (train.grad_reduce_dtype). accelerate's own policy under bf16 gathers bf16 parameters, reduce-scatters in bf16
    and casts every module's output, the loss too, to bf16: another run than the same config under DDP."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=None, reduce_dtype=reduce_dtype or torch.float32, output_dtype=None)


def fsdp_active(cfg: RunConfig) -> bool:
    """train.strategy=fsdp takes effect only with several processes: one process has nothing to shard with."""
    return cfg.train.strategy == "fsdp" and world_size() > 1


def _strategy_arguments(cfg: RunConfig, block_classes: list[str] | None = None) -> dict:
    """FSDP2 through accelerate: every decoder block its own shard group, full (unsharded) state dicts on save."""
    if not fsdp_active(cfg):
        return {}
    return {"fsdp": True, "fsdp_config": {
        "version": 2,
        "reshard_after_forward": True,  # FULL_SHARD: parameters are gathered per block and freed after use
        "transformer_layer_cls_to_wrap": list(block_classes or [AttnLabBlock.__name__]),
        "state_dict_type": "FULL_STATE_DICT",
    }}


def run_training(cfg: RunConfig, run_dir: Path, report: PreflightReport, console: Console | None = None) -> TrainResult:
    """Train as `cfg` says into `run_dir`. `report` is a passed preflight (it holds the tokenizer and data)."""
    is_main = rank() == 0
    console = console or make_console(quiet=not is_main)
    resume_from = report.resume_from
    start_step = int(resume_from.name.split("-")[1]) if resume_from else 0
    transformers.utils.logging.disable_progress_bar()  # our own progress bar is the only one
    transformers.set_seed(cfg.train.seed)
    model = build_model(cfg, report)
    if report.init_from is not None:
        kind, where = report.init_from
        what = f"HF {model.config.model_type}" if kind == "hf" else f"attnlab {model.config.mixer}"
        console.print(f"[dim]train.init_from: {what} model from {_escape(where)}[/dim]")
    parameters = sum(p.numel() for p in model.parameters())  # tied weights once
    status_file = RunStatus(run_dir, cfg, report, parameters, start_step) if is_main else None
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        if is_main:
            save_config(cfg, run_dir / "config.yaml")
            status_file.write("running")
    except OSError as e:
        raise RunDirError(f"cannot write the run directory {run_dir}: {e.strerror or e}. Nothing was trained; "
                          "make it writable (or free space) and start again.") from None
    console.print(f"model: {parameters:,} parameters ({parameters / 1e6:.2f} M)", highlight=False)
    if cfg.train.gradient_checkpointing:
        # attnlab models: the form that is captured with the step (train/graphs.py); HF models keep their RNG bookkeeping
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs=CHECKPOINT_KWARGS if isinstance(model, AttnLabForCausalLM) else {"use_reentrant": False})
    if hasattr(model, "enable_health_stats"):
        model.enable_health_stats(True)
    tokenizer, data = report.tokenizer, report.data
    has_val = data.val is not None and len(data.val) > 0
    val_rows = data.val[: cfg.train.eval_batches * cfg.train.batch_size] if has_val else None

    checkpoints = CheckpointManager(run_dir, keep_last=cfg.train.keep_last)
    if is_main:
        checkpoints.clear_staging()  # whatever a crash left half-written is never used
    logger = RunLogger(run_dir, resume_step=start_step, wandb_run=_wandb_run(cfg, run_dir) if cfg.train.wandb and is_main else None,
                       rank=rank(), world_size=world_size())
    tokens_per_step = cfg.train.batch_size * cfg.train.grad_accum * cfg.data.seq_len
    telemetry = TelemetryCallback(
        cfg, logger, tokenizer, data.stats["val_bytes_per_token"] if has_val else None, console,
        tokens_per_step, _elapsed_at(run_dir, start_step), start_step,
        on_heartbeat=(lambda record: status_file.write("running", quiet=True, step=record["step"])) if is_main else None,
    )
    stopper = StopOnSignal()
    say = lambda text: console.print(f"[dim]{text}[/dim]")  # noqa: E731
    rows_per_step = cfg.train.batch_size * cfg.train.grad_accum  # global: every rank's share together
    stream = isinstance(data.train, PreparedBlocks)
    sampler, data_state = None, None
    if stream:
        start = _stream_start(resume_from, start_step, rows_per_step, data.train, say)
        sampler = PositionSampler(start, cfg.train.max_steps * rows_per_step)
        identity = data.train.identity()
        data_state = lambda step: {"position": step * rows_per_step, "step": step, **identity}  # noqa: E731
        say(f"data: {data.train.n_blocks:,} blocks of {cfg.data.seq_len} tokens read lazily from {data.stats['prepared']}, "
            f"seeded order, from position {start:,}")
    callbacks: list[TrainerCallback] = [telemetry, stopper]
    if cfg.train.profile_steps:
        callbacks.append(ProfileSteps(run_dir, cfg.train.profile_from, cfg.train.profile_steps, rank(), cuda=report.device == "cuda",
                                      say=lambda text: console.print(text, markup=False)))
    if cfg.eval.tasks and is_main:
        callbacks.append(EvalDuringTraining(cfg.eval, tokenizer, logger, run_dir=run_dir, console=console, data=cfg.data))
    trainer = AttnLabTrainer(
        model=model,
        args=training_arguments(cfg, report, checkpoints.staging, has_val, stream=stream,
                                block_classes=getattr(model, "_no_split_modules", None)),
        train_dataset=data.train if stream or not torch.is_tensor(data.train) else BlockDataset(data.train),  # blocks, or a dataset (MQAR)
        eval_dataset=BlockDataset(val_rows) if has_val else None,
        data_collator=default_data_collator,
        processing_class=tokenizer,
        callbacks=callbacks,
        checkpoints=checkpoints,
        run_config_yaml=config_to_yaml(cfg),
        cuda_graphs=cfg.train.cuda_graphs and report.device == "cuda",
        compile_blocks=cfg.train.compile if report.device == "cuda" else False,
        grad_reduce_dtype=torch.bfloat16 if cfg.train.grad_reduce_dtype == "bf16" else None,
        say=say,
        train_sampler=sampler,
        data_state=data_state,
    )
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
    t0 = time.perf_counter()
    status = "failed"
    stopper.install()
    try:
        trainer.train_or_finish(resume_from)
        if stopper.stopped_at is not None and trainer.state.global_step < trainer.state.max_steps:  # at the end: just finish
            status = "interrupted"
            saved = checkpoints.newest()
            raise RunInterrupted(
                f"stopped by {stopper.name} at step {stopper.stopped_at}; its checkpoint {saved} is saved. "
                f"Continue with: attnlab train --resume --run-dir {run_dir}", exit_code=128 + int(stopper.signum))
        # Sharded weights are gathered whole by every rank (rank 0 keeps them); rank 0 writes the final model.
        weights = trainer.accelerator.get_state_dict(trainer.model) if trainer.is_fsdp_enabled else None
        if is_main:
            _save_final(trainer.model, tokenizer, cfg, run_dir, trainer.state.global_step, weights)
        status = "finished"
    except TrainingDivergedError:
        status = "diverged"
        raise
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    finally:
        stopper.restore()
        wall_s = time.perf_counter() - t0
        telemetry.progress.stop()
        logger.close()
        if is_main:
            try:  # a full disk must not hide the error that stopped the run
                checkpoints.clear_staging()
                status_file.write(status, quiet=True, step=trainer.state.global_step, val_loss=telemetry.val_loss, val_bpb=telemetry.val_bpb, world_size=world_size())
            except OSError:
                pass
    total = status_file.total_wall_s() if status_file is not None else wall_s
    return TrainResult(run_dir, trainer.state.global_step, total, telemetry.val_loss, telemetry.val_bpb, telemetry.sample,
                       segment_wall_s=wall_s, parameters=parameters)


def _stream_start(resume_from: Path | None, step: int, rows_per_step: int, blocks, say) -> int:
    """Where a prepared corpus's block stream starts: 0, or the position a resumed checkpoint recorded."""
    if resume_from is None:
        return 0
    path = resume_from / DATA_STATE
    if not path.is_file():
        say(f"{resume_from} records no data position ({DATA_STATE}): the block stream continues at step {step}'s, {step * rows_per_step:,}")
        return step * rows_per_step
    state = json.loads(path.read_text())
    changed = {k: (state.get(k), v) for k, v in blocks.identity().items() if state.get(k) != v}
    if changed:
        what = ", ".join(f"{k} {old} -> {new}" for k, (old, new) in changed.items())
        say(f"the prepared corpus differs from the one this run trained on ({what}): the run continues at position "
            f"{state['position']:,} of the new block order, not with the batches it would have seen")
    return int(state["position"])


def _wandb_run(cfg: RunConfig, run_dir: Path):
    import wandb  # preflight has checked that the extra is installed

    return wandb.init(
        project=cfg.train.wandb_project, name=run_dir.name, dir=str(run_dir), id=_stable_run_id(run_dir),
        resume="allow", config=cfg.model_dump(mode="json"),
    )


def _stable_run_id(run_dir: Path) -> str:
    """One W&B run per run directory, across resumes."""
    path = run_dir / "wandb_id"
    if not path.exists():
        replace_file(path, uuid.uuid4().hex[:12])
    return path.read_text().strip()


def _save_final(model, tokenizer, cfg: RunConfig, run_dir: Path, step: int, state_dict: dict | None = None) -> None:
    with publishing(run_dir / "final", step) as tmp:  # its manifest: generate / eval verify the final model against it
        model.save_pretrained(tmp, state_dict=state_dict)
        tokenizer.save_pretrained(tmp)
        save_config(cfg, tmp / "run_config.yaml")


def _elapsed_at(run_dir: Path, step: int) -> float:
    """Elapsed seconds recorded at `step` by an earlier process of this run (0 for a new run)."""
    path = run_dir / "heartbeat.jsonl"
    if not step or not path.exists():
        return 0.0
    elapsed = 0.0
    for rec in read_jsonl(path):
        if rec.get("step", 0) <= step and isinstance(rec.get("elapsed_s"), (int, float)):
            elapsed = rec["elapsed_s"]
    return float(elapsed)


class RunStatus:
    """RUN/run.json: the run's state, versions, parameter count and wall time.

    A run resumed after a stop is made of segments (one per process lifetime); `segments` lists them and
    `wall_s` is their sum, so that a resumed run's wall time counts every segment. The current segment's
    entry is rewritten at every heartbeat, so a segment that ended in a SIGKILL still counts up to its last one."""

    def __init__(self, run_dir: Path, cfg: RunConfig, report: PreflightReport, parameters: int, start_step: int):
        self.run_dir, self.cfg, self.report, self.parameters = run_dir, cfg, report, parameters
        self.t0 = time.perf_counter()
        self.previous = self._previous_segments() if start_step else []
        self.segment = {"start_step": start_step, "end_step": start_step, "wall_s": 0.0, "status": "running"}
        self.extra: dict = {}

    def _previous_segments(self) -> list[dict]:
        try:
            old = json.loads((self.run_dir / "run.json").read_text())
        except (OSError, ValueError):
            return []
        if not isinstance(old, dict):
            return []
        segments = old.get("segments")
        if isinstance(segments, list):
            return [s for s in segments if isinstance(s, dict) and isinstance(s.get("wall_s"), (int, float))]
        if isinstance(old.get("wall_s"), (int, float)):  # a run.json written before segments were recorded
            return [{"wall_s": old["wall_s"], "status": old.get("status")}]
        return []

    def total_wall_s(self) -> float:
        return round(sum(s["wall_s"] for s in self.previous) + self.segment["wall_s"], 2)

    def write(self, status: str, quiet: bool = False, step: int | None = None, **extra) -> None:
        """`step`: the step the segment reached. quiet: an OSError (a full disk) is not raised (the heartbeat
        and the run's end must not fail on it)."""
        self.segment["wall_s"] = round(time.perf_counter() - self.t0, 2)
        self.segment["status"] = status
        if step is not None:
            self.segment["end_step"] = step
        self.extra.update({k: v for k, v in extra.items() if v is not None})
        try:
            _write_status(self.run_dir, status, self.cfg, self.report, parameters=self.parameters, wall_s=self.total_wall_s(),
                          segment_wall_s=self.segment["wall_s"], segments=self.previous + [dict(self.segment)], **self.extra)
        except OSError:
            if not quiet:
                raise


def _write_status(run_dir: Path, status: str, cfg: RunConfig, report: PreflightReport, **extra) -> None:
    record = {
        "status": status,
        "attnlab_version": attnlab.__version__,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name() if report.device == "cuda" else platform.processor() or "cpu",
        "precision": report.precision,
        "max_steps": cfg.train.max_steps,
        "updated": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **{k: v for k, v in extra.items() if v is not None},
    }
    if "eval" not in record:  # the latest evaluation during training, which the logger merges in, stays
        try:
            old = json.loads((run_dir / "run.json").read_text())
        except (OSError, ValueError):
            old = None
        if isinstance(old, dict) and "eval" in old:
            record["eval"] = old["eval"]
    replace_file(run_dir / "run.json", json.dumps(record, indent=1))
