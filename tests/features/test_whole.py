"""Views small enough to keep whole: read at warm-up, served without store reads, read
again when the store changes, never served past the staleness bound."""

from __future__ import annotations

import asyncio
import math
import shutil
import sqlite3
import time
from datetime import UTC, datetime

import numpy as np
import pandas as pd
import pytest

from features.breaker import BreakerState, StoreBreaker
from features.config import FeatureCacheConfig
from features.errors import FeatureStoreError, StoreUnavailable
from features.lookup import FeatureLookup
from features.online_read import ViewRows, WholeRows
from features.store import open_store
from features.whole import WholeView, WholeViews
from tests.helpers import wait_until

ENTITY_FIELDS = {"user_id": "user_id", "merchant_id": "merchant_id"}
EVENTS = [{"user_id": f"u{i:07d}", "merchant_id": f"m{i % 7:06d}"} for i in range(40)]


@pytest.fixture
def repo(tmp_path, sample_assets):
    """A copy of the sample repo, so that writes stay in this test."""
    copy = tmp_path / "repo"
    shutil.copytree(sample_assets.repo, copy)
    return copy


def warmed(repo, **cache) -> FeatureLookup:
    lookup = FeatureLookup(
        open_store(repo), "fraud_scoring", ENTITY_FIELDS, FeatureCacheConfig(**cache)
    )
    lookup.warm(timeout_s=30.0)
    return lookup


async def test_a_small_view_is_served_whole_without_store_reads(repo):
    lookup = warmed(repo)
    uncached = FeatureLookup(
        open_store(repo), "fraud_scoring", ENTITY_FIELDS, FeatureCacheConfig(max_entries=0)
    )
    try:
        rows = await lookup.fetch(EVENTS)
        assert rows.store_reads == 0
        expected = uncached.read(EVENTS)
        for ref in lookup.feature_refs:
            np.testing.assert_array_equal(rows.columns[ref], expected.columns[ref])
        # An entity the view does not hold is absent from the store: missing, not read.
        nobody = await lookup.fetch([{"user_id": "nobody", "merchant_id": "m000001"}])
        assert nobody.store_reads == 0
        assert nobody.missing_views == [("user_stats",)]
    finally:
        lookup.close()
        uncached.close()


async def test_events_sharing_keys_and_absent_entities_get_the_rows_a_store_read_gives(repo):
    events = [
        *EVENTS, EVENTS[0], {"user_id": "nobody", "merchant_id": EVENTS[1]["merchant_id"]},
        EVENTS[1], {**EVENTS[2], "merchant_id": "nowhere"},
    ]  # fmt: skip
    lookup = warmed(repo)
    uncached = FeatureLookup(
        open_store(repo), "fraud_scoring", ENTITY_FIELDS, FeatureCacheConfig(max_entries=0)
    )
    try:
        rows = await lookup.fetch(events)
        expected = uncached.read(events)
        assert rows.store_reads == 0 and expected.store_reads > 0
        for ref in lookup.feature_refs:
            np.testing.assert_array_equal(rows.columns[ref], expected.columns[ref])
        assert rows.missing_views == expected.missing_views
        assert rows.missing_views[-3:] == [("user_stats",), (), ("merchant_stats",)]
    finally:
        lookup.close()
        uncached.close()


async def test_a_write_to_the_store_is_served_within_the_staleness_bound(repo):
    lookup = warmed(repo, max_staleness_s=2.0)
    event = {"user_id": "u0000001", "merchant_id": "m000001"}
    try:
        before = (await lookup.fetch([event])).columns["user_stats__txn_count_7d"][0]
        open_store(repo).write_to_online_store(
            "user_stats",
            pd.DataFrame(
                {
                    "user_id": ["u0000001"],
                    "txn_count_7d": [int(before) + 1000],
                    "avg_amount_7d": [1.0],
                    "chargeback_rate_90d": [0.0],
                    "account_age_days": [1],
                    "event_timestamp": [datetime.now(UTC)],
                }
            ),
        )
        written = time.monotonic()
        while True:
            rows = await lookup.fetch([event])
            if rows.columns["user_stats__txn_count_7d"][0] == before + 1000:
                break
            assert time.monotonic() - written < 10.0, "the write was never served"
            await asyncio.sleep(0.05)  # polling the condition, not synchronising on time
        assert rows.store_reads == 0  # served whole again, read after the write
    finally:
        lookup.close()


async def test_a_view_with_more_entities_than_the_bound_is_read_per_key(repo):
    lookup = warmed(repo, whole_view_max_entities=100)  # 10,000 users, 1,000 merchants
    try:
        rows = await lookup.fetch(EVENTS)
        assert rows.store_reads == 40 + 7
    finally:
        lookup.close()


