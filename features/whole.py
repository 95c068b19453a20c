"""Feature views small enough to keep whole: read entirely before the first event and
served from memory while the store is unchanged.

Why. A light load meets an entity less often than the cache's staleness bound, so
nearly every event was a store read on the event loop (250-850 µs of CPU each), and a
worker that starts cold pays that for every entity it meets: the first seconds of a
benchmark step shed load the warm worker later carries.

How. A SQLite view with a value for at most `whole_view_max_entities` entities is read
whole (the sample's 10,000 users of four features: about 0.25 s of CPU) when the worker
warms up. A thread checks every second whether the store changed: SQLite's
`data_version` moves whenever another connection commits (a materialization, a push).
Unchanged, the rows count as read at the check; changed, they are read whole again, at
most every `max_staleness_s / 2`. Rows not verified within `max_staleness_s` are not
served (the store gone, a check failing): events go back to the cache, the store read
and its breaker. So the cache's promise holds: a served row reflects the store as of at
most `max_staleness_s` ago. The rows hold every entity stored with a value, so an
entity they lack is absent from the store as of the check too: it reads as missing
without a read (a stored key whose form cannot be read back turns that off: such keys
go the cache's way). So while the rows are verified, the view needs no store read at
all, and a store outage shorter than `max_staleness_s` goes unnoticed by its events.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence

from features.errors import FeatureStoreError
from features.online_read import OnlineViewReader, WholeRows

log = logging.getLogger(__name__)

# Seconds between checks of the store's version (at most; a quarter of a shorter
# staleness bound): a check is one SQLite pragma, a few µs.
CHECK_EVERY_S = 1.0


class WholeView:
    """One view kept whole. `current()` on the event loop; `refresh()` on one thread."""

    def __init__(
        self,
        reader: OnlineViewReader,
        max_entities: int,
        max_staleness_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.reader = reader
        self.max_entities = max_entities
        self.max_staleness_s = max_staleness_s
        self._clock = clock
        # Swapped whole, so the event loop reads a consistent pair without a lock.
        self._state: tuple[WholeRows | None, float] = (None, -math.inf)
        self._loaded_at = -math.inf
        self._version_tried: int | None = None  # of a read that found too many entities
        self._failing = False

    def current(self, now_s: float) -> tuple[WholeRows, float] | None:
        """The rows and how long ago they were last known current, within the bound."""
        whole, verified_at = self._state
        if whole is None or now_s - verified_at > self.max_staleness_s:
            return None
        return whole, max(0.0, now_s - verified_at)

    def refresh(self) -> None:
        """Blocking: check the store's version; read the view again when it changed
        (and it is due). Logs, never raises: the rows then age out of `current()`."""
        try:
            self._refresh()
        except FeatureStoreError as exc:
            if not self._failing:
                log.warning("feature view %s: cannot check the store (%s); its rows are read "
                            "per key once they are %.0f s old", self.reader.view.name, exc,
                            self.max_staleness_s)  # fmt: skip
            self._failing = True
            return
        if self._failing:
            log.warning("feature view %s: store readable again", self.reader.view.name)
            self._failing = False

    def _refresh(self) -> None:
        checked_at = self._clock()
        version = self.reader.store_version()
        whole = self._state[0]
        if whole is not None and version == whole.version:
            self._state = (whole, checked_at)
            return
        if version == self._version_tried:
            return  # too many entities at this version already
        if checked_at - self._loaded_at < self.max_staleness_s / 2:
            return  # changed again soon after a read: served as read until due
        started = time.perf_counter()
        fresh = self.reader.read_whole(self.max_entities)
        self._loaded_at = checked_at
        if fresh is None:
            self._version_tried = version
            self._state = (None, -math.inf)
            log.info("feature view %s: more than %d entities; read per key, not kept whole",
                     self.reader.view.name, self.max_entities)  # fmt: skip
            return
        self._version_tried = None
        self._state = (fresh, checked_at)
        log.info("feature view %s: %d entities read whole in %.0f ms",
                 self.reader.view.name, len(fresh.index),
                 (time.perf_counter() - started) * 1000)  # fmt: skip


class WholeViews:
    """Keeps `views` whole in one thread of its own: `start()`, then `stop()` (both
    safe twice). `wait_loaded()` blocks until each view's first read was tried."""

    def __init__(self, views: Sequence[WholeView]) -> None:
        self.views = list(views)
        shortest_s = min((view.max_staleness_s for view in self.views), default=CHECK_EVERY_S)
        self._every_s = min(CHECK_EVERY_S, shortest_s / 4)
        self._stopping = threading.Event()
        self._loaded = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None and self.views and not self._stopping.is_set():
            self._thread = threading.Thread(target=self._run, name="feature-whole", daemon=True)
            self._thread.start()

    def wait_loaded(self, timeout_s: float) -> bool:
        return not self._thread or self._loaded.wait(timeout_s)

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        failing: set[str] = set()  # logged once per run of failures, not every second
        while True:
            for view in self.views:
                name = view.reader.view.name
                try:
                    view.refresh()
                except Exception:  # a bug: keep checking the others; its rows age out
                    if name not in failing:
                        failing.add(name)
                        log.exception("feature view %s: check failed (logged once until "
                                      "it succeeds)", name)  # fmt: skip
                    continue
                if name in failing:
                    failing.discard(name)
                    log.warning("feature view %s: checks succeed again", name)
            self._loaded.set()
            if self._stopping.wait(self._every_s):
                return
