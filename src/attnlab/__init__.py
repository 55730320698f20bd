"""attnlab: pretrain, fine-tune, generate from and evaluate efficient-mixer language models."""

__version__ = "0.1.0"

from attnlab.noise import silence as _silence  # noqa: E402

_silence()


def load(path, device: str = "auto", dtype: str = "auto", trust_remote_code: bool = False):
    """(model, tokenizer) from a run directory, checkpoint, HF model directory or GGUF file."""
    from attnlab.loading import load as _load

    return _load(path, device=device, dtype=dtype, trust_remote_code=trust_remote_code)


def generate(model, tokenizer, prompts, config=None, **settings):
    """See attnlab.generation.generate."""
    from attnlab.generation import generate as _generate

    return _generate(model, tokenizer, prompts, config, **settings)


def __getattr__(name):
    if name == "GenerateConfig":
        from attnlab.config import GenerateConfig

        return GenerateConfig
    raise AttributeError(name)
