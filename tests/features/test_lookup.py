"""Online feature reads: one deduplicated read per batch, missing entities flagged."""

from __future__ import annotations

import asyncio
import shutil
import sqlite3
import time

import numpy as np
import pytest

from features.breaker import BreakerState, StoreBreaker
from features.config import FeatureCacheConfig
from features.errors import FeatureStoreError, StoreUnavailable
from features.lookup import FeatureLookup
from features.store import open_store

ENTITY_FIELDS = {"user_id": "user_id", "merchant_id": "merchant_id"}


@pytest.fixture(scope="module")
def store(sample_assets):
    return open_store(sample_assets.repo)


@pytest.fixture
def lookup(store):
    client = FeatureLookup(store, "fraud_scoring", ENTITY_FIELDS)
    yield client
    client.close()


def test_values_equal_the_generated_statistics(lookup, sample_assets):
    users = sample_assets.world.users().set_index("user_id")
    merchants = sample_assets.world.merchants().set_index("merchant_id")
    events = [
        {"user_id": "u0000003", "merchant_id": "m000010"},
        {"user_id": "u0000004", "merchant_id": "m000011"},
    ]
    rows = lookup.read(events)
    for row, event in enumerate(events):
        user = users.loc[event["user_id"]]
        merchant = merchants.loc[event["merchant_id"]]
        assert rows.columns["user_stats__txn_count_7d"][row] == user["txn_count_7d"]
        assert rows.columns["user_stats__avg_amount_7d"][row] == pytest.approx(
            user["avg_amount_7d"], rel=1e-6
        )
        assert rows.columns["merchant_stats__risk_score"][row] == pytest.approx(
            merchant["risk_score"], rel=1e-6
        )
    assert rows.missing_views == [(), ()]


def test_duplicate_keys_are_read_once(lookup):
    events = [{"user_id": "u0000001", "merchant_id": "m000001"}] * 5 + [
        {"user_id": "u0000002", "merchant_id": "m000001"}
    ]
    rows = lookup.read(events)
    assert rows.unique_keys == 3  # two users, one merchant
    assert len(rows.columns["user_stats__txn_count_7d"]) == 6


def test_missing_entity_is_flagged_not_fatal(lookup):
    rows = lookup.read(
        [
            {"user_id": "nobody", "merchant_id": "m000001"},
            {"user_id": "u0000001", "merchant_id": "nowhere"},
        ]
    )
    assert rows.missing_views == [("user_stats",), ("merchant_stats",)]
    assert np.isnan(rows.columns["user_stats__txn_count_7d"][0])
    assert not np.isnan(rows.columns["merchant_stats__risk_score"][0])
    assert np.isnan(rows.columns["merchant_stats__risk_score"][1])


async def test_fetch_runs_off_the_loop_and_matches_read(lookup):
    events = [{"user_id": f"u{i:07d}", "merchant_id": f"m{i:06d}"} for i in range(20)]
    fetched = await lookup.fetch(events)
    direct = lookup.read(events)
    for ref in lookup.feature_refs:
        np.testing.assert_array_equal(fetched.columns[ref], direct.columns[ref])


async def test_a_few_misses_are_read_on_the_loop_and_many_on_the_store_thread(store):
    client = FeatureLookup(store, "fraud_scoring", ENTITY_FIELDS, FeatureCacheConfig(max_entries=0))
    handed: list[int] = []
    submit = client._executor.submit
    client._executor.submit = lambda *args: handed.append(1) or submit(*args)
    try:
        few = [{"user_id": f"u{i:07d}", "merchant_id": f"m{i:06d}"} for i in range(3)]
        fetched = await client.fetch(few)
        assert handed == []  # 6 keys: no hand-off to the store thread
        many = [{"user_id": f"u{i:07d}", "merchant_id": f"m{i:06d}"} for i in range(20)]
        await client.fetch(many)
        assert handed == [1]
        direct = client.read(few)
        for ref in client.feature_refs:
            np.testing.assert_array_equal(fetched.columns[ref], direct.columns[ref])
    finally:
        client.close()


def test_empty_batch(lookup):
    rows = lookup.read([])
    assert rows.unique_keys == 0
    assert rows.missing_views == []


def test_unknown_feature_service_is_a_clear_error(store):
    with pytest.raises(FeatureStoreError, match="not registered"):
        FeatureLookup(store, "no_such_service", ENTITY_FIELDS)


def test_store_without_repo_is_a_clear_error(tmp_path):
    with pytest.raises(FeatureStoreError, match=r"feature_store\.yaml"):
        open_store(tmp_path)


def test_a_locked_store_fails_reads_within_their_bound_then_refuses_them(store, sample_assets):
    client = FeatureLookup(store, "fraud_scoring", ENTITY_FIELDS, FeatureCacheConfig(max_entries=0))
    now = [0.0]
    client.breaker = StoreBreaker(2, 1.0, lambda: now[0], client._breaker_changed)
    events = [{"user_id": "u0000003", "merchant_id": "m000010"}]
    database = sample_assets.repo / "data" / "online_store.db"
    lock = sqlite3.connect(database, isolation_level=None)
    try:
        lock.execute("BEGIN EXCLUSIVE")
        for _ in range(2):
            started = time.monotonic()
            with pytest.raises(StoreUnavailable, match="took over 50 ms"):
                asyncio.run(client.fetch(events, timeout_s=0.05))
            assert time.monotonic() - started < 1.0
        with pytest.raises(StoreUnavailable, match="down"):  # open: not even tried
            asyncio.run(client.fetch(events, timeout_s=0.05))
    finally:
        lock.execute("ROLLBACK")
        lock.close()
    now[0] = 1.0  # a probe is due; the store answers again
    rows = asyncio.run(client.fetch(events, timeout_s=10.0))
    assert rows.columns["user_stats__txn_count_7d"].shape == (1,)
    client.close()


