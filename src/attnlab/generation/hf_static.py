"""Static decoding for Hugging Face causal LMs (Llama, Qwen3, SmolLM2, ...): a preallocated KV
cache and the one-token step captured as a CUDA graph.

transformers' `StaticCache` keeps every layer's keys and values in buffers of one length, written
in place at the position the layer counts on the device (`cumulative_length`). The prompt fills it
through the model's ordinary forward; then every step is the same work on the same buffers:
tokens [B, 1], position ids [B, 1], and a [B, 1, 1, length] mask over the whole cache that hides
each row's left padding and the slots not written yet. The step never reads a value back to the
host, so on CUDA it is recorded once per batch size and replayed for every token; elsewhere (and
in the tests) the same step runs eagerly.

Beams are reordered by a gather into the same buffers; a batch of another size (beam search's
prompts expanded to beams, prompts leaving a batch on the host path) moves its rows into the
buffers of that size. Finished rows stay in the batch, so a generation captures each size once.
The cache length is the longest prompt plus `max_new_tokens`, rounded up to a multiple of
`BLOCK`, so calls of similar lengths reuse the same buffers and graphs.

A model that this path does not cover (a sliding-window or linear-attention layer, dynamic RoPE,
an attention implementation that takes no 4D mask, or a forward that fails the probe) decodes
with the plain `ModelRunner`, and says so once.
"""

from __future__ import annotations

import inspect
import warnings
import weakref
from typing import Any

import torch

from attnlab.models.hf_names import CACHE_KEY
from attnlab.models.modeling import AttnLabPreTrainedModel
from attnlab.models.weights import weights_fingerprint

from .runner import KEPT_RUNNERS, DecodeState, GraphPool, ModelRunner

BLOCK = 256  # cache lengths are multiples of this
MASKS = {"sdpa": "bool", "eager": "additive"}  # attention implementations that take our 4D mask, and its kind
PROBE_TOLERANCE = 5e-2  # relative error of the probe's logits (static vs plain), loose enough for bf16


