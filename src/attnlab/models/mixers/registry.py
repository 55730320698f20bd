"""The mixer interface and the registry of mixers by name.

`Mixer` declares everything the trainer and the decoding engine ask a mixer; each family file
subclasses it and registers itself (`register_mixer`), and presets of a family register with
`register_preset`. `attnlab.models.mixers` imports every family, so `MIXERS` is complete once that
package is imported.
"""

from __future__ import annotations

import difflib
import math
from typing import Any

import torch.nn as nn

MIXERS: dict[str, type["Mixer"]] = {}


class Mixer(nn.Module):
    """Base class of every token mixer: its options, and every capability the trainer and the decoding engine
    ask a mixer about. A family overrides what it supports (as class attributes, or per instance in `__init__`
    where the options decide); nothing else is looked up on a mixer."""

    default_options: dict[str, Any] = {}

    # --- what the trainer asks (attnlab.train.graphs, AttnLabForCausalLM.enable_health_stats) ---
    # The training step's forward and backward may be captured as CUDA graphs: no host synchronisation and no
    # host-side state in the training forward, checked on the GPU.
    train_graph_safe: bool = False
    # The mixer can record training-health statistics: with `collect_stats` on, each training forward leaves them
    # in `last_stats` (name -> tensor or float), which the model averages over layers (`health_stats`).
    reports_stats: bool = False
    collect_stats: bool = False
    # Recording those statistics keeps a captured training step valid (they are written into fixed buffers).
    stats_graph_safe: bool = False
    # torch.compile traces the training forward whole, the mixer's kernels included: a compiled block is one graph,
    # checked against the block as written on the GPU (tests/test_compile_blocks.py). `train.compile`'s "auto"
    # compiles the blocks of an eager step only for such mixers (attnlab.models.kernels.eager).
    compiles_whole: bool = False

    def compiles_whole_at(self, seq_len: int) -> bool:
        """Whether a training forward of `seq_len` tokens traces whole (`compiles_whole`, unless a form the mixer picks
        by length breaks the graph)."""
        return self.compiles_whole

    # --- what the decoding engine asks (attnlab.generation.graphs) ---
    # Decodes over a state of fixed size (a recurrent state, a convolution window): CUDA-graph decoding applies
    # with no further buffers.
    fixed_size_state: bool = False
    # Keeps its KV cache in preallocated buffers of a given capacity (`static_state`), so that CUDA-graph decoding
    # applies to it too.
    static_kv: bool = False
    # The static buffers whose prompt columns every beam of one prompt shares (beam search copies them once).
    static_columns: tuple[str, ...] = ()
    # Each row's tokens start at column 0 of its buffers (no left padding): a prompt ends at its own length.
    left_aligned: bool = False

    def static_state(self, state: dict, capacity: int) -> dict:
        """The prefill's cache `state` moved into preallocated buffers of `capacity` columns (mixers with
        `static_kv`)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no KV cache in static buffers (static_kv is false)")

    @staticmethod
    def options_of(config) -> dict[str, Any]:
        """The layer's options as `config` holds them: every option of `config.mixer`, resolved and checked once, when
        the config was built (`AttnLabConfig` runs `resolve_mixer`, which calls the mixer's `resolve_options`). A
        family's `__init__` reads its options here rather than resolving them again per layer."""
        return dict(config.mixer_options)

    @classmethod
    def resolve_options(cls, options: dict[str, Any] | None) -> dict[str, Any]:
        options = dict(options or {})
        unknown = sorted(set(options) - set(cls.default_options))
        if unknown:
            raise ValueError(
                f"unknown option(s) {unknown} for mixer {cls.name!r}; valid options: {sorted(cls.default_options)}"
            )
        return {**cls.default_options, **options}

    @classmethod
    def check_option_types(cls, options: dict[str, Any]) -> None:
        """Each option of the type of its default; run after `resolve_options`, whose family checks
        give the more precise message where they exist."""
        family_defaults = getattr(cls, "family", cls).default_options  # a preset may set what its family leaves None
        for key, value in options.items():
            _check_option_type(cls.name, key, value, family_defaults.get(key, cls.default_options.get(key)))


def _check_option_type(mixer: str, key: str, value: Any, default: Any) -> None:
    """An option takes the type of its default (an int where the default is a float is fine); a default
    of None leaves the check to the mixer. Catches `num_kv_heads=abc` here, not as a TypeError deep in a layer."""
    if default is None:
        return
    if isinstance(default, bool):
        ok, kind = isinstance(value, bool), "true or false"
    elif isinstance(default, int):
        ok, kind = isinstance(value, int) and not isinstance(value, bool), "an integer"
    elif isinstance(default, float):
        ok, kind = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value), "a finite number"
    elif isinstance(default, str):
        ok, kind = isinstance(value, str), "a string"
    else:
        return
    if not ok:
        raise ValueError(f"model.mixer_options.{key} must be {kind} (mixer {mixer!r}, default {default!r}), got {value!r}")


