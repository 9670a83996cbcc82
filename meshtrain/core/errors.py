"""The one exception meshtrain raises for bad input, and its kind for a layout that does not divide."""


class UserError(Exception):
    """Bad input from the user: printed as one `error: ...` line by the CLI, exit status 2."""


class LayoutError(UserError):
    """A layout (mesh, microbatches) that the device count, the model or the batch does not divide:
    another layout of the same run may (`python -m meshtrain.plan --fit` searches for one)."""


def first_line(e: BaseException) -> str:
    """An exception's message as one line (its first), or its type's name where it has none."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
