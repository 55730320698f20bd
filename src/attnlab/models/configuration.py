"""Configuration of the attnlab causal language model.

The architecture is the run config's `model` section (`attnlab.config.ModelSection`): each field's name, type,
default and bounds are declared there once, with the description `attnlab config reference` prints, and
`AttnLabConfig` takes them over by name. What the model adds is what a run config leaves to the tokenizer (the
special token ids) and transformers' `use_cache`.
"""

from __future__ import annotations

import dataclasses

from pydantic import ValidationError
from transformers import PretrainedConfig

from attnlab.config.schema import ModelSection
from attnlab.models.mixers import resolve_mixer

# vocab_size null means the tokenizer's size; a model built without one has the default tokenizer's ('byte': 256
# bytes and bos, eos, pad, the ids below)
BYTE_TOKENIZER_SIZE = 259


def round_up(value: float, multiple: int) -> int:
    return int(multiple * -(-value // multiple))


def _fields_of(section: type) -> type:
    """A dataclass with the fields of the pydantic `section`, their types and defaults. As a base of a config
    (transformers makes each config class a dataclass of its own and its bases' fields), it gives the config
    those fields."""
    fields = []
    for name, info in section.model_fields.items():
        if info.default_factory is not None:
            default = dataclasses.field(default_factory=info.default_factory)
        else:
            default = dataclasses.field(default=info.default)
        fields.append((name, info.annotation, default))
    return dataclasses.make_dataclass(f"{section.__name__}Fields", fields, kw_only=True, init=False, repr=False, eq=False)


class AttnLabConfig(_fields_of(ModelSection), PretrainedConfig):
    """A decoder-only LM whose token mixer is chosen by name (`mixer`).

    Its architecture fields and their defaults are `ModelSection`'s, checked by its rules when the config is built.
    `mixer_options` holds the options of that mixer only; each mixer declares its options and defaults
    (`MIXERS[name].default_options`) and rejects unknown ones. The stored `mixer_options` always contain every
    option, defaults filled in; so do `vocab_size` (null: `BYTE_TOKENIZER_SIZE`) and `intermediate_size`
    (null: 8/3 * hidden_size rounded up to 32). `intermediate_size` 0 builds blocks without an MLP (Mamba-2's
    layout).
    """

    model_type = "attnlab"
    keys_to_ignore_at_inference = ["cache", "past_key_values"]
    # the names transformers looks for (generation, device maps)
    attribute_map = {"num_hidden_layers": "num_layers", "num_attention_heads": "num_heads"}

    use_cache: bool = True
    bos_token_id: int | None = 256
    eos_token_id: int | None = 257
    pad_token_id: int | None = 258

    def __post_init__(self, **kwargs):
        self.mixer_options = resolve_mixer(self.mixer, self.mixer_options)
        self._check_architecture()
        if self.hidden_size % self.num_heads != 0:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})"
            )
        if self.vocab_size is None:
            self.vocab_size = BYTE_TOKENIZER_SIZE
        if self.intermediate_size is None:
            self.intermediate_size = round_up(8 / 3 * self.hidden_size, 32)
        super().__post_init__(**kwargs)

    def _check_architecture(self) -> None:
        """The architecture fields by `ModelSection`'s rules (types, bounds, choices), as a run config's are."""
        try:
            ModelSection.model_validate({name: getattr(self, name) for name in ModelSection.model_fields})
        except ValidationError as e:
            raise ValueError("; ".join(
                f"model.{'.'.join(map(str, error['loc']))} {error['msg'].removeprefix('Value error, ').removeprefix('Input ')} "
                f"(got {error['input']!r})" for error in e.errors())) from None
