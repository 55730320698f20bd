"""Where an eager training step's host time goes, per mixer: `python benchmarks/eager_host.py --model 2mamba ...`.

For each model (bench names of `attnlab bench train`), at one shape: the eager step's time (CUDA events), the
GPU's kernel time, the host's time to issue the forward, the backward and the optimizer step separately
(the GPU drained before each part), the number of kernels each part launches, and the Python functions
the forward and the backward spend their host time in (cProfile, own time). Prints a table last; --out
writes the rows as JSON. `--compiled` adds each attnlab model with its blocks under torch.compile (`model+compiled`),
as `attnlab train` runs an eager step (the kernels marked `outside_compile(traced=True)` traced, the others graph
breaks). `--stack` adds each with every block in turn under one torch.compile (`model+stack`,
`compile_blocks(stack=True)`: the compiled code's per-call costs once a step instead of once a block); `--stack-with
OPTIONS` so with Inductor's config options changed (`model+stack:OPTIONS`, OPTIONS as `key=value,key=value`, values
Python literals: `cpp_wrapper=True`, the graph's buffer allocations and kernel launches issued from C++ instead of
its generated Python; `size_asserts=False`, no check of each input's and extern kernel output's sizes and strides;
`memory_planning=True`, the graph's buffers carved from pooled allocations; `combo_kernels=True`, independent small
kernels launched as one); `--stack-cpp` is `--stack-with cpp_wrapper=True`. `--traced` adds
each with its blocks compiled and every mixer kernel traced (`model+traced`: all the `outside_compile` marks lifted,
so that a block can compile to one graph with its Triton kernels launched by Inductor, where torch.compile can trace
them). `--whole` adds each with the whole
model's training forward and loss under one torch.compile, the kernels traced as with `--traced` (`model+whole`: one
forward graph and one backward graph where nothing breaks them). Compiled rows record the graphs compiled and the
graph breaks by reason.
"""

from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import statistics
import time
from contextlib import contextmanager

import torch

from attnlab.bench.timing import host_python_calls, median_time, release
from attnlab.bench.train import build, train_step
from attnlab.bench.zoo import model_names


def _kernels(fn):
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return len(events), round(sum(e.device_time for e in events) / 1000, 2)


@contextmanager
def kernels_traced(only=None):
    """Every function and method of attnlab.models marked `outside_compile` (torch.compiler.disable) as written instead,
    wherever a module or class holds it, for the duration; yields how many places were changed. `only`: names of
    the marked functions to lift (e.g. {"causal_conv1d"}), the others kept."""
    import attnlab.models

    changed = []
    for info in pkgutil.walk_packages(attnlab.models.__path__, "attnlab.models."):
        module = importlib.import_module(info.name)
        owners = [module] + [c for c in vars(module).values() if isinstance(c, type) and c.__module__ == module.__name__]
        for owner in owners:
            for name, value in list(vars(owner).items()):
                inner = getattr(value, "__wrapped__", None)
                if inner is None or not getattr(value, "_torchdynamo_disable", False):
                    continue
                if only is not None and inner.__name__ not in only:
                    continue
                # what was set on the marked function after marking it (e.g. `attention_terms.divide`)
                inner.__dict__.update({k: v for k, v in vars(value).items() if k != "__wrapped__" and not k.startswith("_torchdynamo")})
                setattr(owner, name, inner)
                changed.append((owner, name, value))
    try:
        yield len(changed)
    finally:
        for owner, name, value in reversed(changed):
            setattr(owner, name, value)


def captured_ms(name, hidden, layers, heads, vocab, intermediate, batch, seq_len):
    """The same step captured as CUDA graphs, as `attnlab train` runs it (a model of its own: a captured backward
    needs gradient accumulators made on the capture stream, which an eager step before it would have made)."""
    device = torch.device("cuda")
    torch.manual_seed(0)
    release(device)
    model = build(name, hidden, layers, heads, vocab, intermediate).cuda().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randint(0, vocab, (batch, seq_len), device="cuda")
    step, captured = train_step(model, opt, x, capture=True)
    if captured is None:
        return None
    for _ in range(3):
        step()
    step_s, _ = median_time(step, 6, device)
    del model, opt, step, captured
    return round(step_s * 1000, 2)


