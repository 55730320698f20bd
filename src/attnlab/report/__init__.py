"""Compare runs: a self-contained HTML page, the main loss plot as PNG, a Markdown table.

`attnlab.report.load` reads run directories; `attnlab.report.render` (matplotlib) draws and writes."""

from .load import RunRecord, config_differences, load_run, load_runs

__all__ = ["RunRecord", "load_run", "load_runs", "config_differences"]
