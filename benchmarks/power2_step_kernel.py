"""Times power2's decoding step (`attnlab.models.kernels.attention_family.step.attention_family_step_`)
of one 2mamba layer on CUDA: the step that rewrites the state (its committed blocks), then the windowed
step (the state read, a window of recent tokens attended to and folded in once per window) under
several choices of its read kernel's blocks.

    python benchmarks/power2_step_kernel.py

The shape is the decode benchmark's: 8 rows, 16 heads of 64, a decay, bf16 q, k and v, the packed
state (fp32, then bf16) with its normaliser. Each variant sets the module's constants and runs 4
windows of steps back to back (the folds included), timed with CUDA events: microseconds per step and
the state's bytes per step over that time (read once for the windowed step, read and written otherwise).
"""

from __future__ import annotations

import itertools

import torch

from attnlab.models.kernels.attention_family import step as step
from attnlab.models.ops.attention_family import RECENT_TOKENS, linear_feature_count, new_recent


def time_steps(state, normalizer, recent, inputs, steps: int) -> float:
    """Microseconds per step: `steps` steps captured as one CUDA graph (so the host's work per call is
    not timed), replayed three times."""
    kwargs = {"similarity": "power2", "scale": 64**-0.5, "denominator": "sum", "packed": True, "recent": recent,
              "decay_fn": "neg_softplus"}
    count = torch.ones(state.shape[0], dtype=torch.long, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile, warm
        for i in range(2):
            step.attention_family_step_(*inputs[i], state, normalizer, count, **kwargs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(steps):
            step.attention_family_step_(*inputs[i % len(inputs)], state, normalizer, count, **kwargs)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    torch.cuda.synchronize()
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (3 * steps)


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    batch, heads, d = 8, 16, 64
    features = linear_feature_count(d, "power2", packed=True)
    inputs = [tuple(torch.randn(batch, heads, d, device="cuda", generator=gen).bfloat16() for _ in range(3))
              + (torch.randn(batch, heads, device="cuda", generator=gen),) for _ in range(16)]
    names = ("READ_PROGRAMS", "READ_BLOCK_ROWS", "READ_WARPS")
    base = tuple(getattr(step, n) for n in names)
    steps = 2 * RECENT_TOKENS
    print("one layer's step, microseconds (state GB/s)")
    for dtype in (torch.float32, torch.bfloat16):
        state = torch.randn(batch, heads, features, d, device="cuda", generator=gen).to(dtype) * 0.01
        normalizer = torch.rand(batch, heads, features, device="cuda", generator=gen)
        for windowed, values in [(False, base)] + [(True, v) for v in [base] + list(itertools.product([8, 16, 32], [32, 64, 128], [2, 4, 8]))]:
            for n, val in zip(names, values):
                setattr(step, n, val)
            recent = new_recent(torch.zeros(batch, 1, heads, d, device="cuda", dtype=torch.bfloat16),
                                torch.zeros(batch, 1, heads, d, device="cuda", dtype=torch.bfloat16)) if windowed else None
            try:
                us = time_steps(state, normalizer, recent, inputs, steps)
            except Exception as exc:  # a block shape that does not fit: say so and go on
                print(f"  fails: {type(exc).__name__}  " + ", ".join(f"{n} {val}" for n, val in zip(names, values)))
                continue
            moved = (state.numel() * state.element_size() + normalizer.numel() * 4) * (1 if windowed else 2)
            label = "windowed" if windowed else "in place"
            print(f"{us:8.1f} ({moved / us / 1e3:6.0f})  {str(dtype)[6:]:9s} {label:9s} " +
                  ", ".join(f"{n} {val}" for n, val in zip(names, values)))
    for n, val in zip(names, base):
        setattr(step, n, val)


if __name__ == "__main__":
    main()
