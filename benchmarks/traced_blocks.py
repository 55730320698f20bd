"""Which mixers' blocks torch.compile can trace whole, their kernels included, and whether that step computes what the
eager one does: `python benchmarks/traced_blocks.py --model 2mamba --model mamba2 ...`.

For each model (bench names of `attnlab bench train`, small by default: 2 layers), in a process of its own (a kernel
that faults must not take the next model down with it): the blocks compiled with the `outside_compile` marks lifted
(`eager_host.kernels_traced`), so that Inductor launches the mixers' Triton kernels itself where it can trace them;
one training forward and backward under bf16 autocast (`--fp32`: without; `--both`: each), beside the same model run
eagerly from the same weights. A row gives the graphs compiled, the graph breaks by reason, the loss of each, and the
largest difference of any parameter's gradient relative to that gradient's largest magnitude (under bf16 also each
step's from the fp32 step's gradients: the yardstick of bf16's own rounding); or the error, with the innermost frames
of its traceback and what the process wrote last. `--lift NAME` lifts only some marks, to find which kernel entry
fails; `--code-dir` keeps Inductor's generated code; `CUDA_LAUNCH_BLOCKING=1` in the environment places a kernel's
fault at its launch. Prints a table last; --out writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import traceback

import torch
import torch._inductor.config

from attnlab.bench.zoo import model_names


def causes(err: BaseException, keep: int = 4) -> list[str]:
    """The exceptions that led to `err` (its `__cause__` or `__context__`, and theirs), innermost last: a Triton
    compile error raised inside Inductor names the failing line at the top and the reason at the bottom of this chain."""
    chain, seen = [], {id(err)}
    inner = err.__cause__ or err.__context__
    while inner is not None and id(inner) not in seen:
        seen.add(id(inner))
        message = f"{type(inner).__name__}: {inner}"
        chain.append(message if len(message) <= 800 else message[:200] + " ... " + message[-600:])
        inner = inner.__cause__ or inner.__context__
    return chain[-keep:]


def check(name: str, hidden: int, layers: int, heads: int, vocab: int, batch: int, seq_len: int, fp32: bool = False,
          inductor: dict | None = None, lift: set[str] | None = None) -> dict:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from eager_host import kernels_traced
    from torch._dynamo.utils import counters

    from attnlab.bench.train import build

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = build(name, hidden, layers, heads, vocab, 2 * hidden).to(device).train()
    x = torch.randint(0, vocab, (batch, seq_len), device=device)

    def run(in_fp32=fp32):
        model.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=not in_fp32):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        return loss.item(), {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}

    eager_loss, eager_grads = run()
    reference = None if fp32 else run(in_fp32=True)[1]  # bf16's yardstick: each step's distance from fp32's gradients
    row = {"model": name, "shape": f"{batch}x{seq_len}", "precision": "fp32" if fp32 else "bf16", "eager_loss": round(eager_loss, 6),
           **({"inductor": inductor} if inductor else {}), **({"lifted": sorted(lift)} if lift else {})}
    for key, value in (inductor or {}).items():
        setattr(torch._inductor.config, key, value)
    counters.clear()
    with kernels_traced(lift) as places:
        model.compile_blocks()
        try:
            traced_loss, traced_grads = run()
            run()  # a second step through the compiled code, as training runs it
        finally:
            model.compile_blocks(False)
    def farthest(grads, base):
        """The largest difference of any parameter's gradient from base's, relative to base's largest magnitude."""
        worst, where = 0.0, None
        for n, g in base.items():
            t = grads.get(n)
            rel = float("inf") if t is None else float((t - g).abs().max() / g.abs().max().clamp_min(1e-12))
            if rel > worst:
                worst, where = rel, n
        return worst, where

    worst, where = farthest(traced_grads, eager_grads)
    if reference is not None:
        row.update(eager_from_fp32=farthest(eager_grads, reference)[0], traced_from_fp32=farthest(traced_grads, reference)[0])
    missing = sorted(set(traced_grads) ^ set(eager_grads))
    row.update(traced_loss=round(traced_loss, 6), loss_diff=abs(traced_loss - eager_loss), grad_rel_diff=worst, worst_param=where,
               missing_grads=missing, graphs=counters["stats"].get("unique_graphs", 0),
               graph_breaks={reason.splitlines()[0][:160]: n for reason, n in counters["graph_break"].items()},
               outside_compile_lifted=places)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", required=True, help="bench name or mixer (repeatable)")
    ap.add_argument("--shape", action="append", help="BATCHxSEQ (repeatable; default 2x512)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--fp32", action="store_true", help="no bf16 autocast: both steps in fp32")
    ap.add_argument("--both", action="store_true", help="each model and shape under bf16 autocast and in fp32")
    ap.add_argument("--lift", action="append", metavar="NAME", help=(
        "lift only the outside_compile marks of functions of this name (repeatable, e.g. causal_conv1d): the others stay"))
    ap.add_argument("--code-dir", help="keep Inductor's generated Python code of each run under this folder")
    ap.add_argument("--inductor", action="append", default=[], metavar="KEY=VALUE",
                    help="a torch._inductor.config setting for the compiled blocks (repeatable), e.g. comprehensive_padding=False")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # the child process: one model, one JSON line
    ap.add_argument("--out")
    args = ap.parse_args()
    shapes = args.shape or ["2x512"]
    names = model_names(args.model)
    if args.one:
        batch, seq_len = (int(v) for v in shapes[0].split("x"))
        try:
            settings = {key: json.loads(value.lower()) if value.lower() in ("true", "false") or value.isdigit() else value
                        for key, value in (item.split("=", 1) for item in args.inductor)}
            row = check(names[0], args.hidden, args.layers, args.heads, args.vocab, batch, seq_len, args.fp32, settings,
                        set(args.lift) if args.lift else None)
        except Exception as err:
            frames = traceback.extract_tb(err.__traceback__)[-6:]
            message = f"{type(err).__name__}: {err}"  # its head and its tail: a compile error's reason comes last
            row = {"model": names[0], "shape": shapes[0], "precision": "fp32" if args.fp32 else "bf16",
                   "error": message if len(message) <= 1500 else message[:500] + " ... " + message[-1000:],
                   "where": [f"{f.filename.rsplit('site-packages/', 1)[-1]}:{f.lineno} {f.name}" for f in frames],
                   "causes": causes(err)}
        print("ROW " + json.dumps(row), flush=True)
        return
    rows = []
    precisions = [False, True] if args.both else [args.fp32]
    for name in names:
        for shape in shapes:
            for fp32 in precisions:
                cmd = [sys.executable, os.path.abspath(__file__), "--one", "--model", name, "--shape", shape, "--hidden", str(args.hidden),
                       "--layers", str(args.layers), "--heads", str(args.heads), "--vocab", str(args.vocab)] + (["--fp32"] if fp32 else []) + [
                    f"--inductor={item}" for item in args.inductor] + [f"--lift={item}" for item in args.lift or []]
                env = dict(os.environ)
                code = None
                if args.code_dir:
                    code = os.path.join(args.code_dir, f"{name}-{shape}-{'fp32' if fp32 else 'bf16'}")
                    env["TORCHINDUCTOR_CACHE_DIR"] = code
                done = subprocess.run(cmd, capture_output=True, text=True, env=env)
                found = [line[4:] for line in done.stdout.splitlines() if line.startswith("ROW ")]
                row = json.loads(found[-1]) if found else {"model": name, "shape": shape, "error": f"exit {done.returncode}"}
                if "error" in row:  # what the process said before it failed: Inductor's and Triton's own reports
                    row["stderr_tail"] = done.stderr.strip()[-3000:]
                if code and os.path.isdir(code):  # the generated code only, not the binaries
                    for root, _, files in os.walk(code):
                        for file in files:
                            if not file.endswith(".py"):
                                os.remove(os.path.join(root, file))
                rows.append(row)
                print(json.dumps(row), flush=True)
                if args.out:
                    with open(args.out, "w") as f:
                        json.dump({"shapes": shapes, "rows": rows}, f, indent=1)
    print(f"\n{'model':28s} {'graphs':>6s} {'breaks':>6s} {'loss diff':>10s} {'grad rel diff':>13s} {'eager/traced from fp32':>22s}  worst / error")
    for r in rows:
        if "error" in r:
            print(f"{r['model']} {r.get('shape', '')} {r.get('precision', '')}: {r['error'][-300:]}")
            for frame in r.get("where", [])[-3:]:
                print(f"{'':28s}   at {frame}")
            continue
        label = f"{r['model']} {r.get('shape', '')} {r.get('precision', '')}" + "".join(f" {k}={v}" for k, v in r.get("inductor", {}).items())
        yardstick = f"{r['eager_from_fp32']:.1e} / {r['traced_from_fp32']:.1e}" if "eager_from_fp32" in r else ""
        print(f"{label[:28]:28s} {r['graphs']:>6d} {sum(r['graph_breaks'].values()):>6d} {r['loss_diff']:>10.2e} "
              f"{r['grad_rel_diff']:>13.2e} {yardstick:>22s}  {r['worst_param']}")
        for reason, n in r["graph_breaks"].items():
            print(f"{'':28s}   {n} x {reason}")


if __name__ == "__main__":
    main()
