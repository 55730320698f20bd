"""Decode throughput: attnlab's engine against HF `generate` on the same model and prompts."""

from __future__ import annotations

import statistics
import time

import torch

from attnlab.generation import generate_ids


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.no_grad()
def bench_decode(model, tokenizer, batch_sizes: list[int], prompt_len: int, new_tokens: int, repeats: int = 3,
                 compare_hf: bool = True, seed: int = 0) -> list[dict]:
    """Greedy decoding of `new_tokens` after random prompts of `prompt_len` tokens; EOS never stops a row."""
    device = next(model.parameters()).device
    vocab = min(model.config.vocab_size, len(tokenizer))
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for batch in batch_sizes:
        prompts = torch.randint(0, min(vocab, 256), (batch, prompt_len), generator=gen)
        engine_s = _timed(lambda: generate_ids(model, tokenizer, prompts.tolist(), max_new_tokens=new_tokens,
                                               eos_token_id=[], batch_size=batch), device, repeats)
        row = {"batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens,
               "attnlab_s": round(engine_s, 4), "attnlab_new_tok_per_s": round(batch * new_tokens / engine_s, 1)}
        if compare_hf:
            ids, mask = prompts.to(device), torch.ones_like(prompts).to(device)
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
            hf_s = _timed(lambda: model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad), device, repeats)
            row.update(hf_generate_s=round(hf_s, 4), hf_generate_new_tok_per_s=round(batch * new_tokens / hf_s, 1),
                       speedup=round(hf_s / engine_s, 2))
        rows.append(row)
    return rows
