"""Events and stored values the store cannot answer as asked: null or mistyped entity
keys, non-numeric stored values, a store file replaced or deleted, a failing read. Each
reads as missing or as a store outage, never as an error that ends the worker."""

from __future__ import annotations

import asyncio
import os
import shutil
import sqlite3
import time
from datetime import UTC, datetime
from types import SimpleNamespace

import numpy as np
import pytest
from feast.infra.key_encoding_utils import serialize_entity_key
from feast.protos.feast.types.EntityKey_pb2 import EntityKey as EntityKeyProto
from feast.protos.feast.types.Value_pb2 import Value as ValueProto

from features.breaker import BreakerState, StoreBreaker
from features.config import FeatureCacheConfig
from features.errors import StoreUnavailable
from features.lookup import FeatureLookup
from features.online_read import OnlineViewReader
from features.store import open_store

ENTITY_FIELDS = {"user_id": "user_id", "merchant_id": "merchant_id"}
USER_FEATURES = ["txn_count_7d", "avg_amount_7d", "chargeback_rate_90d", "account_age_days"]
KNOWN = {"user_id": "u0000001", "merchant_id": "m000001"}
# Whole views on (the default) and off (every key read from the store).
WHOLE = pytest.mark.parametrize("whole", [True, False], ids=["whole", "per-key"])


@pytest.fixture
def repo(tmp_path, sample_assets):
    copy = tmp_path / "repo"
    shutil.copytree(sample_assets.repo, copy)
    return copy


def lookup_of(repo, whole: bool, **cache) -> FeatureLookup:
    settings = FeatureCacheConfig(**cache, **({} if whole else {"whole_view_max_entities": 0}))
    lookup = FeatureLookup(open_store(repo), "fraud_scoring", ENTITY_FIELDS, settings)
    lookup.warm(timeout_s=30.0)
    return lookup


def user_table(connection: sqlite3.Connection) -> str:
    names = connection.execute("SELECT name FROM sqlite_master WHERE type='table'")
    return next(name for (name,) in names if name.endswith("user_stats"))


def user_blob(store, user: str) -> bytes:
    key = EntityKeyProto(join_keys=["user_id"], entity_values=[ValueProto(string_val=user)])
    version = store.config.entity_key_serialization_version
    return serialize_entity_key(key, entity_key_serialization_version=version)


async def wait_for(condition, timeout_s: float):
    """Poll an async `condition()` until it returns a true value, within a deadline."""
    deadline = time.monotonic() + timeout_s
    while not (value := await condition()):
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)
    return value


@WHOLE
async def test_an_event_with_a_null_key_misses_the_view_and_the_store_stays_healthy(repo, whole):
    lookup = lookup_of(repo, whole)
    events = [
        {"user_id": None, "merchant_id": "m000001"},
        {"user_id": float("nan"), "merchant_id": "m000001"},
        KNOWN,
    ]
    try:
        for _ in range(3):  # more failures than the breaker tolerates, were they failures
            rows = await lookup.fetch(events, timeout_s=5.0)
            assert rows.missing_views == [("user_stats",), ("user_stats",), ()]
            assert not np.isnan(rows.columns["merchant_stats__risk_score"]).any()
        assert lookup.breaker.state is BreakerState.CLOSED
    finally:
        lookup.close()


class _Unconvertible:
    def __str__(self) -> str:
        raise ValueError("no text form")


def test_a_key_the_store_cannot_take_reads_as_absent_and_the_others_are_read(store):
    reader = OnlineViewReader(store, "user_stats", USER_FEATURES)
    keys = [(None,), ("u0000001",), (float("nan"),), (_Unconvertible(),), ("u0000002",)]
    rows = reader.read(keys)
    expected = reader.read([("u0000001",), ("u0000002",)])
    assert np.isnan(rows.values[[0, 2, 3]]).all() and np.isnan(rows.event_ts_s[[0, 2, 3]]).all()
    np.testing.assert_array_equal(rows.values[[1, 4]], expected.values)


