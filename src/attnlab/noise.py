"""Messages from libraries that say nothing to an attnlab user, silenced one by one (by exact text,
never a whole logger or warning category), when attnlab is imported.

- bitsandbytes, imported by peft, which transformers' Trainer imports whenever peft is installed,
  logs "Failed to load CPU gemm_4bit_forward from kernels-community ..." on every CPU process:
  an optional kernel for 4-bit matmuls that only QLoRA would use, and QLoRA works without it.
- peft asks a model for `is_gradient_checkpointing`, which transformers 5 deprecates with a
  FutureWarning on every fine-tune; the replacement is transformers' business, not the user's.
"""

from __future__ import annotations

import logging
import warnings

BNB_CPU_KERNEL = "Failed to load CPU gemm_4bit_forward"
GRADIENT_CHECKPOINTING = "`is_gradient_checkpointing` is deprecated"


class _DropMessage(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def silence() -> None:
    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")  # the same object bitsandbytes logs through later
    if not any(isinstance(f, _DropMessage) for f in logger.filters):
        logger.addFilter(_DropMessage(BNB_CPU_KERNEL))
    warnings.filterwarnings("ignore", message=GRADIENT_CHECKPOINTING, category=FutureWarning)
