"""The training step's forward and backward captured as CUDA graphs and replayed.

A training step of a mid-sized model launches thousands of kernels (about 3,000 for the 374M GLA
model at 8 x 2048), and on a fast GPU Python cannot issue them as fast as the GPU runs them: the
step then takes as long as the host needs to issue it, not as long as the kernels take. Captured
once, the forward and the backward each replay with one call. The optimizer, gradient clipping
and the schedule stay eager (a few launches).

What is captured is the summed token loss of one batch shape: the model's forward (under autocast
when the run trains in bf16) and the gradients of every trainable parameter. A batch of another
shape runs eagerly. Capture needs a step free of host synchronisation, so it applies only where
that is known: mixers marked `train_graph_safe` (checked against the eager step on the GPU), the HF
causal LMs of `HF_CAPTURABLE` (in `attnlab train`), and
gradient checkpointing only in its non-reentrant form without RNG bookkeeping (`CHECKPOINT_KWARGS`:
the recomputation is then captured inside the backward graph). `graph_blocker` says why a run stays eager.

Under DDP the captured step bypasses DDP's forward (whose hooks reduce gradients during an eager
backward) and does what DDP's reducer does, with the collectives captured: the gradients land in
buckets of about `BUCKET_BYTES` (flat buffers, the parameters in reverse order, as DDP buckets them),
and a bucket is averaged over the processes by an asynchronous NCCL all-reduce as soon as the backward
has written its last gradient, while the backward goes on (`GradientBuckets`; the buckets are launched
in one fixed order on every process, so the collectives match). That applies where each optimizer step
has one micro-batch; with gradient accumulation the micro-batches' gradients are summed in the same
buckets and `CapturedLoss.all_reduce_grads` averages them once per optimizer step, after the last
backward.

Under FSDP (torch's FSDP2, `fully_shard`) the captured forward and backward run FSDP's own hooks: its
all-gathers of each block's parameters and its reduce-scatters of their gradients, on its own streams, are
captured with the compute and replayed with it; a replay leaves each sharded parameter's `.grad` holding
its shard of the averaged gradient, as FSDP's eager backward does. The shards themselves stay where FSDP put
them (the optimizer updates them in place), so the replayed all-gathers read the new weights. The backward
graph reduce-scatters whichever micro-batch it replays, so with gradient accumulation every micro-batch's
shards are reduce-scattered and summed (`replay_backward`), where FSDP's eager step under accelerate's
`no_sync` keeps the whole unsharded gradients until the last: more traffic, less memory, the same sum; the
trainer makes its eager micro-batches (other shapes) do the same. With gradient checkpointing, the
recomputed blocks gather their parameters again inside the backward graph, as FSDP's eager backward does.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
import torch.nn as nn

from attnlab.models import AttnLabForCausalLM
from attnlab.models.mixers import Mixer
from attnlab.models.weights import local_part as local, weights_fingerprint

BUCKET_BYTES = 25 * 2**20  # DDP's default bucket size (bucket_cap_mb=25)
WARMUP_STEPS = 3  # forward and backward on a side stream before capture: fla's kernels autotune, the allocator settles
# How attnlab models checkpoint blocks: non-reentrant (its recomputation runs inside the backward, so it is
# captured with it, and DDP sees each gradient once); no RNG state saved and restored around the recomputation
# (the host reads of the generator's state cannot be captured; attnlab's forwards draw no random numbers).
CHECKPOINT_KWARGS = {"use_reentrant": False, "preserve_rng_state": False}


# HF causal LMs whose training step is verified under capture (the CUDA tests of tests/test_train.py): their
# forward keeps no host-side state and never waits for the GPU with SDPA or eager attention, no attention mask,
# no cache and no dropout.
HF_CAPTURABLE = ("LlamaForCausalLM",)


def graph_blocker(model: nn.Module, sharded: bool = False, hf: bool = False) -> str | None:
    """Why the training step of `model` cannot be captured, or None when it can. `sharded`: FSDP; `hf`: HF
    causal LMs of `HF_CAPTURABLE` may be captured too (`attnlab train` captures them; the benchmarks keep
    their HF peers as HF trains them)."""
    if not isinstance(model, AttnLabForCausalLM):
        # the model's own class: FSDP makes a subclass of it (FSDPLlamaForCausalLM)
        name = next((c.__name__ for c in type(model).__mro__ if c.__name__ in HF_CAPTURABLE), type(model).__name__)
        if not hf or name not in HF_CAPTURABLE:
            return f"{name} is not an attnlab model" + (" nor an HF model verified for capture" if hf else "")
        config = model.config
        attention = getattr(config, "_attn_implementation", None)
        if attention not in ("sdpa", "eager"):
            return f"{name} with {attention} attention is not verified for capture (sdpa and eager are)"
        if any(getattr(config, key, 0) for key in ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop")):
            return f"{name} trains with dropout (not verified for capture)"
        mixers = []
    else:
        mixers = [m for m in model.modules() if isinstance(m, Mixer)]
    unsafe = sorted({type(m).__name__ for m in mixers if not m.train_graph_safe})
    if unsafe:
        return f"mixer {', '.join(unsafe)} is not verified for capture"
    if any(m.collect_stats and not m.stats_graph_safe for m in mixers):
        return "a mixer records statistics during the forward (not verified for capture)"
    if getattr(model, "is_activation_checkpointing", False) and not _checkpoints_capturably(model):
        return f"gradient checkpointing is not in its capturable form ({CHECKPOINT_KWARGS})"
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


def averaging_in(dtype: torch.dtype):
    """A DDP communication hook that averages each bucket in `dtype`: divided by the number of processes, rounded
    to `dtype`, all-reduced and copied back (torch's bf16_compress_hook, which refuses gloo, rounds before it
    divides); the captured step's `GradientBuckets` and `CapturedLoss.all_reduce_grads` do the same arithmetic."""
    import torch.distributed as dist

    def hook(process_group, bucket):
        group = process_group if process_group is not None else dist.group.WORLD
        buffer = bucket.buffer()
        wire = buffer.div(group.size()).to(dtype)
        fut = dist.all_reduce(wire, group=group, async_op=True).get_future()

        def back(fut):
            buffer.copy_(fut.value()[0])
            return buffer
        return fut.then(back)
    return hook


