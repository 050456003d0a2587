"""What reaches the user as one line: errors (exit code 2) and warnings (the run goes on).

The lowest layer, so that any module, the runtime's included, can raise or warn.
"""

from __future__ import annotations

import sys
from typing import TextIO


class UserError(Exception):
    """Bad input from the user (config, data, checkpoint, arguments).

    The CLI prints the message as one line on stderr and exits with code 2; the message must
    name the bad input and what would be accepted.
    """


class ConfigError(UserError):
    """An invalid run configuration."""


class DataError(UserError):
    """Input data that cannot be prepared or read."""


class CheckpointError(UserError):
    """A checkpoint that cannot be loaded."""


def warn(message: str, stream: TextIO | None = None) -> None:
    """A loud one-line warning on stderr that survives a progress bar."""
    print(f"relaytrain: warning: {message}", file=stream or sys.stderr, flush=True)
