"""What torch.compile's graph breaks cost an eager training step, on a stand-in of attnlab's blocks:
`python benchmarks/compile_breaks.py [--hidden 1024 --layers 20 --batch 9 --seq 1024]`.

The blocks are the shape of attnlab's (RMSNorm, a short causal convolution, q/k/v and gate projections, a token
mixer, the output projection, RMSNorm, SwiGLU), with a stand-in mixer of a few elementwise and scan kernels each way
(a decayless linear recurrence, y = q * cumsum(k * v)) behind an autograd function of its own, as attnlab's mixers
run their Triton kernels. The same step runs five ways:

- eager: op by op, as `train.cuda_graphs=false`;
- blocks compiled, the mixer a graph break: each block through torch.compile with the mixer under
  `torch.compiler.disable`, as `train.compile` runs attnlab's blocks today (the compiled parts around each mixer);
- blocks compiled, the mixer a custom op: the mixer registered with `torch.library.custom_op` (its backward too),
  so each block compiles to one graph;
- model compiled, the mixer a custom op: the whole forward (embedding to loss) one graph;
- captured: the eager step's forward and backward as CUDA graphs (the target).

For each: the step's time (CUDA events, median), the host's time to issue the forward and backward with the
GPU drained first, and the step's ratio to the captured one. Prints a table last; --out writes JSON. On CPU it
runs at the sizes given as a functional check (no capture).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def mix_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return q * torch.cumsum(k * v, dim=1)


def mix_backward(q, k, v, grad):
    dq = grad * torch.cumsum(k * v, dim=1)
    dkv = torch.flip(torch.cumsum(torch.flip(grad * q, [1]), dim=1), [1])
    return dq, dkv * v, dkv * k


class _Mix(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        return mix_forward(q, k, v)

    @staticmethod
    def backward(ctx, grad):
        return mix_backward(*ctx.saved_tensors, grad)


@torch.compiler.disable(recursive=True)
def mix_with_break(q, k, v):
    return _Mix.apply(q, k, v)


@torch.library.custom_op("attnlab_bench::mix", mutates_args=())
def mix_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return mix_forward(q, k, v).contiguous()


@mix_op.register_fake
def _(q, k, v):
    return q.new_empty(q.shape)


@torch.library.custom_op("attnlab_bench::mix_backward", mutates_args=())
def mix_backward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(t.contiguous() for t in mix_backward(q, k, v, grad))


@mix_backward_op.register_fake
def _(q, k, v, grad):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _save(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _mix_op_backward(ctx, grad):
    return mix_backward_op(*ctx.saved_tensors, grad.contiguous())


mix_op.register_autograd(_mix_op_backward, setup_context=_save)


class Block(nn.Module):
    def __init__(self, hidden: int, intermediate: int, mix):
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
        self.conv = nn.Conv1d(hidden, hidden, 4, groups=hidden, padding=3)
        self.qkvg = nn.Linear(hidden, 4 * hidden, bias=False)
        self.out = nn.Linear(hidden, hidden, bias=False)
        self.up = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)
        self.mix = mix

    def forward(self, x):
        seq = x.shape[1]
        h = self.norm1(x)
        h = F.silu(self.conv(h.transpose(1, 2))[..., :seq].transpose(1, 2))
        q, k, v, g = self.qkvg(h).chunk(4, dim=-1)
        y = self.mix(torch.sigmoid(q).contiguous(), torch.sigmoid(k).contiguous(), v.contiguous())
        x = x + self.out(y * F.silu(g))
        a, b = self.up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(a) * b)


class Model(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int, intermediate: int, mix, compile_blocks: bool = False):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden, intermediate, mix) for _ in range(layers))
        self.norm = nn.RMSNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.calls = [torch.compile(b, fullgraph=mix is mix_op) if compile_blocks else b for b in self.blocks]

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.calls:
            x = block(x)
        logits = self.head(self.norm(x)).float()
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


VARIANTS = ("eager", "blocks compiled, mixer a break", "blocks compiled, mixer a custom op",
            "model compiled, mixer a custom op", "captured")


def build(variant: str, args, device: torch.device):
    torch.manual_seed(0)
    mix = mix_op if "custom op" in variant else mix_with_break
    model = Model(args.vocab, args.hidden, args.layers, args.intermediate, mix, compile_blocks=variant.startswith("blocks"))
    model = model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    forward = torch.compile(model, fullgraph=True) if variant.startswith("model") else model
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def loss_of(ids):
        with amp:
            return forward(ids)

    return model, opt, loss_of


def measure(variant: str, args, device: torch.device) -> dict:
    torch._dynamo.reset()  # nothing compiled for an earlier variant is reused or guarded against
    model, opt, loss_of = build(variant, args, device)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=device, generator=torch.Generator(device).manual_seed(0))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step():
        loss = loss_of(ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=variant != "captured")
        return loss

    first = step().item()
    if variant == "captured":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        opt.zero_grad(set_to_none=False)
        with torch.cuda.graph(graph):
            static_loss = loss_of(ids)
            static_loss.backward()
        run = lambda: (graph.replay(), opt.step(), opt.zero_grad(set_to_none=False))  # noqa: E731
    else:
        for _ in range(3):
            step()
        run = step
    times, hosts = [], []
    for _ in range(args.steps):
        sync()
        t0 = time.perf_counter()
        if variant == "captured":
            graph.replay()
        else:
            loss_of(ids).backward()
        hosts.append(time.perf_counter() - t0)  # the forward and backward issued, the GPU drained before
        sync()
        opt.step()
        opt.zero_grad(set_to_none=variant != "captured")
    for _ in range(args.steps):
        sync()
        t0 = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - t0)
    del model, opt
    return {"step_ms": round(statistics.median(times) * 1e3, 2), "host_fwd_bwd_ms": round(statistics.median(hosts) * 1e3, 2),
            "first_loss": round(first, 5)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=9)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--variant", action="append", choices=VARIANTS, help="repeatable; default: every one (captured on CUDA only)")
    parser.add_argument("--out", default=None, help="JSON of the rows")
    args = parser.parse_args()
    device = torch.device(args.device)
    variants = args.variant or [v for v in VARIANTS if v != "captured" or device.type == "cuda"]
    rows = {}
    for variant in variants:
        t0 = time.perf_counter()
        rows[variant] = measure(variant, args, device)
        rows[variant]["wall_s"] = round(time.perf_counter() - t0, 1)
        print(f"{variant}: {rows[variant]}", flush=True)
    captured = rows.get("captured", {}).get("step_ms")
    print(f"\n{args.layers} blocks x {args.hidden}, {args.batch} x {args.seq} tokens, on {device.type}"
          + (f" ({torch.cuda.get_device_name()})" if device.type == "cuda" else ""))
    print(f"{'variant':40s} {'step ms':>9s} {'host fwd+bwd ms':>16s} {'captured / step':>16s}")
    for variant, row in rows.items():
        ratio = f"{captured / row['step_ms']:.2f}" if captured else "-"
        print(f"{variant:40s} {row['step_ms']:9.2f} {row['host_fwd_bwd_ms']:16.2f} {ratio:>16s}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"settings": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
