"""Logit processing, with the semantics of the matching transformers logits processors.

All functions take and return fp32 scores [rows, vocab] and never change them in place.
"""

from __future__ import annotations

import torch


def suppress_eos(scores: torch.Tensor, eos_ids: torch.Tensor) -> torch.Tensor:
    """min_new_tokens not yet reached: no EOS token may be chosen."""
    scores = scores.clone()
    scores[:, eos_ids] = float("-inf")
    return scores


def repetition_penalty(scores: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """Tokens in `seen` [rows, vocab] (bool) get their score divided (if > 0) or multiplied (if < 0) by `penalty`."""
    penalised = torch.where(scores < 0, scores * penalty, scores / penalty)
    return torch.where(seen, penalised, scores)


def warp_for_sampling(scores: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus), as HF's sampling warpers; removed tokens get -inf.

    The best score is subtracted before dividing by the temperature (softmax is unchanged by it): a
    tiny temperature then sends the others to -inf instead of every score to +-inf, whose difference
    is NaN, so that temperature -> 0 samples the most likely token as greedy decoding picks it.
    """
    scores = scores.float()
    scores = (scores - scores.amax(dim=-1, keepdim=True)) / temperature
    if top_k > 0:
        k = min(top_k, scores.shape[-1])
        kth_best = torch.topk(scores, k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth_best, float("-inf"))
    if top_p < 1.0:
        sorted_scores, sorted_idx = torch.sort(scores, descending=False, dim=-1)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= (1 - top_p)
        remove_sorted[:, -1] = False  # always keep the most likely token
        remove = remove_sorted.scatter(1, sorted_idx, remove_sorted)
        scores = scores.masked_fill(remove, float("-inf"))
    return scores
