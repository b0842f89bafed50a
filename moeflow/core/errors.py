"""Errors that are the user's to fix (bad config, bad file, missing path).

The CLI prints a `UserError` as one line and exits non-zero; anything else is a
bug and keeps its traceback.
"""


class UserError(Exception):
    """Bad input: the message names the file / tensor / field / line at fault."""


class StageFailed(Exception):
    """A pipeline stage failed; carries the stage name and its one-line error."""

    def __init__(self, stage: str, message: str):
        super().__init__(f"stage {stage} failed: {message}")
        self.stage = stage
        self.message = message


class Terminated(KeyboardInterrupt):
    """SIGTERM (`kill`, systemd, a pod stop) where a command stops as Ctrl-C does; the CLI
    exits 143 (128 + SIGTERM) for it, 130 for Ctrl-C."""
