"""The training step under FSDP2 (`fully_shard`, each decoder block and the root) captured as CUDA graphs, apart
from the trainer, per process of a `torchrun`: does it capture, do its gradients equal FSDP's eager step's, and
how long does a replay take against the eager step.

    torchrun --standalone --nproc_per_node 2 benchmarks/fsdp_capture.py --model attnlab-2mamba [--batch 9 --seq 1024]
        [--reshard-after-forward {true,false}] [--deadline 120]

It captures as `attnlab train` does (`CapturedLoss(sharded=True)`: a forward graph, then a backward graph). A
capture that fails prints the whole chain of errors (the first is the cause; CUDA reports the later ones as
"a previous error during capture"). Each process ends itself after `--deadline` seconds: a collective that one
process never joins would otherwise hold the other past any time limit.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist

from attnlab.bench.train import add_size_arguments, build_sized
from attnlab.train.graphs import CapturedLoss


def shard(model, reshard_after_forward: bool):
    from torch.distributed.fsdp import fully_shard

    from attnlab.models import AttnLabBlock

    blocks = [m for m in model.modules() if isinstance(m, AttnLabBlock) or type(m).__name__ == "LlamaDecoderLayer"]
    for block in blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    return model


def eager_grads(model, x, dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
    with torch.autocast("cuda", dtype=dtype):
        loss = model(input_ids=x, labels=x, num_items_in_batch=1).loss
    loss.backward()
    grads = [p.grad.to_local().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def largest_difference(grads: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    """The largest difference of any gradient from its reference, relative to the reference's largest value."""
    return max((g - r).abs().max().item() / (r.abs().max().item() + 1e-12) for g, r in zip(grads, ref))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="attnlab-2mamba")
    parser.add_argument("--batch", type=int, default=9)
    parser.add_argument("--seq", type=int, default=1024)
    add_size_arguments(parser)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--reshard-after-forward", choices=("true", "false"), default="true")
    parser.add_argument("--deadline", type=float, default=120.0)
    args = parser.parse_args()
    threading.Timer(args.deadline, lambda: (print(f"deadline of {args.deadline:g} s passed", flush=True), os._exit(3))).start()
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=args.deadline))
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.all_reduce(torch.zeros(1, device="cuda"))
    torch.manual_seed(0)
    model = build_sized(args.model, args).cuda().train()
    model = shard(model, args.reshard_after_forward == "true")
    x = torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda", generator=torch.Generator("cuda").manual_seed(rank))
    dtype = torch.bfloat16
    label = f"{args.model}, reshard_after_forward={args.reshard_after_forward}"

    # FSDP's eager step: the reference gradients, how far a second eager step's differ from them (kernels with
    # atomics or a split reduction differ from run to run), and its time
    ref_loss, ref = eager_grads(model, x, dtype)
    times, again = [], None
    for _ in range(args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        _, grads = eager_grads(model, x, dtype)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
        again = grads if again is None else again
    eager_ms = statistics.median(times)
    eager_worst = largest_difference(again, ref)
    del again

    try:
        captured = CapturedLoss(model, x, x, dtype, sharded=True)

        def step():
            captured.replay_forward(x, x)
            captured.replay_backward(torch.ones((), device="cuda"))
            return captured.static_loss
    except Exception as err:  # noqa: BLE001 - the chain is the report
        chain = "".join(traceback.format_exception(err, chain=True))
        print(f"[rank {rank}] {label}: capture FAILED\n{chain}", flush=True)
        os._exit(1)  # FSDP's state and the communicator may be unusable after a failed capture: no teardown

    loss = step().clone()
    grads = [p.grad.to_local().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    worst = largest_difference(grads, ref)
    times = []
    for _ in range(args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    replay_ms = statistics.median(times)
    line = (f"[rank {rank}] {label}: captured; loss {loss.item():.6f} against eager {ref_loss.item():.6f}, gradients' "
            f"largest difference {worst:.2e} of each one's largest value (a second eager step's: {eager_worst:.2e}); step {replay_ms:.2f} ms replayed, {eager_ms:.2f} ms "
            f"eager ({args.batch} x {args.seq} per process)\n")
    sys.stdout.write(line)  # one write: the processes' lines do not interleave
    sys.stdout.flush()
    dist.barrier()  # every process done replaying (their collectives pair up) before any leaves
    torch.cuda.synchronize()
    os._exit(0)  # no teardown of the process group; the deadline's timer thread would keep the process alive


if __name__ == "__main__":
    main()
