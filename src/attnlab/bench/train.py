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

import torch

from attnlab.bench.names import FLA_MODELS
from attnlab.bench.timing import median_time, peak_gib, profile_step, release

PEERS = ("attnlab-gla", "attnlab-gla-eager", "fla-gla", "hf-llama")  # what `attnlab bench train` compares by default


def fla_mlp_width(hidden: int, ratio: int = 4, multiple: int = 256) -> int:
    width = int(hidden * ratio * 2 / 3)
    return multiple * ((width + multiple - 1) // multiple)


def build(name: str, hidden: int, layers: int, heads: int, vocab: int, intermediate: int | None = None,
          mixer_options: dict[str, dict] | None = None):
    """A randomly initialised model by its bench name, every one of the same width, depth, heads,
    vocabulary and SwiGLU width (default: fla's for the width), untied embeddings.
    `mixer_options`: {mixer or preset: {option: value}} over its defaults, for attnlab's model of that
    mixer and for fla's model of the same family (`nsa`, `mamba2`).

    `attnlab-<mixer>`: any registered mixer or preset (`attnlab-gla-eager` is attnlab-gla, which the
    bench runs without CUDA graphs); `hf-llama`: LlamaForCausalLM on SDPA; `fla-gla`,
    `fla-forgetting-transformer`, `fla-nsa`, `fla-mamba2`: fla's models, NSA and Mamba-2 with
    attnlab's block and state sizes (fla's Mamba-2 blocks have no MLP). An fla model whose fast
    path needs a package that is missing (flash-attn for NSA, mamba-ssm for Mamba-2) is refused.
    """
    intermediate = intermediate or fla_mlp_width(hidden)
    options = mixer_options or {}
    if name.startswith("attnlab-"):
        from attnlab.models import AttnLabConfig, AttnLabForCausalLM

        mixer = name.removeprefix("attnlab-").removesuffix("-eager")
        cfg = AttnLabConfig(vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=heads, mixer=mixer,
                            mixer_options=options.get(mixer), intermediate_size=intermediate, tie_word_embeddings=False,
                            max_position_embeddings=131072)
        return AttnLabForCausalLM(cfg)
    if name == "hf-llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                          num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=131072)
        cfg._attn_implementation = "sdpa"
        return LlamaForCausalLM(cfg)
    if name not in FLA_MODELS:
        raise ValueError(f"unknown model {name!r}; choose from attnlab-<mixer>, hf-llama, {', '.join(FLA_MODELS)}")
    import fla.models as fm
    from attnlab.models.mixers import MIXERS

    same = dict(hidden_size=hidden, num_hidden_layers=layers, vocab_size=vocab, tie_word_embeddings=False)
    if name == "fla-gla":
        return fm.GLAForCausalLM(fm.GLAConfig(num_heads=heads, intermediate_size=intermediate, **same))
    if name == "fla-forgetting-transformer":
        return fm.ForgettingTransformerForCausalLM(fm.ForgettingTransformerConfig(num_heads=heads, intermediate_size=intermediate, **same))
    if name == "fla-nsa":
        import fla.ops.nsa.parallel as fla_nsa

        nsa = MIXERS["nsa"].resolve_options(options.get("nsa"))
        note = None
        if nsa["window_size"] and fla_nsa.flash_attn_func is None:
            nsa["window_size"], note = 0, "window 0: fla's sliding window needs flash-attn, which is not installed"
        model = fm.NSAForCausalLM(fm.NSAConfig(num_heads=heads, num_kv_heads=nsa["num_kv_heads"], head_dim=hidden // heads,
                                              block_size=nsa["block_size"], block_counts=nsa["block_counts"],
                                              window_size=nsa["window_size"], intermediate_size=intermediate,
                                              max_position_embeddings=131072, **same))
        model.bench_note = note  # the row says how this peer differs from attnlab's model
        return model
    import fla.layers.mamba2 as fla_mamba2

    if not fla_mamba2.is_fast_path_available:
        raise RuntimeError("fla's Mamba-2 runs its kernels only with mamba-ssm installed (else a naive PyTorch path)")
    ssm = MIXERS["mamba2"].resolve_options(options.get("mamba2"))
    head_dim = ssm["head_dim"] or ssm["expand"] * hidden // heads  # fla's Mamba-2 has expand * hidden / head_dim heads
    return fm.Mamba2ForCausalLM(fm.Mamba2Config(head_dim=head_dim, expand=ssm["expand"], state_size=ssm["state_size"],
                                                n_groups=ssm["n_groups"], conv_kernel=ssm["conv_kernel"], **same))


def add_size_arguments(parser, vocab: int = 32768) -> None:
    """The model size options of the benchmark scripts (`build_sized` builds from them): the issues' 300M model by default."""
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=vocab)


def build_sized(name: str, args):
    """`build(name, ...)` at the sizes of `add_size_arguments`' options."""
    return build(name, args.hidden, args.layers, args.heads, args.vocab, args.intermediate)


def train_step(model, opt, x: torch.Tensor, capture: bool = True):
    """One optimizer step on the batch x (labels = inputs), as `attnlab train` runs it: on CUDA under
    bf16 autocast, an attnlab model's forward and backward captured as CUDA graphs where they can be
    (attnlab.train.graphs; capturing runs a few steps first). Returns (step, captured)."""
    cuda = x.device.type == "cuda"
    captured = None
    if capture and cuda:
        from attnlab.train.graphs import CapturedLoss, graph_blocker

        if graph_blocker(model) is None:
            captured = CapturedLoss(model, x, x, torch.bfloat16)

    def step():
        if captured is not None:
            loss = captured.loss(x, x)
        else:
            with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=cuda):
                loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step, captured


def bench_train(name: str, hidden: int, layers: int, heads: int, vocab: int, batch: int, seq_len: int,
                steps: int = 10, warmup: int = 3, grad_checkpointing: bool = False, profile: bool = False,
                intermediate: int | None = None) -> dict:
    device = torch.device("cuda")
    torch.manual_seed(0)
    release(device)
    model = build(name, hidden, layers, heads, vocab, intermediate).cuda().train()
    if grad_checkpointing:
        model.activation_checkpointing_enable()
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randint(0, vocab, (batch, seq_len), device="cuda")
    step, captured = train_step(model, opt, x, capture=not name.endswith("-eager"))
    row = {"model": name, "params_M": round(params / 1e6, 1), "batch": batch, "seq_len": seq_len, "cuda_graphs": captured is not None}
    try:
        for _ in range(warmup):
            step()
        step_s, loss = median_time(step, steps, device)
        peak, reserved = peak_gib(device)
        row.update(step_s=round(step_s, 4), tok_per_s=round(batch * seq_len / step_s), peak_gib=peak, reserved_gib=reserved,
                   loss=round(float(loss), 3))
        if profile:
            row["profile"] = profile_step(step)
    except torch.cuda.OutOfMemoryError:
        row.update(step_s=None, tok_per_s=None, peak_gib=None, reserved_gib=None, error="out of memory")
    del model, opt, step, captured
    release(device)
    return row


def saved_for_backward(name: str, hidden: int, layers: int, heads: int, vocab: int, batch: int, seq_len: int, top: int = 15,
                       intermediate: int | None = None) -> dict:
    """What one forward under bf16 autocast keeps for the backward: GiB in all, and the largest
    groups of saved tensors by (module path with layer numbers as *, shape, dtype)."""
    import gc
    import re

    torch.manual_seed(0)
    model = build(name, hidden, layers, heads, vocab, intermediate).cuda().train()
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
