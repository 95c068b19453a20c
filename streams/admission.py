"""Admission: which events the full model may still answer on time, and how the rest
are answered (the degradation ladder).

An event's deadline is its event time plus the pipeline's latency budget. Before any
work is spent on it, and again before inference, the runner asks `Admission.decide`
with an estimate of how long the rest of the path takes (`streams/completion.py`: the
model work already admitted ahead, the batch's own run, the rest of the path). An event
that cannot be answered in full goes down the ladder, in order:

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass


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
REASONS = (DEADLINE_PASSED, DEADLINE_AT_RISK, LOW_PRIORITY)


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


@dataclass(frozen=True)
class Decision:
    route: Route
    reason: str | None
    """None for FULL; otherwise one of `REASONS`."""


@dataclass(frozen=True)
class Candidate:
    """What admission needs to know of one event."""

    deadline_s: float
    priority: int
    """In range (see `Admission.clamp`)."""
    cached: bool
    """Whether the answer cache holds a fresh answer for its input."""


# Share of the budget admission keeps in hand for what its estimates cannot see: the
# consumer reading the answer, stalls of the event loop, the machine or the broker.
MARGIN_SHARE = 0.05


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
        decisions = []
        taken = 0
        tightest_s = math.inf  # the least usable time among the events taken
        for candidate in candidates:
            left_s = candidate.deadline_s - now_s
            usable_s = left_s - self._reserve_s[candidate.priority]
            needed_s = estimates.full_s(taken + 1)
            if min(usable_s, tightest_s) >= needed_s:
                taken += 1
                tightest_s = min(tightest_s, usable_s)
                decisions.append(Decision(Route.FULL, None))
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

    def _degrade(self, usable_s: float, fallback_s: float, cached: bool) -> Route:
        """The first rung of the ladder that can answer, given the seconds left to use."""
        if self.ladder.fallback_model and usable_s >= fallback_s:
            return Route.FALLBACK
        if self.ladder.answer_cache and cached:
            return Route.CACHED
        if self.ladder.default_answer:
            return Route.DEFAULT
        return Route.SHED
