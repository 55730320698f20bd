"""One calling convention over attnlab models and any Hugging Face causal LM.

The runner prefills a left-padded batch, then feeds one token per row per step over the
model's own cache (an `AttnLabCache`, or a transformers `Cache`). It asks for the logits of
the last position only, and takes the last position itself when a model returns more: a
[batch, time, vocab] tensor is never kept.
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from attnlab.models.hf_names import CACHE_KEY, cache_of
from attnlab.models.modeling import AttnLabPreTrainedModel
from attnlab.models.modules import fuse_projections, fused_projections

SYNC_EVERY = 16  # steps between the host's looks at whether every row has finished

# The static runners `make_runner` keeps between `generate` calls, per model (graphs.py for attnlab models,
# hf_static.py for HF causal LMs; None: a model refused before), each with the weights' fingerprint it was
# built for (attnlab.models.weights): (fingerprint, runner).
KEPT_RUNNERS: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple, ModelRunner | None]]" = weakref.WeakKeyDictionary()


def release_graphs(model) -> None:
    """Free the CUDA graphs and decode buffers that `generate` keeps for `model` between calls."""
    KEPT_RUNNERS.pop(model, None)


class GraphPool:
    """The memory pool the CUDA graphs of one runner share. PyTorch releases a pool once no graph captured into it
    is alive (a step replaced for buffers of another size, a runner's steps cleared) and then refuses a capture into
    it with an internal assert: a capture after every earlier graph is gone starts a new pool."""

    def __init__(self) -> None:
        self.handle: Any = None
        self.graphs: weakref.WeakSet = weakref.WeakSet()  # the graphs captured into `handle` and still alive

    def capture(self, graph: torch.cuda.CUDAGraph):
        """`torch.cuda.graph(graph, pool=...)` into the shared pool, or a new one when no graph holds it."""
        if self.handle is None or not self.graphs:
            self.handle = torch.cuda.graph_pool_handle()
        self.graphs.add(graph)
        return torch.cuda.graph(graph, pool=self.handle)


@dataclass
class DecodeState:
    cache: Any  # the model's cache object
    attention_mask: torch.Tensor  # [rows, past]: 1 = token, 0 = left padding
    next_position: torch.Tensor  # [rows]: position id of the next token


def left_pad(prompts: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists of any lengths -> input_ids and attention_mask [rows, longest], padded on the left."""
    longest = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), longest), dtype=torch.long)
    for i, p in enumerate(prompts):
        if p:
            input_ids[i, longest - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, longest - len(p):] = 1
    return input_ids.to(device), mask.to(device)


class ModelRunner:
    def __init__(self, model):
        self.model = model
        params = inspect.signature(model.forward).parameters
        self.keep_arg = next((name for name in ("logits_to_keep", "num_logits_to_keep") if name in params), None)
        self.takes_positions = "position_ids" in params
        self.device = next(model.parameters()).device
        # attnlab models decode with their input projections fused (one product per group instead
        # of several), in every step and on every path, so the graphed and eager paths stay equal
        self.fused = fuse_projections(model) if isinstance(model, AttnLabPreTrainedModel) else []

    def reserve(self, new_tokens: int) -> None:
        """Called before prefills that are followed by up to `new_tokens` steps (runners with
        preallocated caches size them by it; this one grows its cache as it goes)."""

    def refresh_fused(self) -> None:
        """Copy the modules' current weights into the fused stacks (in place: captured graphs read them)."""
        with torch.no_grad():
            for module, stacks in self.fused:
                weights, first = module.fusion_weights(), 0
                for stack in stacks:
                    torch.stack(weights[first:first + len(stack)], out=stack)
                    first += len(stack)

    def _forward(self, input_ids, attention_mask, positions, cache) -> tuple[torch.Tensor, Any]:
        kwargs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask, "use_cache": True}
        if cache is not None:
            kwargs[CACHE_KEY] = cache
        if self.keep_arg:
            kwargs[self.keep_arg] = 1
        if self.takes_positions:
            kwargs["position_ids"] = positions
        with fused_projections(self.fused):
            out = self.model(**kwargs)
        logits = out.logits[:, -1, :].float()  # [rows, vocab], also for models that ignored logits_to_keep
        return logits, cache_of(out)

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, DecodeState]:
        positions = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
        logits, cache = self._forward(input_ids, attention_mask, positions, None)
        return logits, DecodeState(cache, attention_mask, positions[:, -1] + 1)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, state: DecodeState) -> torch.Tensor:
        """tokens: [rows] -> next-token logits [rows, vocab]; the state advances by one token."""
        state.attention_mask = torch.cat([state.attention_mask, state.attention_mask.new_ones(len(tokens), 1)], dim=1)
        logits, state.cache = self._forward(tokens[:, None], state.attention_mask, state.next_position[:, None], state.cache)
        state.next_position = state.next_position + 1
        return logits

    def select(self, state: DecodeState, rows: torch.Tensor, group: int = 0) -> None:
        """Keep (or reorder, or repeat) rows of the batch: row i becomes old row rows[i]. `group` > 0
        promises that rows move only within groups of that many (beam search's beams of a prompt):
        static runners then reorder in one pass."""
        rows = rows.to(self.device)
        cache = state.cache
        if hasattr(cache, "select"):  # AttnLabCache
            cache.select(rows)
        elif hasattr(cache, "reorder_cache"):  # transformers Cache
            cache.reorder_cache(rows)
        elif hasattr(self.model, "_reorder_cache"):  # legacy tuple caches
            state.cache = self.model._reorder_cache(cache, rows)
        else:
            raise TypeError(f"cannot select rows of a {type(cache).__name__} cache")
        state.attention_mask = state.attention_mask.index_select(0, rows)
        state.next_position = state.next_position.index_select(0, rows)
