"""The launcher's one error type: bad command-line input, a bad hostfile, an impossible resource request."""

from __future__ import annotations


class LauncherError(ValueError):
    """The launch request is wrong. The message names the flag or file:line, the bad value, and what is valid.

    Raised before any process starts, so a mistake never leaves half a job running on some nodes.
    """


class MissingScriptError(LauncherError):
    """The training script does not exist (the CLI then checks whether a subcommand name was meant)."""
