"""The exception types reported as a single line: bad user input (before training starts) and a failed write."""


class UsageError(ValueError):
    """Bad input from the command line or a file it names; the message is one line naming the culprit."""


class StorageError(OSError):
    """A checkpoint that could not be written (a full disk): the message is one line naming the folder, what is left
    and the last complete checkpoint, since the writers' own errors (torch's "iostream error") name neither."""
