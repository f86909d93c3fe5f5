"""Errors a user can cause. Entry points turn them into one line on stderr and exit 1."""


class UserError(Exception):
    """Bad flags, files or environment: the message is the whole story, no traceback."""


class UsageError(UserError):
    """Flags that cannot work together or with this machine."""


class DataError(UserError):
    """A data set that cannot be read: missing, truncated or corrupt files, no download."""
