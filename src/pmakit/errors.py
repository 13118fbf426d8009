"""The one error type of the project: a user mistake or a bad input, reported as one line."""


class PmakitError(Exception):
    """A problem the user can fix (bad input, bad option, missing file). The CLI prints it as one line."""
