from .loader import apply_overrides, config_to_yaml, default_config_path, diff_configs, load_config, save_config, valid_keys
from .schema import RESUME_LOCKED, DataSection, GenerateConfig, ModelSection, RunConfig, TrainSection

__all__ = [
    "RunConfig", "GenerateConfig", "ModelSection", "DataSection", "TrainSection", "RESUME_LOCKED",
    "load_config", "save_config", "config_to_yaml", "apply_overrides", "default_config_path", "diff_configs", "valid_keys",
]
