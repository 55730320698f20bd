"""Static decoding: preallocated state buffers, and the one-token step captured as a CUDA graph.

A decode step of an attnlab model whose every layer either keeps a state of fixed size (GLA,
Mamba-2: `fixed_size_state` of the `Mixer` interface) or can keep its KV cache in preallocated buffers (softmax
attention, the attention family's KV variants: `static_kv` and `static_state`, buffers of the prompt's length plus `max_new_tokens`
written in place one column per step) reads and writes the same buffers every time. The whole step
— embedding, every layer, the head — is then recorded once per batch size as a CUDA graph and
replayed: one launch per token instead of hundreds, which is what keeps small-batch decoding from
being bound by Python and kernel launches.

Beam search reorders beams as a gather into the same buffers (for KV buffers only the columns
after the prompt: every beam of a prompt holds the same prompt); rows that leave the batch move
the state into the buffers of the smaller batch size (captured on first use). Without CUDA (and
in the tests) the same static path runs eagerly, so its logic is checked on any machine; the
GPU tests hold the captured graph to the eager engine token for token.
"""

from __future__ import annotations

import weakref

import torch

from attnlab.models import AttnLabForCausalLM
from attnlab.models.cache import AttnLabCache
from attnlab.models.modeling import AttnLabPreTrainedModel
from attnlab.models.modules import fused_projections
from attnlab.models.weights import weights_fingerprint

from .hf_static import hf_static_runner
from .runner import KEPT_RUNNERS, DecodeState, GraphPool, ModelRunner

GRAPH_CHOICES = ("auto", "off")
CAPACITY_STEP = 256  # KV buffers are sized up to a multiple of this, so one capture serves prompts of similar lengths


def fixed_size_decoding(model) -> bool:
    """Whether every layer of `model` decodes over a fixed-size state (no KV cache that grows)."""
    if not isinstance(model, AttnLabForCausalLM):
        return False
    return all(block.attn.fixed_size_state for block in model.model.layers)


def static_decoding(model) -> bool:
    """Whether every layer of `model` decodes over static buffers: a fixed-size state, or a KV cache
    the mixer can keep in preallocated buffers (`static_kv`, `static_state`)."""
    if not isinstance(model, AttnLabForCausalLM):
        return False
    return all(block.attn.fixed_size_state or block.attn.static_kv for block in model.model.layers)


