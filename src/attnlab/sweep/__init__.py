"""Suites of runs: a base config x a grid or list of overrides, run on GPU or CPU slots with skip/resume."""

from .suite import Job, Suite, expand, load_suite, resolve_suite_path

__all__ = ["Suite", "Job", "expand", "load_suite", "resolve_suite_path"]
