"""Errors of the feature stage."""

from schemas.errors import HeadraceError


class FeatureStoreError(HeadraceError):
    """The Feast store is missing, misconfigured or failed a read."""


class StoreUnavailable(FeatureStoreError):
    """A batch's read failed, took too long, or was refused while the store is down
    (the circuit breaker is open): its events answer without the store."""