class _Reader:
    """A store of one entity whose version the test moves, or whose check fails."""

    def __init__(self) -> None:
        self.version = 1
        self.fails = False
        self.reads = 0
        self.view = type("View", (), {"name": "v"})

    def store_version(self) -> int:
        if self.fails:
            raise FeatureStoreError("gone")
        return self.version

    def read_whole(self, max_entities: int) -> WholeRows | None:
        self.reads += 1
        rows = ViewRows(np.array([[float(self.version)]]), np.array([0.0]))
        return WholeRows(self.version, {("k",): 0}, rows)


def test_rows_not_verified_within_the_bound_are_not_served_and_changes_are_read_when_due():
    now = [100.0]
    reader = _Reader()
    whole = WholeView(reader, max_entities=10, max_staleness_s=10.0, clock=lambda: now[0])
    assert whole.current(now[0]) is None  # nothing read yet
    whole.refresh()
    assert reader.reads == 1
    now[0] = 108.0
    whole.refresh()  # unchanged: verified now, not read again
    assert reader.reads == 1
    now[0] = 117.0
    rows, staleness_s = whole.current(now[0])
    assert staleness_s == pytest.approx(9.0)
    reader.fails = True
    whole.refresh()  # the check fails: the rows age out
    now[0] = 118.5
    assert whole.current(now[0]) is None
    reader.fails = False
    reader.version = 2
    whole.refresh()  # changed, and due (over half the bound since the read)
    assert reader.reads == 2
    rows, _ = whole.current(now[0])
    assert rows.rows.values[0, 0] == 2.0
    reader.version = 3
    now[0] = 120.0
    whole.refresh()  # changed again soon after a read: waits until due ...
    assert reader.reads == 2
    assert whole.current(now[0])[0].version == 2  # ... serving what was read
    now[0] = 123.5
    whole.refresh()
    assert reader.reads == 3
    assert not math.isnan(whole.current(now[0])[1])


class _Broken:
    """A whole view whose check fails with a bug until `mended`; counts its checks."""

    def __init__(self, name: str) -> None:
        self.reader = type("Reader", (), {"view": type("View", (), {"name": name})})
        self.max_staleness_s = 0.04  # checked every 10 ms
        self.checks = 0
        self.mended = False

    def refresh(self) -> None:
        self.checks += 1
        if not self.mended:
            raise KeyError("a bug")


def test_a_view_whose_check_fails_is_logged_once_and_the_others_are_still_checked(caplog):
    broken, sound = _Broken("broken"), _Broken("sound")
    sound.mended = True
    views = WholeViews([broken, sound])
    views.start()
    try:
        assert wait_until(lambda: sound.checks >= 5, 5, 0.01)
        assert broken.checks >= 5
        failures = [r for r in caplog.records if "check failed" in r.getMessage()]
        assert len(failures) == 1 and "broken" in failures[0].getMessage()
        broken.mended = True
        assert wait_until(lambda: "checks succeed again" in caplog.text, 5, 0.01)
    finally:
        views.stop()


async def test_while_the_store_is_down_rows_in_memory_are_served_and_misses_refused(repo):
    # Merchants (1,000) kept whole, users (10,000) read per key and cached.
    lookup = warmed(repo, whole_view_max_entities=5_000)
    now = [0.0]
    lookup.breaker = StoreBreaker(1, 60.0, lambda: now[0], lookup._breaker_changed)
    before = await lookup.fetch(EVENTS)  # their users now cached
    newcomer = [{"user_id": "u0009999", "merchant_id": "m000001"}]
    lock = sqlite3.connect(repo / "data" / "online_store.db", isolation_level=None)
    try:
        lock.execute("BEGIN EXCLUSIVE")
        with pytest.raises(StoreUnavailable, match="took over"):
            await lookup.fetch(newcomer, timeout_s=0.05)
        assert lookup.breaker.state is BreakerState.OPEN
        rows = await lookup.fetch(EVENTS, timeout_s=0.05)  # all in memory: no read needed
        assert rows.store_reads == 0
        for ref in lookup.feature_refs:
            np.testing.assert_array_equal(rows.columns[ref], before.columns[ref])
        with pytest.raises(StoreUnavailable, match="down") as refused:  # a miss: not tried
            await lookup.fetch(EVENTS + newcomer, timeout_s=0.05)
        # The rows it had in memory come with the refusal: those events can be answered.
        in_memory = refused.value.in_memory
        assert in_memory.answered == [True] * len(EVENTS) + [False]
        for ref in lookup.feature_refs:
            np.testing.assert_array_equal(in_memory.rows.columns[ref][:-1], rows.columns[ref])
        assert np.isnan(in_memory.rows.columns["user_stats__txn_count_7d"][-1])
    finally:
        lock.execute("ROLLBACK")
        lock.close()
        lookup.close()
