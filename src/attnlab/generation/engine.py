"""The generation engine: greedy, sampling and beam search for attnlab and HF causal LMs.

`generate(model, tokenizer, prompts, config)` takes prompts as strings or token lists of any
lengths; batching, left padding and attention masks are its own business. Semantics follow
transformers' `generate` (max_new_tokens / min_new_tokens, EOS handling, beam scoring), and the
tests hold it to HF token for token.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from attnlab.config import GenerateConfig
from attnlab.config.loader import validate_section
from attnlab.errors import ConfigError, DataError
from attnlab.models.kernels import triton_installed

from .beam import beam_search
from .graphs import make_runner
from .processors import repetition_penalty, suppress_eos, warp_for_sampling
from .results import Candidate, GenerationResult, StopStrings, finish_candidate
from .runner import SYNC_EVERY, ModelRunner, left_pad


def resolve_config(config: GenerateConfig | dict[str, Any] | None, **overrides) -> GenerateConfig:
    if isinstance(config, GenerateConfig):
        data = {k: getattr(config, k) for k in config.model_fields_set}
    else:
        data = dict(config or {})
    data.update(overrides)
    return validate_section(GenerateConfig, data, "generation settings")


def eos_ids_for(model, tokenizer, config: GenerateConfig) -> list[int]:
    """EOS ids: the config's if given, else the tokenizer's and the model's generation config's."""
    if config.eos_token_id is not None:
        ids = config.eos_token_id
        return [ids] if isinstance(ids, int) else list(ids)
    found: list[int] = []
    candidates = [getattr(tokenizer, "eos_token_id", None), getattr(getattr(model, "generation_config", None), "eos_token_id", None)]
    for c in candidates:
        for i in ([c] if isinstance(c, int) else (c or [])):
            if i not in found:
                found.append(i)
    return found


def check_prompt_lengths(model, encoded: Sequence[Sequence[int]]) -> None:
    """Refuse a prompt longer than the positions the model is configured for (`max_position_embeddings`)."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    longest = max((len(e) for e in encoded), default=0)
    if isinstance(limit, int) and longest > limit:
        raise ConfigError(f"a prompt of {longest} tokens is longer than the model's {limit} positions (max_position_embeddings); "
                          "shorten the prompt (keep its last tokens) or use a model configured for longer sequences")


def _encode(tokenizer, prompt: str | Sequence[int]) -> list[int]:
    if isinstance(prompt, str):
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:
            raise DataError(f"a prompt holds a lone surrogate ({prompt[e.start]!r} at character {e.start}), which is not text "
                            "and no tokenizer reads; write the character itself") from None
        return list(tokenizer(prompt)["input_ids"])
    ids = [int(t) for t in prompt]
    return ids


@torch.no_grad()
def generate(
    model,
    tokenizer,
    prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
    config: GenerateConfig | dict[str, Any] | None = None,
    stream: Callable[[str], None] | None = None,
    progress: Callable[[int], None] | None = None,
    **settings,
) -> list[GenerationResult]:
    """Generate a continuation (or several) for each prompt.

    prompts: one prompt or a list; a prompt is a string or a list of token ids.
    config: a GenerateConfig, a dict of its fields, or None; keyword `settings` override it.
    stream: called with each new piece of text (one prompt, one candidate only).
    progress: called with the number of prompts finished: one by one as they finish (greedy and sampling, one
      row per step), or after each batch (beam search, static batches on CUDA).
    """
    cfg = resolve_config(config, **settings)
    single = isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], int))
    prompt_list = [prompts] if single else list(prompts)
    if not prompt_list:
        return []
    if stream is not None and (len(prompt_list) > 1 or cfg.num_return_sequences > 1 or cfg.num_beams > 1):
        raise ConfigError("streaming needs one prompt, one returned sequence and no beam search")
    encoded = [_encode(tokenizer, p) for p in prompt_list]
    if any(len(e) == 0 for e in encoded):
        raise ConfigError("a prompt is empty after tokenisation; every prompt needs at least one token")
    check_prompt_lengths(model, encoded)
    eos = eos_ids_for(model, tokenizer, cfg)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    stops = StopStrings(tokenizer, cfg.stop)
    was_training = model.training
    model.eval()
    runner = make_runner(model, cfg.cuda_graphs)
    runner.reserve(cfg.max_new_tokens)
    try:
        # Decode in batches of similar lengths (less padding); results return in prompt order.
        order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
        results: list[GenerationResult | None] = [None] * len(encoded)
        generator = torch.Generator(device=runner.device).manual_seed(cfg.seed)
        for start in range(0, len(order), cfg.batch_size):
            batch = order[start:start + cfg.batch_size]
            batch_prompts = [encoded[i] for i in batch]
            if cfg.num_beams > 1:
                outs = beam_search(runner, batch_prompts, cfg, eos, pad_id, stops)
            elif getattr(runner, "keeps_finished_rows", False) and not stops.stops and stream is None:
                outs = _greedy_or_sample_on_device(runner, batch_prompts, cfg, eos, pad_id, stops, generator)
            else:  # reports each prompt as it finishes: a long batch is not silent
                outs = _greedy_or_sample(runner, batch_prompts, cfg, eos, pad_id, stops, generator, stream, progress)
            for i, candidates in zip(batch, outs):
                results[i] = GenerationResult(prompt_list[i], candidates)
            if progress is not None and not outs_reported(outs):
                progress(len(batch))
    finally:
        model.train(was_training)
    return results  # type: ignore[return-value]


