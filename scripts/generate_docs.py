"""Write the tables of attnlab's docs that are generated from code, so that they never drift from it.

    python scripts/generate_docs.py           rewrite every generated block in place
    python scripts/generate_docs.py --check   change nothing; exit 1 naming each block that differs

A generated block sits between `<!-- NAME -->` and `<!-- /NAME -->` in its page; tests/test_docs.py checks
that every block equals what its generator writes now.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def _config_reference() -> str:
    from attnlab.config.reference import reference_markdown

    return reference_markdown()


def _mixer_presets() -> str:
    from attnlab.models.mixers import presets_markdown

    return presets_markdown()


# The tables of measured figures: each reads the JSON that `attnlab bench ...` wrote in benchmarks/results/.


def _result(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def _fixed(x: float, places: int) -> str:
    """`x` with `places` decimals and thousands separators, rounded half up as its JSON text reads (2.965 -> 2.97,
    where the binary float would give 2.96)."""
    return f"{Decimal(repr(x)).quantize(Decimal(10) ** -places, rounding=ROUND_HALF_UP):,}"


def _shape(shape: str) -> str:
    return shape.replace("x", " × ")  # 16x1024 -> 16 × 1024


def _row(cells: list[str]) -> str:
    return "|" + "|".join(f" {cell} " if cell else " " for cell in cells) + "|"  # an empty cell is "| |"


def _decode_zoo() -> str:
    """Every mixer through attnlab's engine: one `attnlab bench decode` JSON per row."""
    rows = [  # label, file, bold tokens/s
        ("`mamba2` (fixed)", "mamba2", True),
        ("`linear__output_norm` (fixed)", "linear__output_norm", True),
        ("`linear_elu` (fixed)", "linear_elu", True),
        ("`softmax` (KV)", "softmax", True),
        ("`nsa` (KV, sparse)", "nsa", True),
        ("`2mamba-e` (KV, decay)", "2mamba-e", True),
        ("`gated_softmax` (KV, clamp)", "gated_softmax", True),
        ("`2mamba` (fixed, d² × d per head; windowed step, bf16 state)", "2mamba", True),
        ("`2mamba`, `state_dtype: float32`", "2mamba-fp32", False),
    ]
    lines = [
        "| model (decode state) | new tokens/s | step (captured) | kernels per step | peak | beam cost |",
        "|---|---|---|---|---|---|",
    ]

    def line(label: str, r: dict, bold: bool) -> str:
        speed = _fixed(r["attnlab_new_tok_per_s"], 0)
        return _row([label, f"**{speed}**" if bold else speed, f"{_fixed(r['graph_step_ms'], 2)} ms",
                     str(r["step_kernels"]), f"{_fixed(r['peak_gib'], 2)} GiB", f"{_fixed(r['beam_cost_ratio'], 2)}×"])

    for label, name, bold in rows:
        lines.append(line(label, _result(f"h100-decode-attnlab-{name}.json")["results"][0], bold))
    llama = _result("h100-decode-hf-llama.json")["results"][0]
    lines.append(line("HF Llama (SDPA) through attnlab's engine", llama, False))
    hf_generate = _fixed(llama["hf_generate_new_tok_per_s"], 1)
    lines.append(_row(["HF `generate` on the same Llama", hf_generate, "", "", "", ""]))
    return "\n".join(lines)


def _power2_state_precision() -> str:
    """`benchmarks/power2_state_precision.py`'s JSON: 2mamba's state, rewritten or windowed, fp32 or bf16."""
    rows = _result("cpu-power2-state-precision.json")["rows"]
    lines = ["| state | logits' relative error, last step | largest | greedy token agrees |", "|---|---|---|---|"]
    for way in ("rewritten", "windowed"):
        for dtype, short in (("float32", "fp32"), ("bfloat16", "bf16")):
            r = rows[f"{way} {dtype}"]
            error = [f"{e * 100:.3g}e-2" for e in (r["last_rel_err"], r["max_rel_err"])]  # 0.009977 -> 0.998e-2
            label = "rewritten every step" if way == "rewritten" else way
            lines.append(_row([f"{label}, {short}", *error, f"{r['greedy_agreement']:.1%}"]))
    return "\n".join(lines)


