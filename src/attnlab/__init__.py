"""attnlab: pretrain, fine-tune, generate from and evaluate efficient-mixer language models."""

__version__ = "0.1.0"
