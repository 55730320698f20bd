"""The training step's forward and backward captured as CUDA graphs and replayed.

A training step of a mid-sized model launches thousands of kernels (about 3,000 for the 374M GLA
model at 8 x 2048), and on a fast GPU Python cannot issue them as fast as the GPU runs them: the
step then takes as long as the host needs to issue it, not as long as the kernels take. Captured
once, the forward and the backward each replay with one call. The optimizer, gradient clipping
and the schedule stay eager (a few launches).

What is captured is the summed token loss of one batch shape: the model's forward (under autocast
when the run trains in bf16) and the gradients of every trainable parameter. A batch of another
shape runs eagerly. Capture needs a step free of host synchronisation, so it applies only where
that is known: one process, no gradient checkpointing, and mixers marked `train_graph_safe`
(checked against the eager step on the GPU). `graph_blocker` says why a run stays eager.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn as nn

from attnlab.generation.graphs import weights_fingerprint

WARMUP_STEPS = 3  # forward and backward on a side stream before capture: fla's kernels autotune, the allocator settles


def graph_blocker(model: nn.Module, world_size: int = 1) -> str | None:
    """Why the training step of `model` cannot be captured, or None when it can."""
    from attnlab.models import AttnLabForCausalLM
    from attnlab.models.mixers import Mixer

    if not isinstance(model, AttnLabForCausalLM):
        return f"{type(model).__name__} is not an attnlab model"
    unsafe = sorted({type(m).__name__ for m in model.modules() if isinstance(m, Mixer) and not getattr(m, "train_graph_safe", False)})
    if unsafe:
        return f"mixer {', '.join(unsafe)} is not verified for capture"
    if any(getattr(m, "collect_stats", False) and not getattr(m, "stats_graph_safe", False) for m in model.modules()):
        return "a mixer records statistics during the forward (not verified for capture)"
    if getattr(model, "is_gradient_checkpointing", False):
        return "gradient checkpointing recomputes blocks inside the backward"
    if world_size > 1:
        return "several processes train together (their gradients are reduced between backward passes)"
    if not torch.cuda.is_available() or next(model.parameters()).device.type != "cuda":
        return "the model is not on a CUDA device"
    return None


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
    CUDA graphs. Call it with tensors of that shape; `matches` says whether a batch fits."""

    def __init__(self, model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, autocast_dtype: torch.dtype | None):
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.fingerprint = weights_fingerprint(model)
        self.autocast_dtype = autocast_dtype
        self.static_ids, self.static_labels = input_ids.clone(), labels.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                torch.autograd.grad(self._loss(), self.params, allow_unused=True)
        torch.cuda.current_stream().wait_stream(side)
        self.forward_graph, self.backward_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        # thread_local: a CUDA call from another thread (a data loader, a logger) does not void the capture
        with torch.cuda.graph(self.forward_graph, capture_error_mode="thread_local"):
            static_loss = self._loss()
        self.static_loss = static_loss.detach()
        self.static_grad_loss = torch.empty_like(static_loss)
        with torch.cuda.graph(self.backward_graph, pool=self.forward_graph.pool(), capture_error_mode="thread_local"):
            self.static_grads = torch.autograd.grad(static_loss, self.params, grad_outputs=self.static_grad_loss,
                                                    allow_unused=True, materialize_grads=True)

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
        # The forward's scratch memory overlaps the gradient buffers (both live in the graphs' pool):
        # a gradient still held in a buffer (an earlier micro-batch, or gradients zeroed in place)
        # is copied out before the replay.
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
        for p, buffer in zip(self.params, self.static_grads):
            if p.grad is None:
                p.grad = buffer
            else:
                p.grad.add_(buffer)

    def __call__(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return _Replay.apply(self, input_ids, labels, *self.params)

    def loss(self, input_ids: torch.Tensor, labels: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
        """The model's own loss: the summed loss over `num_items_in_batch` (transformers.Trainer under
        gradient accumulation) or, without it, the mean over the predicted tokens."""
        if num_items_in_batch is None:
            num_items_in_batch = (labels[:, 1:] != -100).sum()
        return self(input_ids, labels) / num_items_in_batch
