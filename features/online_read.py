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

import logging
import os
import sqlite3
import struct
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from feast.infra.key_encoding_utils import serialize_entity_key, serialize_entity_key_prefix
from feast.infra.online_stores.helpers import compute_table_id
from feast.infra.online_stores.redis import RedisOnlineStore
from feast.infra.online_stores.sqlite import SqliteOnlineStore
from feast.protos.feast.types.EntityKey_pb2 import EntityKey as EntityKeyProto
from feast.protos.feast.types.Value_pb2 import Value as ValueProto
from feast.protos.feast.types.Value_pb2 import ValueType as StoredType
from feast.type_map import python_values_to_proto_values
from feast.types import Bool, Float32, Float64, Int32, Int64, UnixTimestamp
from feast.value_type import ValueType
from redis.backoff import NoBackoff
from redis.exceptions import RedisClusterException, RedisError
from redis.retry import Retry

from features.errors import FeatureStoreError

log = logging.getLogger(__name__)

# A Redis call's socket bound where the connection string sets none (redis-py waits for
# ever): a store that hangs would hold the read thread, and every read queued behind it.
REDIS_SOCKET_TIMEOUT_S = 1.0

# Serialized entity keys kept per reader (see `OnlineViewReader._stored_keys`): about
# 10 MB at most.
MAX_KEY_BLOBS = 100_000
# How often a per-key SQLite read checks that the store file is the one it opened.
FILE_CHECK_S = 1.0
# Stored values read as numbers; any other (text, bytes, lists) reads as missing.
NUMERIC_KINDS = frozenset(
    {"double_val", "float_val", "int32_val", "int64_val", "bool_val", "unix_timestamp_val"}
)
_NUMERIC_TYPES = (Float32, Float64, Int32, Int64, Bool, UnixTimestamp)
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


@dataclass(frozen=True)
class WholeRows:
    """Every entity of a view with a value, as read at one version of the store."""

    version: int
    """The store's `data_version` read just before the rows."""
    index: dict[tuple, int]
    """Entity key (join-key values) to its row."""
    rows: ViewRows
    complete: bool = True
    """Whether `index` holds every entity stored with a value: then a key it lacks is
    absent from the store (as the store would answer, no read needed)."""


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
        _redis_fails_fast(self._provider, store.config.online_store)
        self._sqlite = _SqliteTable(store, self.view, self.features) if _is_sqlite(store) else None
        self._key_version = store.config.entity_key_serialization_version
        self._key_blobs: dict[tuple, bytes] = {}
        codec = _direct_key_codec(
            self.join_keys, self._value_types, self._key_version, self._entity_keys
        )
        self._blob_of, self._key_of = codec if codec is not None else (None, None)
        non_numeric = _non_numeric(self.view, self.features)
        if non_numeric:
            log.warning("feature view %s: features %s are not numbers; they read as missing",
                        view_name, non_numeric)  # fmt: skip

    @property
    def reads_at_once(self) -> bool:
        """Whether `read(keys, wait=False)` is possible: a local store (SQLite)."""
        return self._sqlite is not None

    def read(self, keys: Sequence[tuple], wait: bool = True) -> ViewRows:
        """Blocking read of `keys` (tuples of join-key values, in `join_keys` order).
        With `wait=False` (`reads_at_once` stores only) a store locked by a writer
        raises FeatureStoreError at once instead of waiting for the lock. A key holding
        a null (None, NaN) or a value Feast cannot convert to the entity's type reads
        as absent, without a read."""
        usable = [index for index, key in enumerate(keys) if not has_null(key)]
        wanted = keys if len(usable) == len(keys) else [keys[index] for index in usable]
        convert = self._stored_keys if self._sqlite is not None else self._entity_keys
        try:
            entity_keys = convert(wanted)
        except Exception:  # some key Feast cannot convert: only that one is missing
            usable = [index for index in usable if _converts(convert, keys[index])]
            wanted = [keys[index] for index in usable]
            entity_keys = convert(wanted)
        rows = self._read(entity_keys, wait) if wanted else None
        if len(usable) == len(keys) and rows is not None:
            return rows
        values = np.full((len(keys), len(self.features)), np.nan)
        stamps = np.full(len(keys), np.nan)
        if rows is not None:
            values[usable], stamps[usable] = rows.values, rows.event_ts_s
        return ViewRows(values, stamps)

    def _read(self, entity_keys: list, wait: bool) -> ViewRows:
        sqlite = self._sqlite
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
                f"online read of view {self.view.name!r} for {len(entity_keys)} keys failed: {exc}"
            ) from exc
        values = np.full((len(entity_keys), len(self.features)), np.nan)
        stamps = np.full(len(entity_keys), np.nan)
        for row, (event_ts, stored) in enumerate(rows):
            if stored is None:
                continue
            for column, name in enumerate(self.features):
                proto = stored.get(name)
                kind = proto.WhichOneof("val") if proto is not None else None
                if kind in NUMERIC_KINDS:  # any other value (text, a list) is missing
                    values[row, column] = float(getattr(proto, kind))
            # Redis answers an absent entity with empty values and a zero timestamp.
            if not np.isnan(values[row]).all():
                stamps[row] = _epoch_s(event_ts)
        return ViewRows(values, stamps)

    @property
    def value_types(self) -> list[ValueType]:
        """The entities' value types, in `join_keys` order."""
        return self._value_types

    def read_whole(self, max_entities: int) -> WholeRows | None:
        """Blocking: every entity's row of the view, if it can be kept whole: a SQLite
        store, a key that reads back from its stored form (one string or integer join
        key), at most `max_entities` entities with a value. None otherwise; call from one
        thread only. FeatureStoreError when the store cannot be read."""
        if self._sqlite is None or self._key_of is None:
            return None
        try:
            whole = self._sqlite.read_whole(max_entities)
        except Exception as exc:  # sqlite3's errors, a file gone
            raise FeatureStoreError(f"whole read of view {self.view.name!r} failed: {exc}") from exc
        if whole is None:
            return None
        version, blobs, rows = whole
        key_of = self._key_of
        keys = [key_of(blob) for blob in blobs]
        known = [index for index, key in enumerate(keys) if key is not None]
        complete = len(known) == len(keys)
        if not complete:  # another writer's form: keys not kept are read per key
            keys = [keys[index] for index in known]
            rows = ViewRows(rows.values[known], rows.event_ts_s[known])
        index = dict(zip(keys, range(len(keys)), strict=True))
        return WholeRows(version, index, rows, complete)

    def store_version(self) -> int:
        """The store's version as the whole read's connection sees it (see `read_whole`):
        it changes when another connection commits. FeatureStoreError when unreadable."""
        if self._sqlite is None:
            raise FeatureStoreError(f"view {self.view.name!r} is not in a SQLite store")
        try:
            return self._sqlite.version()
        except Exception as exc:
            raise FeatureStoreError(f"version of view {self.view.name!r}: {exc}") from exc

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


