"""The long-context targets of issue 36 checked against `attnlab bench zoo` results (the `zoo-long` stage of
benchmarks/gpu.sh writes them): each line a target, the measured ratio, and whether it holds.

    python benchmarks/long_context_targets.py gpu-out/zoo-long-*.json

A missing row (not measured, out of memory, cut by the time limit) makes its line say so.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# tokens/s of the tiled kernels before the chunked form, on an H100: "no shape slower than today's". 4 x 4096 from
# issue 36's table; 16 x 1024 from the zoo run of the same days (results/h100-zoo-4x4096-16x1024.json)
TILED = {
    "4x4096": {"attnlab-2mamba": 120_243, "attnlab-linear_elu": 128_826, "attnlab-linear__output_norm": 179_955},
    "16x1024": {"attnlab-2mamba": 178_773, "attnlab-linear_elu": 152_566, "attnlab-linear__output_norm": 219_946},
}


def main(paths: list[str]) -> None:
    rows: dict[str, dict] = {}
    for path in paths:
        if Path(path).is_file():  # a run the time limit stopped before its first row wrote nothing
            rows.update(json.loads(Path(path).read_text())["train"])

    def tps(model: str, shape: str) -> float | None:
        row = rows.get(f"{model}@{shape}", {})
        return row.get("tokens_per_s")

    def peak(model: str, shape: str) -> float | None:
        return rows.get(f"{model}@{shape}", {}).get("peak_reserved_gib")

    def check(label: str, value: float | None, base: float | None, at_least: float) -> None:
        if value is None or base is None:
            print(f"{label:62s} {'not measured':>10s}")
            return
        ratio = value / base
        print(f"{label:62s} {ratio:10.2f}  {'holds' if ratio >= at_least else 'MISSED'} (target >= {at_least})")

    print("issue 36 targets (tokens/s ratios; peak memory as GiB reserved)")
    mamba, llama = "attnlab-2mamba", "hf-llama"
    check("2mamba 1x16384 / its own 4x4096", tps(mamba, "1x16384"), tps(mamba, "4x4096"), 0.85)
    check("2mamba 1x32768 / HF Llama-SDPA 1x32768", tps(mamba, "1x32768"), tps(llama, "1x32768"), 2.0)
    check("2mamba 1x65536 / mamba2 1x65536", tps(mamba, "1x65536"), tps("attnlab-mamba2", "1x65536"), 0.5)
    for shape in ("1x16384", "1x32768"):
        ours, theirs = peak(mamba, shape), peak(llama, shape)
        if ours is not None and theirs is not None:
            print(f"{'2mamba peak memory ' + shape + ' / HF Llama-SDPA':62s} {ours / theirs:10.2f}  "
                  f"{'holds' if ours <= theirs else 'MISSED'} (target <= 1; {ours} and {theirs} GiB)")
    for preset in ("attnlab-linear__output_norm", "attnlab-linear_elu"):
        for shape in ("1x16384", "1x32768", "1x65536"):
            check(f"{preset.removeprefix('attnlab-')} {shape} / mamba2", tps(preset, shape), tps("attnlab-mamba2", shape), 0.9)
    for shape, tiled in TILED.items():
        for model, before in tiled.items():
            check(f"{model.removeprefix('attnlab-')} {shape} / the tiled kernels' {before:,}", tps(model, shape), before, 1.0)
    check("medium model (1536 x 27 x 24) 2mamba 2x8192 / HF Llama-SDPA", tps(mamba, "2x8192"), tps(llama, "2x8192"), 1.3)


if __name__ == "__main__":
    main(sys.argv[1:])
