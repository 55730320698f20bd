"""Which mixers' blocks torch.compile can trace whole, their kernels included, and whether that step computes what the
eager one does: `python benchmarks/traced_blocks.py --model 2mamba --model mamba2 ...`.

For each model (bench names of `attnlab bench train`, small by default: 2 layers), in a process of its own (a kernel
that faults must not take the next model down with it): the blocks compiled with the `outside_compile` marks lifted
(`eager_host.kernels_traced`), so that Inductor launches the mixers' Triton kernels itself where it can trace them;
one training forward and backward under bf16 autocast (`--fp32`: without), beside the same model run eagerly from the same weights.
A row gives the graphs compiled, the graph breaks by reason, the loss of each, and the largest difference of any
parameter's gradient relative to that gradient's largest magnitude; or the error, with the innermost frames of its
traceback. `CUDA_LAUNCH_BLOCKING=1` in the environment places a kernel's fault at its launch. Prints a table last;
--out writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import traceback

import torch


def check(name: str, hidden: int, layers: int, heads: int, vocab: int, batch: int, seq_len: int, fp32: bool = False) -> dict:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from eager_host import kernels_traced
    from torch._dynamo.utils import counters

    from attnlab.bench.train import build

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = build(name, hidden, layers, heads, vocab, 2 * hidden).to(device).train()
    x = torch.randint(0, vocab, (batch, seq_len), device=device)

    def run():
        model.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=not fp32):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        return loss.item(), {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}

    eager_loss, eager_grads = run()
    row = {"model": name, "eager_loss": round(eager_loss, 6)}
    counters.clear()
    with kernels_traced() as places:
        model.compile_blocks()
        try:
            traced_loss, traced_grads = run()
            run()  # a second step through the compiled code, as training runs it
        finally:
            model.compile_blocks(False)
    worst, where = 0.0, None
    for n, g in eager_grads.items():
        t = traced_grads.get(n)
        rel = float("inf") if t is None else float((t - g).abs().max() / g.abs().max().clamp_min(1e-12))
        if rel > worst:
            worst, where = rel, n
    missing = sorted(set(traced_grads) ^ set(eager_grads))
    row.update(traced_loss=round(traced_loss, 6), loss_diff=abs(traced_loss - eager_loss), grad_rel_diff=worst, worst_param=where,
               missing_grads=missing, graphs=counters["stats"].get("unique_graphs", 0),
               graph_breaks={reason.splitlines()[0][:160]: n for reason, n in counters["graph_break"].items()},
               outside_compile_lifted=places)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", required=True, help="bench name or mixer (repeatable)")
    ap.add_argument("--shape", default="2x512")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--fp32", action="store_true", help="no bf16 autocast: both steps in fp32")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # the child process: one model, one JSON line
    ap.add_argument("--out")
    args = ap.parse_args()
    batch, seq_len = (int(v) for v in args.shape.split("x"))
    names = [name if name.startswith(("attnlab-", "hf-", "fla-")) else f"attnlab-{name}" for name in args.model]
    if args.one:
        try:
            row = check(names[0], args.hidden, args.layers, args.heads, args.vocab, batch, seq_len, args.fp32)
        except Exception as err:
            frames = traceback.extract_tb(err.__traceback__)[-6:]
            row = {"model": names[0], "error": f"{type(err).__name__}: {err}"[:600],
                   "where": [f"{f.filename.rsplit('site-packages/', 1)[-1]}:{f.lineno} {f.name}" for f in frames]}
        print("ROW " + json.dumps(row), flush=True)
        return
    rows = []
    for name in names:
        cmd = [sys.executable, os.path.abspath(__file__), "--one", "--model", name, "--shape", args.shape, "--hidden", str(args.hidden),
               "--layers", str(args.layers), "--heads", str(args.heads), "--vocab", str(args.vocab)] + (["--fp32"] if args.fp32 else [])
        done = subprocess.run(cmd, capture_output=True, text=True)
        found = [line[4:] for line in done.stdout.splitlines() if line.startswith("ROW ")]
        row = json.loads(found[-1]) if found else {"model": name, "error": f"exit {done.returncode}: {done.stderr.strip()[-600:]}"}
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"shape": args.shape, "rows": rows}, f, indent=1)
    print(f"\n{'model':28s} {'graphs':>6s} {'breaks':>6s} {'loss diff':>10s} {'grad rel diff':>13s}  worst / error")
    for r in rows:
        if "error" in r:
            print(f"{r['model']:28s} {r['error'][:110]}")
            for frame in r.get("where", [])[-3:]:
                print(f"{'':28s}   at {frame}")
            continue
        print(f"{r['model']:28s} {r['graphs']:>6d} {sum(r['graph_breaks'].values()):>6d} {r['loss_diff']:>10.2e} "
              f"{r['grad_rel_diff']:>13.2e}  {r['worst_param']}")
        for reason, n in r["graph_breaks"].items():
            print(f"{'':28s}   {n} x {reason}")


if __name__ == "__main__":
    main()
