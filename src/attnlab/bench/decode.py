"""Decode throughput: attnlab's engine against HF `generate`, greedy and beam search.

Rows are decoded with EOS disabled, so every row produces exactly `new_tokens` tokens and the
timings compare equal work. On CUDA the engine decodes through CUDA graphs the models whose
layers keep fixed-size states or static KV buffers, and HF causal LMs over a static KV cache; HF
`generate` runs the same model, or a peer model (fla's GLAForCausalLM) given as `hf_model`.
"""

from __future__ import annotations

import torch

from attnlab.bench.timing import median_time, profile_step
from attnlab.generation import generate_ids
from attnlab.generation.graphs import StaticRunner, make_runner, static_decoding
from attnlab.generation.hf_static import HFStaticRunner


class IdTokenizer:
    """For randomly initialised models with any vocabulary: token ids are their own text."""

    pad_token_id, eos_token_id = 0, None

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return self.vocab_size

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(str(int(i)) for i in ids)


def _timed(fn, warm, device, repeats: int) -> float:
    warm()  # kernel compilation, autotuning, graph capture
    return median_time(fn, repeats, device, wall=True)[0]


def _engine(model, tokenizer, prompts, new_tokens: int, **settings):
    return generate_ids(model, tokenizer, prompts, max_new_tokens=new_tokens, eos_token_id=[], batch_size=len(prompts), **settings)


def _hf_generate(model, prompts: torch.Tensor, new_tokens: int, pad: int):
    device = next(model.parameters()).device
    ids = prompts.to(device)
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                          do_sample=False, pad_token_id=pad)


@torch.no_grad()
def _graph_step_ms(model, prompts: torch.Tensor, new_tokens: int, replays: int = 50) -> float | None:
    """Milliseconds per replay of the captured one-token step (CUDA: attnlab models that decode over
    static buffers, HF causal LMs over a static KV cache), else None. attnlab's KV buffers are sized
    for `new_tokens` after the prompts and the replays rewrite one column (the step's time at that fill)."""
    runner = make_runner(model)
    if not isinstance(runner, (StaticRunner, HFStaticRunner)):
        return None
    runner.reserve(max(new_tokens, replays + 3))  # an HF static cache advances one slot per replay
    _, state = runner.prefill(prompts, torch.ones_like(prompts))
    tokens = prompts[:, -1]
    columns = [s["length"] for s in getattr(state.cache, "states", []) if "length" in s]  # attnlab KV buffers
    for _ in range(3):
        state.cache.step(tokens)  # capture and warm up
    if state.cache.graph is None:  # the capture failed (the runner said why): no graph to time
        return None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        for length in columns:
            length.sub_(1)  # write the same column again: a KV cache never outgrows its buffers
        state.cache.graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


@torch.no_grad()
def _step_kernels(model, prompts: torch.Tensor, new_tokens: int) -> dict | None:
    """The one-token step run eagerly under the CUDA profiler: how many kernels it launches and
    their summed GPU time (what the captured graph replays, without the gaps between kernels)."""
    if prompts.device.type != "cuda":
        return None
    if static_decoding(model):
        runner = StaticRunner(model, capture=False)
        runner.reserve(new_tokens)
    elif isinstance(make_runner(model), HFStaticRunner):
        runner = HFStaticRunner(model, capture=False)
        runner.reserve(16)  # the steps below and the profiler's
    else:
        return None
    _, state = runner.prefill(prompts, torch.ones_like(prompts))
    tokens = prompts[:, -1]
    state.cache.step(tokens)
    prof = profile_step(lambda: state.cache.step(tokens))
    return {"step_kernels": prof["kernels"], "step_kernel_ms": round(prof["gpu_ms"], 3), "step_profile": prof}


@torch.no_grad()
def bench_decode(model, tokenizer, batch_sizes: list[int], prompt_len: int, new_tokens: int, repeats: int = 3,
                 compare_hf: bool = True, seed: int = 0, hf_model=None, beams: int = 1, hf_repeats: int | None = None,
                 profile: bool = False) -> list[dict]:
    """Greedy decoding of `new_tokens` after random prompts of `prompt_len` tokens; EOS never stops a row.

    hf_model: time HF generate on this model instead of `model` (same prompts).
    beams > 1: also time beam search with that many beams, and greedy over batch x beams rows, so
    that the cost per generated token of the two can be compared (`beam_cost_ratio`).
    """
    device = next(model.parameters()).device
    vocab = min(model.config.vocab_size, len(tokenizer))
    gen = torch.Generator().manual_seed(seed)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    hf_target = hf_model if hf_model is not None else model
    rows = []
    for batch in batch_sizes:
        prompts = torch.randint(0, min(vocab, 256), (batch, prompt_len), generator=gen)
        as_lists = prompts.tolist()
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        engine_s = _timed(lambda: _engine(model, tokenizer, as_lists, new_tokens), lambda: _engine(model, tokenizer, as_lists, 4), device, repeats)
        row = {"batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens,
               "attnlab_s": round(engine_s, 4), "attnlab_new_tok_per_s": round(batch * new_tokens / engine_s, 1)}
        if device.type == "cuda":  # weights, prefill, static buffers and captured graphs together
            row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        step_ms = _graph_step_ms(model, prompts.to(device), new_tokens)
        if step_ms is not None:
            # the captured step alone, replayed back to back: what the engine's per-step work adds is the rest
            row.update(graph_step_ms=round(step_ms, 3), engine_step_ms=round((engine_s * 1000) / new_tokens, 3))
            if profile:
                prefill_s = _timed(lambda: _engine(model, tokenizer, as_lists, 1), lambda: None, device, repeats)
                row.update(prefill_ms=round(prefill_s * 1000, 1))
                row.update(_step_kernels(model, prompts.to(device), new_tokens) or {})
        if compare_hf:
            hf_s = _timed(lambda: _hf_generate(hf_target, prompts, new_tokens, pad), lambda: _hf_generate(hf_target, prompts, 4, pad),
                          device, hf_repeats or repeats)
            row.update(hf_generate_s=round(hf_s, 4), hf_generate_new_tok_per_s=round(batch * new_tokens / hf_s, 1),
                       speedup=round(hf_s / engine_s, 2))
        if beams > 1:
            wide = [p for p in as_lists for _ in range(beams)]
            greedy_wide_s = _timed(lambda: _engine(model, tokenizer, wide, new_tokens), lambda: _engine(model, tokenizer, wide, 4), device, repeats)
            beam_s = _timed(lambda: _engine(model, tokenizer, as_lists, new_tokens, num_beams=beams),
                            lambda: _engine(model, tokenizer, as_lists, 4, num_beams=beams), device, repeats)
            row.update(beams=beams, greedy_rows_x_beams_s=round(greedy_wide_s, 4), beam_s=round(beam_s, 4),
                       beam_cost_ratio=round(beam_s / greedy_wide_s, 2))
        rows.append(row)
    return rows