@pytest.fixture(scope="module", params=["sqlite", "redis"])
def store(request, sample_assets):
    repo = (
        sample_assets.repo if request.param == "sqlite" else request.getfixturevalue("redis_repo")
    )
    return open_store(repo)


async def test_a_read_that_fails_with_a_bug_counts_as_a_store_failure(repo):
    lookup = lookup_of(repo, whole=False, max_entries=0)
    now = [0.0]
    lookup.breaker = StoreBreaker(2, 1.0, lambda: now[0], lookup._breaker_changed)

    def bug(keys, wait=True):
        raise KeyError("a bug below the lookup")

    lookup._views[0].reader.read = bug
    try:
        for _ in range(2):
            with pytest.raises(StoreUnavailable, match="KeyError"):
                await lookup.fetch([KNOWN], timeout_s=5.0)
        assert lookup.breaker.state is BreakerState.OPEN
        now[0] = 1.0
        with pytest.raises(StoreUnavailable, match="KeyError"):  # the probe reports back
            await lookup.fetch([KNOWN], timeout_s=5.0)
        assert lookup.breaker.state is BreakerState.OPEN
    finally:
        lookup.close()


@WHOLE
async def test_a_text_value_in_the_store_reads_as_missing_and_the_others_are_read(repo, whole):
    connection = sqlite3.connect(repo / "data" / "online_store.db")
    table = user_table(connection)
    blob = user_blob(open_store(repo), KNOWN["user_id"])
    text = ValueProto(string_val="forty").SerializeToString()
    connection.execute(
        f'UPDATE "{table}" SET value = ? WHERE entity_key = ? AND feature_name = ?',
        (text, blob, "account_age_days"),
    )
    connection.commit()
    connection.close()
    lookup = lookup_of(repo, whole)
    try:
        rows = await lookup.fetch([KNOWN], timeout_s=5.0)
        assert np.isnan(rows.columns["user_stats__account_age_days"][0])
        assert not np.isnan(rows.columns["user_stats__txn_count_7d"][0])
        assert lookup.breaker.state is BreakerState.CLOSED
    finally:
        lookup.close()


def test_text_and_lists_from_the_provider_read_as_missing(sample_assets):
    """Stores other than SQLite (Redis) answer protos through Feast's provider."""
    reader = OnlineViewReader(open_store(sample_assets.repo), "user_stats", USER_FEATURES)
    stored = {
        "txn_count_7d": ValueProto(int64_val=4),
        "avg_amount_7d": ValueProto(string_val="12.5"),
        "chargeback_rate_90d": ValueProto(bytes_val=b"0.1"),
        "account_age_days": ValueProto(int64_list_val={"val": [1, 2]}),
    }
    now = datetime.now(UTC)
    reader._sqlite = None
    reader._provider = SimpleNamespace(online_read=lambda **_: [(now, stored)])
    rows = reader.read([("u0000001",)])
    np.testing.assert_array_equal(rows.values, [[4.0, np.nan, np.nan, np.nan]])
    assert rows.event_ts_s[0] == pytest.approx(now.timestamp())


@WHOLE
async def test_an_integer_key_finds_the_entity_stored_as_its_text(repo, whole):
    connection = sqlite3.connect(repo / "data" / "online_store.db")
    table, store = user_table(connection), open_store(repo)
    copied = connection.execute(
        f'SELECT feature_name, value, event_ts, created_ts FROM "{table}" WHERE entity_key = ?',
        (user_blob(store, KNOWN["user_id"]),),
    ).fetchall()
    connection.executemany(
        f'INSERT OR REPLACE INTO "{table}" (entity_key, feature_name, value, event_ts, '
        "created_ts) VALUES (?, ?, ?, ?, ?)",
        [(user_blob(store, "42"), *row) for row in copied],
    )
    connection.commit()
    connection.close()
    lookup = lookup_of(repo, whole)
    try:
        as_text = await lookup.fetch([{**KNOWN, "user_id": "42"}], timeout_s=5.0)
        as_int = await lookup.fetch([{**KNOWN, "user_id": 42}], timeout_s=5.0)
        original = await lookup.fetch([KNOWN], timeout_s=5.0)
        for ref in lookup.feature_refs:
            np.testing.assert_array_equal(as_int.columns[ref], original.columns[ref])
            np.testing.assert_array_equal(as_text.columns[ref], original.columns[ref])
    finally:
        lookup.close()


