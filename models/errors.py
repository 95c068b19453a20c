"""Errors of the model stage."""

from schemas.errors import HeadraceError


class ModelError(HeadraceError):
    """A model artifact is missing, malformed, or failed to run."""
