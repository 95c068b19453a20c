"""How long until a batch admitted now is answered: measured service times, counted work.

Admission (`streams/admission.py`) needs, for a batch it is about to admit, the time
until its answers are written. `CompletionModel` composes it from the full-model work
already admitted ahead of the batch (counted), the batch's own model run and the rest of
its path (measured: a high quantile of recent times per batch size). Clocks are passed in.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Callable

from streams.admission import Estimates
from streams.batching import scaled_from_nearest, size_bucket


class RecentTimes:
    """A high quantile of the durations measured in the last `window_s` seconds.

    Deadlines need a bound, not a mean: an event admitted with a mean estimate misses
    its deadline half the time when it is admitted at the edge, which is exactly
    where overload puts it. The window also forgets: a stall does not keep shedding
    long after it ended, and with nothing measured lately the estimate is 0, so the
    next batch takes the full path and measures it again.
    """

    def __init__(self, window_s: float = 2.0, quantile: float = 0.99, max_samples: int = 128):
        self.window_s = window_s
        self.quantile = quantile
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
        """The quantile of recent durations; 0 when nothing was measured in the window."""
        horizon = now_s - self.window_s
        while self._samples and self._samples[0][0] < horizon:
            self._forget()
        if not self._sorted:
            return 0.0
        rank = math.ceil(self.quantile * len(self._sorted)) - 1
        return self._sorted[min(len(self._sorted) - 1, rank)]

    def _forget(self) -> None:
        _, seconds = self._samples.popleft()
        del self._sorted[bisect_left(self._sorted, seconds)]


class SizedTimes:
    """`RecentTimes` per batch-size bucket (powers of two). A size without recent
    measurements is scaled linearly from the nearest bucket that has some."""

    def __init__(self, window_s: float = 2.0, quantile: float = 0.99) -> None:
        self._window_s = window_s
        self._quantile = quantile
        self._buckets: dict[int, RecentTimes] = {}

    def observe(self, size: int, seconds: float, now_s: float) -> None:
        bucket = size_bucket(size)
        times = self._buckets.get(bucket)
        if times is None:
            times = self._buckets[bucket] = RecentTimes(self._window_s, self._quantile)
        times.observe(seconds, now_s)

    def bounds(self, now_s: float) -> Callable[[int], float]:
        """Seconds for a batch of a given size, as of `now_s` (0 when nothing was
        measured lately). Computed once here: admission asks it for every event."""
        measured = {b: t.bound(now_s) for b, t in self._buckets.items()}
        measured = {b: seconds for b, seconds in measured.items() if seconds > 0}
        return lambda size: scaled_from_nearest(measured, size)


class CompletionModel:
    """When would a batch admitted now be answered? Its wait for the full-model work
    admitted before it, its own run, and the rest of its path (decode, features, publish).

    Measured queueing would lag and feed on itself (a slow spell makes admission shed,
    so nothing is measured that could show it ended); here only service times are
    measured (a high quantile of the recent ones, per batch size) and the work ahead is
    counted: `reserve` when a batch is admitted, `release` when its model run ends.
    Service times are properties of the model and the machine, so they are remembered
    for a while (`window_s`): a quiet spell must not leave the next burst unestimated.
    """

    def __init__(self, sessions: int, window_s: float = 30.0, quantile: float = 0.95) -> None:
        self._sessions = max(sessions, 1)
        self.full_runs = SizedTimes(window_s, quantile)
        """Seconds of one full-model run, by batch size."""
        self.fallback_runs = RecentTimes(window_s, quantile)
        self.rest = SizedTimes(window_s, quantile)
        """Seconds a batch spends outside the model runs (decode, features, publish), by
        its size: a backlog's large batches of cheap answers must not count for small ones."""
        self._ahead_s = 0.0
        self._first_full_runs = SizedTimes(math.inf, quantile)
        self._first_fallback_run_s = 0.0

    def seed(self, full_runs: dict[int, float], fallback_run_s: float = 0.0) -> None:
        """Run times to use while nothing has been measured (the models' warm-up runs:
        on an idle machine, so optimistic, but better than none)."""
        for size, seconds in full_runs.items():
            self._first_full_runs.observe(size, seconds, 0.0)
        self._first_fallback_run_s = fallback_run_s

    def estimates(self, now_s: float, batch_size: int, own_reservation_s: float = 0.0) -> Estimates:
        """For a batch of `batch_size` entering now; pass its own reservation once it
        holds one."""
        run = self._full_run_bounds(now_s)
        fallback_run_s = self.fallback_runs.bound(now_s) or self._first_fallback_run_s
        wait_s = max(0.0, self._ahead_s - own_reservation_s) / self._sessions
        rest_s = self.rest.bounds(now_s)(batch_size)
        return Estimates(
            full_s=lambda n: wait_s + run(n) + rest_s,
            fallback_s=wait_s + fallback_run_s + rest_s,
        )

    def reserve(self, full_events: int, now_s: float) -> float:
        """Count a batch's full-model work as ahead of later batches; returns the
        reservation to `release` when its run ends."""
        seconds = self._full_run_bounds(now_s)(full_events) if full_events else 0.0
        self._ahead_s += seconds
        return seconds

    def _full_run_bounds(self, now_s: float) -> Callable[[int], float]:
        run = self.full_runs.bounds(now_s)
        if run(1) == 0.0:  # nothing measured lately: the warm-up runs stand in
            run = self._first_full_runs.bounds(now_s)
        return run

    def release(self, reservation_s: float) -> None:
        self._ahead_s = max(0.0, self._ahead_s - reservation_s)
