"""The errors attnlab raises for problems a person can fix.

Each carries one message that says what is wrong and what to do. The CLI prints it
and exits non-zero; nothing else is printed for these (no traceback).
"""


class AttnLabError(Exception):
    """Base class: a problem with the user's input, data or run directory."""


class ConfigError(AttnLabError):
    """A config file or override is missing, malformed or invalid."""


class DataError(AttnLabError):
    """A corpus or tokenizer cannot be read or does not fit the config."""


class CheckpointError(AttnLabError):
    """A checkpoint is missing, incomplete or corrupted, or a resume is not possible."""


class RunDirError(AttnLabError):
    """A run directory cannot be used: held by another process, not writable, not a directory, or its files damaged."""


class RunInterrupted(AttnLabError):
    """SIGINT or SIGTERM stopped a run after it saved a checkpoint; `exit_code` is the signal's shell status."""

    def __init__(self, message: str, exit_code: int = 130):
        super().__init__(message)
        self.exit_code = exit_code


class PreflightError(AttnLabError):
    """Preflight found one or more errors; the run was not started."""


class TrainingDivergedError(AttnLabError):
    """The loss became NaN or infinite; no checkpoint was written after it."""


class OutputError(AttnLabError):
    """An output file or directory cannot be created or written (a file in the way, no permission, a full disk)."""
