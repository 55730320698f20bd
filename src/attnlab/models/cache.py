"""Inference cache: one state per layer, whatever the layer's mixer keeps.

A layer state is a dict of tensors whose first dim is the batch, e.g.
GLA: {"recurrent_state": [B, H, K, V]}; softmax: {"key": [B, T, Hkv, D], "value": ..., "mask": [B, T] or None}.
"""

from __future__ import annotations

import torch


class AttnLabCache:
    """Works with `GenerationMixin.generate`: the model builds it on the first forward and
    beam search reorders it through `AttnLabForCausalLM._reorder_cache`."""

    is_compileable = False  # read by `generate` to decide on auto-compilation

    def __init__(self, num_layers: int = 0):
        self.states: list[dict | None] = [None] * num_layers
        self.seen_tokens = 0

    def __len__(self) -> int:
        return len(self.states)

    def __getitem__(self, layer_idx: int) -> dict | None:
        return self.states[layer_idx] if layer_idx < len(self.states) else None

    def update(self, layer_idx: int, state: dict) -> None:
        """Store the state of layer `layer_idx` after the latest tokens."""
        while len(self.states) <= layer_idx:
            self.states.append(None)
        self.states[layer_idx] = state

    def advance(self, num_tokens: int) -> None:
        """Record that `num_tokens` more positions have been consumed by every layer."""
        self.seen_tokens += num_tokens

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    def _map(self, fn) -> None:
        self.states = [
            None if state is None else {name: None if t is None else fn(t) for name, t in state.items()}
            for state in self.states
        ]

    def reorder(self, beam_idx: torch.LongTensor) -> "AttnLabCache":
        """Batch row i becomes old row beam_idx[i] (beam search). In place; returns self."""
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))
        return self

    reorder_cache = reorder

    def select(self, indices: torch.LongTensor | list[int]) -> "AttnLabCache":
        """Keep only these batch rows, in this order. In place; returns self."""
        if not torch.is_tensor(indices):
            indices = torch.tensor(indices, dtype=torch.long)
        return self.reorder(indices)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_layers={len(self)}, seen_tokens={self.seen_tokens})"
