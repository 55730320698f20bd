"""Configuration of the attnlab causal language model."""

from __future__ import annotations

from transformers import PretrainedConfig


def round_up(value: float, multiple: int) -> int:
    return int(multiple * -(-value // multiple))


class AttnLabConfig(PretrainedConfig):
    """A decoder-only LM whose token mixer is chosen by name (`mixer`).

    `mixer_options` holds the options of that mixer only; each mixer declares its
    options and defaults (`MIXERS[name].default_options`) and rejects unknown ones.
    The stored `mixer_options` always contain every option, defaults filled in.
    `intermediate_size` 0 builds blocks without an MLP (Mamba-2's layout).
    """

    model_type = "attnlab"
    keys_to_ignore_at_inference = ["cache", "past_key_values"]
    # the names transformers looks for (generation, device maps)
    attribute_map = {"num_hidden_layers": "num_layers", "num_attention_heads": "num_heads"}

    vocab_size: int = 259
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    mixer: str = "gla"
    mixer_options: dict | None = None
    intermediate_size: int | None = None
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02
    use_cache: bool = True
    kernels: str = "auto"  # "auto": Triton kernels (fla's, attnlab's) on CUDA when installed; "torch": always the reference; "fla": insist
    bos_token_id: int | None = 256
    eos_token_id: int | None = 257
    pad_token_id: int | None = 258

    def __post_init__(self, **kwargs):
        from attnlab.models.mixers import MIXERS, unknown_mixer_message

        if self.mixer not in MIXERS:
            raise ValueError(unknown_mixer_message(self.mixer))
        from attnlab.models.kernels import KERNEL_CHOICES

        if self.kernels not in KERNEL_CHOICES:
            raise ValueError(f"kernels must be one of {KERNEL_CHOICES}, not {self.kernels!r}")
        if self.hidden_size % self.num_heads != 0:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})"
            )
        self.mixer_options = MIXERS[self.mixer].resolve_options(self.mixer_options)
        MIXERS[self.mixer].check_option_types(self.mixer_options)
        if self.intermediate_size is not None and self.intermediate_size < 0:
            raise ValueError(f"intermediate_size must be >= 0 (0: blocks without an MLP), not {self.intermediate_size}")
        if self.intermediate_size is None:
            self.intermediate_size = round_up(8 / 3 * self.hidden_size, 32)
        super().__post_init__(**kwargs)
