"""Admission: each event's deadline and priority, which events the full model may still
answer on time, and how the rest are answered (the degradation ladder).

An event's deadline is its event time (the configured field, else its Kafka timestamp)
plus the pipeline's latency budget, computed once when it is decoded (`Tickets`); the
batcher and admission both use that one value. Before any feature or model work is
spent on a batch, and again before inference, the runner asks `Admission.decide` with
an estimate of how long the rest of the path takes (`CompletionModel`: the model work
already admitted ahead, the batch's own run, the rest of the path), the same estimator
that tells the batcher when a batch must leave. An event that cannot be answered in
full goes down the ladder, in order:

    fallback model  ->  cached answer  ->  default answer  ->  shed record

The fallback model costs inference time, so it must still meet the deadline too; a
cached or default answer costs nothing. Priorities: an event of priority `p` may use
only `budget_shares[p]` of the budget, so under load the queue ahead of the model grows
past what low priorities may wait and they degrade first, while high priorities keep
their full budget. Pure logic with the clock passed in: tested without a broker.
"""

from __future__ import annotations

import enum
import math
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple

from schemas.config import InputConfig
from streams.batching import scaled_from_nearest, size_bucket
from streams.config import PriorityConfig
from streams.records import InputRecord


class Route(enum.Enum):
    """How one event is answered; `status` and `level` are what its outcome says."""

    FULL = ("OK", None)
    FALLBACK = ("DEGRADED", "fallback_model")
    CACHED = ("DEGRADED", "cache")
    DEFAULT = ("DEGRADED", "default")
    SHED = ("SHED", None)

    def __init__(self, status: str, level: str | None) -> None:
        self.status = status
        self.level = level


# Why an event was not answered in full (the outcome's `reason`).
DEADLINE_PASSED = "deadline_passed"
"""Its deadline had already passed when it was considered (it waited in Kafka)."""
DEADLINE_AT_RISK = "deadline_at_risk"
"""The estimated completion of the full path lies beyond its deadline."""
LOW_PRIORITY = "low_priority"
"""It would have met its deadline, but not within the share of the budget its priority gets."""
STORE_UNAVAILABLE = "store_unavailable"
"""Its features could not be read in time (the store failed, was too slow, or is down)."""
NON_FINITE = "non_finite_answer"
"""The model answered NaN or infinity for it."""
REASONS = (DEADLINE_PASSED, DEADLINE_AT_RISK, LOW_PRIORITY, STORE_UNAVAILABLE, NON_FINITE)


@dataclass(frozen=True)
class Ladder:
    """Which rungs below the full model a pipeline has configured."""

    fallback_model: bool = False
    answer_cache: bool = False
    default_answer: bool = False


@dataclass(frozen=True)
class Estimates:
    """Conservative seconds from now until a batch's answers are written."""

    full_s: Callable[[int], float]
    """For a batch with this many events for the full model."""
    fallback_s: float
    """For a batch without full-model work (the fallback model's path)."""


class Decision(NamedTuple):  # tuples: made for every event of every batch, twice
    route: Route
    reason: str | None
    """None for FULL; otherwise one of `REASONS`."""


_TAKEN = Decision(Route.FULL, None)


class Candidate(NamedTuple):
    """What admission needs to know of one event."""

    deadline_s: float
    priority: int
    """In range (see `Admission.clamp`)."""
    cached: bool
    """Whether the answer cache holds a fresh answer for its input."""


# Share of the budget admission keeps in hand for what its estimates cannot see: the
# consumer reading the answer, stalls of the event loop, the machine or the broker.
# At 5% (12.5 ms of 250), the overload test's answers in full reached p99 253 and
# 265 ms on 2 shared cores: there a model run or a publish stalls now and then for
# 50-170 ms (its bound: 30-40 ms), and the batches admitted at the edge then finish
# 30-45 ms past their deadline.
MARGIN_SHARE = 0.1


