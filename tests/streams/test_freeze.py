"""The freeze watch: a gap between ticks past the session marks answers until the next
assignment after a revoke, whichever of the tick and the question comes first after the
freeze."""

from __future__ import annotations

import asyncio

from streams.freeze import FreezeWatch


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_ticks_closer_than_the_session_leave_answers_unmarked():
    clock = Clock()
    watch = FreezeWatch(session_timeout_s=6.0, heartbeat_interval_s=1.2, clock=clock)
    for _ in range(100):
        clock.now += 0.5
        watch.tick()
        assert not watch.unsure()


def test_a_freeze_is_seen_before_the_watch_ticks_again_and_lasts_until_an_assignment():
    clock = Clock()
    watch = FreezeWatch(session_timeout_s=6.0, heartbeat_interval_s=1.2, clock=clock)
    clock.now += 5.0  # past the session less one heartbeat interval (4.8 s)
    assert watch.unsure()  # asked first: the stale tick tells
    watch.tick()
    assert watch.unsure()  # ticked since: the freeze is remembered
    clock.now += 0.1
    watch.tick()
    assert watch.unsure()
    watch.revoked()  # the consumer rejoins its group
    watch.assigned()
    assert not watch.unsure()


def test_an_assignment_from_a_rebalance_begun_before_the_freeze_does_not_end_it():
    clock = Clock()
    watch = FreezeWatch(session_timeout_s=6.0, heartbeat_interval_s=1.2, clock=clock)
    watch.revoked()  # a rebalance began, then the worker froze in its middle
    clock.now += 10.0
    watch.tick()
    watch.assigned()  # that rebalance's stale assignment, handed over as it wakes
    assert watch.unsure()
    clock.now += 0.5
    watch.revoked()  # its membership was gone: it rejoins
    watch.assigned()
    assert not watch.unsure()


def test_a_pause_shorter_than_the_session_less_a_heartbeat_is_not_a_freeze():
    clock = Clock()
    watch = FreezeWatch(session_timeout_s=6.0, heartbeat_interval_s=1.2, clock=clock)
    clock.now += 4.5
    assert not watch.unsure()
    watch.tick()
    assert not watch.unsure()


async def test_an_event_loop_blocked_past_the_session_counts_as_a_freeze():
    # The Faust runtime heartbeats from its event loop: a blocked loop loses the group
    # session while the watch's own thread goes on ticking.
    clock = Clock()
    watch = FreezeWatch(session_timeout_s=6.0, heartbeat_interval_s=1.2, clock=clock)
    watching = asyncio.create_task(watch.watch_loop())
    await asyncio.sleep(0)  # the loop's first tick
    for _ in range(10):  # the watch's thread ticks on through 5 s
        clock.now += 0.5
        watch.tick()
    assert watch.unsure()  # asked before the loop ticked again: its stale tick tells
    watching.cancel()
    await asyncio.gather(watching, return_exceptions=True)
    assert not watch.unsure()  # no longer watched: a quiet loop is not a freeze


async def test_a_loop_that_goes_round_is_not_a_freeze():
    clock = Clock()
    watch = FreezeWatch(session_timeout_s=6.0, heartbeat_interval_s=1.2, clock=clock)
    watching = asyncio.create_task(watch.watch_loop())
    try:
        await asyncio.sleep(0)
        for _ in range(9):
            clock.now += 0.5
            watch.tick()
        assert not watch.unsure()
    finally:
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)
