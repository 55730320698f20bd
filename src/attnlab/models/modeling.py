"""The attnlab decoder-only language model (module names follow flash-linear-attention)."""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from attnlab.models import kernels
from attnlab.models.kernels.common.cross_entropy import cross_entropy
from attnlab.models.cache import AttnLabCache
from attnlab.models.configuration import AttnLabConfig
from attnlab.models.hf_names import CACHE_KEY, one_cache
from attnlab.models.mixers import Mixer, build_mixer
from attnlab.models.modules import GatedRMSNorm, PreNorm, RMSNorm, SwiGLU


class AttnLabBlock(GradientCheckpointingLayer):
    """Pre-norm residual block: x + attn(attn_norm(x)), then x + mlp(mlp_norm(x)).

    With `intermediate_size` 0 the block has no MLP (nor its norm): x + attn(attn_norm(x)), as
    Mamba-2's blocks (mamba_ssm, fla, transformers)."""

    def __init__(self, config: AttnLabConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.attn_norm = PreNorm(config.hidden_size, eps=config.norm_eps, kernels=config.kernels)
        self.attn = build_mixer(config, layer_idx)
        if config.intermediate_size:
            self.mlp_norm = PreNorm(config.hidden_size, eps=config.norm_eps, kernels=config.kernels)
            self.mlp = SwiGLU(config.hidden_size, config.intermediate_size, kernels=config.kernels)
        else:
            self.mlp_norm = self.mlp = None

    # Set by `AttnLabForCausalLM.compile_blocks`: training forwards (gradients on, no cache, no padding mask) run
    # through torch.compile; every other call (evaluation, decoding) runs as written.
    compiled: bool = False

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: AttnLabCache | None = None,
        use_cache: bool = False,
    ) -> torch.Tensor:
        if self.compiled and cache is None and not use_cache and attention_mask is None and torch.is_grad_enabled():
            return _compiled_block()(self, hidden_states)
        return self.block(hidden_states, attention_mask, cache, use_cache)

    def block(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: AttnLabCache | None = None,
        use_cache: bool = False,
    ) -> torch.Tensor:
        layer_state = cache[self.layer_idx] if cache is not None else None
        mixed, layer_state = self.attn(
            self.attn_norm(hidden_states), attention_mask=attention_mask, cache=layer_state, use_cache=use_cache
        )
        if use_cache and cache is not None:
            cache.update(self.layer_idx, layer_state)
        if self.mlp is None:
            return hidden_states + mixed
        normed, hidden_states = self.mlp_norm(mixed, residual=hidden_states)  # hidden_states + mixed, and its norm
        return hidden_states + self.mlp(normed)


@functools.cache
def _compiled_stack():
    """Every block's training forward in turn under one torch.compile (`compile_blocks(stack=True)`): one graph each way
    for the whole stack where no mixer breaks it, so the compiled code's per-call costs are paid once a step, not once
    a block. `fullgraph`: dynamo runs a loop with a graph break in it as written, nothing compiled; a break raises
    instead, before anything runs, and the model compiles its blocks one by one (`AttnLabModel._stack`)."""
    def stack(layers, hidden_states):
        for block in layers:
            hidden_states = block.block(hidden_states)
        return hidden_states

    return torch.compile(stack, dynamic=False, fullgraph=True)


@functools.cache
def _compiled_block():
    """`AttnLabBlock.block` under torch.compile, one function for every block (the blocks of a model share its
    graphs: their parameters are the graph's inputs). Each batch shape compiles once (no dynamic shapes)."""
    return torch.compile(AttnLabBlock.block, dynamic=False)


class AttnLabPreTrainedModel(PreTrainedModel):
    config_class = AttnLabConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["AttnLabBlock"]
    _skip_keys_device_placement = ["cache", "past_key_values"]
    _is_stateful = True  # recurrent mixers cannot roll back, so no assisted generation

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, (RMSNorm, GatedRMSNorm)):
            init.ones_(module.weight)