def _direct_key_codec(
    join_keys: list[str],
    value_types: list[ValueType],
    version: int,
    entity_keys: Callable[[Sequence[tuple]], list[EntityKeyProto]],
) -> tuple[Callable[[Any], bytes], Callable[[bytes], tuple | None]] | None:
    """Feast's serialized form of a one-column string or integer key, made without its
    protos: a constant prefix (the join key) and the value's bytes; and the key read
    back from that form. Feast's conversion and serializer took 20 µs a key; every new
    key of a light load pays it. Checked against Feast's own serializer once, here: None
    (Feast's way) where they differ, or for any other key. The first raises TypeError for
    a value of another type; the second answers None for a form it does not know."""
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

        def key_of(blob: bytes) -> tuple | None:
            start = len(head) + 4
            if not blob.startswith(head) or len(blob) < start:
                return None
            (size,) = struct.unpack_from("<I", blob, len(head))
            if len(blob) != start + size:
                return None
            try:
                return (blob[start:].decode(),)
            except UnicodeDecodeError:
                return None

        sample: Any = "headrace-key-check"
    else:
        head = prefix + struct.pack("<II", StoredType.INT64, 8)

        def blob_of(value: Any) -> bytes:
            if type(value) is not int:
                raise TypeError(value)
            return head + struct.pack("<q", value)

        def key_of(blob: bytes) -> tuple | None:
            if not blob.startswith(head) or len(blob) != len(head) + 8:
                return None
            return struct.unpack_from("<q", blob, len(head))

        sample = -12345
    (proto,) = entity_keys([(sample,)])
    feasts = serialize_entity_key(proto, entity_key_serialization_version=version)
    if blob_of(sample) != feasts or key_of(feasts) != (sample,):
        return None
    return blob_of, key_of


def has_null(key: tuple) -> bool:
    """Whether an entity key holds a null (None, NaN): no entity has it."""
    return any(value is None or (isinstance(value, float | np.floating) and value != value)
               for value in key)  # fmt: skip