def compressing_gradients(prepare_model, dtype: torch.dtype, say=print):
    """`prepare_model` (accelerate's) whose DDP model averages its gradients in `dtype` in an eager backward."""
    def prepare(*args, **kwargs):
        from torch.nn.parallel import DistributedDataParallel

        model = prepare_model(*args, **kwargs)
        if isinstance(model, DistributedDataParallel) and not getattr(model, "_attnlab_compressed", False):
            model.register_comm_hook(None, averaging_in(dtype))
            model._attnlab_compressed = True
            say(f"gradients averaged over the processes in {str(dtype).removeprefix('torch.')} (train.grad_reduce_dtype)")
        return model
    return prepare


def _checkpoints_capturably(model: nn.Module) -> bool:
    funcs = [getattr(m, "_gradient_checkpointing_func", None) for m in model.modules() if getattr(m, "gradient_checkpointing", False)]
    return bool(funcs) and all(getattr(f, "keywords", {}) == CHECKPOINT_KWARGS for f in funcs)


def bucket_layout(params: list[torch.Tensor], bucket_bytes: int | None) -> list[list[int]]:
    """The parameters' indices grouped into buckets: one per dtype (bucket_bytes None), or, as DDP buckets
    them, the parameters in reverse order (about the order the backward finishes their gradients) cut into
    runs of one dtype and at most `bucket_bytes` (a parameter larger than that alone)."""
    if bucket_bytes is None:
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, p in enumerate(params):
            by_dtype.setdefault(p.dtype, []).append(i)
        return list(by_dtype.values())
    buckets: list[list[int]] = []
    size = 0
    for i in reversed(range(len(params))):
        p = params[i]
        nbytes = p.numel() * p.element_size()
        if not buckets or params[buckets[-1][0]].dtype != p.dtype or (size + nbytes > bucket_bytes and size > 0):
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += nbytes
    return buckets