class AttnLabModel(AttnLabPreTrainedModel):
    def __init__(self, config: AttnLabConfig):
        super().__init__(config)
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(AttnLabBlock(config, i) for i in range(config.num_layers))
        self.norm = PreNorm(config.hidden_size, eps=config.norm_eps, kernels=config.kernels)
        self.gradient_checkpointing = False
        self.compiled_stack = False  # set by `AttnLabForCausalLM.compile_blocks(stack=True)`
        self.post_init()

    def _stack(self, hidden_states):
        """The blocks' training forward as one compiled graph: (True, output), or, where a block breaks the graph, (False,
        the input) with the blocks compiled one by one from then on, and a warning that says where."""
        try:
            return True, _compiled_stack()(self.layers, hidden_states)
        except torch._dynamo.exc.Unsupported as e:
            lines = [line.strip() for line in str(e).strip().splitlines()]
            reason = lines[0] if lines else type(e).__name__
            explanation = next((line.removeprefix("Explanation:").strip() for line in lines if line.startswith("Explanation:")), "")
            if explanation:
                reason += f": {explanation}"
            stack = getattr(e, "real_stack", None)  # the traced code's frames, innermost last: where it broke
            if stack:
                reason += f"; at {stack[-1].filename}:{stack[-1].lineno} in {stack[-1].name}"
            warnings.warn(f"the blocks do not compile as one graph ({reason}): each block is compiled on its own instead",
                          stacklevel=3)
            self.compiled_stack = False
            for block in self.layers:
                block.compiled = True
            return False, hidden_states

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embeddings

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embeddings = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: AttnLabCache | None = None,
        use_cache: bool | None = None,
        inputs_embeds: torch.Tensor | None = None,
        return_dict: bool | None = True,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        past_key_values: AttnLabCache | None = None,
    ) -> BaseModelOutputWithPast:
        """attention_mask: [B, T] or [B, past + T], 1 for tokens and 0 for (left) padding.
        cache: the state after earlier tokens (`past_key_values` is its name before transformers 5.24).
        use_cache defaults to config.use_cache outside training. output_hidden_states: also return the
        input of every block and the final normed output, as HF models do."""
        cache = one_cache(cache, past_key_values)
        if output_attentions:
            raise ValueError("attnlab models return no attention weights (most of their mixers form none): "
                             "leave output_attentions off")
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        hidden_states = self.embeddings(input_ids) if inputs_embeds is None else inputs_embeds  # [B, T, hidden]
        batch, seq_len = hidden_states.shape[:2]

        if use_cache is None:
            use_cache = self.config.use_cache and not self.training
        if self.gradient_checkpointing and self.training:
            use_cache = False
        if use_cache and cache is None:
            cache = AttnLabCache(self.config.num_layers)
        if attention_mask is not None and bool(attention_mask.all()):
            attention_mask = None  # no padding: let mixers take their unmasked fast paths

        all_hidden = [] if output_hidden_states else None
        # `compile_blocks(stack=True)`: a training forward runs every block under one torch.compile (not where the
        # blocks are checkpointed: each block's own call recomputes it)
        stacked = (self.compiled_stack and cache is None and not use_cache and attention_mask is None and all_hidden is None
                   and torch.is_grad_enabled() and not any(getattr(b, "gradient_checkpointing", False) for b in self.layers))
        if stacked:
            stacked, hidden_states = self._stack(hidden_states)
        for block in () if stacked else self.layers:
            if all_hidden is not None:
                all_hidden.append(hidden_states)
            hidden_states = block(hidden_states, attention_mask=attention_mask, cache=cache, use_cache=use_cache)
        hidden_states = self.norm(hidden_states)
        if all_hidden is not None:
            all_hidden.append(hidden_states)
        if use_cache:
            cache.advance(seq_len)

        output = BaseModelOutputWithPast(**{"last_hidden_state": hidden_states, CACHE_KEY: cache if use_cache else None,
                                            "hidden_states": tuple(all_hidden) if all_hidden is not None else None})
        return output if return_dict is not False else output.to_tuple()  # None (peft, HF) means a dict


