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

from .processors import repetition_penalty
from .results import Candidate, StopStrings, finish_candidate
from .runner import SYNC_EVERY, ModelRunner, left_pad

NEG = -1.0e9  # HF's "impossible" score


def _gather(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """t [B, N, ...], idx [B, M] -> [B, M, ...]."""
    expanded = idx.reshape(idx.shape + (1,) * (t.dim() - 2)).expand(idx.shape + t.shape[2:])
    return torch.gather(t, 1, expanded)


def _advance(s: dict[str, torch.Tensor], t_dev: torch.Tensor, t: int, cfg: GenerateConfig, eos_t: torch.Tensor,
             top_k_slots: torch.Tensor, stops: StopStrings, on_device: bool) -> dict[str, torch.Tensor]:
    """One step of the search from the logits in `s`, on the device: the new running beams and
    finished hypotheses, whether each item is done (`finished`), the rows of the last step each
    beam continues (`beam_rows`) and the beams' next tokens (`tokens`). The step's index is the
    0-dim tensor `t_dev`, so that the same operations serve every step (recorded once as a CUDA
    graph, `_CapturedSearch`); the host's `t` is read only for stop strings."""
    K, L, lp = cfg.num_beams, cfg.max_new_tokens, cfg.length_penalty
    running, running_scores = s["running"], s["running_scores"]
    n, V = running.shape[0], s["logits"].shape[-1]
    keep_n = top_k_slots.shape[0]
    log_probs = s["logits"].log_softmax(dim=-1)  # [n*K, V]
    if cfg.min_new_tokens > 0 and len(eos_t):
        log_probs[:, eos_t] = torch.where(t_dev < cfg.min_new_tokens, float("-inf"), log_probs[:, eos_t])
    if cfg.repetition_penalty != 1.0:
        before = (torch.arange(L, device=running.device) < t_dev).long().expand(n * K, L)  # tokens generated so far
        seen = torch.zeros(n * K, V, dtype=torch.long, device=running.device).scatter_add_(1, running.reshape(n * K, L), before)
        seen = (seen > 0) | s["prompt_seen"].repeat_interleave(K, dim=0)
        log_probs = repetition_penalty(log_probs, seen, cfg.repetition_penalty)
    scores = (log_probs.view(n, K, V) + running_scores[:, :, None]).view(n, K * V)
    cand_scores, cand_idx = torch.topk(scores, keep_n, dim=1)  # [n, keep_n]
    parent, token = cand_idx // V, cand_idx % V
    cand = _gather(running, parent).scatter_(2, t_dev.view(1, 1, 1).expand(n, keep_n, 1), token[:, :, None])

    ends = torch.isin(token, eos_t) if len(eos_t) else torch.zeros_like(token, dtype=torch.bool)
    ends = ends | (t_dev + 1 == L)
    if stops.stops:
        ends |= _stop_hits(stops, cand, t, ends)

    # Running beams: the best K candidates that did not end.
    masked = cand_scores + ends.float() * NEG
    next_idx = torch.topk(masked, K, dim=1).indices
    new = {"running": _gather(cand, next_idx), "running_scores": _gather(masked, next_idx)}
    running_parent = _gather(parent, next_idx)

    # Finished hypotheses: merge the new ones into the best K so far.
    length = (t_dev + 1).double()
    new_scores = cand_scores / (length ** lp).float()
    full = s["done_flags"].all(dim=1, keepdim=True) & (cfg.early_stopping is True)
    new_scores = new_scores + full.float() * NEG + (~s["improvable"]).float() * NEG
    just_done = ends & top_k_slots[None, :]
    new_scores = new_scores + (~just_done).float() * NEG
    merged_scores = torch.cat([s["done_scores"], new_scores], dim=1)
    best = torch.topk(merged_scores, K, dim=1).indices
    done = {"done_seqs": _gather(torch.cat([s["done_seqs"], cand], dim=1), best),
            "done_lens": _gather(torch.cat([s["done_lens"], (t_dev + 1).expand_as(token)], dim=1), best),
            "done_flags": _gather(torch.cat([s["done_flags"], just_done], dim=1), best),
            "done_scores": _gather(merged_scores, best)}

    # Can a running beam still beat the worst finished one?
    best_len = torch.full_like(length, L) if (cfg.early_stopping == "never" and lp > 0.0) else length
    best_running = new["running_scores"][:, :1] / (best_len ** lp).float()
    worst_done = torch.where(done["done_flags"], done["done_scores"].min(dim=1, keepdim=True).values,
                             torch.full_like(done["done_scores"], NEG))
    new["improvable"] = s["improvable"] & (best_running > worst_done).any(dim=1, keepdim=True)
    finished = (~new["improvable"][:, 0]) | (done["done_flags"].all(dim=1) & (cfg.early_stopping is True)) | ends.all()
    if on_device:  # items finished at an earlier step keep their hypotheses as they were
        keep = s["frozen"][:, None]
        done = {name: torch.where(keep if value.dim() == 2 else keep[:, :, None], s[name], value) for name, value in done.items()}
        finished = finished | s["frozen"]
        new["frozen"] = finished
    new.update(done)
    new["finished"] = finished
    new["beam_rows"] = running_parent + torch.arange(n, device=running.device)[:, None] * K  # [n, K] rows of the last step
    new["tokens"] = new["running"].gather(2, t_dev.view(1, 1, 1).expand(n, K, 1)).reshape(-1)
    return new


class _CapturedSearch:
    """The search's step and the state's reorder, recorded once as a CUDA graph over the buffers of
    `s` (static runners on CUDA, items staying in the batch): one replay instead of the step's many
    small operations, which otherwise wait for the host when the model's own step is short."""

    def __init__(self, s: dict[str, torch.Tensor], step):
        self.graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.graph(self.graph, stream=side):
            for name, value in step().items():
                s[name].copy_(value)
        torch.cuda.current_stream().wait_stream(side)

    def replay(self) -> None:
        self.graph.replay()


@torch.no_grad()
def beam_search(runner: ModelRunner, prompts: list[list[int]], cfg: GenerateConfig, eos: list[int], pad_id: int,
                stops: StopStrings) -> list[list[Candidate]]:
    K, L = cfg.num_beams, cfg.max_new_tokens
    device = runner.device
    input_ids, mask = left_pad(prompts, pad_id, device)
    logits, state = runner.prefill(input_ids, mask)  # [B, V]
    B, V = logits.shape
    expand = torch.arange(B, device=device).repeat_interleave(K)
    runner.select(state, expand)  # every prompt's state copied to its K beams

    eos_t = torch.tensor([e for e in eos if e < V], dtype=torch.long, device=device)
    keep_n = max(2, 1 + len(eos_t)) * K  # candidates kept per prompt and step
    top_k_slots = torch.arange(keep_n, device=device) < K  # only the best K candidates may finish

    running_scores = torch.zeros(B, K, device=device)
    running_scores[:, 1:] = NEG  # all beams start identical: expand only the first
    s = {
        "logits": logits.float().index_select(0, expand),  # [B*K, V]
        "running": torch.full((B, K, L), pad_id, dtype=torch.long, device=device),  # generated tokens
        "running_scores": running_scores,
        "done_seqs": torch.full((B, K, L), pad_id, dtype=torch.long, device=device),
        "done_lens": torch.zeros(B, K, dtype=torch.long, device=device),
        "done_scores": torch.full((B, K), NEG, device=device),
        "done_flags": torch.zeros(B, K, dtype=torch.bool, device=device),
        "improvable": torch.ones(B, 1, dtype=torch.bool, device=device),
        "frozen": torch.zeros(B, dtype=torch.bool, device=device),  # items finished at an earlier step (on_device)
        "finished": torch.zeros(B, dtype=torch.bool, device=device),
        "beam_rows": torch.zeros(B, K, dtype=torch.long, device=device),
        "tokens": torch.zeros(B * K, dtype=torch.long, device=device),
    }
    if cfg.repetition_penalty != 1.0:
        s["prompt_seen"] = torch.zeros(B, V, dtype=torch.bool, device=device).scatter_(1, input_ids, mask.bool())
    items = list(range(B))  # original prompt index of each batch item
    out: list[list[Candidate] | None] = [None] * B
    # A static runner keeps finished items in the batch (their finished hypotheses frozen), so the
    # host looks at the search only every SYNC_EVERY steps instead of after each one; stop strings
    # need the host at every step. On CUDA such a runner's search step (with the reorder of the
    # state, where the runner reorders in place) is a CUDA graph from the second step on.
    on_device = getattr(runner, "keeps_finished_rows", False) and not stops.stops
    in_graph = on_device and device.type == "cuda" and getattr(runner, "capture", False)
    t_dev = torch.zeros((), dtype=torch.long, device=device)
    captured: _CapturedSearch | None = None

    def step(t: int) -> dict[str, torch.Tensor]:
        new = _advance(s, t_dev, t, cfg, eos_t, top_k_slots, stops, on_device)
        if in_graph and getattr(runner, "reorders_in_place", False):
            runner.select(state, new["beam_rows"].reshape(-1), group=K)
        return new

    for t in range(L):
        n = len(items)
        t_dev.fill_(t)
        if captured is not None:
            captured.replay()
        elif in_graph and t == 1:  # the first step ran eagerly (lazy initialisation, allocations)
            captured = _CapturedSearch(s, lambda: step(t))
            captured.replay()
        else:
            s.update(step(t))
        if on_device:
            if t + 1 == L or (t + 1) % SYNC_EVERY == 0:  # the host looks
                fin = [True] * n if t + 1 == L else s["finished"].tolist()
                for j in range(n):
                    if fin[j] and out[items[j]] is None:
                        out[items[j]] = _results(stops, s["done_seqs"][j], s["done_lens"][j], s["done_scores"][j], eos,
                                                 cfg.num_return_sequences)
                if all(fin):
                    break
        else:
            finished_items = s["finished"]  # every item at the last step, or where every candidate ended
            for j in finished_items.nonzero()[:, 0].tolist():
                out[items[j]] = _results(stops, s["done_seqs"][j], s["done_lens"][j], s["done_scores"][j], eos, cfg.num_return_sequences)
            still = (~finished_items).nonzero()[:, 0]
            if len(still) == 0:
                break
            if len(still) < n:
                for name in s:
                    if name not in ("logits", "tokens"):
                        s[name] = s[name].index_select(0, still)
                s["tokens"] = s["running"][:, :, t].reshape(-1)
                items = [items[j] for j in still.tolist()]
        if not (in_graph and getattr(runner, "reorders_in_place", False)):
            runner.select(state, s["beam_rows"].reshape(-1), group=K)  # rows stay within their prompt's K beams
        logits = runner.step(s["tokens"], state)
        if captured is not None or (in_graph and t == 0):
            s["logits"].copy_(logits)  # the graph reads this buffer
        else:
            s["logits"] = logits.float()
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
            out.append(finish_candidate(stops, tokens[:-1], "eos", score))
        else:
            out.append(finish_candidate(stops, tokens, "length", score))
    return out
