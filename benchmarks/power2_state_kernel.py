"""Times power2's prompt-state kernel (`attnlab.models.kernels.attention_family.step.linear_state_update`,
the d(d + 1) / 2 x d state of a 2mamba layer after its prompt) under several block choices, on CUDA.

    python benchmarks/power2_state_kernel.py

The shape is the decode benchmark's: 8 rows of 2048 tokens, 16 heads of 64, a decay, bf16 keys and values,
the packed state with its normaliser. Each variant sets the module's constants and is timed with
triton.testing.do_bench (median ms); the first row is the committed choice.
"""

from __future__ import annotations

import itertools

import torch
import triton

from attnlab.models.kernels.attention_family import step as step
from attnlab.models.ops.attention_family import log_decay_cumsum


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    batch, seq_len, heads, d = 8, 2048, 16, 64
    k = torch.randn(batch, seq_len, heads, d, device="cuda", generator=gen).bfloat16()
    v = torch.randn(batch, seq_len, heads, d, device="cuda", generator=gen).bfloat16()
    c = log_decay_cumsum(-torch.rand(batch, seq_len, heads, device="cuda", generator=gen) * 0.01)
    kwargs = {"similarity": "power2", "scale": d**-0.5, "packed": True, "want_normalizer": True}
    names = ("STATE_FEATURE_ROWS", "STATE_BLOCK_T", "STATE_WARPS")
    base = tuple(getattr(step, n) for n in names)
    flops = 2 * batch * heads * d * d * d * seq_len  # every (a, b) row is multiplied, the packed ones stored
    print("one layer's prompt state, ms (TFLOP/s)")
    for values in [base] + list(itertools.product([64, 128, 256, 512], [32, 64], [4, 8])):
        for n, val in zip(names, values):
            setattr(step, n, val)
        try:
            ms = triton.testing.do_bench(lambda: step.linear_state_update(k, v, c, None, None, **kwargs))
            print(f"{ms:7.3f} ({flops / ms / 1e9:5.0f})  " + ", ".join(f"{n} {val}" for n, val in zip(names, values)))
        except Exception as exc:  # a block shape that does not fit: say so and go on
            print(f"  fails: {type(exc).__name__}  " + ", ".join(f"{n} {val}" for n, val in zip(names, values)))
    for n, val in zip(names, base):
        setattr(step, n, val)


if __name__ == "__main__":
    main()
