"""Feature cache semantics with a controlled clock."""

from __future__ import annotations

import numpy as np

from features.cache import FeatureCache


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def row(value: float) -> np.ndarray:
    return np.array([value, value + 1])


def test_miss_then_hit():
    clock = Clock()
    cache = FeatureCache(10, max_staleness_s=5, clock=clock)
    assert cache.get(("u1",)) is None
    cache.put(("u1",), row(1), event_ts_s=900.0)
    values, event_ts, staleness = cache.get(("u1",))
    np.testing.assert_array_equal(values, row(1))
    assert event_ts == 900.0
    assert staleness == 0.0


def test_a_row_older_than_the_staleness_bound_is_read_again():
    clock = Clock()
    cache = FeatureCache(10, max_staleness_s=5, clock=clock)
    cache.put(("u1",), row(1), 900.0)
    clock.now += 5
    assert cache.get(("u1",)) is not None
    clock.now += 0.01
    assert cache.get(("u1",)) is None
    assert len(cache) == 0


def test_the_bound_evicts_the_least_recently_used():
    cache = FeatureCache(2, max_staleness_s=60, clock=Clock())
    cache.put("a", row(1), 0)
    cache.put("b", row(2), 0)
    cache.get("a")  # a is now more recent than b
    cache.put("c", row(3), 0)
    assert len(cache) == 2
    assert cache.get("b") is None
    assert cache.get("a") is not None
    assert cache.evictions == 1


def test_invalidate_forgets_a_key():
    cache = FeatureCache(2, max_staleness_s=60, clock=Clock())
    cache.put("a", row(1), 0)
    cache.invalidate("a")
    cache.invalidate("never-there")
    assert cache.get("a") is None


def test_zero_entries_turns_the_cache_off():
    cache = FeatureCache(0, max_staleness_s=60, clock=Clock())
    cache.put("a", row(1), 0)
    assert cache.get("a") is None


def test_a_spread_expires_rows_read_together_at_different_times():
    clock = Clock()
    cache = FeatureCache(100, max_staleness_s=10.0, clock=clock, spread=0.5)
    for key in range(50):
        cache.put(key, np.zeros(1), 0.0)
    clock.now += 7.5  # within the bound for rows counted as read up to 2.5 s early
    alive = sum(cache.get(key) is not None for key in range(50))
    assert 0 < alive < 50
    clock.now += 2.6  # past the bound: none is served, whatever its spread
    assert all(cache.get(key) is None for key in range(50))