async def test_a_probe_alone_skips_memory_and_if_it_fails_answers_from_memory(repo):
    lookup = lookup_of(repo, whole=True)
    now = [0.0]
    lookup.breaker = StoreBreaker(1, 1.0, lambda: now[0], lookup._breaker_changed)
    lookup.breaker.failed("an outage seen earlier")
    now[0] = 1.0  # a probe is due
    other = {"user_id": "u0000002", "merchant_id": "m000002"}
    lock = sqlite3.connect(repo / "data" / "online_store.db", isolation_level=None)
    try:
        lock.execute("BEGIN EXCLUSIVE")
        probe = asyncio.ensure_future(lookup.fetch([KNOWN], timeout_s=0.5))
        await wait_for(lambda: _true(lookup.breaker.state is BreakerState.PROBING), 5.0)
        # Beside the probe, a batch the whole views answer is answered.
        rows = await lookup.fetch([other], timeout_s=0.5)
        assert rows.store_reads == 0 and rows.missing_views == [()]
        with pytest.raises(StoreUnavailable, match="took over") as failed:
            await probe
        # The probe's own rows are in memory too: its events can still be answered.
        assert failed.value.in_memory.answered == [True]
        assert not np.isnan(failed.value.in_memory.rows.columns["user_stats__txn_count_7d"])
    finally:
        lock.execute("ROLLBACK")
        lock.close()
        lookup.close()


async def _true(value: bool) -> bool:
    return value


@pytest.mark.parametrize("whole", [True, False], ids=["whole-view", "per-key"])
async def test_a_replaced_store_file_is_read_and_a_deleted_one_is_an_outage(repo, whole):
    if whole:
        lookup = lookup_of(repo, whole=True, max_staleness_s=2.0)
    else:
        lookup = lookup_of(repo, whole=False, max_entries=0)
    database = repo / "data" / "online_store.db"
    try:
        before = (await lookup.fetch([KNOWN])).columns["user_stats__txn_count_7d"][0]
        rebuilt = database.with_suffix(".new")
        shutil.copy(database, rebuilt)
        connection = sqlite3.connect(rebuilt)
        table = user_table(connection)
        changed = ValueProto(int64_val=int(before) + 1000).SerializeToString()
        connection.execute(
            f'UPDATE "{table}" SET value = ? WHERE entity_key = ? AND feature_name = ?',
            (changed, user_blob(open_store(repo), KNOWN["user_id"]), "txn_count_7d"),
        )
        connection.commit()
        connection.close()
        os.replace(rebuilt, database)  # a rebuilt store moved into place

        async def served_new() -> bool:
            rows = await lookup.fetch([KNOWN])
            return rows.columns["user_stats__txn_count_7d"][0] == before + 1000

        await wait_for(served_new, 10.0)
        database.unlink()

        async def refused() -> bool:
            try:
                await lookup.fetch([KNOWN], timeout_s=1.0)
            except StoreUnavailable:
                return True
            return False

        await wait_for(refused, 10.0)
    finally:
        lookup.close()


async def test_a_read_refused_by_the_open_breaker_is_not_counted_as_a_cache_miss(repo):
    lookup = lookup_of(repo, whole=False, max_entries=0)
    lookup.breaker = StoreBreaker(1, 60.0, lambda: 0.0, lookup._breaker_changed)
    lookup.breaker.failed("an outage")
    misses = lookup._views[0].misses
    try:
        before = misses._value.get()
        with pytest.raises(StoreUnavailable, match="down"):
            await lookup.fetch([KNOWN])
        assert misses._value.get() == before
    finally:
        lookup.close()
