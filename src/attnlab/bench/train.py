"""Training throughput, side by side in one process: attnlab GLA, fla's GLAForCausalLM, HF Llama (SDPA).

Same width, depth and vocabulary for all three (untied embeddings, the SwiGLU width fla's GLA
uses); bf16 autocast over fp32 weights, fused AdamW; median step time over timed steps after a
warm-up (fla's kernels autotune on first use), peak memory from the CUDA allocator over the
whole run of a model (capture included): allocated, and reserved (what the process holds; a
captured graph's activations live in memory reserved for it, which `allocated` does not count
while the graph replays). attnlab GLA runs its step as `attnlab train` does, with
the forward and backward captured as CUDA graphs (attnlab.train.graphs); `attnlab-gla-eager`
is the same model without them.
"""

from __future__ import annotations

import statistics

import torch

PEERS = ("attnlab-gla", "attnlab-gla-eager", "fla-gla", "hf-llama")


def fla_mlp_width(hidden: int, ratio: int = 4, multiple: int = 256) -> int:
    width = int(hidden * ratio * 2 / 3)
    return multiple * ((width + multiple - 1) // multiple)


def build(name: str, hidden: int, layers: int, heads: int, vocab: int):
    if name in ("attnlab-gla", "attnlab-gla-eager"):
        from attnlab.models import AttnLabConfig, AttnLabForCausalLM

        cfg = AttnLabConfig(vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=heads, mixer="gla",
                            intermediate_size=fla_mlp_width(hidden), tie_word_embeddings=False, max_position_embeddings=65536)
        return AttnLabForCausalLM(cfg)
    if name == "fla-gla":
        from fla.models import GLAConfig, GLAForCausalLM

        return GLAForCausalLM(GLAConfig(hidden_size=hidden, num_hidden_layers=layers, num_heads=heads, vocab_size=vocab))
    if name == "hf-llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=fla_mlp_width(hidden), num_hidden_layers=layers,
                          num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=65536)
        cfg._attn_implementation = "sdpa"
        return LlamaForCausalLM(cfg)
    raise ValueError(f"unknown model {name!r}; choose from {PEERS}")


CATEGORIES = (  # kernel name fragments -> what the time goes to
    ("gla (fla chunk/recurrent)", ("chunk", "recurrent", "cumsum")),
    ("matmul", ("gemm", "nvjet", "cutlass", "sm90_", "sm80_", "ampere", "hopper", "matmul")),
    ("attention (sdpa/flash)", ("flash", "fmha", "attention", "sdp")),
    ("norms/swiglu/ce (fused)", ("layer_norm", "rms", "swiglu", "cross_entropy", "logsumexp", "softmax")),
    ("optimizer", ("adam", "multi_tensor")),
    ("elementwise/copies", ("elementwise", "vectorized", "copy", "reduce", "fill", "cat", "index", "unrolled")),
)


def host_ms(step, repeats: int = 3) -> float:
    """How long the host takes to issue one step (median), with the GPU drained before each: when
    this is close to the step time, the step is bound by the host, not by the GPU's kernels."""
    import time

    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return round(statistics.median(times) * 1000, 1)


def profile_step(step) -> dict:
    """One training step under the profiler: GPU time per kernel category, the top kernels, the
    host's time to issue the step, and the host-side calls that take most of it."""
    from torch.profiler import ProfilerActivity, profile

    issue_ms = host_ms(step)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    host_calls = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:10]
    kernels: dict[str, float] = {}
    launches = 0
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            kernels[evt.name] = kernels.get(evt.name, 0.0) + evt.device_time / 1000  # ms
            launches += 1
    total = sum(kernels.values()) or 1.0
    shares: dict[str, float] = {}
    for kname, ms in kernels.items():
        low = kname.lower()
        cat = next((c for c, frags in CATEGORIES if any(f in low for f in frags)), "other")
        shares[cat] = shares.get(cat, 0.0) + ms
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:12]
    return {"gpu_ms": round(total, 3), "kernels": launches, "host_issue_ms": issue_ms,
            "host_self_ms": [[e.key[:60], e.count, round(e.self_cpu_time_total / 1000, 2)] for e in host_calls],
            "by_category_ms": {k: round(v, 3) for k, v in sorted(shares.items(), key=lambda kv: -kv[1])},
            "top_kernels_ms": [[k[:90], round(v, 3)] for k, v in top]}