def unknown_mixer_message(name: Any) -> str:
    """'unknown mixer' with the closest registered names, not all of them."""
    close = difflib.get_close_matches(str(name), list(MIXERS), n=5, cutoff=0.6)
    families = sorted(n for n, cls in MIXERS.items() if not hasattr(cls, "preset_options"))
    hint = (f"did you mean {' or '.join(repr(c) for c in close)}?" if close
            else f"the families are {', '.join(families)}; docs/mixers.md lists all {len(MIXERS)} registered names")
    return f"unknown mixer {name!r}; {hint}"


def mixer_class(name: Any) -> type[Mixer]:
    """The mixer registered as `name`; ValueError naming the closest registered names."""
    if name not in MIXERS:
        raise ValueError(unknown_mixer_message(name))
    return MIXERS[name]


def resolve_mixer(name: Any, options: dict[str, Any] | None) -> dict[str, Any]:
    """Every option of mixer `name`, `options` over its defaults: the one check of a model's mixer (its name, its
    options' names and types), which `AttnLabConfig` runs when it is built."""
    cls = mixer_class(name)
    options = cls.resolve_options(options)
    cls.check_option_types(options)
    return options


def register_mixer(name: str):
    """Class decorator adding a mixer to `MIXERS` under `name`."""

    def register(cls):
        if name in MIXERS:
            raise ValueError(f"mixer {name!r} is already registered")
        cls.name = name
        MIXERS[name] = cls
        return cls

    return register


def register_preset(
    name: str, family_cls: type["Mixer"], options: dict[str, Any], doc: str | None = None, note: str | None = None
):
    """Register `name` as a mixer of the family `family_cls` whose defaults are `options`.
    `note`: where the preset comes from (the table in docs/mixers.md shows it), e.g. the published code it reproduces.

    `MIXERS[name]` is then a subclass of the family: `resolve_options` starts from the preset's
    options, so `model.mixer_options` overrides single options of the preset. The options are
    checked now, so a bad preset fails at import.
    """
    family_cls.resolve_options(options)
    attrs = {
        "default_options": {**family_cls.default_options, **options},
        "preset_options": dict(options),
        "family": family_cls,
        "preset_note": note,
        "__doc__": doc or f"Preset {name!r} of the {family_cls.name!r} mixer family: {options}",
        "__module__": family_cls.__module__,
    }
    preset_cls = type(family_cls.__name__, (family_cls,), attrs)
    return register_mixer(name)(preset_cls)


def presets_markdown(hidden_size: int = 1024, num_heads: int = 16) -> str:
    """The table of every registered preset (docs/mixers.md) (of any family that can describe itself)."""
    head_dim = hidden_size // num_heads
    lines = [
        f"Decode state: one layer, one sequence, fp32, at hidden size {hidden_size} "
        f"({num_heads} heads of {head_dim}); KV-cache variants grow by the per-token figure.",
        "",
        "| preset | options (beyond the family defaults) | formula | constant-memory decode | decode state | follows |",
        "|---|---|---|---|---|---|",
    ]
    for name, cls in MIXERS.items():
        if not hasattr(cls, "preset_options"):
            continue
        options = cls.resolve_options(None)
        family_defaults = cls.family.default_options
        shown = ", ".join(
            f"{key}={value}" for key, value in cls.preset_options.items() if value != family_defaults[key]
        ) or "(defaults)"
        fixed, per_token = cls.decode_state_elements(options, hidden_size, num_heads)
        if per_token:
            size = f"{fixed:,} + {per_token:,}/token el. ({fixed * 4:,} B + {per_token * 4:,} B/token)"
        else:
            size = f"{fixed:,} el. ({fixed * 4:,} B)"
        constant = "no (KV cache)" if per_token else "yes"
        note = getattr(cls, "preset_note", None) or "—"
        lines.append(f"| `{name}` | {cls.family.name}: {shown} | `{cls.formula(options)}` | {constant} | {size} | {note} |")
    return "\n".join(lines)


def build_mixer(config, layer_idx: int) -> nn.Module:
    """Layer `layer_idx`'s mixer, of the kind `config.mixer` names (an `AttnLabConfig`, whose mixer `resolve_mixer`
    checked)."""
    return mixer_class(config.mixer)(config, layer_idx)
