"""The training step's forward and backward captured as CUDA graphs and replayed.

A training step of a mid-sized model launches thousands of kernels (about 3,000 for the 374M GLA
model at 8 x 2048), and on a fast GPU Python cannot issue them as fast as the GPU runs them: the
step then takes as long as the host needs to issue it, not as long as the kernels take. Captured
once, the forward and the backward each replay with one call. The optimizer, gradient clipping
and the schedule stay eager (a few launches).

What is captured is the summed token loss of one batch shape: the model's forward (under autocast
when the run trains in bf16) and the gradients of every trainable parameter. A batch of another
shape runs eagerly. Capture needs a step free of host synchronisation, so it applies only where
that is known: mixers marked `train_graph_safe` (checked against the eager step on the GPU), and
gradient checkpointing only in its non-reentrant form without RNG bookkeeping (`CHECKPOINT_KWARGS`:
the recomputation is then captured inside the backward graph). `graph_blocker` says why a run stays eager.

Under DDP the captured step bypasses DDP's forward (whose hooks reduce gradients during an eager
backward): the backward graph writes the gradients into one flat buffer per dtype, and once per
optimizer step `CapturedLoss.all_reduce_grads` averages those buffers over the processes with one
NCCL all-reduce each, as DDP would. FSDP gathers parameters inside the forward, so it stays eager.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn as nn

from attnlab.generation.graphs import weights_fingerprint

WARMUP_STEPS = 3  # forward and backward on a side stream before capture: fla's kernels autotune, the allocator settles
# How attnlab models checkpoint blocks: non-reentrant (its recomputation runs inside the backward, so it is
# captured with it, and DDP sees each gradient once); no RNG state saved and restored around the recomputation
# (the host reads of the generator's state cannot be captured; attnlab's forwards draw no random numbers).
CHECKPOINT_KWARGS = {"use_reentrant": False, "preserve_rng_state": False}


def graph_blocker(model: nn.Module, sharded: bool = False) -> str | None:
    """Why the training step of `model` cannot be captured, or None when it can. `sharded`: FSDP."""
    from attnlab.models import AttnLabForCausalLM
    from attnlab.models.mixers import Mixer

    if not isinstance(model, AttnLabForCausalLM):
        return f"{type(model).__name__} is not an attnlab model"
    mixers = [m for m in model.modules() if isinstance(m, Mixer)]
    unsafe = sorted({type(m).__name__ for m in mixers if not m.train_graph_safe})
    if unsafe:
        return f"mixer {', '.join(unsafe)} is not verified for capture"
    if any(m.collect_stats and not m.stats_graph_safe for m in mixers):
        return "a mixer records statistics during the forward (not verified for capture)"
    if getattr(model, "is_gradient_checkpointing", False) and not _checkpoints_capturably(model):
        return f"gradient checkpointing is not in its capturable form ({CHECKPOINT_KWARGS})"
    if sharded:
        return "FSDP gathers the sharded parameters inside the forward"
    if not torch.cuda.is_available() or next(model.parameters()).device.type != "cuda":
        return "the model is not on a CUDA device"
    return None


_CAPTURE_STREAM: torch.cuda.Stream | None = None


def capture_stream() -> torch.cuda.Stream:
    """The one stream the training step is warmed up and captured on. DDP must be built on it too: DDP keeps
    each parameter's gradient accumulator alive, which autograd ties to the stream current when it was made;
    one made on another stream makes the captured backward wait on that stream, and the capture fails."""
    global _CAPTURE_STREAM
    if _CAPTURE_STREAM is None:
        _CAPTURE_STREAM = torch.cuda.Stream()
    return _CAPTURE_STREAM


def on_capture_stream(prepare_model):
    """`prepare_model` (accelerate's, which wraps the model in DDP) run on `capture_stream()`."""
    def prepare(*args, **kwargs):
        stream = capture_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            model = prepare_model(*args, **kwargs)
        torch.cuda.current_stream().wait_stream(stream)
        return model
    return prepare


def _checkpoints_capturably(model: nn.Module) -> bool:
    funcs = [getattr(m, "_gradient_checkpointing_func", None) for m in model.modules() if getattr(m, "gradient_checkpointing", False)]
    return bool(funcs) and all(getattr(f, "keywords", {}) == CHECKPOINT_KWARGS for f in funcs)


def flat_views(params: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One zeroed flat buffer per dtype and, in it, a tensor shaped like each parameter: (flats, views)."""
    sizes: dict[torch.dtype, int] = {}
    offsets = []
    for p in params:
        offsets.append(sizes.get(p.dtype, 0))
        sizes[p.dtype] = offsets[-1] + p.numel()
    flats = {dtype: torch.zeros(n, dtype=dtype, device=params[0].device) for dtype, n in sizes.items()}
    views = [flats[p.dtype][o:o + p.numel()].view_as(p) for p, o in zip(params, offsets)]
    return list(flats.values()), views


class _Replay(torch.autograd.Function):
    """Replays the captured forward; its backward replays the captured backward and hands the
    gradients to the parameters itself (`CapturedLoss.replay_backward`). The parameters are inputs
    only so that the loss requires grad."""

    @staticmethod
    def forward(ctx, step: CapturedLoss, input_ids, labels, *params):
        ctx.step = step
        return step.replay_forward(input_ids, labels)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        ctx.step.replay_backward(grad_loss)
        return (None,) * (3 + len(ctx.step.params))


class CapturedLoss:
    """sum over tokens of the cross-entropy of `model` on (input_ids, labels) of one shape, as two
    CUDA graphs. Call it with tensors of that shape; `matches` says whether a batch fits.
    `flat`: the gradients land in flat buffers (`all_reduce_grads` reduces them over processes)."""

    def __init__(self, model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, autocast_dtype: torch.dtype | None,
                 flat: bool = False):
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        # flat: the backward graph's gradients and, across micro-batches, their sums live in flat buffers
        self.flats, self.flat_grads = flat_views(self.params) if flat else (None, None)
        self.sums: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None  # (flats, views), made on first accumulation
        self.fingerprint = weights_fingerprint(model)
        self.autocast_dtype = autocast_dtype
        self.static_ids, self.static_labels = input_ids.clone(), labels.clone()
        side = capture_stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                torch.autograd.grad(self._loss(), self.params, allow_unused=True)
        torch.cuda.current_stream().wait_stream(side)
        self.forward_graph, self.backward_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        # thread_local: a CUDA call from another thread (a data loader, a logger) does not void the capture
        with torch.cuda.graph(self.forward_graph, stream=side, capture_error_mode="thread_local"):
            static_loss = self._loss()
        self.static_loss = static_loss.detach()
        self.static_grad_loss = torch.empty_like(static_loss)
        with torch.cuda.graph(self.backward_graph, pool=self.forward_graph.pool(), stream=side, capture_error_mode="thread_local"):
            self.static_grads = torch.autograd.grad(static_loss, self.params, grad_outputs=self.static_grad_loss,
                                                    allow_unused=True, materialize_grads=True)
            if self.flat_grads is not None:
                torch._foreach_copy_(self.flat_grads, self.static_grads)
                self.static_grads = self.flat_grads

    def _loss(self) -> torch.Tensor:
        # Autocast's weight-cast cache must be off while capturing: a cached cast would be reused by
        # later replays after the optimizer has changed the weights.
        amp = (torch.autocast("cuda", dtype=self.autocast_dtype, cache_enabled=False) if self.autocast_dtype is not None
               else nullcontext())
        with amp:
            # the class's forward: not a wrapper another library may have put on the instance
            return type(self.model).forward(self.model, input_ids=self.static_ids, labels=self.static_labels,
                                            num_items_in_batch=1).loss

    def matches(self, input_ids: torch.Tensor, labels: torch.Tensor) -> bool:
        """The batch has the captured shape and the weights are where they were when captured."""
        return (input_ids.shape == self.static_ids.shape and labels.shape == self.static_labels.shape
                and input_ids.device == self.static_ids.device and weights_fingerprint(self.model) == self.fingerprint)

    def replay_forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # A gradient still held in a graph's buffer (an earlier micro-batch, or gradients zeroed in place) is
        # copied out before the replay: the forward's scratch memory overlaps the pool's gradient buffers, and
        # the next backward rewrites the flat ones.
        if self.flats is not None and self._grads_are(self.flat_grads):  # summed across micro-batches, still flat
            if self.sums is None:
                self.sums = flat_views(self.params)
            for total, flat in zip(self.sums[0], self.flats):
                total.copy_(flat)
            for p, view in zip(self.params, self.sums[1]):
                p.grad = view
        for p, buffer in zip(self.params, self.static_grads):
            if p.grad is not None and p.grad.data_ptr() == buffer.data_ptr():
                p.grad = p.grad.clone()
        self.static_ids.copy_(input_ids)
        self.static_labels.copy_(labels)
        self.forward_graph.replay()
        return self.static_loss.clone()

    def replay_backward(self, grad_loss: torch.Tensor) -> None:
        """Gradients into `.grad`, accumulated as autograd would. A parameter without a gradient gets
        the graph's buffer itself (no copy of every gradient per step); the next forward replay
        copies it out if it is still there (see `replay_forward`)."""
        self.static_grad_loss.copy_(grad_loss)
        self.backward_graph.replay()
        if self.sums is not None and self._grads_are(self.sums[1]):
            for total, flat in zip(self.sums[0], self.flats):
                total.add_(flat)
            return
        for p, buffer in zip(self.params, self.static_grads):
            if p.grad is None:
                p.grad = buffer
            else:
                p.grad.add_(buffer)

    def _grads_are(self, views: list[torch.Tensor]) -> bool:
        return all(p.grad is not None and p.grad.data_ptr() == v.data_ptr() for p, v in zip(self.params, views))

    def all_reduce_grads(self) -> None:
        """Average the parameters' gradients over the default process group, as DDP does: one
        all-reduce per flat buffer where they lie in one (every captured step), else one per gradient."""
        import torch.distributed as dist

        if self.flats is not None and self._grads_are(self.flat_grads):
            tensors = self.flats
        elif self.sums is not None and self._grads_are(self.sums[1]):
            tensors = self.sums[0]
        else:  # gradients made partly by an eager step: correct, not fast
            tensors = [p.grad for p in self.params if p.grad is not None]
        world = dist.get_world_size()
        for t in tensors:
            dist.all_reduce(t)
            t.div_(world)

    def __call__(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return _Replay.apply(self, input_ids, labels, *self.params)

    def loss(self, input_ids: torch.Tensor, labels: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
        """The model's own loss: the summed loss over `num_items_in_batch` (transformers.Trainer under
        gradient accumulation) or, without it, the mean over the predicted tokens."""
        if num_items_in_batch is None:
            num_items_in_batch = (labels[:, 1:] != -100).sum()
        return self(input_ids, labels) / num_items_in_batch
