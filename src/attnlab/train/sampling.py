"""The short sample printed at each validation: temperature + top-k sampling over the model's cache.

It draws from its own seeded generator, so sampling never moves the training RNG.
"""

from __future__ import annotations

import torch

from attnlab.models.hf_names import cache_of


@torch.no_grad()
def sample_continuation(model, tokenizer, prompt: str, max_new_tokens: int, temperature: float = 0.8,
                        top_k: int = 40, seed: int = 0) -> str:
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"].to(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    eos = tokenizer.eos_token_id
    out, cache, new = None, None, []
    x = ids
    for _ in range(max_new_tokens):
        out = model(input_ids=x, cache=cache, use_cache=True, logits_to_keep=1)
        cache = cache_of(out)
        logits = out.logits[:, -1, :].float() / temperature  # [1, V]
        if top_k:
            kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        next_id = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen)  # [1, 1]
        if eos is not None and next_id.item() == eos:
            break
        new.append(next_id.item())
        x = next_id
    model.train(was_training)
    return tokenizer.decode(new, skip_special_tokens=True)