def static_length(needed: int) -> int:
    return BLOCK * -(-needed // BLOCK)


def static_cache_problem(model) -> str | None:
    """Why `model` cannot decode through a static cache and a 4D mask here, or None."""
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer

    if isinstance(model, AttnLabPreTrainedModel):
        return "an attnlab model (its own cache)"
    config = getattr(model, "config", None)
    if config is None:
        return "no config"
    attn = getattr(config, "_attn_implementation", None)
    if attn not in MASKS:
        return f"attention implementation {attn!r} takes no 4D mask (use sdpa or eager)"
    placed = set(getattr(model, "hf_device_map", None) and model.hf_device_map.values() or ())
    if len(placed) > 1:
        return f"its layers are spread over {', '.join(sorted(map(str, placed)))}"
    params = inspect.signature(model.forward).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    missing = [name for name in ("attention_mask", CACHE_KEY) if name not in params and not takes_any]
    if missing:
        return f"its forward takes no {', '.join(missing)}"
    for module in model.modules():
        rope = getattr(module, "rope_type", None)
        kinds = rope.values() if isinstance(rope, dict) else [rope] if isinstance(rope, str) else []
        if any("dynamic" in kind or kind == "longrope" for kind in kinds):
            return "dynamic RoPE (its frequencies change with the length, on the host)"
    try:
        cache = StaticCache(config=config, max_cache_len=BLOCK)
    except Exception as exc:  # noqa: BLE001 - any failure means: no static cache for this model
        return f"no static cache ({type(exc).__name__}: {exc})"
    kinds = sorted({type(layer).__name__ for layer in cache.layers if type(layer) is not StaticLayer})
    if kinds or not cache.layers:
        return f"cache layers {', '.join(kinds) or 'none'} (only full-attention layers are static here)"
    return None


class HFStaticStep:
    """The one-token step for one batch size over a `StaticCache` it owns, with its inputs in
    buffers: tokens [B], position ids [B], and which cache slots each row may see [B, length]."""

    def __init__(self, runner: HFStaticRunner, batch: int):
        from transformers import StaticCache

        self.runner, self.model = weakref.proxy(runner), runner.model  # weakly: the runner owns its steps
        self.batch, self.max_len = batch, runner.max_len
        device = runner.device
        self.cache = StaticCache(config=self.model.config, max_cache_len=self.max_len)
        self.tokens = torch.zeros(batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(batch, dtype=torch.long, device=device)  # position id of the next token
        self.allowed = torch.ones(batch, self.max_len, dtype=torch.bool, device=device)  # False over left padding
        self.slots = torch.arange(self.max_len, device=device)
        self.length = 0  # tokens in the cache, counted on the host: the slot the next step writes
        self.prefix = 0  # leading slots every beam of a prompt shares (the prompt's), set at prefill
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self.additive = MASKS[self.model.config._attn_implementation] == "additive"

    @property
    def initialized(self) -> bool:
        return all(layer.is_initialized for layer in self.cache.layers)

    def allocate_like(self, other: HFStaticStep) -> None:
        """Allocate the cache buffers with `other`'s heads, head sizes, dtype and device."""
        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            k, v = theirs.keys, theirs.values
            mine.lazy_initialization(k.new_empty(self.batch, k.shape[1], 0, k.shape[3]),
                                     v.new_empty(self.batch, v.shape[1], 0, v.shape[3]))

    def begin(self, attention_mask: torch.Tensor) -> None:
        """Before a prefill into this cache: empty it, and take the prompts' padding."""
        self.cache.reset()  # zeroes the buffers in place (stale slots are masked, but never NaN)
        prompt = attention_mask.shape[1]
        self.allowed[:, :prompt] = attention_mask.bool()
        self.allowed[:, prompt:] = True
        self.length = prompt

    def _run(self) -> torch.Tensor:
        written = self.cache.layers[0].cumulative_length  # on the device: the slot this token's key goes to
        visible = (self.allowed & (self.slots <= written))[:, None, None, :]  # [B, 1, 1, length]
        if self.additive:  # eager attention adds its mask: 0 where visible, the dtype's lowest elsewhere
            dtype = self.runner.dtype
            mask = (visible.to(dtype) - 1) * torch.finfo(dtype).max
        else:
            mask = visible
        kwargs: dict[str, Any] = dict(input_ids=self.tokens[:, None], attention_mask=mask, position_ids=self.positions[:, None],
                                      use_cache=True, **{CACHE_KEY: self.cache})
        if self.runner.keep_arg:
            kwargs[self.runner.keep_arg] = 1
        out = self.model(**kwargs)
        self.positions.add_(1)
        return out.logits[:, -1]

    def _capture(self) -> None:
        counters = [layer.cumulative_length.clone() for layer in self.cache.layers]
        positions = self.positions.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the graph (it writes slots that stay masked until rewritten)
            for _ in range(min(2, self.max_len - self.length)):
                self._run()
        torch.cuda.current_stream().wait_stream(side)

        def rewind():
            for layer, counter in zip(self.cache.layers, counters):
                layer.cumulative_length.copy_(counter)
            self.positions.copy_(positions)

        rewind()
        graph = torch.cuda.CUDAGraph()
        try:
            with self.runner.pool.capture(graph):
                self.logits = self._run()
        except Exception as exc:  # noqa: BLE001 - a model whose step cannot be recorded still decodes statically
            warnings.warn(f"{type(self.model).__name__}: the decode step could not be captured as a CUDA graph "
                          f"({type(exc).__name__}: {exc}); it runs eagerly over the static cache", stacklevel=2)
            self.runner.graphs = False
            torch.cuda.synchronize()
            rewind()
            return
        self.graph = graph

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B] -> next-token logits [B, vocab] (float32, a fresh tensor); the cache advances."""
        if self.length >= self.max_len:
            raise RuntimeError(f"the static cache holds {self.max_len} tokens and is full; call the runner's "
                               "reserve(max_new_tokens) before prefill")
        self.tokens.copy_(tokens)
        if self.runner.graphs and self.graph is None:
            self._capture()
        self.length += 1
        if self.graph is None:
            return self._run().float()
        self.graph.replay()
        return self.logits.float() if self.logits.dtype != torch.float32 else self.logits.clone()

    def _buffers(self):
        for layer in self.cache.layers:
            yield layer.keys
            yield layer.values

    def reorder(self, rows: torch.Tensor, group: int = 0) -> None:
        """Row r becomes old row rows[r] (beam search: rows move among the beams of one prompt), in
        place, over the slots written after the prompt: every beam of a prompt holds the same prompt.
        With `group` (rows move only within groups of that many) one pass over the rows that change."""
        if group:
            from attnlab.models.kernels.common.beam_reorder import reorder_rows_
        for buf in self._buffers():
            if group and buf.is_contiguous():  # [batch, heads, capacity, dim]
                width = buf.shape[-1]
                reorder_rows_(buf, rows, group, row_dim=0, outer_dim=1, start=self.prefix * width,
                              count=(self.length - self.prefix) * width)
                continue
            written = buf[:, :, self.prefix:self.length]
            written.copy_(written.index_select(0, rows))
        self.positions.copy_(self.positions.index_select(0, rows))
        self.allowed.copy_(self.allowed.index_select(0, rows))

    def load_rows(self, source: HFStaticStep, rows: torch.Tensor) -> None:
        """Take rows `rows` of `source` (a step of another batch size) into this step's buffers."""
        if not self.initialized:
            self.allocate_like(source)
        for mine, theirs in zip(self._buffers(), source._buffers()):
            mine[:, :, :source.length].copy_(theirs[:, :, :source.length].index_select(0, rows))
        for mine, theirs in zip(self.cache.layers, source.cache.layers):
            mine.cumulative_length.copy_(theirs.cumulative_length)
        self.positions.copy_(source.positions.index_select(0, rows))
        self.allowed.copy_(source.allowed.index_select(0, rows))
        self.length, self.prefix = source.length, source.prefix


class HFStaticRunner(ModelRunner):
    """`ModelRunner` for a HF causal LM whose steps run over a static KV cache, captured as CUDA graphs
    when `capture` (eagerly otherwise). `reserve(max_new_tokens)` before each prefill sizes the cache."""

    keeps_finished_rows = True  # finished rows stay in the batch (their outputs are ignored): no re-capture

    def __init__(self, model, capture: bool):
        super().__init__(model)
        params = inspect.signature(model.forward).parameters
        # position ids always go in (also through wrappers that pass **kwargs on, such as PEFT's), so that
        # the prompt and the steps agree on them
        self.takes_positions = self.takes_positions or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        self.dtype = embeddings.weight.dtype if embeddings is not None else next(model.parameters()).dtype  # eager masks' dtype
        self.model = weakref.proxy(model)  # kept between generate calls: hold the model weakly
        self.capture = capture
        self.graphs = capture  # False once a capture failed: steps then run eagerly
        self.pool = GraphPool() if capture else None
        self.new_tokens = 0
        self.max_len = 0
        self.steps: dict[int, HFStaticStep] = {}

    def reserve(self, new_tokens: int) -> None:
        self.new_tokens = new_tokens

    def _step(self, batch: int) -> HFStaticStep:
        step = self.steps.get(batch)
        if step is None:
            step = self.steps[batch] = HFStaticStep(self, batch)
        return step

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, DecodeState]:
        length = static_length(input_ids.shape[1] + max(self.new_tokens, 1))
        if length != self.max_len:  # a new length: new buffers (and graphs) for every batch size
            self.steps.clear()
            self.max_len = length
        step = self._step(input_ids.shape[0])
        step.begin(attention_mask)
        step.prefix = input_ids.shape[1]  # the prompt's slots, shared by the beams made from it
        positions = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
        logits, _ = self._forward(input_ids, attention_mask, positions, step.cache)
        step.positions.copy_(positions[:, -1] + 1)
        return logits, DecodeState(step, attention_mask, positions[:, -1] + 1)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, state: DecodeState) -> torch.Tensor:
        return state.cache.step(tokens)

    @torch.no_grad()
    def select(self, state: DecodeState, rows: torch.Tensor, group: int = 0) -> None:
        rows = rows.to(self.device)
        current: HFStaticStep = state.cache
        if len(rows) == current.batch:  # beam reorder: in the same buffers
            current.reorder(rows, group)
        else:
            target = self._step(len(rows))
            target.load_rows(current, rows)
            state.cache = target
        state.attention_mask = state.attention_mask.index_select(0, rows)
        state.next_position = state.next_position.index_select(0, rows)


