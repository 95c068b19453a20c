"""The batch-release policy with a controlled clock: full, wait expired, deadline
pressure, adaptive sizing."""

from __future__ import annotations

import asyncio

import pytest

from streams.admit import CompletionModel
from streams.batching import MAX_EXPIRED_BATCH, BatchPolicy, MicroBatcher


class FakeClock:
    def __init__(self) -> None:
        self.mono = 1000.0
        self.wall = 1_700_000_000.0

    def advance(self, seconds: float) -> None:
        self.mono += seconds
        self.wall += seconds


def policy(adaptive: bool = False, max_batch_size: int = 8, max_wait_s: float = 0.010):
    # The pipeline's one service-time estimator, as the runner gives it.
    return BatchPolicy(
        max_batch_size=max_batch_size,
        max_wait_s=max_wait_s,
        adaptive=adaptive,
        service=CompletionModel(sessions=1),
    )


def batcher(p: BatchPolicy, clock: FakeClock) -> MicroBatcher[int]:
    return MicroBatcher(p, clock=lambda: clock.mono, wall_clock=lambda: clock.wall)


def far_deadlines(clock: FakeClock, n: int) -> list[float]:
    return [clock.wall + 10.0] * n


def test_a_full_batch_is_released_at_once():
    clock = FakeClock()
    b = batcher(policy(), clock)
    b.put(list(range(8)), far_deadlines(clock, 8))
    assert b.ready() == 0.0
    assert b.take() == list(range(8))


def test_a_partial_batch_waits_until_max_wait_expires():
    clock = FakeClock()
    b = batcher(policy(), clock)
    b.put([1, 2, 3], far_deadlines(clock, 3))
    assert b.ready() == pytest.approx(0.010, abs=1e-6)
    clock.advance(0.004)
    assert b.ready() == pytest.approx(0.006, abs=1e-6)
    clock.advance(0.006)
    assert b.ready() == 0.0
    assert b.take() == [1, 2, 3]


def test_the_wait_counts_from_the_first_event_not_the_last():
    clock = FakeClock()
    b = batcher(policy(), clock)
    b.put([1], far_deadlines(clock, 1))
    clock.advance(0.008)
    b.put([2], far_deadlines(clock, 1))
    assert b.ready() == pytest.approx(0.002, abs=1e-6)


def test_a_backlog_past_its_deadline_leaves_in_one_large_batch():
    clock = FakeClock()
    b = batcher(policy(max_batch_size=8), clock)
    expired = [clock.wall - 1.0] * (MAX_EXPIRED_BATCH + 5)
    b.put(list(range(len(expired))), expired)
    b.put(["fresh"] * 3, far_deadlines(clock, 3))
    assert b.ready() == 0.0
    assert b.take() == list(range(MAX_EXPIRED_BATCH))
    # The rest of the expired run, then the fresh events in batches of the usual size.
    assert b.take() == list(range(MAX_EXPIRED_BATCH, MAX_EXPIRED_BATCH + 5))
    assert b.take() == ["fresh"] * 3


def test_deadline_pressure_releases_early():
    clock = FakeClock()
    p = policy(max_wait_s=1.0)
    p.service.rest.observe(2, 0.030, clock.mono)  # a batch of 2 takes 30 ms to complete
    b = batcher(p, clock)
    # The oldest event has 40 ms left: release within 10 ms, well before max_wait.
    b.put([1, 2], [clock.wall + 0.040, clock.wall + 0.090])
    assert b.ready() == pytest.approx(0.010, abs=1e-6)
    clock.advance(0.011)
    assert b.ready() == 0.0


def test_an_event_already_late_is_released_at_once():
    clock = FakeClock()
    b = batcher(policy(max_wait_s=1.0), clock)
    b.put([1], [clock.wall - 0.5])
    assert b.ready() == 0.0


def test_a_backlog_leaves_in_batches_of_the_maximum_size():
    clock = FakeClock()
    b = batcher(policy(max_batch_size=4), clock)
    b.put(list(range(10)), far_deadlines(clock, 10))
    assert b.take() == [0, 1, 2, 3]
    assert b.take() == [4, 5, 6, 7]
    assert len(b) == 2


def test_flush_releases_everything_without_waiting():
    clock = FakeClock()
    b = batcher(policy(max_wait_s=5.0), clock)
    b.put([1], far_deadlines(clock, 1))
    b.flush()
    assert b.ready() == 0.0


def test_empty_batcher_is_never_due():
    assert batcher(policy(), FakeClock()).ready() == float("inf")


def test_adaptive_size_is_small_under_light_load_and_grows_under_heavy_load():
    p = policy(adaptive=True, max_batch_size=64)
    now = 1000.0
    # Slowest stage: 2 ms fixed + 0.1 ms per event.
    for size in (1, 2, 4, 8, 16, 32, 64):
        p.service.slowest_stages.observe(size, 0.002 + 0.0001 * size, now)
    assert p.target_size(100, now) == 1  # 1 / 2.1 ms = 476/s, keeps up with 100/s
    assert p.target_size(2_000, now) == 8  # 8 / 2.8 ms = 2857/s >= 1.25 * 2000
    assert p.target_size(9_000, now) == 64  # nothing smaller keeps up


def test_adaptive_size_before_any_measurement_is_one():
    assert policy(adaptive=True).target_size(5_000, 1000.0) == 1


def test_fixed_size_ignores_the_arrival_rate():
    assert policy(adaptive=False, max_batch_size=32).target_size(1, 1000.0) == 32


async def test_next_batch_returns_a_full_batch_without_waiting():
    b: MicroBatcher[int] = MicroBatcher(policy(max_wait_s=60.0))
    b.put(list(range(8)), [1e12] * 8)
    assert await asyncio.wait_for(b.next_batch(), timeout=5) == list(range(8))


async def test_next_batch_wakes_when_events_arrive():
    b: MicroBatcher[int] = MicroBatcher(policy(max_wait_s=60.0))
    waiting = asyncio.create_task(b.next_batch())
    await asyncio.sleep(0)  # a yield to the loop, so the task is waiting when events arrive
    b.put(list(range(8)), [1e12] * 8)
    assert await asyncio.wait_for(waiting, timeout=5) == list(range(8))
