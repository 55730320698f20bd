"""Fine-tuning: LoRA / DoRA / QLoRA through peft, exact prompt–completion label masks,
control tokens trained as their own embedding rows, adapter directories that reload in one call."""

from .adapter import is_adapter_dir, load_adapter, merge_adapter, save_adapter
from .config import FinetuneConfig, load_finetune_config
from .presets import generate_with_presets, settings_for_prompt, style_separation

__all__ = ["FinetuneConfig", "load_finetune_config", "is_adapter_dir", "load_adapter", "merge_adapter", "save_adapter",
           "generate_with_presets", "settings_for_prompt", "style_separation", "run_finetune"]


def run_finetune(*args, **kwargs):
    from .run import run_finetune as _run

    return _run(*args, **kwargs)
