"""Consoles that read well in a terminal and in a log file.

Off a terminal (nohup, tmux logs, job logs, pipes) rich lays text out at 80 columns and wraps every longer
line, generated text included. attnlab's consoles take `LOG_WIDTH` columns there instead, unless `COLUMNS`
says otherwise; on a terminal they take its width.
"""

from __future__ import annotations

import os

from rich.console import Console

LOG_WIDTH = 160


def make_console(**kwargs) -> Console:
    """A rich Console (same arguments) that is `LOG_WIDTH` wide when it does not write to a terminal."""
    console = Console(**kwargs)
    if console.is_terminal or "width" in kwargs or os.environ.get("COLUMNS"):
        return console
    return Console(width=LOG_WIDTH, **kwargs)
