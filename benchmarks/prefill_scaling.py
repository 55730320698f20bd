"""Prefill time against prompt length through the engine, on CUDA: one prompt of each length (1K to 64K tokens
by default) given to the generation engine for one new token, on the decode benchmark's model (hidden 1024,
20 layers, 16 heads, 32K vocabulary, bf16, untrained). Issue 36 asks for a 65,536-token prompt's prefill in
time linear in its length: 1K to 64K within 1.2x of proportional.

    python benchmarks/prefill_scaling.py --arch attnlab-2mamba --arch attnlab-linear__output_norm

Prints, per model and length, the median ms (prefill and the one step after it), the ms per 1K tokens, the
time over the time at the shortest length scaled by the length (1.00: proportional) and over the length
before it, doubled; then the 64K figure against 1.2.
"""

from __future__ import annotations

import argparse

import torch

from attnlab.bench.decode import IdTokenizer, _engine, _timed
from attnlab.bench.timing import release
from attnlab.bench.train import build

LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768, 65536)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", action="append", help="attnlab-<mixer> or hf-llama, as `attnlab bench decode --arch` "
                        "(repeatable; default attnlab-2mamba)")
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="prompt lengths, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    lengths = [int(x) for x in args.lengths.split(",")]
    device = torch.device("cuda")
    tokenizer = IdTokenizer(32000)
    print(f"{'model':30s} {'tokens':>7s} {'ms':>9s} {'ms/1K':>7s} {'vs first':>9s} {'vs last x2':>10s}", flush=True)
    for arch in args.arch or ["attnlab-2mamba"]:
        torch.manual_seed(0)
        lm = build(arch, 1024, 20, 16, 32000).to(device, torch.bfloat16).eval()
        first = last = None
        for length in lengths:
            prompt = [torch.randint(1, 32000, (length,)).tolist()]
            release(device)
            try:
                with torch.no_grad():
                    ms = 1000 * _timed(lambda: _engine(lm, tokenizer, prompt, 1), lambda: _engine(lm, tokenizer, prompt, 1),
                                       device, args.repeats)
            except torch.cuda.OutOfMemoryError:
                print(f"{arch:30s} {length:>7d} {'out of memory':>9s}", flush=True)
                break
            first = first or (length, ms)
            vs_first = ms / (first[1] * length / first[0])
            vs_last = "" if last is None else f"{ms / (last[1] * length / last[0]):10.2f}"
            print(f"{arch:30s} {length:>7d} {ms:9.1f} {ms * 1024 / length:7.2f} {vs_first:9.2f} {vs_last:>10s}", flush=True)
            last = (length, ms)
        if first and last and last[0] > first[0]:
            ratio = last[1] / (first[1] * last[0] / first[0])
            print(f"{arch}: {last[0]} tokens took {ratio:.2f}x proportional to {first[0]} "
                  f"({'within' if ratio <= 1.2 else 'beyond'} 1.2)", flush=True)
        del lm
        release(device)


if __name__ == "__main__":
    main()
