"""A circuit breaker around the online store: while the store fails, stop asking it.

    closed ──(failures_to_open failed or too-slow reads in a row)──► open
    open ──(probe_after_s passed; the next read goes through as a probe)──► probing
    probing ──(the probe read succeeds)──► closed
    probing ──(it fails)──► open again

While the breaker is not closed, reads are refused at once: the events that needed
them go down the degradation ladder (the fallback model needs no store) instead of
piling up behind a store that does not answer. The probe is a real batch's read, with
the same time bound as any read, so probing costs one batch at most that bound.
Pure logic with the clock passed in; `on_change` is told every state change.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable


class BreakerState(enum.Enum):
    CLOSED = 0
    OPEN = 1
    PROBING = 2


class Access(enum.Enum):
    """`StoreBreaker.allow()`'s answer: false when refused."""

    REFUSED = 0
    READ = 1
    PROBE = 2
    """This read is the probe: it must read the store and report back."""

    def __bool__(self) -> bool:
        return self is not Access.REFUSED


class StoreBreaker:
    def __init__(
        self,
        failures_to_open: int = 2,
        probe_after_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[BreakerState, str], None] = lambda state, why: None,
    ) -> None:
        if failures_to_open < 1 or probe_after_s <= 0:
            raise ValueError("failures_to_open must be >= 1 and probe_after_s > 0")
        self._failures_to_open = failures_to_open
        self.probe_after_s = probe_after_s
        self._clock = clock
        self._on_change = on_change
        self.state = BreakerState.CLOSED
        self._failures = 0
        self._opened_at = 0.0

    def allow(self) -> Access:
        """Whether a read may go to the store now; `Access.PROBE` at most once per probe
        while open (that read is the probe, and it must report back, or call
        `probe_unused`). Only the probe's caller knows it is the probe: reads allowed
        at the same time are refused."""
        if self.state is BreakerState.CLOSED:
            return Access.READ
        due = self._clock() - self._opened_at >= self.probe_after_s
        if self.state is BreakerState.OPEN and due:
            self._change(BreakerState.PROBING, "probing the store with one read")
            return Access.PROBE
        return Access.REFUSED

    def probe_unused(self) -> None:
        """The probe did not read the store (its batch needed no read, or it ended
        before it could report back): open again, the next read probes at once."""
        if self.state is BreakerState.PROBING:
            self._change(BreakerState.OPEN, "the probe's batch needed no read")

    def succeeded(self) -> None:
        self._failures = 0
        if self.state is not BreakerState.CLOSED:
            self._change(BreakerState.CLOSED, "the store answered; reading it again")

    def failed(self, why: str) -> None:
        self._failures += 1
        if self.state is BreakerState.PROBING or (
            self.state is BreakerState.CLOSED and self._failures >= self._failures_to_open
        ):
            self._opened_at = self._clock()
            self._change(BreakerState.OPEN, why)

    def _change(self, state: BreakerState, why: str) -> None:
        self.state = state
        self._on_change(state, why)