class Admission:
    def __init__(
        self,
        budget_s: float,
        budget_shares: Sequence[float],
        ladder: Ladder,
        margin_share: float = MARGIN_SHARE,
    ) -> None:
        if not budget_shares or not all(0 < share <= 1 for share in budget_shares):
            raise ValueError(f"budget shares must be in (0, 1], got {list(budget_shares)}")
        self.budget_s = budget_s
        self.ladder = ladder
        self._margin_s = budget_s * margin_share
        # Seconds an event of each priority must keep in hand before its deadline.
        self._reserve_s = [budget_s * (1 - share) + self._margin_s for share in budget_shares]

    @property
    def top_priority(self) -> int:
        return len(self._reserve_s) - 1

    def clamp(self, priority: int) -> int:
        return min(max(priority, 0), self.top_priority)

    def decide(
        self, candidates: Sequence[Candidate], now_s: float, estimates: Estimates
    ) -> list[Decision]:
        """The route of each event of one batch, in the batch's order.

        Each event the full model takes makes the batch slower for all of them, so an
        event is taken only if every event taken so far, and itself, can still finish
        in time with one more in the batch.
        """
        reserve_s = self._reserve_s
        # Mostly every event can wait for the whole batch: then all are taken, with one
        # estimate instead of one per event.
        earliest_s = min((c.deadline_s - reserve_s[c.priority] for c in candidates), default=0.0)
        if candidates and earliest_s - now_s >= estimates.full_s(len(candidates)):
            return [_TAKEN] * len(candidates)
        decisions = []
        taken = 0
        tightest_s = math.inf  # the least usable time among the events taken
        for candidate in candidates:
            left_s = candidate.deadline_s - now_s
            usable_s = left_s - reserve_s[candidate.priority]
            needed_s = estimates.full_s(taken + 1)
            if min(usable_s, tightest_s) >= needed_s:
                taken += 1
                tightest_s = min(tightest_s, usable_s)
                decisions.append(_TAKEN)
                continue
            if left_s <= 0:
                reason = DEADLINE_PASSED
            elif min(left_s - self._margin_s, tightest_s) >= needed_s:
                reason = LOW_PRIORITY
            else:
                reason = DEADLINE_AT_RISK
            route = self._degrade(usable_s, estimates.fallback_s, candidate.cached)
            decisions.append(Decision(route, reason))
        return decisions

    def without_store(self, cached: bool, fallback_needs_store: bool) -> Decision:
        """For an event whose store read failed: it was admitted to a path at least as
        slow as the fallback model's, so it has time for that model, if it needs no store."""
        usable_s = -math.inf if fallback_needs_store else math.inf
        return Decision(self._degrade(usable_s, 0.0, cached), STORE_UNAVAILABLE)

    def without_model(self, cached: bool) -> Decision:
        """For an event a model answered with NaN or infinity: the rungs after the models."""
        return Decision(self._degrade(-math.inf, 0.0, cached), NON_FINITE)

    def _degrade(self, usable_s: float, fallback_s: float, cached: bool) -> Route:
        """The first rung of the ladder that can answer, given the seconds left to use."""
        if self.ladder.fallback_model and usable_s >= fallback_s:
            return Route.FALLBACK
        if self.ladder.answer_cache and cached:
            return Route.CACHED
        if self.ladder.default_answer:
            return Route.DEFAULT
        return Route.SHED


class Tickets:
    """An event's deadline and priority, from its record and its decoded fields."""

    def __init__(self, admission: Admission, event: InputConfig, priority: PriorityConfig) -> None:
        self._budget_s = admission.budget_s
        self._admission = admission
        self._time_field = event.event_time_field
        self._header = priority.header
        self._field = priority.field
        self._default = priority.default

    def deadline_s(self, record: InputRecord, event: Mapping[str, Any] | None) -> float:
        """Event time plus the budget; the Kafka timestamp where there is no event time
        (no field configured, a null or unusable value, or an input that did not decode)."""
        event_time_ms = None
        if self._time_field is not None and event is not None:
            event_time_ms = event.get(self._time_field)
            if type(event_time_ms) is not int:  # int: epoch ms, the usual case
                event_time_ms = _epoch_ms(event_time_ms)
        if event_time_ms is None:
            event_time_ms = record.timestamp_ms
        return event_time_ms / 1000 + self._budget_s

    def priority(self, record: InputRecord, event: Mapping[str, Any]) -> int:
        value: Any = None
        if self._header is not None:
            for name, raw in record.headers:
                if name == self._header:
                    value = raw
        if value is None and self._field is not None:
            value = event.get(self._field)
        if value is None:  # the usual case, without the cost of int(None) raising
            return self._default
        try:
            return self._admission.clamp(int(value))
        except (TypeError, ValueError, OverflowError):  # not a number, NaN or infinite
            return self._default


