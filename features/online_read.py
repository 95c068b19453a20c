"""A direct read of Feast's online store, below `get_online_features`.

This is the one module that uses Feast internals: the provider's `online_read` for a
feature view (`FeatureStore._get_provider()`), `EntityKeyProto` and `ValueProto`, and
for the SQLite store its table layout. It skips Feast's request and response objects
and turns the stored values straight into float64 arrays, one row per entity key. If a
Feast upgrade breaks it, this is the place to mend (tests/features/test_online_read.py
compares it with `get_online_features`).

The SQLite store (the default) is read with SQL here rather than through the provider:
Feast's `online_read` turns every stored row into a `datetime` (its column converter)
and every key into a dict of protos, where the rows themselves are an indexed lookup.
Reading the same rows as stored cost two thirds of the CPU (12 against 18 µs per key of
four features, 64 keys a read; 38 against 45 µs for one key; one process, alternating).
Other stores go through the provider.
"""

from __future__ import annotations

import sqlite3
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from feast.infra.key_encoding_utils import serialize_entity_key, serialize_entity_key_prefix
from feast.infra.online_stores.helpers import compute_table_id
from feast.infra.online_stores.sqlite import SqliteOnlineStore
from feast.protos.feast.types.EntityKey_pb2 import EntityKey as EntityKeyProto
from feast.protos.feast.types.Value_pb2 import Value as ValueProto
from feast.protos.feast.types.Value_pb2 import ValueType as StoredType
from feast.type_map import python_values_to_proto_values
from feast.value_type import ValueType

from features.errors import FeatureStoreError

