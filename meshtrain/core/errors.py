"""The one exception meshtrain raises for bad input, and its kind for a layout that does not divide."""


class UserError(Exception):
    """Bad input from the user: printed as one `error: ...` line by the CLI, exit status 2."""


class LayoutError(UserError):
    """A layout (mesh, microbatches) that the device count, the model or the batch does not divide:
    another layout of the same run may (`python -m meshtrain.plan --fit` searches for one)."""
