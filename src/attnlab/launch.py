"""Where this process sits under torchrun (which sets RANK and WORLD_SIZE); one process otherwise."""

from __future__ import annotations

import os


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    """Processes training together; train.batch_size is split across them."""
    return int(os.environ.get("WORLD_SIZE", "1"))
