"""The circuit breaker around the online store, with a fake clock."""

from __future__ import annotations

from features.breaker import Access, BreakerState, StoreBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def breaker(clock: Clock, changes: list) -> StoreBreaker:
    return StoreBreaker(2, 1.0, clock, lambda state, why: changes.append(state))


def test_opens_after_failures_in_a_row_and_refuses_reads_until_a_probe_is_due():
    clock, changes = Clock(), []
    store = breaker(clock, changes)
    store.failed("error")
    store.succeeded()  # a success in between: the count starts again
    store.failed("error")
    assert store.allow() and store.state is BreakerState.CLOSED
    store.failed("timeout")
    assert changes == [BreakerState.OPEN]
    clock.now = 0.9
    assert not store.allow()
    clock.now = 1.0
    assert store.allow()  # the probe
    assert not store.allow()  # one probe at a time
    assert changes == [BreakerState.OPEN, BreakerState.PROBING]


def test_a_failed_probe_opens_again_and_a_good_one_closes():
    clock, changes = Clock(), []
    store = breaker(clock, changes)
    store.failed("error")
    store.failed("error")
    clock.now = 1.0
    assert store.allow()
    store.failed("still down")
    assert store.state is BreakerState.OPEN
    assert not store.allow()
    clock.now = 2.0
    assert store.allow()
    store.succeeded()
    assert store.state is BreakerState.CLOSED and store.allow()
    assert changes[-1] is BreakerState.CLOSED


def test_only_the_probe_is_told_it_is_the_probe_and_an_unused_probe_is_handed_back():
    clock, changes = Clock(), []
    store = breaker(clock, changes)
    assert store.allow() is Access.READ
    store.failed("error")
    store.failed("error")
    clock.now = 1.0
    assert store.allow() is Access.PROBE
    assert store.allow() is Access.REFUSED  # a batch beside the probe: memory only
    store.probe_unused()  # the probe's batch needed no read
    assert store.state is BreakerState.OPEN
    assert store.allow() is Access.PROBE  # the next read probes at once
