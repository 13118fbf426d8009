"""The one error type of the project: a user mistake or a bad input, reported as one line."""


class PmakitError(Exception):
    """A problem the user can fix (bad input, bad option, missing file). The CLI prints it as one line."""


def first_line(exc: BaseException) -> str:
    """``Type: first line of the message``: another library's exception named in one line of a warning or error."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
