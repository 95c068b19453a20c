"""Errors of the feature stage."""

from typing import Any

from schemas.errors import HeadraceError


class FeatureStoreError(HeadraceError):
    """The Feast store is missing, misconfigured or failed a read."""


class StoreUnavailable(FeatureStoreError):
    """A batch's read failed, took too long, or was refused while the store is down
    (the circuit breaker is open): its events answer without the store, except those
    whose rows were all in memory (`in_memory`, when the lookup had any)."""

    in_memory: Any = None
    """`features.lookup.InMemory`: the batch's rows from memory, and which events they
    answer in full."""


class StoreUnreachable(FeatureStoreError):
    """An online store a command must write (Redis) does not answer."""

    exit_status = 69  # EX_UNAVAILABLE: worth retrying once the store is up
