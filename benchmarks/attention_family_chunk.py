"""The crossover between the attention family's tiled quadratic kernels and its chunked, linear-time form
(`attnlab.models.kernels.attention_family.chunk`), on CUDA: forward and backward of one layer's token mixing
at the zoo's shapes, for the three linearizable presets the issue tables (their options as `mixing_function`
sees them), and the chunked form under several chunk sizes.

    python benchmarks/attention_family_chunk.py [--shape 4x4096 ...] [--heads 16] [--head-dim 64]

Prints, per preset and shape, the median ms of forward + backward (gradients of q, k, v and the log-decays)
and the peak memory beyond the inputs, tiled and chunked, and the ratio (and, for power2, the default chunk with
its state's products with the features formed in memory for cuBLAS, `POWER2_STATE_KERNELS` off; for power1,
whose chunks run on the SSD kernels,
the chunks of PyTorch's products it ran on before, `power1_on_ssd` off); `CHUNKED_MIN_TOKENS`
(`attnlab.models.kernels`) is the shortest T where chunked wins, `CHUNK_SIZES` the fastest chunk size.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
from unittest import mock

import torch
import torch.nn.functional as F

from attnlab.bench.timing import median_time, release
from attnlab.models.kernels.attention_family import chunk as chunk_module
from attnlab.models.kernels.attention_family import power2_states
from attnlab.models.kernels.attention_family.parallel import attention_terms as tiled_terms
from attnlab.models.mixers import MIXERS
from attnlab.models.mixers.attention_family import mixing_denominator
from attnlab.models.ops.attention_family import apply_feature_map, log_decay_cumsum, parallel_attention

PRESETS = ("2mamba", "linear__output_norm", "linear_elu")
SHAPES = ("16x1024", "8x2048", "4x4096", "2x8192", "1x16384", "1x32768", "1x65536")
CHUNKS = {"power1": (32, 64, 128), "power2": (128, 256, 512)}  # power1: on the SSD kernels (16 to 128)
SIZES = (32, 64, 128, 256, 512)


def inputs(options, batch, seq_len, heads, head_dim):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(batch, seq_len, heads, head_dim, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(3))
    q, k = apply_feature_map(q, options["feature_map"]), apply_feature_map(k, options["feature_map"])
    log_decay = None
    if options["decay"] != "none":
        log_decay = -F.softplus(torch.randn(batch, seq_len, heads, device="cuda", generator=gen))
    return [t.requires_grad_() for t in (q, k, v, log_decay) if t is not None]


def timed(fn, leaves, repeats):
    """(median ms of forward + backward, peak GiB beyond the inputs), or (None, reason)."""
    release(torch.device("cuda"))
    try:
        with torch.no_grad():
            grad_out = torch.randn_like(fn(*leaves))
        step = lambda: torch.autograd.grad(fn(*leaves), leaves, grad_out)  # noqa: E731
        step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        seconds, _ = median_time(step, repeats, torch.device("cuda"))
        return seconds * 1000, (torch.cuda.max_memory_allocated() - before) / 2**30
    except torch.cuda.OutOfMemoryError:
        return None, "out of memory"
    except Exception as exc:  # noqa: BLE001  (a kernel that does not compile or run: its cell says so, the rest go on)
        return None, type(exc).__name__


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", help="BATCHxSEQ_LEN (repeatable)")
    parser.add_argument("--preset", action="append", help="a linearizable attention-family preset (repeatable)")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tiled-up-to", type=int, default=65536, help="time the tiled kernels up to this T only")
    parser.add_argument("--sweep", action="store_true", help="instead: 2mamba at the first --shape (default 1x65536) under "
                        "each block choice of power2's state kernels in SWEEP (power2_states' BANDED, KEEP_STATES, CHUNK_FIRSTS, "
                        "blocks and warps) and chunk size")
    parser.add_argument("--profile", action="store_true", help="instead: the kernels of 2mamba's chunked mixing (forward + "
                        "backward) at the first --shape, by GPU time (torch.profiler), and the chunked form's Python time")
    parser.add_argument("--bare", action="store_true", help="instead: 2mamba's chunked mixing forward + backward at the "
                        "first --shape twice, nothing else (for Nsight Compute: gpu.sh's chunk-ncu stage)")
    args = parser.parse_args()
    if args.bare:
        return bare(args)
    if args.sweep:
        return sweep(args)
    if args.profile:
        return profile(args)
    print(f"{'preset':22s} {'shape':>8s} {'tiled ms':>9s} {'GiB':>6s} " + " ".join(f"{'chunk ' + str(c):>14s}" for c in SIZES)
          + f" {'best/tiled':>10s}")
    for preset in args.preset or PRESETS:
        options = MIXERS[preset].resolve_options(None)
        similarity = options["similarity"]
        denominator = mixing_denominator(options)
        scale = args.head_dim**-0.5
        count_power = None
        if denominator == "count_power":
            count_power = torch.sigmoid(torch.full((args.heads,), 0.5, device="cuda"))

        def tiled(q, k, v, log_decay=None):
            c = log_decay_cumsum(log_decay)
            return parallel_attention(q, k, v, similarity=similarity, scale=scale, denominator=denominator, count_power=count_power,
                                      query_log_decay=c, key_log_decay=c, terms=tiled_terms, out_dtype=v.dtype)

        for spec in args.shape or SHAPES:
            batch, seq_len = (int(x) for x in spec.split("x"))
            leaves = inputs(options, batch, seq_len, args.heads, args.head_dim)
            tiled_ms, tiled_gib = timed(tiled, leaves, args.repeats) if seq_len <= args.tiled_up_to else (None, "skipped")
            cells, best = [], None
            for size in SIZES:
                if size not in CHUNKS[similarity]:
                    cells.append(f"{'':>14s}")
                    continue

                def chunked(q, k, v, log_decay=None, size=size):
                    return chunk_module.chunk_attention(q, k, v, log_decay, similarity=similarity, scale=scale, denominator=denominator,
                                                        count_power=count_power, intra_terms=tiled_terms, out_dtype=v.dtype,
                                                        chunk_size=size)[0]

                ms, gib = timed(chunked, leaves, args.repeats)
                cells.append(f"{ms:8.2f} {gib:5.2f}" if ms is not None else f"{gib:>14s}")
                if ms is not None and (best is None or ms < best):
                    best = ms
            def beside(label, name, value, size, module=chunk_module):  # the chunked form at one chunk size, <name> = value
                with mock.patch.object(module, name, value):
                    ms, gib = timed(functools.partial(chunked, size=size), leaves, args.repeats)
                return f"  {label}: {ms:.2f} ms {gib:.2f} GiB" if ms is not None else f"  {label}: {gib}"

            if similarity == "power2":  # the features formed in memory for cuBLAS, as before the state kernels
                size = chunk_module.CHUNK_SIZES["power2"]
                variant = (beside("features in memory", "POWER2_STATE_KERNELS", False, size)
                           + beside("the chunks' shares in fp32", "SHARES_16BIT", False, size, power2_states))
            else:  # power1 in the chunks of PyTorch's products that ran before the SSD kernels took it
                variant = beside("PyTorch chunks", "power1_on_ssd", lambda q: False, chunk_module.CHUNK_SIZES["power1"])
            tiled_cell = f"{tiled_ms:9.2f} {tiled_gib:6.2f}" if tiled_ms is not None else f"{tiled_gib:>16s}"
            ratio = f"{best / tiled_ms:10.2f}" if best is not None and tiled_ms is not None else f"{'':>10s}"
            print(f"{preset:22s} {spec:>8s} {tiled_cell} " + " ".join(cells) + f" {ratio}{variant}", flush=True)
            del leaves


def profile(args) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    batch, seq_len = (int(x) for x in (args.shape or ["1x32768"])[0].split("x"))
    options = MIXERS["2mamba"].resolve_options(None)
    leaves = inputs(options, batch, seq_len, args.heads, args.head_dim)

    def step():
        out = chunk_module.chunk_attention(*leaves, similarity="power2", scale=args.head_dim**-0.5, denominator="sum",
                                           intra_terms=tiled_terms, out_dtype=leaves[2].dtype)[0]
        torch.autograd.grad(out, leaves, torch.ones_like(out))

    step()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    print(f"2mamba's chunked mixing at {batch}x{seq_len}, {args.heads} heads of {args.head_dim}: forward + backward")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))


def sweep(args) -> None:
    batch, seq_len = (int(x) for x in (args.shape or ["1x65536"])[0].split("x"))
    options = MIXERS["2mamba"].resolve_options(None)
    leaves = inputs(options, batch, seq_len, args.heads, args.head_dim)
    print(f"2mamba's mixing at {batch}x{seq_len} on power2's state kernels, forward + backward ms, per block choice and "
          "chunk (the first: the committed blocks; the others change what they name), and the largest difference of its "
          "output and gradients from the committed blocks' (relative to each tensor's largest entry)")
    choices = [({}, 512), ({}, 1024)] + [(change, 512) for change in SWEEP]
    committed = None
    for change, size in choices:
        def mix(q, k, v, log_decay, size=size):
            return chunk_module.chunk_attention(q, k, v, log_decay, similarity="power2", scale=args.head_dim**-0.5,
                                                denominator="sum", intra_terms=tiled_terms, out_dtype=v.dtype,
                                                chunk_size=size)[0]

        with contextlib.ExitStack() as stack:
            for name, value in change.items():
                if name == "INTRA":  # the chunks' own (tiled) kernels' power2 block shapes, parallel.BLOCKS
                    stack.enter_context(intra_blocks(value))
                else:
                    stack.enter_context(mock.patch.object(power2_states, name, value))
            ms, gib = timed(mix, leaves, args.repeats)
            if ms is not None:
                got = results(mix, leaves)
                committed = committed or got
                cell = f"{ms:8.2f} ms {gib:5.2f} GiB  differs by {differences(got, committed):.1e}"
            else:
                cell = f"fails ({gib})"
        print(f"{cell}  chunk {size}" + "".join(f", {n} {v}" for n, v in change.items()), flush=True)


@contextlib.contextmanager
def intra_blocks(shapes: dict):
    """The tiled kernels on other (BLOCK_M, BLOCK_N, warps, stages) for power2 (`parallel.BLOCKS[kernel][2]`): they
    launch on the shape BLOCKS gives at each call."""
    from attnlab.models.kernels.attention_family import parallel

    blocks = {kernel: {**sims, **({2: shapes[kernel]} if kernel in shapes else {})} for kernel, sims in parallel.BLOCKS.items()}
    with mock.patch.object(parallel, "BLOCKS", blocks):
        yield


def bare(args) -> None:
    """2mamba's chunked mixing, forward and backward, twice and nothing else: for a profiler outside the process
    (Nsight Compute), the second one measured."""
    batch, seq_len = (int(x) for x in (args.shape or ["1x32768"])[0].split("x"))
    leaves = inputs(MIXERS["2mamba"].resolve_options(None), batch, seq_len, args.heads, args.head_dim)
    for _ in range(2):
        out = chunk_module.chunk_attention(*leaves, similarity="power2", scale=args.head_dim**-0.5, denominator="sum",
                                           intra_terms=tiled_terms, out_dtype=leaves[2].dtype)[0]
        torch.autograd.grad(out, leaves, torch.ones_like(out))
        torch.cuda.synchronize()


def results(fn, leaves):
    """fn's output and the gradients of its leaves for a fixed random output gradient, in fp32."""
    out = fn(*leaves)
    grad_out = torch.randn(out.shape, device=out.device, dtype=out.dtype,
                           generator=torch.Generator(device=out.device).manual_seed(1))
    return [out.detach().float(), *(g.float() for g in torch.autograd.grad(out, leaves, grad_out))]


