"""Noticing that the worker was frozen past its group session, so that what it answers
next is marked as a possible repeat.

A worker stopped whole (SIGSTOP, a stalled VM, a swap storm) for longer than its session
timeout is dropped from its consumer group: its partitions go to other members, which
answer the records it had fetched. When it runs again it still holds those records, and
its Kafka clients learn that they lost the partitions only at their next heartbeat; until
then (and while it finishes what it held, as a revoke asks) what it answers may repeat
what a new owner answered meanwhile, and that answer comes second. So until it has
rejoined (an assignment after a revoke), every answer it writes carries the
`headrace.redelivered` header, as the
replays of `streams/replay.py` do: a consumer that keeps the first answer per input
keeps the new owner's. After the assignment the read-back of `streams/replay.py` covers
the partitions it gets (back). Not covered: answers its Kafka client held unsent at the
instant it froze; the client's threads send them as soon as it runs again, before any
of ours can act (README, "Reading answers").

A thread ticks every `TICK_S`; a gap between two ticks longer than the session timeout
less one heartbeat interval is a freeze (a member whose last heartbeat came just before
the freeze is dropped that much sooner). Asked before the thread has ticked again after
a freeze, its stale tick says the same. Where the consumer heartbeats from the event
loop (the Faust runtime runs aiokafka on it), a loop blocked that long loses the
partitions the same way: `watch_loop` ticks from the loop, and a gap there counts too.
The bare runtime's librdkafka heartbeats from its own threads, so it does not watch
its loop.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

# A freeze is seconds long, and a gap between ticks is never shorter than the freeze
# within it; a longer tick only lets a freeze up to a tick short of the threshold count
# too (its answers are marked for nothing). Four wake-ups a second of an idle worker.
TICK_S = 0.25
# The loop's tick: a freeze is seconds long; two wake-ups a second of an idle worker.
LOOP_TICK_S = 0.5


class FreezeWatch:
    """`unsure()`: frozen past the session since the last assignment (`assigned()`)."""

    def __init__(
        self,
        session_timeout_s: float,
        heartbeat_interval_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.threshold_s = session_timeout_s - heartbeat_interval_s
        self._clock = clock
        self._last_tick = clock()
        self._last_loop_tick: float | None = None  # while `watch_loop` runs
        self._frozen = False
        # The last tick before the latest freeze, and when partitions were last revoked:
        # only an assignment after a revoke since the freeze renews the membership (one
        # frozen in the middle of a rebalance is handed that rebalance's stale assignment
        # as it wakes, from a generation the group has left behind).
        self._frozen_since = -math.inf
        self._revoked_at = -math.inf
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="freeze-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def tick(self) -> None:
        self._last_tick = self._ticked(self._last_tick, "the worker was frozen")

    async def watch_loop(self) -> None:
        """Tick from the running event loop, for as long as it runs (a task)."""
        self._last_loop_tick = self._clock()
        try:
            while True:
                await asyncio.sleep(LOOP_TICK_S)
                self._last_loop_tick = self._ticked(
                    self._last_loop_tick, "the worker's event loop, which heartbeats, was blocked"
                )  # fmt: skip
        finally:
            self._last_loop_tick = None

    def _ticked(self, last_tick: float, what: str) -> float:
        now = self._clock()
        gap_s = now - last_tick
        if gap_s > self.threshold_s:
            # Before the tick moves on: `unsure()` must never read a fresh tick alone.
            self._frozen_since = max(self._frozen_since, last_tick)
            self._frozen = True
            log.warning(
                "%s for %.1f s, past its group session: its partitions may have been "
                "answered by another member meanwhile; its answers carry "
                "headrace.redelivered until it rejoins its group", what, gap_s,
            )  # fmt: skip
        return now

    def unsure(self) -> bool:
        """Whether answers written now may repeat another member's (any thread)."""
        if self._frozen:
            return True
        now, loop_tick = self._clock(), self._last_loop_tick
        stale_loop = loop_tick is not None and now - loop_tick > self.threshold_s
        return stale_loop or now - self._last_tick > self.threshold_s

    def revoked(self) -> None:
        """The consumer's partitions were revoked (or lost): it is rejoining its group."""
        self._revoked_at = self._clock()

    def assigned(self) -> None:
        """The consumer got an assignment: after a revoke since the freeze, its group
        membership is current again."""
        if self._revoked_at > self._frozen_since:
            self._frozen = False

    def _run(self) -> None:
        while not self._stop.wait(TICK_S):
            self.tick()
