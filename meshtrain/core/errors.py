"""The one exception meshtrain raises for bad input."""


class UserError(Exception):
    """Bad input from the user: printed as one `error: ...` line by the CLI, exit status 2."""