def bench_train(name: str, hidden: int, layers: int, heads: int, vocab: int, batch: int, seq_len: int,
                steps: int = 10, warmup: int = 3, grad_checkpointing: bool = False, profile: bool = False) -> dict:
    torch.manual_seed(0)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = build(name, hidden, layers, heads, vocab).cuda().train()
    if grad_checkpointing:
        model.gradient_checkpointing_enable()
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randint(0, vocab, (batch, seq_len), device="cuda")
    captured = None
    if name == "attnlab-gla":  # as `attnlab train` runs it: the step's forward and backward as CUDA graphs
        from attnlab.train.graphs import CapturedLoss, graph_blocker

        if graph_blocker(model) is None:
            captured = CapturedLoss(model, x, x, torch.bfloat16)

    def step():
        if captured is not None:
            loss = captured.loss(x, x)
        else:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    row = {"model": name, "params_M": round(params / 1e6, 1), "batch": batch, "seq_len": seq_len, "cuda_graphs": captured is not None}
    try:
        for _ in range(warmup):
            step()
        torch.cuda.synchronize()
        times = []
        for _ in range(steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss = step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        step_s = statistics.median(times)
        row.update(step_s=round(step_s, 4), tok_per_s=round(batch * seq_len / step_s), peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
                   reserved_gib=round(torch.cuda.max_memory_reserved() / 2**30, 2),
                   loss=round(float(loss), 3))
        if profile:
            row["profile"] = profile_step(step)
    except torch.cuda.OutOfMemoryError:
        row.update(step_s=None, tok_per_s=None, peak_gib=None, reserved_gib=None, error="out of memory")
    del model, opt, captured
    torch.cuda.empty_cache()
    return row


def saved_for_backward(name: str, hidden: int, layers: int, heads: int, vocab: int, batch: int, seq_len: int, top: int = 15) -> dict:
    """What one forward under bf16 autocast keeps for the backward: GiB in all, and the largest
    groups of saved tensors by (module path with layer numbers as *, shape, dtype)."""
    import gc
    import re

    torch.manual_seed(0)
    model = build(name, hidden, layers, heads, vocab).cuda().train()
    x = torch.randint(0, vocab, (batch, seq_len), device="cuda")
    where: list[str] = ["(top)"]
    hooks = []
    for mod_name, module in model.named_modules():
        label = re.sub(r"\.\d+\.", ".*.", f".{mod_name}.").strip(".") or "(model)"
        hooks.append(module.register_forward_pre_hook(lambda m, a, label=label: where.append(label)))
        hooks.append(module.register_forward_hook(lambda m, a, o: where.pop() and None))  # a hook that returns a value replaces the output
    seen = {(p.untyped_storage().data_ptr(), p.untyped_storage().nbytes()) for p in model.parameters()}  # weights are not activations
    groups: dict[tuple[str, str, str], list[float]] = {}

    def pack(t: torch.Tensor):
        if t.device.type == "cuda":
            storage = t.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
            if key not in seen:
                seen.add(key)
                g = groups.setdefault((where[-1], "x".join(map(str, t.shape)), str(t.dtype).replace("torch.", "")), [0, 0.0])
                g[0] += 1
                g[1] += storage.nbytes() / 2**30
        return t.detach()  # the same storage, without a reference back to the graph

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=x).loss
        del loss
        gc.collect()  # a saved output held by its own node is a reference cycle: free the graph before the next model
    finally:
        for h in hooks:
            h.remove()
    rows = sorted(((k, v) for k, v in groups.items()), key=lambda kv: -kv[1][1])
    total = sum(v[1] for k, v in rows)
    del model
    torch.cuda.empty_cache()
    return {"model": name, "saved_gib": round(total, 3),
            "largest": [[where_, shape, dtype, n, round(gib, 3)] for (where_, shape, dtype), (n, gib) in rows[:top]]}