def _zoo_ops() -> str:
    """The token mixing alone, forward + backward ms: `attnlab bench zoo`'s `ops`, one run per shape, and the
    later run of the published taylor code."""
    runs = {"16x1024": "h100-zoo-ops-16x1024.json", "4x4096": "h100-zoo-ops-4x4096.json",
            "1x16384": "h100-zoo-1x16384.json"}
    ops = {shape: _result(name)["ops"] for shape, name in runs.items()}
    taylor = _result("h100-zoo-taylor-ops.json")["ops"]
    rows = [  # label, ops (several: one cell "a / b"), source per shape
        ("SDPA flash (plain causal softmax)", ["sdpa"], ops),
        ("fla `parallel_forgetting_attn`", ["fla-parallel_forgetting_attn"], ops),
        ("`2mamba-e` (the same function)", ["attnlab-2mamba-e"], ops),
        ("`2mamba`", ["attnlab-2mamba"], ops),
        ("`gated_softmax` / `softmax_divs`", ["attnlab-gated_softmax", "attnlab-softmax_divs"], ops),
        ("`softmax_taylor_80terms`", ["attnlab-softmax_taylor_80terms"], {shape: taylor for shape in runs}),
        ("`linear_elu` / `linear__output_norm`", ["attnlab-linear_elu", "attnlab-linear__output_norm"], ops),
    ]
    lines = [_row(["op", *map(_shape, runs)]), "|---|---|---|---|"]
    for label, names, source in rows:
        cells = [" / ".join(_fixed(source[shape][f"{n}@{shape}"]["fwd_bwd_ms"], 2) for n in names) for shape in runs]
        lines.append(_row([label, *cells]))
    return "\n".join(lines)


def _zoo_nsa() -> str:
    """The 12-layer NSA model beside its peers: tokens/s (peak allocated GiB), two `attnlab bench zoo` runs."""
    train = {**_result("h100-zoo-nsa.json")["train"], **_result("h100-zoo-nsa-long.json")["train"]}
    shapes = ["2x2048", "1x8192", "1x32768", "1x65536"]
    models = [("HF Llama (SDPA)", "hf-llama"), ("fla `NSAForCausalLM` (window 0)", "fla-nsa"),
              ("attnlab `nsa`", "attnlab-nsa")]
    lines = [_row(["model", *map(_shape, shapes)]), "|---|---|---|---|---|"]
    for label, model in models:
        runs = [train.get(f"{model}@{shape}") for shape in shapes]
        cells = [f"{_fixed(r['tokens_per_s'], 0)} ({_fixed(r['peak_allocated_gib'], 1)})" if r else "" for r in runs]
        lines.append(_row([label, *cells]))
    return "\n".join(lines)


# block name -> (page, generator): the config schema's keys, the registered mixer presets, the benchmarks' tables
BLOCKS: dict[str, tuple[str, Callable[[], str]]] = {
    "config-reference": ("docs/config.md", _config_reference),
    "mixer-presets": ("docs/mixers.md", _mixer_presets),
    "decode-zoo": ("docs/speed.md", _decode_zoo),
    "power2-state-precision": ("docs/speed.md", _power2_state_precision),
    "zoo-ops": ("docs/speed.md", _zoo_ops),
    "zoo-nsa": ("docs/speed.md", _zoo_nsa),
}


def _pattern(name: str) -> re.Pattern:
    return re.compile(rf"(<!-- {re.escape(name)} -->\n)(.*?)(\n<!-- /{re.escape(name)} -->)", re.S)


def checked_in(name: str) -> str:
    """The text of block `name` as its page holds it now."""
    page, _ = BLOCKS[name]
    match = _pattern(name).search((ROOT / page).read_text())
    if match is None:
        raise SystemExit(f"{page} lacks the <!-- {name} --> ... <!-- /{name} --> block")
    return match.group(2)


def generated(name: str) -> str:
    """The text of block `name` as its generator writes it."""
    return BLOCKS[name][1]().strip("\n")


def write(name: str) -> bool:
    """Rewrite block `name` in its page; True when it changed."""
    page, _ = BLOCKS[name]
    path = ROOT / page
    text = path.read_text()
    checked_in(name)  # says which page lacks the block
    new = _pattern(name).sub(lambda m: m.group(1) + generated(name) + m.group(3), text, count=1)
    if new != text:
        path.write_text(new)
    return new != text


def main(argv: list[str]) -> int:
    check = "--check" in argv
    drifted = []
    for name, (page, _) in BLOCKS.items():
        if check:
            if checked_in(name) != generated(name):
                drifted.append(f"{page}: <!-- {name} -->")
        elif write(name):
            print(f"rewrote {page}: <!-- {name} -->")
    if drifted:
        print("out of date (run: python scripts/generate_docs.py):\n  " + "\n  ".join(drifted))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
