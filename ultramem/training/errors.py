"""The one exception type for bad user input, reported as a single line before training starts."""


class UsageError(ValueError):
    """Bad input from the command line or a file it names; the message is one line naming the culprit."""
