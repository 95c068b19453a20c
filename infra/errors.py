"""Errors of the local service launchers."""

from schemas.errors import HeadraceError


class InfraError(HeadraceError):
    """A local service could not be installed, started or stopped."""