def _converts(convert: Callable[[Sequence[tuple]], list], key: tuple) -> bool:
    try:
        convert([key])
    except Exception:
        return False
    return True


def _non_numeric(view: Any, features: Sequence[str]) -> list[str]:
    """The features of `features` whose Feast type is not a number (read as missing)."""
    types = {field.name: field.dtype for field in view.features}
    return [name for name in features if name in types and types[name] not in _NUMERIC_TYPES]


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
        self._table = table
        self._select = f'SELECT entity_key, feature_name, value, event_ts FROM "{table}"'
        self._columns = {name: column for column, name in enumerate(features)}
        self._connections: dict[bool | str, sqlite3.Connection] = {}
        # The file (st_dev, st_ino) each connection opened, and the file as last
        # checked (`version`): a store file replaced (a rebuilt store moved into place)
        # or deleted would otherwise be read on the old inode for ever.
        self._opened: dict[bool | str, tuple[int, int] | None] = {}
        self._file: tuple[int, int] | None = None
        self._files_seen = 0
        self._file_checked_at = 0.0

    def read(self, blobs: Sequence[bytes], wait: bool = True) -> ViewRows:
        """The rows of `blobs` (serialized entity keys); `wait`: for a writer's lock."""
        width = len(self._columns)
        if not blobs:
            return ViewRows(np.empty((0, width)), np.empty(0))
        if time.monotonic() - self._file_checked_at >= FILE_CHECK_S:
            self._check_file()  # per-key reads too (the whole view checks its own way)
        unique = list(dict.fromkeys(blobs))
        placeholders = "(" + ",".join("?" * len(unique)) + ")"
        found, stored_ts = self._gather(
            self._connect(wait).execute(self._select + " WHERE entity_key IN " + placeholders,
                                        unique)
        )  # fmt: skip
        # An entity whose requested values are all null reads as absent, as on Redis.
        absent, nan = [float("nan")] * width, float("nan")
        values = np.array([found.get(blob, absent) for blob in blobs], dtype=np.float64)
        stamps = np.array(
            [_stored_epoch_s(stored_ts[blob]) if blob in found else nan for blob in blobs]
        )
        return ViewRows(values, stamps)

    def read_whole(self, max_entities: int) -> tuple[int, list[bytes], ViewRows] | None:
        """Every entity of the table with a value: the store's `data_version` before the
        read (see `version`), their serialized keys and rows; None when the table holds
        more than `max_entities` entities. On its own connection: call from one thread."""
        connection = self._connect("whole")
        version = self.version()
        count = f'SELECT COUNT(DISTINCT entity_key) FROM "{self._table}"'
        (entities,) = connection.execute(count).fetchone()
        if entities > max_entities:
            return None
        found, stored_ts = self._gather(connection.execute(self._select))
        blobs = list(found)
        values = np.array([found[blob] for blob in blobs], dtype=np.float64).reshape(
            len(blobs), len(self._columns)
        )
        stamps = np.array([_stored_epoch_s(stored_ts[blob]) for blob in blobs])
        return version, blobs, ViewRows(values, stamps)

    def version(self) -> int:
        """SQLite's `data_version` of the store file on the whole read's connection: it
        changes when any other connection (a materialization, a push) commits. A store
        file replaced since is reopened (every connection, at its next use); a deleted
        one raises (FileNotFoundError), and reads fail from then on."""
        self._check_file()
        (data_version,) = self._connect("whole").execute("PRAGMA data_version").fetchone()
        # A new file's connection starts its data_version again: the count of files
        # seen tells its versions apart.
        return (self._files_seen << 32) + data_version

    def _check_file(self) -> None:
        """Note a store file replaced since (each connection reopens it at its next use)
        or deleted (FileNotFoundError, from here and from every later connection)."""
        self._file_checked_at = time.monotonic()
        try:
            file = _identity(self._path)
        except FileNotFoundError:
            self._file = _GONE
            raise
        if file != self._file:
            if self._file is not None:
                self._files_seen += 1
            self._file = file

    def _gather(self, rows: Iterable) -> tuple[dict[bytes, list[float]], dict[bytes, Any]]:
        """Per entity key, its requested values (NaN where null) and its event time."""
        # Plain lists until the end: per-element numpy writes cost more than the SQL.
        found: dict[bytes, list[float]] = {}
        stored_ts: dict[bytes, Any] = {}
        columns, width, nan = self._columns, len(self._columns), float("nan")
        for blob, name, stored, event_ts in rows:
            stored_ts[blob] = event_ts  # the last row's, as Feast's read
            column = columns.get(name)
            if column is None:
                continue
            value = ValueProto.FromString(stored)
            kind = value.WhichOneof("val")
            if kind in NUMERIC_KINDS:  # any other value (text, a list) is missing
                row = found.get(blob)
                if row is None:
                    row = found[blob] = [nan] * width
                row[column] = float(getattr(value, kind))
        return found, stored_ts

    def _connect(self, wait: bool | str) -> sqlite3.Connection:
        # Read-only, no type converters. One connection waits for a writer's lock
        # (sqlite3's default 5 s: the caller's time bound decides), used from one store
        # thread at a time; one gives up on a lock at once, for reads on the event loop;
        # one ("whole") is the whole view's, in its own thread, which checks again a
        # second later. Opened on first read: the file may be materialized after the
        # worker starts.
        connections = self._connections
        connection = connections.get(wait)
        if connection is not None and self._opened[wait] == self._file:
            return connection
        if connection is not None:  # the file was replaced or deleted: open it again
            del connections[wait]
            connection.close()  # each connection is used by one thread: this one
        if self._file == _GONE:
            raise FileNotFoundError(f"{self._path} was deleted")
        uri = self._path.resolve().as_uri() + "?mode=ro"
        timeout_s = {False: 0.0, "whole": 1.0}.get(wait, 5.0)
        connection = sqlite3.connect(uri, uri=True, check_same_thread=False, timeout=timeout_s)
        opened = _identity(self._path)
        if self._file is None:
            self._file = opened
        self._opened[wait] = opened
        connections[wait] = connection
        return connection