def _epoch_ms(value: Any) -> float | None:
    """An event time field's value in epoch milliseconds: a number as it is, a datetime
    (Avro's `timestamp-millis` and `timestamp-micros`, which fastavro reads as datetimes)
    converted; None for anything else (NaN, infinity, a bool, a date)."""
    if isinstance(value, datetime):
        return value.timestamp() * 1000
    if type(value) is float and math.isfinite(value):
        return value
    return None


class RecentTimes:
    """A high quantile of the durations measured in the last `window_s` seconds (their
    mean with `quantile=None`).

    Deadlines need a bound, not a mean: an event admitted with a mean estimate misses
    its deadline half the time when it is admitted at the edge, which is exactly
    where overload puts it. A mean serves where several durations are added up (a line
    of work ahead): their sum is near the sum of their means. The window also forgets:
    a stall does not keep shedding long after it ended, and with nothing measured
    lately the estimate is 0, so the next batch takes the full path and measures it again.

    `outliers`: how many of the largest durations a bound never rests on while more are
    kept. Until a window holds 1 / (1 - quantile) durations, the quantile is their
    largest: one stall of the machine or the broker (a publish acknowledged 90 ms late)
    then was the estimate for every batch of its size for seconds, and a worker in its
    first seconds shed a third of its events as `deadline_at_risk` while answering the
    rest in 8 ms. Ignoring one costs a real slowdown one batch before it counts.
    """

    def __init__(
        self,
        window_s: float = 2.0,
        quantile: float | None = 0.99,
        max_samples: int = 128,
        outliers: int = 0,
    ):
        self.window_s = window_s
        self.quantile = quantile
        self.outliers = outliers
        self._max_samples = max_samples
        self._samples: deque[tuple[float, float]] = deque()
        # The same durations kept sorted, so that a bound is one index: it is asked for
        # several times per batch, and sorting per ask cost more than the batch's work.
        self._sorted: list[float] = []

    def observe(self, seconds: float, now_s: float) -> None:
        if len(self._samples) == self._max_samples:
            self._forget()
        self._samples.append((now_s, seconds))
        insort(self._sorted, seconds)

    def bound(self, now_s: float) -> float:
        """The quantile (or mean) of recent durations; 0 when nothing was measured in
        the window."""
        horizon = now_s - self.window_s
        while self._samples and self._samples[0][0] < horizon:
            self._forget()
        if not self._sorted:
            return 0.0
        if self.quantile is None:
            return math.fsum(self._sorted) / len(self._sorted)  # at most `max_samples`
        kept = len(self._sorted)
        rank = math.ceil(self.quantile * kept) - 1
        highest = kept - 1 - self.outliers if kept > self.outliers else kept - 1
        return self._sorted[min(highest, rank)]

    def expires_s(self) -> float:
        """When the oldest sample kept leaves the window (and the bound may change);
        infinity when none is kept."""
        return self._samples[0][0] + self.window_s if self._samples else math.inf

    def _forget(self) -> None:
        _, seconds = self._samples.popleft()
        del self._sorted[bisect_left(self._sorted, seconds)]