def inductor_options(text: str) -> dict:
    """`key=value,key=value` (values Python literals) as Inductor config options, each checked to exist."""
    import ast

    import torch._inductor.config as inductor_config

    known = inductor_config.get_config_copy()  # every option, nested ones as "triton.cudagraphs"
    options = {}
    for item in filter(None, text.split(",")):
        key, eq, value = (part.strip() for part in item.partition("="))
        if not eq:
            raise SystemExit(f"--stack-with: {item!r} is not key=value")
        if key not in known:
            raise SystemExit(f"--stack-with: {key!r} is not an option of torch._inductor.config")
        try:
            options[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            raise SystemExit(f"--stack-with: {value!r} ({key}) is not a Python literal") from None
    return options


def measure(name, hidden, layers, heads, vocab, intermediate, batch, seq_len, captured=None):
    """One model's row; `name` with "+compiled": the attnlab model with its blocks under torch.compile (as `attnlab
    train` runs an eager step, `train.compile`), "+traced": so with the mixers' kernels traced too, "+whole": the whole
    model compiled, kernels traced. `captured`: the captured step's ms when already measured."""
    base, _, how = name.partition("+")
    if how.startswith("stack:"):  # the stack compiled with Inductor's config options changed (`--stack-with`)
        import torch._inductor.config as inductor_config

        with inductor_config.patch(inductor_options(how.partition(":")[2])):
            return _measure(name, base, "stack", hidden, layers, heads, vocab, intermediate, batch, seq_len, captured)
    if how in ("traced", "whole"):
        with kernels_traced() as places:
            return {**_measure(name, base, how, hidden, layers, heads, vocab, intermediate, batch, seq_len, captured),
                    "outside_compile_lifted": places}
    return _measure(name, base, how, hidden, layers, heads, vocab, intermediate, batch, seq_len, captured)


def _measure(name, base, how, hidden, layers, heads, vocab, intermediate, batch, seq_len, captured):
    device = torch.device("cuda")
    compiled = bool(how)
    if captured is None and base.startswith("attnlab-"):
        captured = captured_ms(base, hidden, layers, heads, vocab, intermediate, batch, seq_len)
    torch.manual_seed(0)
    release(device)
    model = build(base, hidden, layers, heads, vocab, intermediate).cuda().train()
    if how in ("compiled", "traced", "stack"):
        model.compile_blocks(stack=how == "stack")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randint(0, vocab, (batch, seq_len), device="cuda")
    state = {}
    run = torch.compile(model) if how == "whole" else model

    def forward():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            state["loss"] = run(input_ids=x, labels=x).loss

    def backward():
        state["loss"].backward()

    def optimizer():
        opt.step()
        opt.zero_grad(set_to_none=True)

    def step():
        forward()
        backward()
        optimizer()

    from torch._dynamo.utils import counters

    counters.clear()
    t0 = time.perf_counter()
    step()  # the first step compiles the blocks ("+compiled")
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    compiled_graphs = {"graphs": counters["stats"].get("unique_graphs", 0),
                       "graph_breaks": {reason[:200]: n for reason, n in counters["graph_break"].items()}} if compiled else {}
    for _ in range(2):
        step()
    step_s, _ = median_time(step, 6, device)
    row = {"model": name, "first_step_s": round(first_s, 1), "batch": batch, "seq_len": seq_len, "step_ms": round(step_s * 1000, 2),
           "tok_per_s": round(batch * seq_len / step_s), **compiled_graphs}
    parts = {}
    for part, fn, before, after in (("forward", forward, None, lambda: (backward(), optimizer())),
                                    ("backward", backward, forward, optimizer),
                                    ("optimizer", optimizer, lambda: (forward(), backward()), None)):
        def timed(fn=fn, before=before, after=after):
            if before:
                before()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            state.setdefault(part, []).append(time.perf_counter() - t0)
            torch.cuda.synchronize()
            if after:
                after()
        state[part] = []
        for _ in range(3):
            timed()
        host_ms = round(statistics.median(state[part]) * 1000, 2)
        if before:
            before()
        kernels, gpu_ms = _kernels(fn)
        if after:
            after()
        if before:
            before()
        top = host_python_calls(fn, top=18) if part != "optimizer" else []
        if after:
            after()
        parts[part] = {"host_ms": host_ms, "gpu_ms": gpu_ms, "kernels": kernels, "python_top": top}
    row["parts"] = parts
    if captured:
        row.update(captured_ms=captured, eager_over_captured=round(captured / row["step_ms"], 3))
    del model, opt, run
    if compiled:
        torch._dynamo.reset()  # the next model compiles its own blocks
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", required=True, help="bench name or mixer (repeatable)")
    ap.add_argument("--shape", default="9x1024")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--compiled", action="store_true", help="also each attnlab model with its blocks under torch.compile")
    ap.add_argument("--stack", action="store_true", help="also each attnlab model with its blocks in turn under one torch.compile")
    ap.add_argument("--stack-cpp", action="store_true", help="as --stack-with cpp_wrapper=True")
    ap.add_argument("--stack-with", action="append", default=[], metavar="OPTIONS", help=(
        "also each attnlab model with its blocks in turn under one torch.compile, Inductor's config options changed: "
        "key=value,key=value (repeatable: one variant each)"))
    ap.add_argument("--traced", action="store_true", help=(
        "also each attnlab model with its blocks compiled and the mixers' kernels traced too (the outside_compile marks lifted)"))
    ap.add_argument("--whole", action="store_true", help=(
        "also each attnlab model with the whole model compiled as one, the mixers' kernels traced as with --traced"))
    ap.add_argument("--out")
    args = ap.parse_args()
    batch, seq_len = (int(v) for v in args.shape.split("x"))
    rows = []
    names = model_names(args.model)
    stacked = args.stack_with + (["cpp_wrapper=True"] if args.stack_cpp else [])
    for options in stacked:
        inductor_options(options)  # a wrong option stops here, before any model is built
    suffixes = [suffix for suffix, on in (("+compiled", args.compiled), ("+stack", args.stack), ("+traced", args.traced),
                                          ("+whole", args.whole)) if on] + [f"+stack:{options}" for options in stacked]
    if suffixes:  # each attnlab model eager as written, then compiled in each way asked for
        names = [variant for name in names for variant in ([name] + ([name + x for x in suffixes] if name.startswith("attnlab-") else []))]
    captured = {}
    for name in names:
        try:
            base = name.partition("+")[0]
            row = measure(name, args.hidden, args.layers, args.heads, args.vocab, args.intermediate, batch, seq_len, captured.get(base))
            if "captured_ms" in row:
                captured[base] = row["captured_ms"]
        except Exception as err:  # one model's failure is a row, not the end of the run
            row = {"model": name, "error": f"{type(err).__name__}: {err}"[:300]}
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"shape": args.shape, "rows": rows}, f, indent=1)
    print(f"\n{'model':32s} {'step ms':>8s} {'tok/s':>8s} | {'fwd host':>8s} {'gpu':>6s} {'kern':>5s} | "
          f"{'bwd host':>8s} {'gpu':>6s} {'kern':>5s} | {'opt host':>8s} {'gpu':>6s} | {'captured':>8s} {'eager/capt':>10s}")
    for r in rows:
        if "error" in r:
            print(f"{r['model']:32s} {r['error'][:100]}")
            continue
        p = r["parts"]
        print(f"{r['model']:32s} {r['step_ms']:>8.1f} {r['tok_per_s']:>8,d} | {p['forward']['host_ms']:>8.1f} {p['forward']['gpu_ms']:>6.1f} "
              f"{p['forward']['kernels']:>5d} | {p['backward']['host_ms']:>8.1f} {p['backward']['gpu_ms']:>6.1f} {p['backward']['kernels']:>5d} | "
              f"{p['optimizer']['host_ms']:>8.1f} {p['optimizer']['gpu_ms']:>6.1f} | {r.get('captured_ms', float('nan')):>8.1f} "
              f"{r.get('eager_over_captured', float('nan')):>10.3f}")
        if "graphs" in r:
            breaks = sum(r["graph_breaks"].values())
            top = max(r["graph_breaks"], key=r["graph_breaks"].get) if breaks else ""
            print(f"{'':32s} {r['graphs']} graphs compiled, {breaks} graph breaks{': most often ' + top[:120] if top else ''}")


if __name__ == "__main__":
    main()
