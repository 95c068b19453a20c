"""A direct read of Feast's online store, below `get_online_features`.

This is the one module that uses Feast internals: the provider's `online_read` for a
feature view (`FeatureStore._get_provider()`), `EntityKeyProto` and `ValueProto`. It
skips Feast's request and response objects and turns the stored values straight into
float64 arrays, one row per entity key. If a Feast upgrade breaks it, this is the
place to mend (tests/features/test_online_read.py compares it with
`get_online_features`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import numpy as np
from feast.protos.feast.types.EntityKey_pb2 import EntityKey as EntityKeyProto
from feast.type_map import python_values_to_proto_values

from features.errors import FeatureStoreError


@dataclass(frozen=True)
class ViewRows:
    """Stored rows of one view for a list of entity keys, in the keys' order."""

    values: np.ndarray
    """(keys, features) float64; NaN where the entity has no row or the value is null."""
    event_ts_s: np.ndarray
    """Feature event timestamp per key (epoch seconds); NaN where the entity has no row."""


class OnlineViewReader:
    """Reads the features of one feature view for entity keys, in one store call."""

    def __init__(self, store: Any, view_name: str, features: Sequence[str]) -> None:
        self._store = store
        self.view = store.get_feature_view(view_name)
        self.features = list(features)
        self.ttl_s: float | None = self.view.ttl.total_seconds() if self.view.ttl else None
        self.join_keys: list[str] = []
        self._value_types = []
        for entity_name in self.view.entities:
            entity = store.get_entity(entity_name)
            self.join_keys.append(entity.join_key)
            self._value_types.append(entity.value_type)
        self._provider = store._get_provider()

    def read(self, keys: Sequence[tuple]) -> ViewRows:
        """Blocking read of `keys` (tuples of join-key values, in `join_keys` order)."""
        protos = self._entity_keys(keys)
        try:
            rows = self._provider.online_read(
                config=self._store.config,
                table=self.view,
                entity_keys=protos,
                # A copy: the Redis store appends to the list it is given.
                requested_features=list(self.features),
            )
        except Exception as exc:
            raise FeatureStoreError(
                f"online read of view {self.view.name!r} for {len(keys)} keys failed: {exc}"
            ) from exc
        values = np.full((len(keys), len(self.features)), np.nan)
        stamps = np.full(len(keys), np.nan)
        for row, (event_ts, stored) in enumerate(rows):
            if stored is None:
                continue
            for column, name in enumerate(self.features):
                proto = stored.get(name)
                kind = proto.WhichOneof("val") if proto is not None else None
                if kind is not None and kind != "null_val":
                    values[row, column] = float(getattr(proto, kind))
            # Redis answers an absent entity with empty values and a zero timestamp.
            if not np.isnan(values[row]).all():
                stamps[row] = _epoch_s(event_ts)
        return ViewRows(values, stamps)

    def _entity_keys(self, keys: Sequence[tuple]) -> list[EntityKeyProto]:
        columns = list(zip(*keys, strict=True)) if keys else [[] for _ in self.join_keys]
        encoded = [
            python_values_to_proto_values(list(column), value_type)
            for column, value_type in zip(columns, self._value_types, strict=True)
        ]
        return [
            EntityKeyProto(join_keys=self.join_keys, entity_values=list(values))
            for values in zip(*encoded, strict=True)
        ]


def _epoch_s(stamp: datetime | None) -> float:
    return float("nan") if stamp is None else stamp.timestamp()
