"""Profiles one prefill of the decode benchmark's model on CUDA: the engine asked for one new token after
8 prompts of 2048 tokens (hidden 1024, 20 layers, 16 heads, bf16, untrained), then the static runner's
prefill alone; prints both times, the prefill's GPU time by kernel and the host's busiest calls.

    python benchmarks/profile_prefill.py attnlab-2mamba
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from attnlab.bench.decode import IdTokenizer, _engine
from attnlab.bench.train import build
from attnlab.generation.graphs import StaticRunner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("arch", help="attnlab-<mixer>, as `attnlab bench decode --arch`")
    arch = parser.parse_args().arch
    torch.manual_seed(0)
    lm = build(arch, 1024, 20, 16, 32000).to("cuda", torch.bfloat16).eval()
    tokenizer = IdTokenizer(32000)
    prompts = torch.randint(0, 256, (8, 2048))
    as_lists = prompts.tolist()
    with torch.no_grad():
        for _ in range(2):  # compile, autotune
            _engine(lm, tokenizer, as_lists, 1)
        torch.cuda.synchronize()
        t = time.perf_counter()
        _engine(lm, tokenizer, as_lists, 1)
        torch.cuda.synchronize()
        print(arch, "engine, 1 new token:", round((time.perf_counter() - t) * 1000, 1), "ms")
        runner = StaticRunner(lm, capture=False)
        runner.reserve(4)
        ids = prompts.cuda()
        runner.prefill(ids, torch.ones_like(ids))
        torch.cuda.synchronize()
        t = time.perf_counter()
        runner.prefill(ids, torch.ones_like(ids))
        torch.cuda.synchronize()
        print("runner.prefill alone:", round((time.perf_counter() - t) * 1000, 1), "ms")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            _engine(lm, tokenizer, as_lists, 1)
            torch.cuda.synchronize()
    kernels: dict[str, float] = {}
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            kernels[evt.name] = kernels.get(evt.name, 0.0) + evt.device_time / 1000
    print("GPU ms total", round(sum(kernels.values()), 2))
    for name, ms in sorted(kernels.items(), key=lambda kv: -kv[1])[:18]:
        print(f"  {ms:7.2f} {name[:100]}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=50))


if __name__ == "__main__":
    main()