# Serialized entity keys kept per reader (see `OnlineViewReader._stored_keys`): about
# 10 MB at most.
MAX_KEY_BLOBS = 100_000
# A key of each entity type for a warm-up read; whether an entity has it does not matter.
_PLACEHOLDER_KEYS: dict[ValueType, Any] = {
    ValueType.STRING: "headrace-warm-up",
    ValueType.INT64: 0,
    ValueType.INT32: 0,
    ValueType.BYTES: b"headrace-warm-up",
}


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
        self._sqlite = _SqliteTable(store, self.view, self.features) if _is_sqlite(store) else None
        self._key_version = store.config.entity_key_serialization_version
        self._key_blobs: dict[tuple, bytes] = {}
        self._blob_of = _direct_key_serializer(
            self.join_keys, self._value_types, self._key_version, self._entity_keys
        )

    @property
    def reads_at_once(self) -> bool:
        """Whether `read(keys, wait=False)` is possible: a local store (SQLite)."""
        return self._sqlite is not None

    def read(self, keys: Sequence[tuple], wait: bool = True) -> ViewRows:
        """Blocking read of `keys` (tuples of join-key values, in `join_keys` order).
        With `wait=False` (`reads_at_once` stores only) a store locked by a writer
        raises FeatureStoreError at once instead of waiting for the lock."""
        sqlite = self._sqlite
        entity_keys = self._stored_keys(keys) if sqlite is not None else self._entity_keys(keys)
        try:
            if sqlite is not None:
                return sqlite.read(entity_keys, wait)
            rows = self._provider.online_read(
                config=self._store.config,
                table=self.view,
                entity_keys=entity_keys,
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

    def warm(self) -> None:
        """Blocking: one read of a placeholder key, so the first batch does not pay for
        the store's connection and first query; FeatureStoreError as `read`."""
        if all(kind in _PLACEHOLDER_KEYS for kind in self._value_types):
            keys = [tuple(_PLACEHOLDER_KEYS[kind] for kind in self._value_types)]
            self.read(keys)
            if self.reads_at_once:
                self.read(keys, wait=False)  # its own connection

    def _stored_keys(self, keys: Sequence[tuple]) -> list[bytes]:
        """Each key as the SQLite store keeps it (Feast's serialized entity key), kept
        per key: the same keys come back each time their cached rows expire, and Feast's
        conversion was two thirds of a one-key read (64 against 22 µs kept)."""
        known = self._key_blobs
        blobs = [known.get(key) for key in keys]
        if None in blobs:
            new = list(dict.fromkeys(k for k, b in zip(keys, blobs, strict=True) if b is None))
            made = self._serialized(new)
            if len(known) + len(made) > MAX_KEY_BLOBS:
                known.clear()  # simpler than an LRU, and rare: one conversion per key again
            known.update(made)  # `made`, not `known`, answers: another thread may clear it
            blobs = [made[k] if b is None else b for k, b in zip(keys, blobs, strict=True)]
        return blobs

    def _serialized(self, keys: list[tuple]) -> dict[tuple, bytes]:
        blob_of = self._blob_of
        if blob_of is not None:
            try:
                return {key: blob_of(key[0]) for key in keys}
            except TypeError:  # a value of another type: Feast's conversion decides
                pass
        version = self._key_version
        return {
            key: serialize_entity_key(proto, entity_key_serialization_version=version)
            for key, proto in zip(keys, self._entity_keys(keys), strict=True)
        }

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


def _direct_key_serializer(
    join_keys: list[str],
    value_types: list[ValueType],
    version: int,
    entity_keys: Callable[[Sequence[tuple]], list[EntityKeyProto]],
) -> Callable[[Any], bytes] | None:
    """Feast's serialized form of a one-column string or integer key, made without its
    protos: a constant prefix (the join key) and the value's bytes. Feast's conversion
    and serializer took 20 µs a key; every new key of a light load pays it. Checked
    against Feast's own serializer once, here: None (Feast's way) where they differ, or
    for any other key. Raises TypeError for a value of another type."""
    if len(join_keys) != 1 or value_types[0] not in (ValueType.STRING, ValueType.INT64):
        return None
    prefix = serialize_entity_key_prefix(join_keys, version)
    if value_types[0] is ValueType.STRING:
        head = prefix + struct.pack("<I", StoredType.STRING)

        def blob_of(value: Any) -> bytes:
            if type(value) is not str:
                raise TypeError(value)
            encoded = value.encode()
            return head + struct.pack("<I", len(encoded)) + encoded

        sample: Any = "headrace-key-check"
    else:
        head = prefix + struct.pack("<II", StoredType.INT64, 8)

        def blob_of(value: Any) -> bytes:
            if type(value) is not int:
                raise TypeError(value)
            return head + struct.pack("<q", value)

        sample = -12345
    (proto,) = entity_keys([(sample,)])
    feasts = serialize_entity_key(proto, entity_key_serialization_version=version)
    return blob_of if blob_of(sample) == feasts else None


def _epoch_s(stamp: datetime | None) -> float:
    return float("nan") if stamp is None else stamp.timestamp()


def _is_sqlite(store: Any) -> bool:
    kind = store.config.online_store.type
    return kind == "sqlite" or kind.endswith("SqliteOnlineStore")


class _SqliteTable:
    """One feature view's table in Feast's SQLite online store, read with SQL: a row per
    (entity key, feature) holding a serialized `ValueProto` and the event time as epoch
    seconds (Feast's adapter for `datetime`), keyed by Feast's serialized entity key."""

    def __init__(self, store: Any, view: Any, features: Sequence[str]) -> None:
        config = store.config
        self._path = Path(SqliteOnlineStore._get_db_path(config))
        versioned = config.registry.enable_online_feature_view_versioning
        table = compute_table_id(config.project, view, versioned).replace('"', '""')
        self._select = (
            f'SELECT entity_key, feature_name, value, event_ts FROM "{table}" WHERE entity_key IN '
        )
        self._columns = {name: column for column, name in enumerate(features)}
        self._connections: dict[bool, sqlite3.Connection] = {}

    def read(self, blobs: Sequence[bytes], wait: bool = True) -> ViewRows:
        """The rows of `blobs` (serialized entity keys); `wait`: for a writer's lock."""
        width = len(self._columns)
        if not blobs:
            return ViewRows(np.empty((0, width)), np.empty(0))
        # Plain lists until the end: per-element numpy writes cost more than the SQL.
        found: dict[bytes, list[float]] = {}
        stored_ts: dict[bytes, Any] = {}
        columns, nan = self._columns, float("nan")
        unique = list(dict.fromkeys(blobs))
        placeholders = "(" + ",".join("?" * len(unique)) + ")"
        for blob, name, stored, event_ts in self._connect(wait).execute(
            self._select + placeholders, unique
        ):
            stored_ts[blob] = event_ts  # the last row's, as Feast's read
            column = columns.get(name)
            if column is None:
                continue
            value = ValueProto.FromString(stored)
            kind = value.WhichOneof("val")
            if kind is not None and kind != "null_val":
                row = found.get(blob)
                if row is None:
                    row = found[blob] = [nan] * width
                row[column] = float(getattr(value, kind))
        # An entity whose requested values are all null reads as absent, as on Redis.
        absent = [nan] * width
        values = np.array([found.get(blob, absent) for blob in blobs], dtype=np.float64)
        stamps = np.array(
            [_stored_epoch_s(stored_ts[blob]) if blob in found else nan for blob in blobs]
        )
        return ViewRows(values, stamps)

    def _connect(self, wait: bool) -> sqlite3.Connection:
        # Read-only, no type converters. One connection waits for a writer's lock
        # (sqlite3's default 5 s: the caller's time bound decides), used from one store
        # thread at a time; the other gives up on a lock at once, for reads on the event
        # loop. Opened on first read: the file may be materialized after the worker starts.
        connections = self._connections
        if wait not in connections:
            uri = self._path.resolve().as_uri() + "?mode=ro"
            connections[wait] = sqlite3.connect(
                uri, uri=True, check_same_thread=False, timeout=5.0 if wait else 0.0
            )
        return connections[wait]


def _stored_epoch_s(event_ts: Any) -> float:
    """Feast stores `datetime`s as epoch seconds; an ISO string (older writers) is read
    as UTC when it has no zone, as Feast's converter does."""
    if event_ts is None:
        return float("nan")
    if isinstance(event_ts, int | float):
        return float(event_ts)
    stamp = datetime.fromisoformat(event_ts.decode() if isinstance(event_ts, bytes) else event_ts)
    return (stamp if stamp.tzinfo else stamp.replace(tzinfo=UTC)).timestamp()