def test_a_read_on_the_loop_that_succeeds_ends_a_run_of_failures(store, sample_assets):
    client = FeatureLookup(store, "fraud_scoring", ENTITY_FIELDS, FeatureCacheConfig(max_entries=0))
    client.breaker = StoreBreaker(2, 1.0, lambda: 0.0, client._breaker_changed)
    events = [{"user_id": "u0000003", "merchant_id": "m000010"}]
    database = sample_assets.repo / "data" / "online_store.db"

    def fetch_while_locked() -> None:
        lock = sqlite3.connect(database, isolation_level=None)
        try:
            lock.execute("BEGIN EXCLUSIVE")
            with pytest.raises(StoreUnavailable, match="took over 50 ms"):
                asyncio.run(client.fetch(events, timeout_s=0.05))
        finally:
            lock.execute("ROLLBACK")
            lock.close()

    try:
        fetch_while_locked()
        asyncio.run(client.fetch(events, timeout_s=10.0))  # read on the loop, in time
        fetch_while_locked()
        # Two failures, but not in a row: the store is still read.
        assert client.breaker.state is BreakerState.CLOSED
    finally:
        client.close()


def test_a_warm_up_reads_the_store_and_leaves_the_cache_to_events(store, caplog):
    client = FeatureLookup(store, "fraud_scoring", ENTITY_FIELDS)
    try:
        readers = [view.reader for view in client._views]
        assert all(not reader._sqlite._connections for reader in readers)
        client.warm(timeout_s=10.0)
        # Each view's store connections (the store thread's, the event loop's, the whole
        # view's) are open and their first queries made, off the cache.
        assert all(set(reader._sqlite._connections) == {True, False, "whole"} for reader in readers)
        assert all(len(view.cache) == 0 for view in client._views)
        assert not caplog.records
    finally:
        client.close()


def test_a_warm_up_of_a_store_not_materialized_yet_is_logged_not_raised(
    tmp_path, sample_assets, caplog
):
    repo = tmp_path / "repo"
    shutil.copytree(sample_assets.repo, repo)
    (repo / "data" / "online_store.db").unlink()
    client = FeatureLookup(open_store(repo), "fraud_scoring", ENTITY_FIELDS)
    try:
        client.warm(timeout_s=10.0)
    finally:
        client.close()
    assert "warm-up read failed" in caplog.text


def test_a_probe_cancelled_while_it_reads_hands_the_probe_back(store, sample_assets):
    # The probe's batch ends before its read does (its partition revoked, the worker
    # stopping): the breaker must not stay probing, refusing every later read.
    client = FeatureLookup(store, "fraud_scoring", ENTITY_FIELDS, FeatureCacheConfig(max_entries=0))
    now = [0.0]
    client.breaker = StoreBreaker(1, 1.0, lambda: now[0], client._breaker_changed)
    client.breaker.failed("down")
    events = [{"user_id": "u0000003", "merchant_id": "m000010"}]
    database = sample_assets.repo / "data" / "online_store.db"
    now[0] = 1.0  # a probe is due

    async def cancel_the_probe() -> None:
        probing = asyncio.ensure_future(client.fetch(events, timeout_s=30.0))
        await asyncio.sleep(0)  # the probe has started its read
        assert client.breaker.state is BreakerState.PROBING
        probing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await probing

    lock = sqlite3.connect(database, isolation_level=None)
    try:
        lock.execute("BEGIN EXCLUSIVE")
        asyncio.run(cancel_the_probe())
    finally:
        lock.execute("ROLLBACK")
        lock.close()
    try:
        assert client.breaker.state is BreakerState.OPEN
        rows = asyncio.run(client.fetch(events, timeout_s=10.0))  # probes again at once
        assert rows.columns["user_stats__txn_count_7d"].shape == (1,)
        assert client.breaker.state is BreakerState.CLOSED
    finally:
        client.close()


def test_a_failed_probe_counts_each_key_once(store, sample_assets):
    # The probe reads every key, the cached ones too; when it fails, the batch is answered
    # from memory without counting those keys again as hits.
    client = FeatureLookup(store, "fraud_scoring", ENTITY_FIELDS, FeatureCacheConfig())
    now = [0.0]
    client.breaker = StoreBreaker(1, 1.0, lambda: now[0], client._breaker_changed)
    events = [{"user_id": "u0000003", "merchant_id": "m000010"}]
    views = client._views
    try:
        asyncio.run(client.fetch(events, timeout_s=10.0))  # cached from now on
        client.breaker.failed("down")
        now[0] = 1.0  # a probe is due; the store is locked
        counted = [(v.hits._value.get(), v.misses._value.get()) for v in views]
        database = sample_assets.repo / "data" / "online_store.db"
        lock = sqlite3.connect(database, isolation_level=None)
        try:
            lock.execute("BEGIN EXCLUSIVE")
            with pytest.raises(StoreUnavailable) as failed:
                asyncio.run(client.fetch(events, timeout_s=0.05))
        finally:
            lock.execute("ROLLBACK")
            lock.close()
        assert all(failed.value.in_memory.answered)
        now_counted = [(v.hits._value.get(), v.misses._value.get()) for v in views]
        added = [
            (h1 - h0, m1 - m0) for (h0, m0), (h1, m1) in zip(counted, now_counted, strict=True)
        ]
        assert added == [(0, 1)] * len(views)
    finally:
        client.close()