class SizedTimes:
    """`RecentTimes` per batch-size bucket (powers of two). A size without recent
    measurements is scaled from the nearest bucket that has some (`scaled_from_nearest`;
    `per_event_share` 1 for a model run, less for a time that is mostly per batch)."""

    def __init__(
        self,
        window_s: float = 2.0,
        quantile: float | None = 0.99,
        per_event_share: float = 1.0,
        outliers: int = 0,
    ) -> None:
        self._window_s = window_s
        self._quantile = quantile
        self._per_event_share = per_event_share
        self._outliers = outliers
        self._buckets: dict[int, RecentTimes] = {}
        # The bounds as last computed, per bucket (None: to compute again), good until a
        # kept measurement leaves the window. A measurement changes only its own bucket's
        # bound: four are taken per batch, and each used to make every bucket's be
        # computed again (the runner's estimator calls took 25 µs a batch, now 15).
        self._measured: dict[int, float] | None = None
        self._bounds_until_s = -math.inf
        self._bounds = self._by_size({})

    def observe(self, size: int, seconds: float, now_s: float) -> None:
        bucket = size_bucket(size)
        times = self._buckets.get(bucket)
        if times is None:
            times = self._buckets[bucket] = RecentTimes(
                self._window_s, self._quantile, outliers=self._outliers
            )
        times.observe(seconds, now_s)
        measured = self._measured
        if measured is not None:
            bound_s = times.bound(now_s)
            if bound_s > 0:
                measured[bucket] = bound_s
            else:
                measured.pop(bucket, None)
            self._bounds_until_s = min(self._bounds_until_s, times.expires_s())
            self._bounds = self._by_size(measured)

    def bounds(self, now_s: float) -> Callable[[int], float]:
        """Seconds for a batch of a given size, as of `now_s` (0 when nothing was
        measured lately). Computed once here: admission asks it for every event."""
        if self._measured is not None and now_s < self._bounds_until_s:
            return self._bounds
        measured = {b: t.bound(now_s) for b, t in self._buckets.items()}
        self._measured = {b: seconds for b, seconds in measured.items() if seconds > 0}
        self._bounds_until_s = min(
            (t.expires_s() for t in self._buckets.values()), default=math.inf
        )
        self._bounds = self._by_size(self._measured)
        return self._bounds

    def _by_size(self, measured: dict[int, float]) -> Callable[[int], float]:
        """`scaled_from_nearest` over a copy of `measured`, each size computed once."""
        by_bucket, share, by_size = dict(measured), self._per_event_share, {}

        def seconds_for(size: int) -> float:
            seconds = by_size.get(size)
            if seconds is None:
                seconds = by_size[size] = scaled_from_nearest(by_bucket, size, share)
            return seconds

        return seconds_for


# The share of a batch's time outside the model runs that grows with its size, for the
# sizes not measured yet. That time is mostly per batch (one store read, one publish
# round trip), little per event (decode, cache probe, encode, produce). Measured on the
# bare runtime (one bench run, 2 cores): 6.5 ms for batches of 1 at 100 events/s,
# 17.9-21.3 ms for batches of 33-42 at 3,000/s, a share of 0.06. Scaled linearly
# instead, a worker that had measured only batches of one at its start estimated 98 ms
# for its first batch of 4 and shed half of its first 200 events (`deadline_at_risk`)
# while answering the others in 30-60 ms.
REST_PER_EVENT_SHARE = 0.1


class Reservation(NamedTuple):
    """A batch's work as counted ahead of later batches (`CompletionModel.reserve`)."""

    model_s: float
    publish_s: float


NO_RESERVATION = Reservation(0.0, 0.0)


