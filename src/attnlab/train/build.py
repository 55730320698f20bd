"""Turn the run config into the model config and the model."""

from __future__ import annotations

from attnlab.config import RunConfig


def model_config_from(cfg: RunConfig, tokenizer):
    from attnlab.models import AttnLabConfig

    m = cfg.model
    return AttnLabConfig(
        vocab_size=m.vocab_size or len(tokenizer),
        hidden_size=m.hidden_size,
        num_layers=m.num_layers,
        num_heads=m.num_heads,
        mixer=m.mixer,
        mixer_options=dict(m.mixer_options),
        intermediate_size=m.intermediate_size,
        max_position_embeddings=m.max_position_embeddings,
        rope_theta=m.rope_theta,
        norm_eps=m.norm_eps,
        tie_word_embeddings=m.tie_word_embeddings,
        initializer_range=m.initializer_range,
        kernels=m.kernels,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