def differences(got, reference) -> float:
    """The largest difference of any of these tensors from its reference, over the reference's largest entry."""
    return max(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() for a, b in zip(got, reference))


# power2_states' block choices that `--sweep` times beside the committed ones
SWEEP = [
    {"SPLIT_MIN_WIDTH": 16},  # every band of the chunk kernel one product per first index
    {"SPLIT_MIN_WIDTH": 128},  # no band: the first indices' features side by side as one operand
    {"PREFETCH": False},  # the loads that feed no product waited for where they are used
    {"STEPPED_ROWS": True},  # dq's and dkdv's full rows found from the last ones
    {"STATE_ROWS": 64},
    {"CHUNK_FIRSTS": 2},
    {"PASS_ROWS": 64, "PASS_WARPS": 8},
    {"TOKEN_ROWS": 128, "TOKEN_WARPS": 8},  # the token kernels on blocks of 128 tokens
    {"BANDED": True},  # the output and dv in bands
    {"KEEP_STATES": False},  # the backward walks the forward's states again
    {"INTRA": {"dq": (128, 64, 8, 3)}},  # the chunks' own parts on other block shapes (BLOCK_M, BLOCK_N, warps, stages)
    {"INTRA": {"fwd": (128, 64, 4, 3)}},
]


if __name__ == "__main__":
    main()