class CompletionModel:
    """When would a batch admitted now be answered? Its wait for the full-model work
    admitted before it, its own run, and the rest of its path (decode, features, publish).
    Batches are published one after another, so it also waits for the publishes of
    every batch admitted before it: under overload that line, not the model, can be
    the longer one (most batches then carry cheap answers, each still a publish).

    Measured queueing would lag and feed on itself (a slow spell makes admission shed,
    so nothing is measured that could show it ended); here only service times are
    measured (a high quantile of the recent ones, per batch size) and the work ahead is
    counted: `reserve` when a batch is admitted, `release` when its model run ends.
    Service times are properties of the model and the machine, so they are remembered
    for a while (`window_s`): a quiet spell must not leave the next burst unestimated.
    """

    def __init__(
        self,
        sessions: int,
        window_s: float = 30.0,
        quantile: float = 0.95,
        publishes_overlap: bool = False,
    ) -> None:
        self._sessions = max(sessions, 1)
        # Publishes handed over while one commits (exactly-once) overlap: not a line.
        self._publishes_in_line = not publishes_overlap
        # The bounds that decide shedding never rest on one stall (`RecentTimes.outliers`).
        self.full_runs = SizedTimes(window_s, quantile, outliers=1)
        """Seconds of one full-model run, by batch size."""
        self.fallback_runs = RecentTimes(window_s, quantile, outliers=1)
        self.rest = SizedTimes(window_s, quantile, REST_PER_EVENT_SHARE, outliers=1)
        """Seconds a batch spends outside the model runs (decode, features, publish), by
        its size: a backlog's large batches of cheap answers must not count for small ones."""
        self.slowest_stages = SizedTimes(window_s, quantile=0.5)
        """Seconds of a batch's slowest stage, by its size: what bounds throughput while
        the stages of successive batches overlap (the batcher's adaptive size). A median:
        throughput follows the typical time; a high quantile would make light-load
        batches wait to fill for nothing."""
        self.publishes = SizedTimes(window_s, None, REST_PER_EVENT_SHARE)
        """Seconds of one batch's publish (the serial stage), by its size: their mean,
        since the publishes ahead of a batch are added up, while its own publish counts
        at the high quantile in `rest`. Each counted at that quantile, a burst of a few
        small batches on a shared machine (a busy loop on one of two cores) counted 27-79 ms
        of publishes ahead while the answers' median latency was 14-30 ms in all, and a
        worker at 150 events/s shed 7-24% per second at a 100 ms budget."""
        self._ahead_s = 0.0
        self._publishing_ahead_s = 0.0
        self._first_full_runs = SizedTimes(math.inf, quantile)
        self._first_fallback_run_s = 0.0

    def seed(self, full_runs: dict[int, float], fallback_run_s: float = 0.0) -> None:
        """Run times to use while nothing has been measured (the models' warm-up runs:
        on an idle machine, so optimistic, but better than none)."""
        for size, seconds in full_runs.items():
            self._first_full_runs.observe(size, seconds, 0.0)
        self._first_fallback_run_s = fallback_run_s

    def estimates(
        self, now_s: float, batch_size: int, own: Reservation = NO_RESERVATION
    ) -> Estimates:
        """For a batch of `batch_size` entering now; pass its own reservation once it
        holds one."""
        run = self._full_run_bounds(now_s)
        fallback_run_s = self.fallback_runs.bound(now_s) or self._first_fallback_run_s
        wait_s = max(0.0, self._ahead_s - own.model_s) / self._sessions
        publish_wait_s = max(0.0, self._publishing_ahead_s - own.publish_s)
        rest_s = self.rest.bounds(now_s)(batch_size)
        return Estimates(
            full_s=lambda n: max(wait_s + run(n), publish_wait_s) + rest_s,
            fallback_s=max(wait_s + fallback_run_s, publish_wait_s) + rest_s,
        )

    def completion_s(self, batch_size: int, now_s: float) -> float:
        """For the batcher: seconds until a batch of this size released now is answered."""
        return self.estimates(now_s, batch_size).full_s(batch_size)

    def stage_bounds(self, now_s: float) -> Callable[[int], float]:
        """For the batcher: seconds of the slowest stage of a batch, by its size."""
        return self.slowest_stages.bounds(now_s)

    def reserve(self, full_events: int, batch_size: int, now_s: float) -> Reservation:
        """Count a batch's full-model work and its publish as ahead of later batches;
        returns the reservation to `release_model` when its run ends and to `published`
        when it is written."""
        model_s = self._full_run_bounds(now_s)(full_events) if full_events else 0.0
        publish_s = self.publishes.bounds(now_s)(batch_size) if self._publishes_in_line else 0.0
        self._ahead_s += model_s
        self._publishing_ahead_s += publish_s
        return Reservation(model_s, publish_s)

    def _full_run_bounds(self, now_s: float) -> Callable[[int], float]:
        run = self.full_runs.bounds(now_s)
        if run(1) == 0.0:  # nothing measured lately: the warm-up runs stand in
            run = self._first_full_runs.bounds(now_s)
        return run

    def release_model(self, reservation: Reservation) -> None:
        self._ahead_s = max(0.0, self._ahead_s - reservation.model_s)

    def published(
        self, reservation: Reservation, batch_size: int, seconds: float, now_s: float
    ) -> None:
        """A batch is written, its publish having taken `seconds`."""
        self._publishing_ahead_s = max(0.0, self._publishing_ahead_s - reservation.publish_s)
        if self._publishes_in_line:
            self.publishes.observe(batch_size, seconds, now_s)
