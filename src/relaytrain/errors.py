"""Errors that reach the user as one line and exit code 2."""


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