def flat_views(params: list[torch.Tensor], bucket_bytes: int | None = None,
               dtype: torch.dtype | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One zeroed flat buffer per bucket (`bucket_layout`; in `dtype`, else the bucket's own) and, in them, a
    tensor shaped like each parameter, in the parameters' order: (flats, views)."""
    flats, views = [], [None] * len(params)
    for bucket in bucket_layout(params, bucket_bytes):
        flat = torch.zeros(sum(params[i].numel() for i in bucket), dtype=dtype or params[bucket[0]].dtype,
                           device=params[0].device)
        offset = 0
        for i in bucket:
            views[i] = flat[offset:offset + params[i].numel()].view_as(params[i])
            offset += params[i].numel()
        flats.append(flat)
    return flats, views


class GradientBuckets:
    """Gradients averaged over the processes while the backward that makes them still runs, as DDP's
    reducer does: `flats` (the buckets of `bucket_layout(params, bucket_bytes)`) and `views` (each
    parameter's place in them). Inside `reducing()`, a hook on each parameter writes its gradient, divided
    by the number of processes, into its view; once a bucket is complete, it and every complete bucket
    after it in the fixed order (the same on every process, so the collectives match) are all-reduced
    asynchronously; `reducing()` ends by launching what is left (a parameter without a gradient keeps
    zeros) and making the current stream wait for every all-reduce. Inside a CUDA graph capture the
    all-reduces are captured with the backward and overlap it on replay.

    `reduce_dtype` (bf16, say): the hooks write into buckets of that dtype, which are all-reduced and then
    copied into `flats` (half the traffic of fp32, as DDP's bf16_compress_hook). `group`: the process group they
    are averaged over (None: the default one)."""

    def __init__(self, params: list[torch.Tensor], bucket_bytes: int, reduce_dtype: torch.dtype | None = None, group=None):
        self.params = params
        self.group = group
        self.layout = bucket_layout(params, bucket_bytes)
        self.flats, self.views = flat_views(params, bucket_bytes)
        self.bucket_of = {i: b for b, bucket in enumerate(self.layout) for i in bucket}
        if reduce_dtype is None or all(f.dtype == reduce_dtype for f in self.flats):
            self.wire, self.wire_views = self.flats, self.views
        else:  # the buckets as sent, in reduce_dtype, copied into `flats` once averaged
            self.wire, self.wire_views = flat_views(params, bucket_bytes, dtype=reduce_dtype)

    @contextmanager
    def reducing(self):
        import torch.distributed as dist

        world = dist.get_world_size(self.group)
        missing = [len(bucket) for bucket in self.layout]
        written = [False] * len(self.params)
        works, launched = [], 0

        def launch_ready():
            nonlocal launched
            while launched < len(self.layout) and missing[launched] == 0:
                works.append(dist.all_reduce(self.wire[launched], group=self.group, async_op=True))
                launched += 1

        def hook(i):
            def write(grad):
                if written[i]:  # a leaf's hook fires once per backward, with its summed gradient
                    raise RuntimeError(f"the gradient of parameter {i} arrived twice in one backward")
                written[i] = True
                if self.wire_views[i].dtype == grad.dtype:
                    torch.div(grad, world, out=self.wire_views[i])
                else:  # the average of the gradients in reduce_dtype: divided before rounding, as DDP's hook does
                    self.wire_views[i].copy_(grad.div(world))
                missing[self.bucket_of[i]] -= 1
                launch_ready()
                return grad
            return write

        handles = [p.register_hook(hook(i)) for i, p in enumerate(self.params)]
        try:
            yield self
            for i, done in enumerate(written):
                if not done:  # no gradient: zeros, as materialize_grads gives
                    self.wire_views[i].zero_()
                    missing[self.bucket_of[i]] -= 1
            launch_ready()
            for work in works:
                work.wait()
            if self.wire is not self.flats:
                for flat, wire in zip(self.flats, self.wire):
                    flat.copy_(wire)
        finally:
            for handle in handles:
                handle.remove()


def fsdp_gather_streams(model: nn.Module) -> list:
    """The streams FSDP2 gathers parameters on (each module's `_comm_ctx`: the copy-in and the all-gather stream)."""
    streams = {}
    for module in model.modules():
        state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
        ctx = getattr(state, "_comm_ctx", None)
        if state is not None and ctx is None:
            raise RuntimeError("this torch's FSDP2 keeps its streams elsewhere (no _comm_ctx): not verified for capture")
        for name in ("all_gather_copy_in_stream", "all_gather_stream"):
            stream = getattr(ctx, name, None)
            if stream is not None:
                streams[id(stream)] = stream
    return list(streams.values())


@contextmanager
def class_forward(module: nn.Module):
    """`module` called through its hooks, but with its class's forward: a forward another library put on the
    instance (accelerate's autocast wrapper) is set aside meanwhile."""
    instance = module.__dict__.pop("forward", None)
    try:
        yield module
    finally:
        if instance is not None:
            module.forward = instance


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
    `flat`: the gradients land in flat buffers (`all_reduce_grads` reduces them over processes); `reduce`:
    the backward graph itself averages them over the processes, bucket by bucket while it runs
    (`GradientBuckets`), for steps of one micro-batch; `reduce_dtype`: the dtype they are averaged in; `group`: the
    process group they are averaged over (None: the default one).

    `sharded`: `model` is the root of an FSDP2 model (`fully_shard`). Forward and backward then run through its
    hooks (the module called, `.backward()` rather than `torch.autograd.grad`): the gradients the backward graph
    leaves are FSDP's reduce-scattered shards, already averaged."""

    def __init__(self, model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, autocast_dtype: torch.dtype | None,
                 flat: bool = False, reduce: bool = False, reduce_dtype: torch.dtype | None = None, group=None,
                 sharded: bool = False):
        if sharded and (flat or reduce or reduce_dtype is not None):
            raise ValueError("under FSDP the gradients are FSDP's reduce-scattered shards: no flat buffers, no averaging of our own")
        self.model = model
        self.sharded = sharded
        self._resharded()
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.reduce_dtype = reduce_dtype  # the dtype the processes average their gradients in (None: their own)
        self.group = group
        # an HF model (HF_CAPTURABLE) would otherwise fill a key-value cache nobody reads
        self.forward_extra = {} if isinstance(model, AttnLabForCausalLM) else {"use_cache": False}
        # flat: the backward graph's gradients and, across micro-batches, their sums live in flat buffers
        self.buckets = GradientBuckets(self.params, BUCKET_BYTES, reduce_dtype, group) if reduce else None
        self.bucket_bytes = BUCKET_BYTES if reduce else None
        if self.buckets is not None:
            self.flats, self.flat_grads = self.buckets.flats, self.buckets.views
        else:
            self.flats, self.flat_grads = flat_views(self.params) if flat else (None, None)
        self.reduced = False  # the gradients in .grad are the backward graph's, already averaged over the processes
        self.sums: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None  # (flats, views), made on first accumulation
        self.shard_sums: list[torch.Tensor] | None = None  # under FSDP: the shards' sums across micro-batches, made on first use
        self.fingerprint = weights_fingerprint(model)
        self.autocast_dtype = autocast_dtype
        self.static_ids, self.static_labels = input_ids.clone(), labels.clone()
        side = capture_stream()
        side.wait_stream(torch.cuda.current_stream())
        if sharded:  # FSDP's backward adds into .grad: the step's gradients so far are set aside, given back after capture
            held = [p.grad for p in self.params]
            self._set_grads([None] * len(self.params))
            # the backward graph always reduce-scatters, whichever micro-batch of a step it is captured in (one
            # under accelerate's no_sync included): the trainer then reduce-scatters every micro-batch
            model.set_requires_gradient_sync(True)
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                if sharded:
                    self._loss().backward()
                    self._set_grads([None] * len(self.params))
                else:
                    torch.autograd.grad(self._loss(), self.params, allow_unused=True)
        torch.cuda.current_stream().wait_stream(side)
        self.forward_graph, self.backward_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        # thread_local: a CUDA call from another thread (a data loader, a logger) does not void the capture
        with torch.cuda.graph(self.forward_graph, stream=side, capture_error_mode="thread_local"):
            static_loss = self._loss()
        self.static_loss = static_loss.detach()
        self.static_grad_loss = torch.empty_like(static_loss)
        with torch.cuda.graph(self.backward_graph, pool=self.forward_graph.pool(), stream=side, capture_error_mode="thread_local"):
            if sharded:
                # FSDP makes its gathering streams wait on the compute stream in the root's forward only: the
                # backward graph's first all-gathers would otherwise run outside the capture
                for stream in fsdp_gather_streams(self.model):
                    stream.wait_stream(side)
                static_loss.backward(self.static_grad_loss)
            else:
                with self.buckets.reducing() if self.buckets is not None else nullcontext():
                    self.static_grads = torch.autograd.grad(static_loss, self.params, grad_outputs=self.static_grad_loss,
                                                            allow_unused=True, materialize_grads=True)
                if self.buckets is None and self.flat_grads is not None:
                    torch._foreach_copy_(self.flat_grads, self.static_grads)
        if sharded:
            missing = [i for i, p in enumerate(self.params) if p.grad is None]
            if missing:
                raise RuntimeError(f"FSDP left no gradient for {len(missing)} parameters in the captured backward")
            self.static_grads = [p.grad for p in self.params]
            self._set_grads(held)
        elif self.flat_grads is not None:
            self.static_grads = self.flat_grads

    def _set_grads(self, grads: list) -> None:
        for p, g in zip(self.params, grads):
            p.grad = g

    def _loss(self) -> torch.Tensor:
        # Autocast's weight-cast cache must be off while capturing: a cached cast would be reused by
        # later replays after the optimizer has changed the weights.
        amp = (torch.autocast("cuda", dtype=self.autocast_dtype, cache_enabled=False) if self.autocast_dtype is not None
               else nullcontext())
        with amp:
            if self.sharded:  # through the module's hooks (FSDP's gathers), with the class's forward
                with class_forward(self.model):
                    return self.model(input_ids=self.static_ids, labels=self.static_labels, num_items_in_batch=1,
                                      **self.forward_extra).loss
            # the class's forward: not a wrapper another library may have put on the instance
            return type(self.model).forward(self.model, input_ids=self.static_ids, labels=self.static_labels,
                                            num_items_in_batch=1, **self.forward_extra).loss

    def _resharded(self) -> None:
        """FSDP's root keeps its parameters gathered after a forward (its reshard_after_forward is off): after one
        outside the graphs (an evaluation), they are sharded again, so that the model holds the shards the graphs read."""
        if self.sharded:
            self.model.reshard()

    def matches(self, input_ids: torch.Tensor, labels: torch.Tensor) -> bool:
        """The batch has the captured shape and the weights are where they were when captured."""
        self._resharded()
        return (input_ids.shape == self.static_ids.shape and labels.shape == self.static_labels.shape
                and input_ids.device == self.static_ids.device and weights_fingerprint(self.model) == self.fingerprint)

    def replay_forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # A gradient still held in a graph's buffer (an earlier micro-batch, or gradients zeroed in place) is
        # copied out before the replay: the forward's scratch memory overlaps the pool's gradient buffers, and
        # the next backward rewrites the flat ones.
        if self.flats is not None and self._grads_are(self.flat_grads):  # summed across micro-batches, still flat
            if self.sums is None:
                self.sums = flat_views(self.params, self.bucket_bytes)
            for total, flat in zip(self.sums[0], self.flats):
                total.copy_(flat)
            for p, view in zip(self.params, self.sums[1]):
                p.grad = view
        if self.sharded and self._grads_are(self.static_grads):  # the last replay's shards, still in .grad
            if self.shard_sums is None:
                self.shard_sums = [g.clone() for g in self.static_grads]
            else:  # one copy for every shard, on their local tensors (no DTensor dispatch per gradient)
                torch._foreach_copy_([local(t) for t in self.shard_sums], [local(g) for g in self.static_grads])
            self._set_grads(self.shard_sums)
        for p, buffer in zip(self.params, self.static_grads):
            if p.grad is not None and local(p.grad).data_ptr() == local(buffer).data_ptr():
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
        self.reduced = False
        if self.sums is not None and self._grads_are(self.sums[1]):
            for total, flat in zip(self.sums[0], self.flats):
                total.add_(flat)
            return
        if self.shard_sums is not None and self._grads_are(self.shard_sums):  # FSDP, a later micro-batch of the step
            torch._foreach_add_([local(t) for t in self.shard_sums], [local(g) for g in self.static_grads])
            self.reduced = True
            return
        for p, buffer in zip(self.params, self.static_grads):
            if p.grad is None:
                p.grad = buffer
            else:
                p.grad.add_(buffer)
        self.reduced = self.sharded or (self.buckets is not None and self._grads_are(self.flat_grads))

    def _grads_are(self, views: list[torch.Tensor] | None) -> bool:
        return views is not None and all(p.grad is not None and local(p.grad).data_ptr() == local(v).data_ptr()
                                         for p, v in zip(self.params, views))

    def all_reduce_grads(self) -> None:
        """Average the parameters' gradients over `group` (None: the default process group), as DDP does: one
        all-reduce per flat buffer where they lie in one (every captured step), else one per gradient."""
        import torch.distributed as dist

        if self.reduced:  # the backward graph averaged them (a sum of averages would be averaged again, harmlessly)
            return
        if self.flats is not None and self._grads_are(self.flat_grads):
            tensors = self.flats
        elif self.sums is not None and self._grads_are(self.sums[1]):
            tensors = self.sums[0]
        else:  # gradients made partly by an eager step: correct, not fast
            tensors = [p.grad for p in self.params if p.grad is not None]
        world = dist.get_world_size(self.group)
        for t in tensors:
            if self.reduce_dtype is not None and t.is_floating_point() and t.dtype != self.reduce_dtype:
                wire = t.div(world).to(self.reduce_dtype)  # divided, then rounded: as the buckets and the eager hook do
                dist.all_reduce(wire, group=self.group)
                t.copy_(wire)
            else:
                dist.all_reduce(t, group=self.group)
                t.div_(world)

    def __call__(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return _Replay.apply(self, input_ids, labels, *self.params)

    def loss(self, input_ids: torch.Tensor, labels: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
        """The model's own loss: the summed loss over `num_items_in_batch` (transformers.Trainer under
        gradient accumulation) or, without it, the mean over the predicted tokens."""
        if num_items_in_batch is None:
            num_items_in_batch = (labels[:, 1:] != -100).sum()
        return self(input_ids, labels) / num_items_in_batch