@torch.no_grad()
def probe(model) -> str | None:
    """Run a left-padded prompt pair and two steps through the static runner (eagerly) and the plain
    runner: None when their logits agree, else what went wrong."""
    device = next(model.parameters()).device
    input_ids = torch.tensor([[0, 1, 2, 3], [0, 0, 4, 5]], device=device)
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]], device=device)
    tokens = torch.tensor([6, 7], device=device)
    try:
        static, plain = HFStaticRunner(model, capture=False), ModelRunner(model)
        static.reserve(2)
        plain.takes_positions = static.takes_positions  # both pass the same position ids
        outs = []
        for runner in (static, plain):
            logits, state = runner.prefill(input_ids, mask)
            got = [logits]
            for _ in range(2):
                got.append(runner.step(tokens, state))
            outs.append(torch.stack(got))
    except Exception as exc:  # noqa: BLE001 - any failure means: decode the plain way
        return f"the static step fails: {type(exc).__name__}: {exc}"
    error = ((outs[0] - outs[1]).norm() / outs[1].norm().clamp_min(1e-6)).item()
    if not error < PROBE_TOLERANCE:
        return f"the static step's logits differ from the plain step's (relative error {error:.3g})"
    return None


def hf_static_runner(model, capture: bool) -> ModelRunner:
    """The static runner for a HF causal LM, kept between `generate` calls (beside the attnlab models'
    static runners, so that `release_graphs(model)` frees it too) while every weight stays where it was;
    the plain `ModelRunner` for a model it does not cover, with one warning per model."""
    key = weights_fingerprint(model)
    entry = KEPT_RUNNERS.get(model)
    if entry is not None and entry[0] == key:
        runner = entry[1]
        if isinstance(runner, HFStaticRunner) and runner.capture == capture:
            return runner
        if runner is None:  # refused before
            return ModelRunner(model)
    problem = static_cache_problem(model) or probe(model)
    if problem is not None:
        warnings.warn(f"{type(model).__name__} decodes without a static cache or CUDA graphs, one forward per token: {problem}",
                      stacklevel=3)
        KEPT_RUNNERS[model] = (key, None)
        return ModelRunner(model)
    runner = HFStaticRunner(model, capture=capture)
    KEPT_RUNNERS[model] = (key, runner)
    return runner
