"""A bounded cache of feature rows in front of the online store, honest about time.

Two clocks matter for a cached row:
- its **staleness**: how long ago it was read from the store. Past the pipeline's
  `max_staleness_s` it is read again, so pushed updates reach the model within
  that bound;
- its **age**: how old the feature values are (their Feast event timestamp). Past
  the view's TTL the row is *expired*: Feast would still serve it, headrace treats
  it as missing. Expiry is checked on every use, hit or miss.

Entries are evicted least recently used beyond `max_entries`. The clock is passed in.
Memory: about 120 bytes of bookkeeping plus 8 bytes per feature for each entry.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable

import numpy as np


class FeatureCache:
    def __init__(
        self,
        max_entries: int,
        max_staleness_s: float,
        clock: Callable[[], float] = time.time,
        spread: float = 0.0,
    ) -> None:
        """`spread`: share of `max_staleness_s` by which a row may count as read earlier
        than it was (random per row), so rows read together do not expire together."""
        self.max_entries = max_entries
        self.spread = spread
        self.max_staleness_s = max_staleness_s
        self._clock = clock
        self._rows: OrderedDict[Hashable, tuple[np.ndarray, float, float]] = OrderedDict()
        self.evictions = 0
        self._jitter = random.Random(0)

    def __len__(self) -> int:
        return len(self._rows)

    def get(self, key: Hashable) -> tuple[np.ndarray, float, float] | None:
        """(values, feature event time, seconds since read) if cached and fresh, else None."""
        entry = self._rows.get(key)
        if entry is None:
            return None
        values, event_ts_s, read_at = entry
        staleness_s = self._clock() - read_at
        if staleness_s > self.max_staleness_s:
            del self._rows[key]
            return None
        self._rows.move_to_end(key)
        return values, event_ts_s, staleness_s

    def put(self, key: Hashable, values: np.ndarray, event_ts_s: float) -> None:
        if self.max_entries <= 0:
            return
        read_at = self._clock()
        if self.spread:
            read_at -= self._jitter.random() * self.spread * self.max_staleness_s
        self._rows[key] = (values, event_ts_s, read_at)
        self._rows.move_to_end(key)
        while len(self._rows) > self.max_entries:
            self._rows.popitem(last=False)
            self.evictions += 1

    def clear(self) -> None:
        self._rows.clear()

    def invalidate(self, key: Hashable) -> None:
        """Forget a key (its features were just updated, e.g. through Feast's push API)."""
        self._rows.pop(key, None)
