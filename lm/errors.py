"""The one exception type for mistakes a user can fix (kept apart from `lm.config`, which imports
the model, so that light processes such as `lm.prepare`'s workers need not import JAX)."""


class UserError(Exception):
    """A mistake the user can fix: printed as one line, with a non-zero exit and no traceback."""
