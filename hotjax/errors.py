"""Errors a user can fix: the CLI prints them as one line, with no traceback."""


class UserError(Exception):
    """Bad input: the message names the problem and the fix."""
