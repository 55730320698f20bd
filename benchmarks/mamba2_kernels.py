"""Times one Mamba-2 layer's SSD and causal-conv kernels (forward and backward) under the block choices
of `attnlab.models.kernels.mamba2.ssd` and `attnlab.models.kernels.common.conv`, on CUDA, and prints a table.

    python benchmarks/mamba2_kernels.py [--shape 4x4096] [--shape 16x1024]

The layer is the zoo's Mamba-2 at hidden 1024: 16 heads of 128 dims, state 64, one group, conv width 4
over 2048 + 2 * 64 channels, bf16. Each variant sets the modules' constants, then times forward and
backward together (triton.testing.do_bench, median ms); the first row of each table is the committed
choice.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton

from attnlab.models.kernels.common import conv
from attnlab.models.kernels.mamba2 import ssd

HEADS, HEAD_DIM, STATE, KERNEL = 16, 128, 64, 4


def _inputs(batch: int, seq_len: int):
    gen = torch.Generator(device="cuda").manual_seed(0)
    channels = HEADS * HEAD_DIM + 2 * STATE
    xBC = torch.randn(batch, seq_len, channels, device="cuda", generator=gen).bfloat16().requires_grad_()
    dt = (torch.rand(batch, seq_len, HEADS, device="cuda", generator=gen) * 0.1).requires_grad_()
    A = -torch.rand(HEADS, device="cuda", generator=gen) - 0.5
    D = torch.ones(HEADS, device="cuda", requires_grad=True)
    w = torch.randn(channels, KERNEL, device="cuda", generator=gen, requires_grad=True)
    bias = torch.randn(channels, device="cuda", generator=gen, requires_grad=True)
    return xBC, dt, A, D, w, bias


def _ssd_step(xBC, dt, A, D):
    batch, seq_len, _ = xBC.shape
    x, B, C = xBC.split([HEADS * HEAD_DIM, STATE, STATE], dim=-1)
    x, B, C = x.view(batch, seq_len, HEADS, HEAD_DIM), B.view(batch, seq_len, 1, STATE), C.view(batch, seq_len, 1, STATE)
    dy = torch.ones(batch, seq_len, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)

    def step():
        y, _ = ssd.ssd_triton(x, dt, A, B, C, D, 64, None, False)
        y.backward(dy)
    return step


def _conv_step(xBC, w, bias):
    dy = torch.ones_like(xBC)

    def step():
        y, _ = conv.causal_conv1d(xBC, w, bias, None, True)
        y.backward(dy)
    return step


def sweep(shape: str) -> list[tuple[str, str, float]]:
    batch, seq_len = (int(v) for v in shape.split("x"))
    xBC, dt, A, D, w, bias = _inputs(batch, seq_len)
    rows = []
    base = {k: getattr(ssd, k) for k in ("_LOW_PRECISION_STATES", "_STATE_PROGRAMS", "_STATE_WARPS")}
    for low, programs, warps in [(base["_LOW_PRECISION_STATES"], base["_STATE_PROGRAMS"], base["_STATE_WARPS"])] + list(
            itertools.product([False, True], [256, 512, 1024], [4, 2])):
        ssd._LOW_PRECISION_STATES, ssd._STATE_PROGRAMS, ssd._STATE_WARPS = low, programs, warps
        ms = triton.testing.do_bench(_ssd_step(xBC, dt, A, D))
        rows.append(("ssd", f"16-bit states {low}, programs {programs}, warps {warps}", ms))
    for k, v in base.items():
        setattr(ssd, k, v)
    names = ("BWD_BLOCK_T", "BWD_WARPS", "BWD_MIN_PROGRAMS", "DX_BLOCK_T", "DX_WARPS")
    base = {k: getattr(conv, k) for k in names}
    variants = [tuple(base.values())] + list(itertools.product([8, 16, 32], [4, 8], [1024, 4096], [32], [8])) + [
        (base["BWD_BLOCK_T"], base["BWD_WARPS"], base["BWD_MIN_PROGRAMS"], dx_t, dx_w) for dx_t, dx_w in [(64, 8), (32, 4), (16, 4)]]
    for values in variants:
        for k, v in zip(names, values):
            setattr(conv, k, v)
        ms = triton.testing.do_bench(_conv_step(xBC, w, bias))
        rows.append(("conv", ", ".join(f"{k} {v}" for k, v in zip(names, values)), ms))
    for k, v in base.items():
        setattr(conv, k, v)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", help="BATCHxSEQ_LEN (repeatable; default 4x4096)")
    args = parser.parse_args()
    for shape in args.shape or ["4x4096"]:
        print(f"## {shape}: one layer, forward + backward, ms")
        for kind, variant, ms in sweep(shape):
            print(f"{kind:5s} {ms:7.3f}  {variant}")


if __name__ == "__main__":
    main()
