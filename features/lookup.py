"""Online feature reads for micro-batches: one deduplicated Feast read per batch, off the loop.

Feast answers a missing entity with `None` values; that is not an error here. The
lookup reports, per event, which views had no row, and leaves NaN in their columns
for the pipeline's missing-feature policy (the model's defaults) to fill.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from features.errors import FeatureStoreError


@dataclass(frozen=True)
class FeatureRows:
    """Features of one batch, aligned with the events it was asked for."""

    columns: dict[str, np.ndarray]
    """Feature reference (`view__feature`) to float64 values, NaN where missing."""
    missing_views: list[tuple[str, ...]]
    """Per event, the views that had no row for its entity key."""
    unique_keys: int
    """Distinct entity keys read from the store (the batch's deduplicated read size)."""


class FeatureLookup:
    """Reads a feature service for batches of events.

    `entity_fields` maps each entity join key to the event field that carries it.
    `fetch` runs the blocking Feast read on one thread owned by this object; call
    `close()` when done.
    """

    def __init__(self, store: Any, feature_service: str, entity_fields: Mapping[str, str]) -> None:
        try:
            self._service = store.get_feature_service(feature_service)
        except Exception as exc:
            raise FeatureStoreError(
                f"feature service {feature_service!r} is not registered in the Feast repo "
                f"at {store.repo_path}; hint: run `headrace features prepare`"
            ) from exc
        self._store = store
        self._entity_fields = dict(entity_fields)
        self.feature_refs: list[str] = [
            f"{projection.name_to_use()}__{feature.name}"
            for projection in self._service.feature_view_projections
            for feature in projection.features
        ]
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="feast-read")

    async def fetch(self, events: Sequence[Mapping[str, Any]]) -> FeatureRows:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self.read, events)

    def read(self, events: Sequence[Mapping[str, Any]]) -> FeatureRows:
        """Blocking read of the features of `events`, one store call for the distinct keys."""
        join_keys = list(self._entity_fields)
        event_fields = list(self._entity_fields.values())
        slot_of: dict[tuple, int] = {}
        slots = np.empty(len(events), dtype=np.intp)
        for row, event in enumerate(events):
            key = tuple(event[field] for field in event_fields)
            slots[row] = slot_of.setdefault(key, len(slot_of))
        if not events:
            return FeatureRows({ref: np.empty(0) for ref in self.feature_refs}, [], 0)

        entity_rows = [dict(zip(join_keys, key, strict=True)) for key in slot_of]
        try:
            response = self._store.get_online_features(
                features=self._service, entity_rows=entity_rows, full_feature_names=True
            ).to_dict()
        except Exception as exc:
            raise FeatureStoreError(
                f"Feast online read of {len(entity_rows)} keys failed: {exc}"
            ) from exc

        columns: dict[str, np.ndarray] = {}
        missing_by_slot = [[] for _ in slot_of]
        for ref in self.feature_refs:
            values = np.array(
                [np.nan if value is None else value for value in response[ref]], dtype=np.float64
            )
            columns[ref] = values[slots]
            view = ref.split("__", 1)[0]
            for slot in np.flatnonzero(np.isnan(values)):
                if view not in missing_by_slot[slot]:
                    missing_by_slot[slot].append(view)
        missing = [tuple(missing_by_slot[slot]) for slot in slots]
        return FeatureRows(columns, missing, len(slot_of))

    def close(self) -> None:
        self._executor.shutdown(wait=True)
