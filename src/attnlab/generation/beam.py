"""Beam search with the scoring and stopping rules of transformers' `generate`.

Per prompt, `num_beams` running hypotheses are extended by their best continuations; of the
2 * num_beams best candidates (more with several EOS ids), those that end (EOS, a stop string,
or max_new_tokens) become finished hypotheses scored by sum log p / length ** length_penalty,
and the best unfinished ones keep running. A prompt is done when no running beam can still
beat its finished ones (early_stopping=False: HF's heuristic; True: once num_beams have
finished; "never": the exact bound). Done prompts leave the batch and the cache at once.
"""

from __future__ import annotations

import torch

from attnlab.config import GenerateConfig

from .engine import SYNC_EVERY, Candidate, StopStrings, _finish
from .processors import repetition_penalty
from .runner import ModelRunner, left_pad

NEG = -1.0e9  # HF's "impossible" score


def _gather(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """t [B, N, ...], idx [B, M] -> [B, M, ...]."""
    expanded = idx.reshape(idx.shape + (1,) * (t.dim() - 2)).expand(idx.shape + t.shape[2:])
    return torch.gather(t, 1, expanded)


@torch.no_grad()
def beam_search(runner: ModelRunner, prompts: list[list[int]], cfg: GenerateConfig, eos: list[int], pad_id: int,
                stops: StopStrings) -> list[list[Candidate]]:
    K, L, lp = cfg.num_beams, cfg.max_new_tokens, cfg.length_penalty
    device = runner.device
    input_ids, mask = left_pad(prompts, pad_id, device)
    logits, state = runner.prefill(input_ids, mask)  # [B, V]
    B, V = logits.shape
    expand = torch.arange(B, device=device).repeat_interleave(K)
    runner.select(state, expand)  # every prompt's state copied to its K beams
    logits = logits.index_select(0, expand)  # [B*K, V]

    eos_t = torch.tensor([e for e in eos if e < V], dtype=torch.long, device=device)
    keep_n = max(2, 1 + len(eos_t)) * K  # candidates kept per prompt and step
    top_k_slots = torch.arange(keep_n, device=device) < K  # only the best K candidates may finish

    running = torch.full((B, K, L), pad_id, dtype=torch.long, device=device)  # generated tokens
    running_scores = torch.zeros(B, K, device=device)
    running_scores[:, 1:] = NEG  # all beams start identical: expand only the first
    done_seqs = torch.full((B, K, L), pad_id, dtype=torch.long, device=device)
    done_lens = torch.zeros(B, K, dtype=torch.long, device=device)
    done_scores = torch.full((B, K), NEG, device=device)
    done_flags = torch.zeros(B, K, dtype=torch.bool, device=device)
    improvable = torch.ones(B, 1, dtype=torch.bool, device=device)
    items = list(range(B))  # original prompt index of each batch item
    if cfg.repetition_penalty != 1.0:
        prompt_seen = torch.zeros(B, V, dtype=torch.bool, device=device).scatter_(1, input_ids, mask.bool())
    out: list[list[Candidate] | None] = [None] * B
    # A static runner keeps finished items in the batch (their finished hypotheses frozen), so the
    # host looks at the search only every SYNC_EVERY steps instead of after each one; stop strings
    # need the host at every step.
    on_device = getattr(runner, "keeps_finished_rows", False) and not stops.stops
    frozen = torch.zeros(B, dtype=torch.bool, device=device)  # items finished at an earlier step (on_device)
    item_rows = torch.arange(B, device=device)  # `items` on the device

    for t in range(L):
        n = len(items)
        before = (done_seqs, done_lens, done_flags, done_scores)
        log_probs = logits.log_softmax(dim=-1)  # [n*K, V]
        if t < cfg.min_new_tokens and len(eos_t):
            log_probs[:, eos_t] = float("-inf")
        if cfg.repetition_penalty != 1.0:
            seen = prompt_seen[item_rows].repeat_interleave(K, dim=0)  # [n*K, V]
            if t:
                seen.scatter_(1, running[:, :, :t].reshape(n * K, t), True)
            log_probs = repetition_penalty(log_probs, seen, cfg.repetition_penalty)
        scores = (log_probs.view(n, K, V) + running_scores[:, :, None]).view(n, K * V)
        cand_scores, cand_idx = torch.topk(scores, keep_n, dim=1)  # [n, keep_n]
        parent, token = cand_idx // V, cand_idx % V
        cand = _gather(running, parent)
        cand[:, :, t] = token

        ends = torch.isin(token, eos_t) if len(eos_t) else torch.zeros_like(token, dtype=torch.bool)
        if t + 1 == L:
            ends = torch.ones_like(ends)
        elif stops.stops:
            ends |= _stop_hits(stops, cand, t, ends)

        # Running beams: the best K candidates that did not end.
        masked = cand_scores + ends.float() * NEG
        next_idx = torch.topk(masked, K, dim=1).indices
        running = _gather(cand, next_idx)
        running_scores = _gather(masked, next_idx)
        running_parent = _gather(parent, next_idx)

        # Finished hypotheses: merge the new ones into the best K so far.
        new_scores = cand_scores / ((t + 1) ** lp)
        full = done_flags.all(dim=1, keepdim=True) & (cfg.early_stopping is True)
        new_scores = new_scores + full.float() * NEG + (~improvable).float() * NEG
        just_done = ends & top_k_slots[None, :]
        new_scores = new_scores + (~just_done).float() * NEG
        new_lens = torch.full_like(token, t + 1)
        merged_scores = torch.cat([done_scores, new_scores], dim=1)
        best = torch.topk(merged_scores, K, dim=1).indices
        done_seqs = _gather(torch.cat([done_seqs, cand], dim=1), best)
        done_lens = _gather(torch.cat([done_lens, new_lens], dim=1), best)
        done_flags = _gather(torch.cat([done_flags, just_done], dim=1), best)
        done_scores = _gather(merged_scores, best)

        # Can a running beam still beat the worst finished one?
        best_len = L if (cfg.early_stopping == "never" and lp > 0.0) else t + 1
        best_running = running_scores[:, :1] / (best_len ** lp)
        worst_done = torch.where(done_flags, done_scores.min(dim=1, keepdim=True).values, torch.full_like(done_scores, NEG))
        improvable = improvable & (best_running > worst_done).any(dim=1, keepdim=True)
        finished_items = (~improvable[:, 0]) | (done_flags.all(dim=1) & (cfg.early_stopping is True))
        beam_rows = running_parent + torch.arange(n, device=device)[:, None] * K  # [n, K] rows of the last step
        if on_device:
            keep = frozen[:, None]  # finished earlier: their hypotheses stay as they were
            done_seqs = torch.where(keep[:, :, None], before[0], done_seqs)
            done_lens, done_flags, done_scores = (torch.where(keep, old, new) for old, new in zip(before[1:], (done_lens, done_flags, done_scores)))
            frozen = finished_items = finished_items | frozen | ends.all()
            if t + 1 == L or (t + 1) % SYNC_EVERY == 0:  # the host looks
                fin = [True] * n if t + 1 == L else finished_items.tolist()
                for j in range(n):
                    if fin[j] and out[items[j]] is None:
                        out[items[j]] = _results(stops, done_seqs[j], done_lens[j], done_scores[j], eos, cfg.num_return_sequences)
                if all(fin):
                    break
        else:
            if t + 1 == L or bool(ends.all()):
                finished_items = torch.ones_like(finished_items)
            for j in finished_items.nonzero()[:, 0].tolist():
                out[items[j]] = _results(stops, done_seqs[j], done_lens[j], done_scores[j], eos, cfg.num_return_sequences)
            still = (~finished_items).nonzero()[:, 0]
            if len(still) == 0:
                break
            if len(still) < n:
                beam_rows = beam_rows.index_select(0, still)
                running, running_scores = running.index_select(0, still), running_scores.index_select(0, still)
                done_seqs, done_lens = done_seqs.index_select(0, still), done_lens.index_select(0, still)
                done_scores, done_flags = done_scores.index_select(0, still), done_flags.index_select(0, still)
                improvable = improvable.index_select(0, still)
                items, item_rows = [items[j] for j in still.tolist()], item_rows.index_select(0, still)
        runner.select(state, beam_rows.reshape(-1), group=K)  # rows stay within their prompt's K beams
        logits = runner.step(running[:, :, t].reshape(-1), state)
    return out  # type: ignore[return-value]


def _stop_hits(stops: StopStrings, cand: torch.Tensor, t: int, ends: torch.Tensor) -> torch.Tensor:
    hits = torch.zeros_like(ends)
    rows = cand[:, :, : t + 1].tolist()
    for i, item in enumerate(rows):
        for j, seq in enumerate(item):
            if not ends[i, j] and stops.cut(stops.decode(seq)) is not None:
                hits[i, j] = True
    return hits


def _results(stops: StopStrings, seqs: torch.Tensor, lens: torch.Tensor, scores: torch.Tensor, eos: list[int], n: int) -> list[Candidate]:
    out = []
    for seq, length, score in zip(seqs[:n].tolist(), lens[:n].tolist(), scores[:n].tolist()):
        tokens = seq[:length]
        if tokens and tokens[-1] in eos:
            out.append(_finish(stops, tokens[:-1], "eos", score))
        else:
            out.append(_finish(stops, tokens, "length", score))
    return out
