"""The micro-batcher: when to release a batch, and a bounded async queue that does it.

A batch is released when it is full, when its first event has waited `max_wait`,
or early when waiting longer would make its oldest event miss its deadline (computed
once per event, at decode) given the estimated time to answer it. In adaptive mode
"full" means the smallest batch size whose measured throughput keeps up with the
arrival rate, so batches stay small (fast) under light load and grow under heavy
load. The estimates come from the pipeline's one service-time estimator (the
`CompletionModel` admission uses too). Clocks are passed in, so the policy is tested
without sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

T = TypeVar("T")

# Keep-up margin of the adaptive size: the chosen size must serve 25% more than arrives.
HEADROOM = 1.25
# Most events in one batch of events already past their deadline: those only get cheap
# answers, so a backlog of them leaves in few, large batches.
MAX_EXPIRED_BATCH = 512
# The shortest wait worth a timer: the resolution of libuv's (uvloop's) timers.
TIMER_RESOLUTION_S = 0.001


class ServiceEstimates(Protocol):
    """What the batcher asks the pipeline's service-time estimator (monotonic seconds)."""

    def completion_s(self, batch_size: int, now_s: float) -> float:
        """Seconds until a batch of this size, released now, is answered."""
        ...

    def stage_bounds(self, now_s: float) -> Callable[[int], float]:
        """Seconds of the slowest stage of a batch, by its size (0: not measured)."""
        ...


def scaled_from_nearest(
    by_bucket: dict[int, float], size: int, per_event_share: float = 1.0
) -> float:
    """Seconds for `size` from seconds per size bucket: its own bucket's, else the nearest
    measured bucket's scaled to the size; 0 when nothing is measured.

    Scaled down linearly (an optimistic guess, soon replaced by a measurement). Scaled up
    in `per_event_share`, the part of a batch's time that grows with its size: all of it
    (1) for a model run, little for a time that is mostly per batch (a store read, a
    publish round trip)."""
    if not by_bucket:
        return 0.0
    bucket = size_bucket(size)
    if bucket in by_bucket:
        return by_bucket[bucket]
    nearest = min(by_bucket, key=lambda b: abs(b.bit_length() - bucket.bit_length()))
    ratio = max(size, 1) / nearest
    if ratio > 1:
        ratio = 1 + (ratio - 1) * per_event_share
    return by_bucket[nearest] * ratio


@dataclass(frozen=True)
class BatchPolicy:
    max_batch_size: int
    max_wait_s: float
    adaptive: bool
    service: ServiceEstimates

    def target_size(self, arrival_per_s: float, now: float) -> int:
        """The size at which a batch counts as full."""
        if not self.adaptive:
            return self.max_batch_size
        stage_s = self.service.stage_bounds(now)
        size = 1
        while size < self.max_batch_size:
            seconds = stage_s(size)
            if seconds <= 0 or size / seconds >= arrival_per_s * HEADROOM:
                return size
            size *= 2
        return self.max_batch_size

    def release_at(
        self,
        first_arrival: float,
        oldest_deadline_wall: float,
        size: int,
        now: float,
        now_wall: float,
    ) -> float:
        """The monotonic instant at which a batch of `size` pending events must be released."""
        wait_expires = first_arrival + self.max_wait_s
        # Leave the expected time to answer before the oldest event's deadline.
        slack = oldest_deadline_wall - now_wall - self.service.completion_s(size, now)
        return min(wait_expires, now + slack)


@dataclass
class _Pending(Generic[T]):
    item: T
    deadline_wall: float
    arrived: float


class MicroBatcher(Generic[T]):
    """FIFO of pending items released as batches by a `BatchPolicy`.

    `put` never blocks: the caller bounds what is pending (the in-flight limit).
    `next_batch` waits until the policy releases a batch; `flush()` makes it release
    everything at once (shutdown).
    """

    def __init__(
        self,
        policy: BatchPolicy,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.policy = policy
        self._clock = clock
        self._wall_clock = wall_clock
        self._pending: deque[_Pending[T]] = deque()
        self._arrived = asyncio.Event()
        self._flushing = False
        self._rate = _RateMeter(clock)

    def __len__(self) -> int:
        return len(self._pending)

    def put(self, items: list[T], deadlines_wall: list[float]) -> None:
        now = self._clock()
        self._pending.extend(
            _Pending(i, d, now) for i, d in zip(items, deadlines_wall, strict=True)
        )
        self._rate.add(len(items))
        self._arrived.set()

    def flush(self) -> None:
        self._flushing = True
        self._arrived.set()

    def target_size(self) -> int:
        """The size at which the pending batch counts as full, at the current arrival rate."""
        return self.policy.target_size(self._rate.per_s(), self._clock())

    def ready(self) -> float:
        """Seconds until the pending batch is due; 0 when it is due now."""
        if not self._pending:
            return float("inf")
        if self._flushing or len(self._pending) >= self.target_size():
            return 0.0
        size = min(len(self._pending), self.policy.max_batch_size)
        oldest = min(self._pending[i].deadline_wall for i in range(size))
        now = self._clock()
        first = self._pending[0].arrived
        due = self.policy.release_at(first, oldest, size, now, self._wall_clock())
        return max(0.0, due - now)

    def take(self) -> list[T]:
        """Remove and return the next batch: everything pending, up to the maximum size.

        The target size decides when a batch is due; a backlog still leaves in full
        batches, so throughput rises under load. When the oldest events are already past
        their deadline, the batch is the run of such events, up to `MAX_EXPIRED_BATCH`.
        """
        pending = self._pending
        now_wall = self._wall_clock()
        if pending and pending[0].deadline_wall < now_wall:
            batch = []
            limit = max(MAX_EXPIRED_BATCH, self.policy.max_batch_size)
            while pending and len(batch) < limit and pending[0].deadline_wall < now_wall:
                batch.append(pending.popleft().item)
            return batch
        size = min(len(pending), self.policy.max_batch_size)
        return [pending.popleft().item for _ in range(size)]

    async def next_batch(self) -> list[T]:
        while True:
            wait_s = self.ready()
            # Due within the event loop's timer resolution: release now. libuv (uvloop)
            # timers count whole milliseconds, so a shorter wait fires at once and the
            # loop would spin until the due instant (a tenth of a core at 100 batches/s).
            if wait_s < TIMER_RESOLUTION_S:
                return self.take()
            self._arrived.clear()
            timeout = None if wait_s == float("inf") else wait_s
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), timeout)


class _RateMeter:
    """Arrivals per second, smoothed over about a second."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._window_start = clock()
        self._count = 0
        self._rate = 0.0

    def add(self, count: int) -> None:
        self._count += count
        now = self._clock()
        elapsed = now - self._window_start
        if elapsed >= 0.25:
            current = self._count / elapsed
            self._rate = current if self._rate == 0 else self._rate + 0.5 * (current - self._rate)
            self._window_start, self._count = now, 0

    def per_s(self) -> float:
        return self._rate


def size_bucket(size: int) -> int:
    return 1 << max(size - 1, 0).bit_length()