def generate_ids(model, tokenizer, prompts, config=None, **settings) -> list[list[int]]:
    """For evaluation code: one plain list of generated token ids per prompt (best candidate)."""
    return [r.token_ids for r in generate(model, tokenizer, prompts, config, **settings)]


def _choose(logits: torch.Tensor, seen: torch.Tensor | None, step: int, cfg: GenerateConfig, eos_t: torch.Tensor,
            generator: torch.Generator) -> torch.Tensor:
    """The next token of every row: repetition penalty, EOS suppression before min_new_tokens, then
    argmax or a draw from the warped distribution."""
    scores = logits
    if seen is not None:
        scores = repetition_penalty(scores, seen, cfg.repetition_penalty)
    if step < cfg.min_new_tokens and len(eos_t):
        scores = suppress_eos(scores, eos_t)
    if cfg.do_sample:
        probs = warp_for_sampling(scores, cfg.temperature, cfg.top_k, cfg.top_p).softmax(dim=-1)
        return torch.multinomial(probs, 1, generator=generator)[:, 0]
    return scores.argmax(dim=-1)


class _Reported(list):
    """The candidates of a batch whose prompts were reported to `progress` one by one as they finished."""


def outs_reported(outs) -> bool:
    return isinstance(outs, _Reported)


def _greedy_or_sample(runner: ModelRunner, prompts: list[list[int]], cfg: GenerateConfig, eos: list[int], pad_id: int,
                      stops: StopStrings, generator: torch.Generator, stream, progress=None) -> list[list[Candidate]]:
    n = cfg.num_return_sequences
    rows = [p for p in prompts for _ in range(n)]  # each prompt n times, like HF's expansion
    input_ids, mask = left_pad(rows, pad_id, runner.device)
    logits, state = runner.prefill(input_ids, mask)
    vocab = logits.shape[-1]
    eos_t = torch.tensor([e for e in eos if e < vocab], dtype=torch.long, device=runner.device)
    eos_set = set(eos)
    seen = None
    if cfg.repetition_penalty != 1.0:
        seen = torch.zeros(len(rows), vocab, dtype=torch.bool, device=runner.device)
        seen.scatter_(1, input_ids, mask.bool())

    generated: list[list[int]] = [[] for _ in rows]
    finished: list[Candidate | None] = [None] * len(rows)
    logprob = [0.0] * len(rows)
    active = list(range(len(rows)))  # original row of each batch row
    streamed = 0
    left = [n] * len(prompts)  # rows of each prompt still being generated

    def finish(row: int, candidate: Candidate) -> None:
        finished[row] = candidate
        left[row // n] -= 1
        if progress is not None and left[row // n] == 0:
            progress(1)
    for step in range(cfg.max_new_tokens):
        next_tokens = _choose(logits, None if seen is None else seen[active], step, cfg, eos_t, generator)
        if cfg.output_scores:
            chosen = logits.log_softmax(-1).gather(1, next_tokens[:, None])[:, 0].tolist()
        if seen is not None:
            seen[torch.tensor(active, device=runner.device), next_tokens] = True

        keep: list[int] = []
        for j, (row, token) in enumerate(zip(active, next_tokens.tolist())):
            if finished[row] is not None:  # a finished row kept in a static batch: its output is ignored
                continue
            if cfg.output_scores:
                logprob[row] += chosen[j]
            score = logprob[row] if cfg.output_scores else None
            if token in eos_set:
                finish(row, finish_candidate(stops, generated[row], "eos", score))
                continue
            generated[row].append(token)
            if stops.stops and stops.cut(stops.decode(generated[row])) is not None:
                finish(row, finish_candidate(stops, generated[row], "stop", score))
            elif len(generated[row]) >= cfg.max_new_tokens:
                finish(row, finish_candidate(stops, generated[row], "length", score))
            else:
                keep.append(j)
        if stream is not None:
            streamed = _stream(stream, stops, generated[0], streamed, done=finished[0] is not None, final=finished[0])
        if not keep:
            break
        # Drop finished rows from the batch and the cache, except where the batch is static (CUDA
        # graphs) or rows are sampled: sampling then draws from the same generator stream either way.
        if len(keep) < len(active) and not cfg.do_sample and not getattr(runner, "keeps_finished_rows", False):
            keep_t = torch.tensor(keep, device=runner.device)
            runner.select(state, keep_t)
            next_tokens = next_tokens.index_select(0, keep_t)
            active = [active[j] for j in keep]
        logits = runner.step(next_tokens, state)
    return _Reported(finished[i * n:(i + 1) * n] for i in range(len(prompts)))  # type: ignore[misc]


FUSED_GREEDY = True  # on CUDA, a greedy step's argmax and bookkeeping as one kernel (greedy_kernel.py)


def _fused_greedy_step(cfg: GenerateConfig, seen: torch.Tensor | None, logits: torch.Tensor, step: int,
                       eos_t: torch.Tensor) -> Callable | None:
    """greedy_kernel.greedy_step_ where it stands in for this step's `_choose` and the bookkeeping
    after it: plain greedy (no repetition penalty, no scores, no EOS suppression left) on CUDA logits
    it reads. On CPU the PyTorch ops stay: Triton's interpreter would be far slower than they are."""
    if (not FUSED_GREEDY or cfg.do_sample or seen is not None or cfg.output_scores or not logits.is_cuda
            or (step < cfg.min_new_tokens and len(eos_t)) or not triton_installed()):
        return None
    from .greedy_kernel import DTYPES, greedy_step_  # imports triton: only where it runs

    return greedy_step_ if logits.dtype in DTYPES and logits.stride(-1) == 1 else None


def _greedy_or_sample_on_device(runner: ModelRunner, prompts: list[list[int]], cfg: GenerateConfig, eos: list[int],
                                pad_id: int, stops: StopStrings, generator: torch.Generator) -> list[list[Candidate]]:
    """`_greedy_or_sample` for a static batch without stop strings or streaming: tokens, lengths and
    finish flags stay on the device, so steps are queued back to back and the host looks at them only
    every SYNC_EVERY steps (rows that finished in between run on; their outputs are ignored).
    Same tokens, finish reasons and scores as `_greedy_or_sample`."""
    n, device = cfg.num_return_sequences, runner.device
    rows = [p for p in prompts for _ in range(n)]
    input_ids, mask = left_pad(rows, pad_id, device)
    logits, state = runner.prefill(input_ids, mask)
    R, vocab = logits.shape
    eos_t = torch.tensor([e for e in eos if e < vocab], dtype=torch.long, device=device)
    seen = None
    if cfg.repetition_penalty != 1.0:
        seen = torch.zeros(R, vocab, dtype=torch.bool, device=device)
        seen.scatter_(1, input_ids, mask.bool())
    out = torch.full((R, cfg.max_new_tokens), pad_id, dtype=torch.long, device=device)
    lengths = torch.zeros(R, dtype=torch.long, device=device)  # tokens kept (EOS excluded)
    done = torch.zeros(R, dtype=torch.bool, device=device)
    ended_by_eos = torch.zeros(R, dtype=torch.bool, device=device)
    logprob = torch.zeros(R, dtype=torch.float64, device=device)  # summed as the host path sums Python floats
    all_rows = torch.arange(R, device=device)
    for step in range(cfg.max_new_tokens):
        greedy_step = _fused_greedy_step(cfg, seen, logits, step, eos_t)
        if greedy_step is not None:  # one kernel launch instead of the dozen small ops below
            next_tokens = greedy_step(logits, eos_t, done, out, lengths, ended_by_eos, step)
        else:
            next_tokens = _choose(logits, seen, step, cfg, eos_t, generator)
            live = ~done
            if cfg.output_scores:
                chosen = logits.log_softmax(-1).gather(1, next_tokens[:, None])[:, 0].double()
                logprob = logprob + torch.where(live, chosen, torch.zeros_like(chosen))
            if seen is not None:
                seen[all_rows, next_tokens] = True
            is_eos = torch.isin(next_tokens, eos_t) & live if len(eos_t) else torch.zeros_like(live)
            keep = live & ~is_eos
            out[:, step] = torch.where(keep, next_tokens, out[:, step])
            lengths += keep.long()
            ended_by_eos |= is_eos
            done |= is_eos
        if step + 1 == cfg.max_new_tokens or ((step + 1) % SYNC_EVERY == 0 and bool(done.all())):
            break
        logits = runner.step(next_tokens, state)
    tokens, lengths_h, eos_h = out.tolist(), lengths.tolist(), ended_by_eos.tolist()
    scores_h = logprob.tolist() if cfg.output_scores else [None] * R
    finished = [finish_candidate(stops, tokens[r][:lengths_h[r]], "eos" if eos_h[r] else "length", scores_h[r]) for r in range(R)]
    return [finished[i * n:(i + 1) * n] for i in range(len(prompts))]


def _stream(emit, stops: StopStrings, token_ids: list[int], streamed: int, done: bool, final: Candidate | None) -> int:
    """Emit the text decoded so far beyond `streamed` characters; hold back what a stop string could still claim."""
    if done and final is not None:
        text = final.text
    else:
        text = stops.decode(token_ids)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for its next bytes
            text = text[:-1]
        hold = max((len(s) for s in stops.stops), default=1) - 1
        text = text[: max(len(text) - hold, streamed)]
    if len(text) > streamed:
        emit(text[streamed:])
    return max(streamed, len(text))