_GONE = (-1, -1)


def _identity(path: Path) -> tuple[int, int]:
    stat = os.stat(path)
    return stat.st_dev, stat.st_ino


def _stored_epoch_s(event_ts: Any) -> float:
    """Feast stores `datetime`s as epoch seconds; an ISO string (older writers) is read
    as UTC when it has no zone, as Feast's converter does."""
    if event_ts is None:
        return float("nan")
    if isinstance(event_ts, int | float):
        return float(event_ts)
    stamp = datetime.fromisoformat(event_ts.decode() if isinstance(event_ts, bytes) else event_ts)
    return (stamp if stamp.tzinfo else stamp.replace(tzinfo=UTC)).timestamp()


def _redis_fails_fast(provider: Any, config: Any) -> None:
    """Feast's Redis client, told to fail at once when Redis is down. redis-py retries a
    failed call three times with backoff from 1 s: a read of a stopped Redis took 10 s,
    holding the read thread while the next reads queued behind it, and batches waiting
    on it were shed past their deadline instead of answered without the store. Here
    the store breaker (`features/breaker.py`) is the retry policy: one immediate retry
    (a pooled connection Redis closed while it restarted), no backoff."""
    online_store = getattr(provider, "online_store", None)
    if not isinstance(online_store, RedisOnlineStore):
        return
    if online_store._client is None:
        # A Redis Cluster or Sentinel client connects as it is made: with the timeouts
        # set only afterwards, a silent node held the worker's start for ever.
        config = _with_socket_timeouts(config)
    try:
        client = online_store._get_client(config)  # made once, kept by the store
    except (RedisError, RedisClusterException) as exc:
        raise FeatureStoreError(
            f"could not reach the Redis online store at {config.connection_string!r}: "
            f"{exc}; hint: check that it runs and that the worker can reach it"
        ) from exc
    client.set_retry(Retry(NoBackoff(), 1))
    for pool in _connection_pools(client):
        for setting in ("socket_timeout", "socket_connect_timeout"):
            if pool.connection_kwargs.get(setting) is None:
                pool.connection_kwargs[setting] = REDIS_SOCKET_TIMEOUT_S


def _with_socket_timeouts(config: Any) -> Any:
    """The Redis store config with socket timeouts in its connection string (Feast passes
    its `key=value` parts to the client), unless the user set them there."""
    given = config.connection_string
    missing = [f"{setting}={REDIS_SOCKET_TIMEOUT_S}"
               for setting in ("socket_timeout", "socket_connect_timeout")
               if f"{setting}=" not in given]  # fmt: skip
    if not missing:
        return config
    return config.model_copy(update={"connection_string": ",".join([given, *missing])})


def _connection_pools(client: Any) -> list[Any]:
    """The connection pools of a Redis client, or of each node of a Redis Cluster."""
    pool = getattr(client, "connection_pool", None)
    if pool is not None:
        return [pool]
    nodes = client.get_nodes()
    return [node.redis_connection.connection_pool for node in nodes if node.redis_connection]