def kv_capacity(prompt_length: int, max_new_tokens: int) -> int:
    """Columns of the static KV buffers for prompts of `prompt_length` (padded) and `max_new_tokens`."""
    needed = prompt_length + max_new_tokens
    return -(-needed // CAPACITY_STEP) * CAPACITY_STEP


class StaticStep:
    """The one-token step for one batch size, over buffers it owns: tokens [B], each layer's
    state tensors, logits [B, vocab]. `capture=True` records the step as a CUDA graph on its
    first call (a batch size that is only passed through, such as beam search's prompts before
    they are expanded to beams, is never captured)."""

    def __init__(self, model, states: list[dict[str, torch.Tensor]], capture: bool, pool: GraphPool | None = None, fused: list | None = None,
                 columns: frozenset[str] = frozenset()):
        self.model = model
        self.columns = columns  # names of per-column (KV) buffers: [batch, capacity, ...]
        self.prefix = 0  # leading columns every beam of a prompt shares (the prompt's), set by the runner
        self.fused = fused or []  # the runner's fused projection weights (kept alive by the runner)
        self.batch = next(iter(states[0].values())).shape[0]
        device = next(iter(states[0].values())).device
        self.tokens = torch.zeros(self.batch, dtype=torch.long, device=device)
        # Each layer's state tensors are views into one stacked tensor per (name, shape, dtype), so
        # that a beam reorder is one gather and one copy per stack rather than two per layer.
        groups: dict[tuple, list[tuple[int, str]]] = {}
        for i, s in enumerate(states):
            for name, t in s.items():
                groups.setdefault((name, tuple(t.shape), t.dtype), []).append((i, name))
        self.stacks: list[torch.Tensor] = []
        self.states = [{} for _ in states]
        for members in groups.values():
            stacked = torch.stack([states[i][name] for i, name in members])  # [layers, batch, ...]
            self.stacks.append(stacked)
            for j, (i, name) in enumerate(members):
                self.states[i][name] = stacked[j]
        self.members = list(groups.values())
        self.shapes = [(name, shape, dtype) for name, shape, dtype in groups]
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self.capture, self.pool = capture, pool

    def _run(self) -> torch.Tensor:
        cache = AttnLabCache(len(self.states))
        cache.states = [dict(s) for s in self.states]
        with fused_projections(self.fused):
            out = self.model(input_ids=self.tokens[:, None], cache=cache, use_cache=True, logits_to_keep=1)
        for buffers, new in zip(self.states, cache.states):
            for name, buf in buffers.items():
                if new[name] is not buf:
                    buf.copy_(new[name])
        return out.logits[:, -1]

    def _capture(self) -> None:
        saved = [{name: t.clone() for name, t in s.items()} for s in self.states]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the graph: kernel autotuning, lazy initialisation
            for _ in range(2):
                self._run()
        torch.cuda.current_stream().wait_stream(side)
        self.load(saved)
        self.graph = torch.cuda.CUDAGraph()
        with self.pool.capture(self.graph):
            self.logits = self._run()

    def load(self, states: list[dict[str, torch.Tensor]]) -> None:
        for buffers, new in zip(self.states, states):
            for name, buf in buffers.items():
                buf.copy_(new[name])

    def gather(self, rows: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        """Each layer's state for the batch rows `rows` (copies)."""
        out: list[dict[str, torch.Tensor]] = [{} for _ in self.states]
        for stacked, members in zip(self.stacks, self.members):
            picked = stacked.index_select(1, rows)
            for j, (i, name) in enumerate(members):
                out[i][name] = picked[j]
        return out

    def reorder(self, rows: torch.Tensor, group: int = 0) -> None:
        """Row r of every state becomes old row rows[r] (beam search: rows move among the beams of
        one prompt), in place. KV buffers are moved from `prefix` on: the prompt's columns are the
        same in every beam of the prompt. With `group` (rows move only within groups of that many)
        one pass that touches only the rows that change; else a gather and a copy."""
        if group:
            from attnlab.models.kernels.common.beam_reorder import reorder_rows_
        for stacked, (name, _, _) in zip(self.stacks, self.shapes):
            prefix = self.prefix if name in self.columns else 0
            if group:
                per_column = stacked[0, 0, 0].numel() if prefix else 0
                reorder_rows_(stacked, rows, group, row_dim=1, outer_dim=0, start=prefix * per_column,
                              count=stacked[0, 0].numel() - prefix * per_column)
            elif prefix:
                tail = stacked[:, :, prefix:]
                tail.copy_(tail.index_select(1, rows))
            else:
                stacked.copy_(stacked.index_select(1, rows))

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B] -> next-token logits [B, vocab] (float32, a fresh tensor); the state advances."""
        self.tokens.copy_(tokens)
        if self.capture and self.graph is None:
            self._capture()
        if self.graph is None:
            return self._run().float()
        self.graph.replay()
        return self.logits.float()


class StaticRunner(ModelRunner):
    """`ModelRunner` whose steps run over static buffers, captured as CUDA graphs when `capture`."""

    keeps_finished_rows = True  # finished rows stay in the batch (their outputs are ignored): no re-capture
    reorders_in_place = True  # a beam reorder only writes the state's buffers: beam search may record it in its graph

    def __init__(self, model, capture: bool):
        super().__init__(model)
        self.model = weakref.proxy(model)  # kept between generate calls (cached_static_runner): hold the model weakly
        self.capture = capture
        self.steps: dict[int, StaticStep] = {}
        self.columns: frozenset[str] = frozenset()
        self.reserved: int | None = None  # `reserve`
        self.pool = GraphPool() if capture else None

    def _static(self, states: list[dict[str, torch.Tensor]], prefix: int) -> StaticStep:
        batch = next(iter(states[0].values())).shape[0]
        step = self.steps.get(batch)
        shapes = sorted({(name, tuple(t.shape), t.dtype) for s in states for name, t in s.items()}, key=str)
        if step is None or sorted(step.shapes, key=str) != shapes:  # new batch size, or KV buffers of another capacity
            step = self.steps[batch] = StaticStep(self.model, states, self.capture, self.pool, self.fused, self.columns)
        step.load(states)
        step.prefix = prefix
        return step

    def reserve(self, max_new_tokens: int) -> None:
        """The most steps that follow each prefill: KV buffers are sized for them."""
        self.reserved = max_new_tokens

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, DecodeState]:
        logits, state = super().prefill(input_ids, attention_mask)
        max_new_tokens = self.reserved
        states = state.cache.states
        layers = [block.attn for block in self.model.model.layers]
        if any(not attn.fixed_size_state for attn in layers):
            if max_new_tokens is None:
                raise ValueError("static decoding of a KV-cache model sizes its buffers for the steps that follow: call reserve(max_new_tokens) first")
            capacity = kv_capacity(input_ids.shape[1], max_new_tokens)
            states = [s if attn.fixed_size_state else attn.static_state(s, capacity)
                      for attn, s in zip(layers, states)]
            self.columns = frozenset(layers[0].static_columns) | self.columns
        prefix = input_ids.shape[1]  # every beam of a prompt holds the same prompt columns
        if any(attn.left_aligned for attn in layers):  # ... up to the shortest prompt's length there
            prefix = int(attention_mask.sum(1).min())
        state.cache = self._static(states, prefix=prefix)
        return logits, state

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, state: DecodeState) -> torch.Tensor:
        return state.cache.step(tokens)

    def select(self, state: DecodeState, rows: torch.Tensor, group: int = 0) -> None:
        rows = rows.to(self.device)
        current: StaticStep = state.cache
        if len(rows) == current.batch:  # beam reorder: in the same buffers
            current.reorder(rows, group)
        else:
            state.cache = self._static(current.gather(rows), prefix=current.prefix)


def cached_static_runner(model, capture: bool) -> StaticRunner:
    """The model's static runner, kept between `generate` calls so that its graphs are captured once
    (capture runs the step eagerly three times: 126 ms measured for a 374M-parameter, 24-layer
    model on an H100, more than the steps of a short generation). It is reused only while every weight and buffer is where it was; the fused
    projection weights are refreshed on every call, so in-place weight updates are always seen.
    `release_graphs(model)` frees it (its graph memory, state buffers and fused weights)."""
    key = weights_fingerprint(model)
    entry = KEPT_RUNNERS.get(model)
    if entry is not None and entry[0] == key and entry[1].capture == capture:
        entry[1].refresh_fused()
        return entry[1]
    runner = StaticRunner(model, capture=capture)
    KEPT_RUNNERS[model] = (key, runner)
    return runner


def make_runner(model, cuda_graphs: str = "auto") -> ModelRunner:
    """The runner for `generate`: CUDA-graph steps for attnlab models that decode over static buffers
    and for HF causal LMs over a static KV cache (hf_static.py) on CUDA (unless `cuda_graphs` is
    "off"), kept between calls; the plain runner otherwise."""
    on_cuda = next(model.parameters()).device.type == "cuda"
    if cuda_graphs == "auto" and on_cuda and static_decoding(model) and not model.training:
        return cached_static_runner(model, capture=True)

    if cuda_graphs == "auto" and on_cuda and not model.training and not isinstance(model, AttnLabPreTrainedModel):
        return hf_static_runner(model, capture=True)
    return ModelRunner(model)
