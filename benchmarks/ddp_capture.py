"""The captured training step under DDP, timed apart from the trainer, per process of a `torchrun`:

    plain   the forward and backward graphs replayed alone, as one GPU runs them (no copy, no collective)
    after   the backward graph also copies the gradients into flat buffers, averaged by one all-reduce per buffer
            after it (the path of a step with several micro-batches)
    inside  the gradients averaged bucket by bucket inside the backward graph (`GradientBuckets`: the path of a
            step of one micro-batch)

with CUDA events (median of the steps, every process starting each variant together) and, from one profiled
step, the GPU time of the NCCL kernels and of all kernels. The difference between `plain` and the others is
what several GPUs cost the captured step; `attnlab bench scale` measures the whole trainer beside it.

`--nccl-max-ctas N` (repeatable) measures the variants again for each N with the gradients averaged over a
process group whose NCCL communicator runs each collective on at most N CTAs (`ncclConfig_t.maxCTAs`), one SM
each: the NCCL kernels of `inside` share the GPU with the backward's, and fewer of them leave it more SMs. The
first rows are NCCL's own choice (`default`). `plain` has no collective: its rows under each cap show the spread
from one measurement to the next. NCCL_MAX_CTAS in the environment replaces every cap, NCCL's default included,
and NCCL_MAX_NCHANNELS bounds them.

    torchrun --standalone --nproc_per_node 4 benchmarks/ddp_capture.py --model attnlab-2mamba-e [--batch 9 --seq 1024]
    torchrun --standalone --nproc_per_node 2 benchmarks/ddp_capture.py --model attnlab-2mamba-e --nccl-max-ctas 4 --nccl-max-ctas 8
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics

import torch
import torch.distributed as dist

from attnlab.bench.train import add_size_arguments, build_sized
from attnlab.train.graphs import CapturedLoss

VARIANTS = {"plain": dict(flat=False), "after": dict(flat=True), "inside": dict(flat=True, reduce=True)}


def kernel_ms(fn) -> tuple[float, float]:
    """(NCCL kernels' GPU ms, all kernels' GPU ms) of one call of fn."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    nccl = sum(e.device_time for e in events if "nccl" in e.name.lower())
    return round(nccl / 1000, 2), round(sum(e.device_time for e in events) / 1000, 2)


def capped_groups(caps: list[int]) -> dict[int | None, dist.ProcessGroup | None]:
    """{cap: the process group of every process whose collectives run on at most `cap` CTAs}, NCCL's own choice
    (the default group) under None first. NCCL reads the cap only when it creates a communicator: each cap gets a
    group of its own, and a first all-reduce creates its communicator before any capture."""
    groups: dict[int | None, dist.ProcessGroup | None] = {None: None}
    for cap in caps:
        options = dist.ProcessGroupNCCL.Options()
        if not hasattr(options, "config"):  # torch built against NCCL < 2.17, which has no ncclConfig_t
            raise SystemExit("--nccl-max-ctas: this torch's ProcessGroupNCCL.Options has no NCCL config")
        options.config.max_ctas = cap
        groups[cap] = dist.new_group(backend="nccl", pg_options=options)
        dist.all_reduce(torch.zeros(1, device="cuda"), group=groups[cap])
    return groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", help="bench model names (attnlab-2mamba, ...)")
    parser.add_argument("--batch", type=int, default=9)
    parser.add_argument("--seq", type=int, default=1024)
    add_size_arguments(parser)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--nccl-max-ctas", type=int, action="append", default=[], metavar="N",
                        help="also measure with NCCL's collectives on at most N CTAs (repeatable)")
    args = parser.parse_args()
    if any(cap < 1 for cap in args.nccl_max_ctas):  # NCCL refuses the communicator; above its channel limit it caps it
        parser.error("--nccl-max-ctas takes positive values")
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.all_reduce(torch.zeros(1, device="cuda"))  # the communicator exists before any capture
    groups = capped_groups(list(dict.fromkeys(args.nccl_max_ctas)))
    rows = []
    for name in args.model or ["attnlab-2mamba-e"]:
        torch.manual_seed(0)
        model = build_sized(name, args).cuda().train()
        x = torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda")
        for (cap, group), (variant, options) in itertools.product(groups.items(), VARIANTS.items()):
            captured = CapturedLoss(model, x, x, torch.bfloat16, group=group, **options)
            one = torch.ones((), device="cuda")

            def step():
                captured.replay_forward(x, x)
                captured.replay_backward(one)
                if variant == "after":
                    captured.all_reduce_grads()
                for p in captured.params:
                    p.grad = None

            for _ in range(3):
                step()
            times = []
            for _ in range(args.steps):
                dist.barrier()
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                step()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            dist.barrier()
            nccl, kernels = kernel_ms(step)
            ms = torch.tensor([statistics.median(times)], device="cuda")
            gathered = [torch.zeros_like(ms) for _ in range(world)]
            dist.all_gather(gathered, ms)
            rows.append((name, variant, "default" if cap is None else str(cap), [round(t.item(), 2) for t in gathered], nccl, kernels))
            del captured
            torch.cuda.empty_cache()
        del model
    if rank == 0:
        print(f"{'model':22s} {'variant':8s} {'max CTAs':>8s} {'step ms per process':>34s} {'NCCL ms':>8s} {'kernels ms':>11s}  "
              f"({world} processes, {args.batch} x {args.seq} each)")
        for name, variant, cap, ms, nccl, kernels in rows:
            print(f"{name:22s} {variant:8s} {cap:>8s} {' '.join(f'{t:7.2f}' for t in ms):>34s} {nccl:8.2f} {kernels:11.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