class AttnLabForCausalLM(AttnLabPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embeddings.weight"}
    accepts_loss_kwargs = True  # transformers.Trainer: the loss divides by `num_items_in_batch` itself

    def __init__(self, config: AttnLabConfig):
        super().__init__(config)
        self.model = AttnLabModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embeddings

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embeddings = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # `generate` must not create a `DynamicCache`; the first forward creates an `AttnLabCache`.
        return False

    def _reorder_cache(self, cache: AttnLabCache, beam_idx: torch.LongTensor) -> AttnLabCache:
        return cache.reorder(beam_idx)

    def compiles_whole(self, seq_len: int | None = None) -> bool:
        """Whether every block's mixer compiles whole under torch.compile, its kernels traced (`Mixer.compiles_whole`;
        for training forwards of `seq_len` tokens, `Mixer.compiles_whole_at`): what `train.compile`'s "auto" asks, and
        what compiling the blocks as one graph (`compile_blocks(stack=True)`) needs."""
        if seq_len is None:
            return all(block.attn.compiles_whole for block in self.model.layers)
        return all(block.attn.compiles_whole_at(seq_len) for block in self.model.layers)

    def compile_blocks(self, on: bool = True, stack: bool = False) -> None:
        """Run each block's training forward through torch.compile (`on=False`: as written again). Inductor fuses
        the glue around each mixer (norms, residual adds, rotary, gates, SwiGLU's activation) and launches it from
        generated code; the mixers' kernels are traced into the block's graph where they are marked so, and run
        between the compiled parts otherwise (`attnlab.models.kernels.eager`). For an eager training step, which the
        host otherwise issues op by op; with `train.compile` on, the trainer turns it on where the step is not
        captured. Evaluation and decoding run as written.
        `stack`: the blocks in turn under one torch.compile instead of each block under its own: the compiled code's
        per-call costs once a step instead of once a block (Mamba-2 at 9 x 1024, 20 layers: eager over captured 0.72 block
        by block, 0.88 as one graph; benchmarks/eager_host.py). For a model that compiles whole (`compiles_whole`):
        where a block breaks the graph after all, the first training forward warns and compiles the blocks one by one
        instead. Its gradients are ready only once the whole stack's backward ends."""
        for block in self.model.layers:
            block.compiled = on and not stack
        self.model.compiled_stack = on and stack

    def enable_health_stats(self, on: bool = True) -> None:
        """Let mixers that report training-health statistics (NSA) record them on training forwards
        (`on=False` stops that and forgets the latest ones)."""
        for module in self.modules():
            if isinstance(module, Mixer) and module.reports_stats:
                module.collect_stats = on
                if not on:
                    module.last_stats = {}

    def health_stats(self) -> dict[str, float]:
        """The latest statistics of the mixers that report them, averaged over layers, as floats
        (e.g. `nsa_gate_entropy_mean`, `nsa_k_mean`); empty when no mixer reports any."""
        keys, values = self.health_stats_table()
        # the mixers keep 0-d tensors on the device (recording them never waits for it): one transfer here, at log time
        return {} if values is None else dict(zip(keys, values.tolist()))

    def health_stats_table(self) -> tuple[list[str], torch.Tensor | None]:
        """`health_stats` before it reaches the host: (the names, their values averaged over layers as one fp32 tensor
        on the device, a copy that later steps do not overwrite), or ([], None) when no mixer reports any."""
        per_layer = [m.last_stats for m in self.modules() if getattr(m, "last_stats", None)]
        if not per_layer:
            return [], None
        keys = list(per_layer[0])
        device = next((v.device for v in per_layer[0].values() if isinstance(v, torch.Tensor)), torch.device("cpu"))
        table = torch.stack([
            torch.stack([torch.as_tensor(stats[key], dtype=torch.float32, device=device).reshape(()) for key in keys])
            for stats in per_layer
        ])  # [layers, keys]
        return keys, table.mean(0)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        cache: AttnLabCache | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        inputs_embeds: torch.Tensor | None = None,
        return_dict: bool | None = True,
        num_items_in_batch: torch.Tensor | int | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        past_key_values: AttnLabCache | None = None,
    ) -> CausalLMOutputWithPast:
        """labels: [B, T] token ids, -100 where no loss is wanted; shifted inside (position t predicts t + 1).
        logits_to_keep: if > 0, logits are computed for the last `logits_to_keep` positions only.
        cache: the state after earlier tokens, under the name the installed transformers uses (`cache`
        from 5.24, `past_key_values` before; both are taken). num_items_in_batch: set by
        transformers.Trainer under gradient accumulation or several processes (see the loss below).
        No other keyword is taken: a misspelt or unsupported one raises TypeError, never vanishes."""
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            cache=one_cache(cache, past_key_values),
            use_cache=use_cache,
            inputs_embeds=inputs_embeds,
            output_hidden_states=output_hidden_states,
            output_attentions=output_attentions,
        )
        hidden_states = outputs.last_hidden_state  # [B, T, hidden]
        if logits_to_keep > 0:
            if labels is not None:
                raise ValueError("labels need logits at every position; use logits_to_keep=0")
            hidden_states = hidden_states[:, -logits_to_keep:]
        logits = self.lm_head(hidden_states)  # [B, T or logits_to_keep, vocab]

        loss = None
        if labels is not None:
            # Shift the labels, not the logits: no copy of the [B, T, vocab] logits (nor of their gradient).
            labels = labels.to(logits.device)
            shifted_labels = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), -100)], dim=1).reshape(-1)
            shifted_logits = logits.reshape(-1, logits.shape[-1])
            # With `num_items_in_batch` (transformers.Trainer under gradient accumulation or several
            # processes) the loss is a sum over this micro-batch divided by the tokens of the whole step.
            num_items = num_items_in_batch
            reduction = "sum" if num_items is not None else "mean"
            if kernels.use_fla(self.config.kernels, logits):
                loss = cross_entropy(shifted_logits, shifted_labels, reduction=reduction)
            else:
                loss = F.cross_entropy(shifted_logits.float(), shifted_labels, ignore_index=-100, reduction=reduction)
            if num_items is not None:
                loss = loss / (num_items.to(loss.device) if torch.is_tensor(num_items) else num_items)

        output = CausalLMOutputWithPast(**{"loss": loss, "logits": logits, CACHE_KEY: getattr(outputs, CACHE_KEY),
                                           "hidden_states": outputs.hidden_states})
        return output if return_dict is not False else output.to_tuple()  # None (peft, HF) means a dict
