"""Errors of the feature stage."""

from schemas.errors import HeadraceError


class FeatureStoreError(HeadraceError):
    """The Feast store is missing, misconfigured or failed a read."""
