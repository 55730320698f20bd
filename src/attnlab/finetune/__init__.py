"""Fine-tuning: LoRA / DoRA / QLoRA through peft, exact prompt–completion label masks,
control tokens trained as their own embedding rows, adapter directories that reload in one call."""

from attnlab.config.presets import settings_for_prompt

from .config import FinetuneConfig, load_finetune_config
from .presets import generate_with_presets, style_separation

_ADAPTER = ("is_adapter_dir", "load_adapter", "merge_adapter", "save_adapter")


def __getattr__(name: str):
    """The adapter functions, imported on first use: they import peft (about 1.5 s), which every other
    command of the CLI can do without."""
    if name in _ADAPTER:
        from . import adapter

        return getattr(adapter, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = ["FinetuneConfig", "load_finetune_config", "is_adapter_dir", "load_adapter", "merge_adapter", "save_adapter",
           "generate_with_presets", "settings_for_prompt", "style_separation", "run_finetune"]


def run_finetune(*args, **kwargs):
    from .run import run_finetune as _run

    return _run(*args, **kwargs)
