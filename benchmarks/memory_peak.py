"""Where a training step's peak GPU memory goes: the tensors alive at the allocator's peak, by the line of
attnlab (or torch) that allocated them.

    python benchmarks/memory_peak.py --model attnlab-2mamba --model attnlab-2mamba+chunked+recompute --shape 1x32768

Each model (`attnlab bench train`'s names: `-eager` runs without CUDA graphs; after the name, `+chunked`: power1 and
power2 layers on the chunked form at any length, `+tiled`: on the tiled kernels at any length (without either: from the
lengths `CHUNKED_MIN_TOKENS` names, as attnlab ships), `+chunkN`: chunks of N tokens (`chunk.CHUNK_SIZES`, and
`chunk.POWER1_SSD_CHUNK` for power1 on the SSD kernels, which take 16 to 128 and run others at 64 with a warning), and
`+recompute`: the chunked form's forward run again in its backward, `chunk.RECOMPUTE_IN_BACKWARD`, `+torch-rotary`: rotary
positions and the feature map in PyTorch, not in attnlab's rotary kernel, `kernels.ROTARY_KERNEL`) takes its warm-up
steps, then
one step under the allocator's history (`torch.cuda.memory._record_memory_history`). The history's
allocations and frees are replayed in order to find the peak; the blocks alive there are summed by the
innermost frame under src/attnlab (else the innermost Python frame), largest first, beside the peaks the
allocator counted. With CUDA graphs the captured step allocates nothing when replayed, so its pool shows
as what the capture left alive (the warm-up's capture runs under the history too).
"""

from __future__ import annotations

import argparse
import collections

import torch

from attnlab.bench.timing import median_time, peak_gib, release
from attnlab.bench.train import build, train_step
from attnlab.models import kernels
from attnlab.models.kernels.attention_family import chunk as chunk_module

DEFAULT_MODELS = ["attnlab-2mamba+tiled", "attnlab-2mamba+chunked", "attnlab-2mamba-eager+chunked", "attnlab-2mamba+chunked+recompute"]


def site(frames: list[dict]) -> str:
    """The innermost frame in attnlab's sources, else the innermost Python frame, as file:line function."""
    python = [f for f in frames if f.get("filename", "").endswith(".py")]
    for frame in python:
        if "/attnlab/" in frame["filename"]:
            return f"{frame['filename'].split('/attnlab/', 1)[1]}:{frame['line']} {frame['name']}"
    if python:
        f = python[0]
        return f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}"
    return "(no Python frame)"


def peak_sites(snapshot: dict, device: int = 0, top: int = 15) -> tuple[int, list[tuple[str, int, int]]]:
    """Replays the trace: (peak bytes in the traced window, [(site, bytes, blocks)] alive at that peak).
    Blocks allocated before the history began count from their segment's state (`snapshot['segments']`)."""
    live: dict[int, tuple[int, str]] = {}
    trace = snapshot["device_traces"][device]
    traced = {e["addr"] for e in trace if e["action"] == "alloc"}
    for segment in snapshot["segments"]:  # what was alive before the window, and still is or is freed in it
        for block in segment["blocks"]:
            if block["state"] == "active_allocated" and block["address"] not in traced:
                live[block["address"]] = (block["size"], site(block.get("frames", [])) + " (before the window)")
    current = sum(size for size, _ in live.values())
    peak, at_peak = current, dict(live)
    for event in trace:
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], site(event.get("frames", [])))
            current += event["size"]
            if current > peak:
                peak, at_peak = current, dict(live)
        elif event["action"] in ("free_completed",) and event["addr"] in live:
            current -= live.pop(event["addr"])[0]
    sums: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for size, where in at_peak.values():
        sums[where][0] += size
        sums[where][1] += 1
    rows = sorted(((where, b, n) for where, (b, n) in sums.items()), key=lambda r: -r[1])
    return peak, rows[:top]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", help="attnlab bench train's names (repeatable)")
    parser.add_argument("--shape", default="1x32768", help="BATCHxSEQ_LEN")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--intermediate", type=int, default=None, help="the MLP's width (default: fla's for --hidden)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    batch, seq_len = (int(n) for n in args.shape.lower().split("x"))
    device = torch.device("cuda")
    chunked_from, chunk_sizes = dict(kernels.CHUNKED_MIN_TOKENS), dict(chunk_module.CHUNK_SIZES)
    ssd_chunk = chunk_module.POWER1_SSD_CHUNK
    for label in args.model or DEFAULT_MODELS:
        name, *variants = label.split("+")
        sizes = [int(v[5:]) for v in variants if v.startswith("chunk") and v[5:].isdigit()]
        if unknown := set(variants) - {"chunked", "tiled", "recompute", "torch-rotary"} - {f"chunk{n}" for n in sizes}:
            parser.error(f"unknown variant {sorted(unknown)} of {label}: +chunked, +tiled, +chunkN, +recompute, +torch-rotary")
        chunk_module.CHUNK_SIZES = {s: sizes[-1] for s in chunk_sizes} if sizes else dict(chunk_sizes)
        chunk_module.POWER1_SSD_CHUNK = sizes[-1] if sizes else ssd_chunk
        if {"chunked", "tiled"} <= set(variants):
            parser.error(f"{label}: +chunked or +tiled, not both")
        forced = 1 if "chunked" in variants else float("inf") if "tiled" in variants else None
        kernels.CHUNKED_MIN_TOKENS = {s: forced for s in chunked_from} if forced else dict(chunked_from)
        chunk_module.RECOMPUTE_IN_BACKWARD = "recompute" in variants
        kernels.ROTARY_KERNEL = "torch-rotary" not in variants
        torch.manual_seed(0)
        release(device)
        model = build(name, args.hidden, args.layers, args.heads, args.vocab, args.intermediate).cuda().train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        x = torch.randint(0, args.vocab, (batch, seq_len), device="cuda")
        step = captured = oom = None
        torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")  # C++ frames: slow to symbolise
        try:
            step, captured = train_step(model, opt, x, capture=not name.endswith("-eager"))
            for _ in range(args.warmup):
                step()
            torch.cuda.synchronize()
            snapshot = torch.cuda.memory._snapshot()
        except torch.cuda.OutOfMemoryError:  # (the exception's frames would hold the step's tensors)
            oom = True
            snapshot = torch.cuda.memory._snapshot()
            print(f"{label} at {args.shape}: out of memory (the trace up to it follows)")
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
        allocated, reserved = peak_gib(device)
        speed = ""
        if step is not None and oom is None:
            step_s, _ = median_time(step, 3, device)
            speed = f", {batch * seq_len / step_s:,.0f} tokens/s"
        peak, rows = peak_sites(snapshot, top=args.top)
        print(f"\n{label} at {args.shape}, CUDA graphs {captured is not None}{speed}: "
              f"allocator peak {allocated} GiB allocated, {reserved} GiB reserved; traced peak {peak / 2**30:.2f} GiB, alive there:")
        for where, size, blocks in rows:
            print(f"  {size / 2**30:8.2f} GiB  {blocks:5d} blocks  {where}")
        del model, opt, x
        step = captured = snapshot = None  # the step's closure holds the model


if __name__ == "__main__":
    main()
