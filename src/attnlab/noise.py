"""Messages from libraries that say nothing to an attnlab user, silenced one by one (by exact text,
never a whole logger or warning category), when attnlab is imported; and the others kept out of a
streamed generation (`held_until_done`): printed once each to stderr when the stream has ended, never
between its words.

- bitsandbytes, imported by peft, which transformers' Trainer imports whenever peft is installed,
  logs "Failed to load CPU gemm_4bit_forward from kernels-community ..." on every CPU process:
  an optional kernel for 4-bit matmuls that only QLoRA would use, and QLoRA works without it.
- peft asks a model for `is_gradient_checkpointing`, which transformers 5 deprecates with a
  FutureWarning on every fine-tune; the replacement is transformers' business, not the user's.
"""

from __future__ import annotations

import contextlib
import logging
import sys
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


# Loggers whose records a streamed generation holds back (each library's root logger; attnlab's own included).
HELD_LOGGERS = ("transformers", "peft", "accelerate", "torch", "attnlab")


class _Holder(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def held_until_done(stream=None):
    """Warnings (the warnings module, under the filters in force) and library log records of WARNING and above
    raised inside the block are held, then written to `stream` (stderr) once each after it: a FutureWarning
    raised at the first decoding step no longer lands between the first and second words of the answer."""
    holder = _Holder()
    loggers = [logging.getLogger(name) for name in HELD_LOGGERS]
    saved = [(logger.handlers[:], logger.propagate) for logger in loggers]
    for logger in loggers:
        logger.handlers = [holder]
        logger.propagate = False
    try:
        with warnings.catch_warnings(record=True) as caught:
            yield
    finally:
        for logger, (handlers, propagate) in zip(loggers, saved):
            logger.handlers, logger.propagate = handlers, propagate
        stream = stream or sys.stderr
        seen = set()
        for w in caught:
            line = f"{w.category.__name__}: {w.message}"
            if line not in seen:  # once each, wherever it was raised
                seen.add(line)
                print(f"warning: {line} ({w.filename}:{w.lineno})", file=stream)
        for record in holder.records:
            line = f"{record.name}: {record.getMessage()}"
            if line not in seen:
                seen.add(line)
                print(f"{record.levelname.lower()}: {line}", file=stream)
