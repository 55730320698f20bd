"""Native sparse attention (Yuan et al., 2025, arXiv 2502.11089) with grouped-query heads and RoPE.

Three branches per query head, mixed by sigmoid gates from `g_proj` (one per head and branch):
attention over compressed blocks (mean-pooled keys/values, or a small learned MLP per block),
attention over the tokens of `block_counts` selected blocks per query and key/value head group,
and sliding-window attention. The math lives in `attnlab.models.ops.nsa`; parameter names follow
fla's `NativeSparseAttention`. On CUDA the parallel form (training, prefill) runs attnlab's Triton
kernels (`attnlab.models.kernels.nsa.parallel`, memory linear in the sequence length) unless
`config.kernels` is "torch"; decoding steps over the decode engine's static cache run one Triton
kernel (`attnlab.models.kernels.nsa.step`), other decoding steps `nsa_step`.

Block selection is the paper's (section 3.3.2) and fla's (`naive_nsa_topk`, `parallel_nsa_topk`):
the first `initial_blocks` blocks and the `local_blocks` blocks ending at the query's own block
(clipped at block 0, never after the query's block) are always selected; the remaining slots go
to the other complete past blocks with the highest compressed attention probability summed over
the group's query heads. `block_counts` is the total, the forced blocks included (fla's
convention, and the paper's n = 16 "including fixed activating the 1 initial block and 2 local
blocks"), so `initial_blocks + local_blocks <= block_counts` is required. The defaults (1 initial,
2 local: the own block and the one before it) are the paper's; `initial_blocks=0, local_blocks=1`
gives attnlab's earlier rule (only the own block forced, the rest by score).

Keys and values are kept left-aligned per sequence (padding removed), so a key's index is its
position and block boundaries do not move with left padding. The cache holds them with the
compressed blocks and each row's length:

    key, value:           [B, L, num_kv_heads, head_dim]   raw KV (also the sliding window)
    key_cmp, value_cmp:   [B, L // block_size, num_kv_heads, head_dim]
    length:               [B]  real tokens so far (entries past it are unused)

While training with `collect_stats` set, `last_stats` holds the gate and selection statistics of
the latest forward (see `_record_stats`).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn

from attnlab.models import kernels
from attnlab.models.mixers.registry import Mixer, register_mixer
from attnlab.models.ops.common import apply_rotary, rotary_cos_sin, rotary_inv_freq
from attnlab.models.ops.nsa import STAT_NAMES, check_selection_counts, mean_pool_blocks, nsa_step, stats_values

COMPRESSIONS = ("mean", "mlp")


class BlockCompressor(nn.Module):
    """One vector per block of `block_size` vectors: the block mean plus an MLP of the whole block
    (with a learned intra-block position embedding). [B, C, bs, H, D] -> [B, C, H, D]."""

    def __init__(self, block_size: int, head_dim: int):
        super().__init__()
        self.pos_emb = nn.Parameter(torch.zeros(block_size, head_dim))
        self.mlp = nn.Sequential(
            nn.Linear(block_size * head_dim, head_dim), nn.SiLU(), nn.Linear(head_dim, head_dim)
        )

    def forward(self, blocks: torch.Tensor) -> torch.Tensor:
        flat = (blocks + self.pos_emb[:, None]).transpose(2, 3).flatten(-2)  # [B, C, H, bs * D]
        return blocks.mean(2) + self.mlp(flat)


@register_mixer("nsa")
class NativeSparseAttention(Mixer):
    # the training forward (no cache, no padding) launches kernels only, and the health statistics are
    # written in place into one buffer, which a replayed CUDA graph rewrites
    train_graph_safe = True
    reports_stats = True  # gate and selection statistics (`collect_stats`, `last_stats`)
    stats_graph_safe = True
    default_options = {
        "num_kv_heads": 1,  # query heads share selected blocks within a kv-head group
        "block_size": 16,  # tokens per compression / selection block
        "block_counts": 4,  # blocks selected per query, the forced (initial and local) blocks included
        "initial_blocks": 1,  # the first blocks of the sequence, always selected
        "local_blocks": 2,  # the query's own block and the ones just before it, always selected
        "window_size": 32,  # sliding-window length, the query included
        "compression": "mean",  # mean: mean-pooled blocks; mlp: mean plus a learned MLP of the block
    }

    @classmethod
    def resolve_options(cls, options):
        options = super().resolve_options(options)
        for key in ("block_size", "block_counts", "window_size"):
            value = options[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"mixer 'nsa': {key} must be a positive integer, got {value!r}")
        try:
            check_selection_counts(options["block_counts"], options["initial_blocks"], options["local_blocks"])
        except ValueError as error:
            raise ValueError(f"mixer 'nsa': {error}") from None
        if options["compression"] not in COMPRESSIONS:
            raise ValueError(
                f"mixer 'nsa': compression must be one of {list(COMPRESSIONS)}, got {options['compression']!r}"
            )
        return options

    def __init__(self, config, layer_idx: int):
        super().__init__()
        options = self.options_of(config)
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.num_kv_heads = options["num_kv_heads"] or config.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be divisible by num_kv_heads ({self.num_kv_heads})")
        self.head_dim = config.hidden_size // config.num_heads
        if self.head_dim % 2:
            raise ValueError(f"nsa uses RoPE, so the head dim ({self.head_dim}) must be even")
        self.block_size = options["block_size"]
        self.block_counts = options["block_counts"]
        self.initial_blocks = options["initial_blocks"]
        self.local_blocks = options["local_blocks"]
        self.window_size = options["window_size"]
        self.rope_theta = config.rope_theta
        self.kernels = config.kernels
        self.kernel_gap = kernels.nsa_gap(self.head_dim, self.block_size, self.num_heads // self.num_kv_heads)
        if self.kernel_gap and config.kernels != "torch" and layer_idx == 0:
            warnings.warn(f"mixer 'nsa': attnlab's CUDA kernels do not cover {self.kernel_gap}; on CUDA it runs the "
                          "PyTorch reference (memory quadratic in the sequence length)", stacklevel=2)
        self.step_gap = kernels.nsa_step_gap(self.head_dim, self.block_size, self.num_heads // self.num_kv_heads)
        if self.step_gap and config.kernels != "torch" and layer_idx == 0:
            warnings.warn(f"mixer 'nsa': attnlab's CUDA decoding-step kernel does not cover {self.step_gap}; decoding "
                          "over a static cache on CUDA runs the PyTorch reference `nsa_step`", stacklevel=2)

        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.g_proj = nn.Linear(hidden, self.num_heads * 3, bias=False)  # gates: cmp, slc, swa per head
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        if options["compression"] == "mlp":
            self.compress_key = BlockCompressor(self.block_size, self.head_dim)
            self.compress_value = BlockCompressor(self.block_size, self.head_dim)
        else:
            self.compress_key = self.compress_value = None

        self.collect_stats = False
        # the statistics' values, moved with the module and never saved: a compiled forward finds the buffer where it
        # writes (one allocated by the first forward would change what the compiled graph was guarded on, and the
        # second step would compile again); `last_stats` reads views of it once a forward has written it
        self.register_buffer("_stats_buffer", torch.zeros(len(STAT_NAMES)), persistent=False)
        self._stats_recorded = False

    static_kv = True  # decodes over static buffers (`static_state`)
    static_columns = ("key", "value")  # the static buffers whose prompt columns every beam of a prompt shares
    left_aligned = True  # each row's tokens start at column 0 (no left padding): its prompt ends at its own length

    def static_state(self, state: dict, capacity: int) -> dict:
        """The cache after a prefill as the decode engine keeps it: each row's real tokens' keys and
        values (left-aligned, as the dynamic cache keeps them) in buffers of `capacity` columns, the
        compressed blocks in buffers of capacity / block_size, `length` [B] (tokens per row) and a
        `static` flag. A step writes its token at its row's length and recompresses the block it falls
        in, which the step's attention reads only once the block is complete."""
        key, key_cmp = state["key"], state["key_cmp"]
        batch, written = key.shape[:2]
        if capacity < written:
            raise ValueError(f"a static cache of {capacity} columns cannot hold {written} tokens")

        def buffer(t: torch.Tensor, columns: int) -> torch.Tensor:
            out = t.new_zeros(batch, columns, *t.shape[2:])
            out[:, :t.shape[1]] = t
            return out

        blocks = -(-capacity // self.block_size)
        return {"key": buffer(key, capacity), "value": buffer(state["value"], capacity),
                "key_cmp": buffer(key_cmp, blocks), "value_cmp": buffer(state["value_cmp"], blocks),
                "length": state["length"].clone(), "static": torch.ones(batch, dtype=torch.bool, device=key.device)}

    def _static_step(self, x: torch.Tensor, attention_mask: torch.Tensor | None, cache: dict) -> torch.Tensor:
        """One token per row over the static cache, written where it lies (see `static_state`)."""
        batch, seq_len, _ = x.shape
        if seq_len != 1 or attention_mask is not None:
            raise ValueError("a static NSA cache takes one real token per row; prefill with a dynamic cache")
        q = self.q_proj(x).view(batch, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(batch, 1, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, 1, self.num_kv_heads, self.head_dim)
        g_cmp, g_slc, g_swa = self.g_proj(x).view(batch, self.num_heads, 3).sigmoid().unbind(-1)
        pos = cache["length"]  # each row's tokens so far: this token's position and column
        if kernels.use_triton(self.kernels, x):  # q and k rotated in one kernel (the eager form takes about twenty)
            from attnlab.models.kernels.softmax.decode import rope_

            if getattr(self, "_inv_freq", None) is None or self._inv_freq.device != x.device:
                self._inv_freq = rotary_inv_freq(self.head_dim, self.rope_theta, x.device)
            q, k = rope_(q, k[:, 0], self._inv_freq, pos)
            k = k[:, None]
        else:
            cos, sin = rotary_cos_sin(pos[:, None], self.head_dim, self.rope_theta)
            q, k = apply_rotary(q[:, None], cos, sin)[:, 0], apply_rotary(k, cos, sin)
        key, value = cache["key"], cache["value"]
        index = pos.view(-1, 1, 1, 1).expand(-1, 1, *k.shape[2:])
        key.scatter_(1, index, k.to(key.dtype))
        value.scatter_(1, index, v.to(value.dtype))
        # the block this token falls in, compressed again from its columns (complete or not: the
        # attention reads a block only once its last token is in)
        bs = self.block_size
        block = torch.div(pos, bs, rounding_mode="floor").clamp(max=cache["key_cmp"].shape[1] - 1)
        columns = (block[:, None] * bs + torch.arange(bs, device=x.device)).clamp(max=key.shape[1] - 1)  # [B, bs]
        gather = columns[..., None, None].expand(-1, -1, *key.shape[2:])
        k_block, v_block = key.gather(1, gather)[:, None], value.gather(1, gather)[:, None]  # [B, 1, bs, Hkv, D]
        if self.compress_key is None:
            k_new, v_new = k_block.mean(2), v_block.mean(2)
        else:
            k_new, v_new = self.compress_key(k_block), self.compress_value(v_block)
        at = block.view(-1, 1, 1, 1).expand(-1, 1, *k.shape[2:])
        cache["key_cmp"].scatter_(1, at, k_new.to(cache["key_cmp"].dtype))
        cache["value_cmp"].scatter_(1, at, v_new.to(cache["value_cmp"].dtype))
        # the one choice between the reference and the CUDA kernel for the static step
        step = kernels.nsa_step_fn(self.kernels, x, covered=not self.step_gap)
        o, _ = step(q, key, value, cache["key_cmp"], cache["value_cmp"], g_cmp, g_slc, g_swa, q_pos=pos,
                    block_size=bs, block_counts=self.block_counts, window_size=self.window_size,
                    initial_blocks=self.initial_blocks, local_blocks=self.local_blocks)
        pos.add_(1)
        return self.o_proj(o.reshape(batch, 1, self.num_heads * self.head_dim))

    def forward(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: dict | None = None,
        use_cache: bool = False,
    ) -> tuple[torch.Tensor, dict | None]:
        batch, seq_len, _ = x.shape
        if cache is not None and "static" in cache:  # the decode engine's static cache (`static_state`)
            return self._static_step(x, attention_mask, cache), cache
        q = self.q_proj(x).view(batch, seq_len, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(batch, seq_len, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, seq_len, self.num_kv_heads, self.head_dim)
        # each branch's gate a sigmoid of its own: the gates are saved for the backward, and under torch.compile
        # views of one saved tensor are what Inductor may overwrite in place (the sigmoid's backward written into
        # its own output) before the gate mixing's backward reads them (torch 2.13: wrong q, k and v gradients)
        g_cmp, g_slc, g_swa = (gate.sigmoid() for gate in self.g_proj(x).view(batch, seq_len, self.num_heads, 3).unbind(-1))

        # position of each new token among its row's real tokens; -1 for padding
        is_token = None if attention_mask is None else attention_mask[:, -seq_len:].bool()  # [B, T]
        past_len = cache["length"] if cache is not None else torch.zeros(batch, dtype=torch.long, device=x.device)
        if is_token is None:
            pos = torch.arange(seq_len, device=x.device).expand(batch, seq_len) + past_len[:, None]
        else:
            pos = (is_token.long().cumsum(-1) - 1 + past_len[:, None]).masked_fill(~is_token, -1)
        q, k = kernels.rotate(self.kernels, x, q, k, pos.clamp(min=0), self.rope_theta)

        k, v, length = self._append(cache, past_len, k, v, is_token)  # [B, L, Hkv, D], left-aligned
        k_cmp, v_cmp = self._compress(cache, past_len, k, v)
        branch = dict(
            block_size=self.block_size, block_counts=self.block_counts, window_size=self.window_size,
            initial_blocks=self.initial_blocks, local_blocks=self.local_blocks,
        )
        if seq_len == 1 and cache is not None:
            o, block_indices = nsa_step(
                q[:, 0], k, v, k_cmp, v_cmp, g_cmp[:, 0], g_slc[:, 0], g_swa[:, 0], q_pos=pos[:, 0], **branch
            )
            o, block_indices = o[:, None], block_indices[:, None]  # [B, 1, H, D], [B, 1, Hkv, S]
        else:
            # the one choice between the reference and the CUDA kernels for the parallel form
            parallel = kernels.nsa_parallel(self.kernels, x, covered=not self.kernel_gap)
            o, block_indices = parallel(q, k, v, k_cmp, v_cmp, g_cmp, g_slc, g_swa, q_pos=pos, **branch)
        y = self.o_proj(o.reshape(batch, seq_len, self.num_heads * self.head_dim))

        if self.training and self.collect_stats:
            self._record_stats(torch.stack((g_cmp, g_slc, g_swa), -1), block_indices, pos)
        new_cache = None
        if use_cache:
            new_cache = {"key": k, "value": v, "key_cmp": k_cmp, "value_cmp": v_cmp, "length": length}
        return y, new_cache

    def _append(self, cache, past_len, k, v, is_token):
        """Past and new keys/values, each row's real tokens first and in order. Returns (k, v, length)."""
        seq_len = k.shape[1]
        if cache is None:
            past_k = past_v = None
        else:
            past_k, past_v = cache["key"], cache["value"]
        if past_k is not None:
            k, v = torch.cat((past_k, k), dim=1), torch.cat((past_v, v), dim=1)
        past_width = 0 if past_k is None else past_k.shape[1]
        if cache is None and is_token is None:  # training: nothing to move, and nothing to ask the device
            return k, v, past_len + seq_len
        if is_token is None and bool((past_len == past_width).all()):
            return k, v, past_len + seq_len  # nothing to move
        is_past = torch.arange(past_width, device=k.device) < past_len[:, None]
        new = torch.ones_like(k[:, past_width:, 0, 0], dtype=torch.bool) if is_token is None else is_token
        valid = torch.cat((is_past, new), dim=1)  # [B, past_width + T]
        order = torch.argsort((~valid).to(torch.uint8), dim=1, stable=True)  # real tokens first, in order
        length = valid.sum(1)
        order = order[:, : int(length.max())][..., None, None].expand(-1, -1, *k.shape[2:])
        return k.gather(1, order), v.gather(1, order), length

    def _compress(self, cache, past_len, k, v):
        """Compressed keys/values of every complete block; blocks complete in every row of the
        cache are reused, the rest recomputed."""
        num_blocks = k.shape[1] // self.block_size
        start = 0
        if cache is not None and cache.get("key_cmp") is not None:
            start = min(int(past_len.min()) // self.block_size, cache["key_cmp"].shape[1], num_blocks)
        bs, span = self.block_size, slice(start * self.block_size, num_blocks * self.block_size)
        if self.compress_key is None:
            k_new, v_new = mean_pool_blocks(k[:, span], bs), mean_pool_blocks(v[:, span], bs)
        else:
            def blocks(x):  # [B, n * bs, H, D] -> [B, n, bs, H, D]
                return x[:, span].reshape(x.shape[0], -1, bs, *x.shape[2:])

            k_new, v_new = self.compress_key(blocks(k)), self.compress_value(blocks(v))
        if start == 0:
            return k_new, v_new
        return (
            torch.cat((cache["key_cmp"][:, :start], k_new), dim=1),
            torch.cat((cache["value_cmp"][:, :start], v_new), dim=1),
        )

    @property
    def last_stats(self) -> dict[str, torch.Tensor | float]:
        """The latest statistics (`_record_stats`): 0-d views of the statistics' buffer, which every training forward
        with `collect_stats` rewrites in place; empty until one has."""
        if not self._stats_recorded:
            return {}
        return {**dict(zip(STAT_NAMES, self._stats_buffer.unbind())), "nsa_k_max": float(self.block_counts)}

    @last_stats.setter
    def last_stats(self, value: dict) -> None:
        if value:
            raise ValueError("NSA's statistics are written by its forward; assign {} to forget them")
        self._stats_recorded = False

    @torch.no_grad()
    def _record_stats(self, g: torch.Tensor, block_indices: torch.Tensor, pos: torch.Tensor) -> None:
        """Gate and selection statistics over the real tokens of the latest forward, as 0-d tensors
        on the model's device (keys prefixed `nsa_`; nothing here waits for the device: the reader,
        `AttnLabForCausalLM.health_stats`, turns them into floats when it logs them):

        gate_entropy_mean: entropy (nats, at most ln 3) of each head's gates normalised to sum to 1;
        max_gate_mean: mean of each head's largest gate (sigmoid, 0..1);
        collapse_fraction: share of heads whose gate on some branch averages > 0.99 over the tokens;
        branch_share_{cmp,slc,swa}: mean normalised gate of each branch (they sum to 1);
        k_mean: mean number of selected blocks per query and kv head; k_max: the cap (block_counts);
        pct_at_k_max: percent of (query, kv head) pairs that selected k_max blocks.

        A forward without real tokens keeps the previous values.
        """
        buffer = self._stats_buffer
        if buffer.device != g.device or buffer.dtype != torch.float32:  # a module whose buffers were cast or left behind
            buffer = self._stats_buffer = torch.zeros(len(STAT_NAMES), dtype=torch.float32, device=g.device)
        self._stats_recorded = True
        # in place: a forward captured in a CUDA graph updates the statistics on every replay
        if kernels.use_triton(self.kernels, g):  # two launches (kernels/nsa/stats.py)
            from attnlab.models.kernels.nsa.stats import record_stats

            record_stats(buffer, g.detach(), pos, block_indices, self.block_counts)
            return
        values, tokens = stats_values(g.detach(), block_indices, pos, self.block_counts)
        buffer.copy_(torch.where(tokens > 0, values, buffer))
