"""Online feature reads for micro-batches: a TTL-honest cache in front of a direct
store read, the store read off the event loop (except a few keys of a local SQLite
store, read at once where the hand-off to a thread would cost more than the read).

Per batch and per view: the distinct entity keys are looked up in the cache; the
misses are read from the online store in one call; rows older than the view's TTL
(Feast would still serve them) and absent entities are reported as missing, with
NaN in their columns for the pipeline's missing-feature policy (the model's defaults).

A read that fails or outlasts its time bound raises `StoreUnavailable` at once (the
read itself may go on in its thread: a blocked store call cannot be interrupted), and a
circuit breaker (`features/breaker.py`) refuses reads while the store keeps failing, so
that a store outage degrades the answers instead of stalling them.
"""

from __future__ import annotations

import asyncio
import logging
import operator
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
from feast.value_type import ValueType

from features import metrics
from features.breaker import Access, BreakerState, StoreBreaker
from features.cache import FeatureCache
from features.config import FeatureCacheConfig
from features.errors import FeatureStoreError, StoreUnavailable
from features.online_read import OnlineViewReader, has_null
from features.whole import WholeView, WholeViews


@dataclass(frozen=True)
class FeatureRows:
    """Features of one batch, aligned with the events it was asked for."""

    columns: dict[str, np.ndarray]
    """Feature reference (`view__feature`) to float64 values, NaN where missing."""
    missing_views: list[tuple[str, ...]]
    """Per event, the views that had no usable row (absent, expired or null values)."""
    unique_keys: int
    """Distinct (view, entity key) pairs the batch needed."""
    store_reads: int = 0
    """Of those, how many were read from the store (cache misses)."""


@dataclass(frozen=True)
class InMemory:
    """A batch's features without the store read it needed (`StoreUnavailable`)."""

    rows: FeatureRows
    """Rows from the whole views and the cache; NaN where the read was needed."""
    answered: list[bool]
    """Per event, whether every one of its rows was in memory."""


# Rows read together (a cold cache fills in seconds) would all expire together and
# make a burst of store reads every `max_staleness_s` (a p99 spike seen in the
# benchmark 30 s after start): each row counts as read up to a fifth earlier.
STALENESS_SPREAD = 0.2
_NO_SETTINGS = FeatureCacheConfig()
# Most cache misses of a batch read on the event loop rather than the store thread
# (SQLite only; see `FeatureLookup._read_at_once`): a few hundred µs of reading at most.
AT_ONCE_KEYS = 16


def _as_str(value: Any) -> Any:
    if type(value) is str or has_null((value,)):
        return value
    return str(value)  # as Feast's conversion to a STRING key


def _as_int(value: Any) -> Any:
    if type(value) is int or has_null((value,)):
        return value
    try:
        return int(value)  # as Feast's conversion to an INT64 key
    except (TypeError, ValueError, OverflowError):
        return value  # the store read finds it missing


_KEY_AS: dict[ValueType, Callable[[Any], Any]] = {
    ValueType.STRING: _as_str,
    ValueType.INT64: _as_int,
    ValueType.INT32: _as_int,
}

log = logging.getLogger(__name__)


class _View:
    """One view of the service: its reader, the event fields of its key, its cache."""

    def __init__(
        self,
        reader: OnlineViewReader,
        fields: list[str],
        cache: FeatureCache,
        whole: WholeView | None = None,
    ) -> None:
        self.reader = reader
        self.name = reader.view.name
        self.cache = cache
        self.whole = whole
        self.columns = [f"{self.name}__{feature}" for feature in reader.features]
        # The key as a tuple, built by one C call per event (a generator cost ~3x more).
        pick = operator.itemgetter(*fields)
        self.key_of: Callable[[Mapping[str, Any]], tuple] = (
            pick if len(fields) > 1 else lambda event: (pick(event),)
        )
        # A one-field key as the entity's type, as Feast converts it for a store read:
        # an event's 42 must meet the whole view's "42" (and the reverse).
        as_entity = _KEY_AS.get(reader.value_types[0]) if len(fields) == 1 else None
        if as_entity is not None:
            self.key_of = lambda event: (as_entity(pick(event)),)
        # Bound once: label lookups on the hot path cost more than the increments.
        self.hits = metrics.CACHE_HITS.labels(self.name)
        self.misses = metrics.CACHE_MISSES.labels(self.name)
        self.evictions = metrics.CACHE_EVICTIONS.labels(self.name)
        self.expired = metrics.EXPIRED.labels(self.name)
        self.read_seconds = metrics.STORE_READ_SECONDS.labels(self.name)
        self.staleness = metrics.SERVED_STALENESS_SECONDS.labels(self.name)


class FeatureLookup:
    """Reads a feature service for batches of events.

    `entity_fields` maps each entity join key to the event field that carries it.
    `fetch` probes the cache on the event loop and reads the misses on one thread owned
    by this object; call `close()` when done.
    """

    def __init__(
        self,
        store: Any,
        feature_service: str,
        entity_fields: Mapping[str, str],
        cache: FeatureCacheConfig = _NO_SETTINGS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        try:
            service = store.get_feature_service(feature_service)
        except Exception as exc:
            raise FeatureStoreError(
                f"feature service {feature_service!r} is not registered in the Feast repo "
                f"at {store.repo_path}; hint: run `headrace features prepare`"
            ) from exc
        self._clock = clock
        self._views: list[_View] = []
        self.feature_refs: list[str] = []
        for projection in service.feature_view_projections:
            names = [feature.name for feature in projection.features]
            reader = OnlineViewReader(store, projection.name, names)
            missing = [key for key in reader.join_keys if key not in entity_fields]
            if missing:
                raise FeatureStoreError(
                    f"view {projection.name!r} is keyed by {reader.join_keys}, but the "
                    f"pipeline's entity_fields map only {sorted(entity_fields)}; "
                    f"hint: add {missing} to entity_fields"
                )
            fields = [entity_fields[key] for key in reader.join_keys]
            view_cache = FeatureCache(
                cache.max_entries, cache.max_staleness_s, clock, spread=STALENESS_SPREAD
            )
            whole = None
            if reader.reads_at_once and min(
                cache.max_entries, cache.max_staleness_s, cache.whole_view_max_entities
            ):
                whole = WholeView(
                    reader, cache.whole_view_max_entities, cache.max_staleness_s, clock
                )
            self._views.append(_View(reader, fields, view_cache, whole))
            self.feature_refs += [f"{projection.name_to_use()}__{name}" for name in names]
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="feature-read")
        self._whole = WholeViews([view.whole for view in self._views if view.whole is not None])
        self.service = feature_service
        self._state = metrics.STORE_STATE.labels(feature_service)
        self._errors = metrics.STORE_FAILURES.labels(feature_service, "error")
        self._timeouts = metrics.STORE_FAILURES.labels(feature_service, "timeout")
        self._down_since: float | None = None
        self._bug_logged = False
        self.breaker = StoreBreaker(on_change=self._breaker_changed)

    async def fetch(
        self, events: Sequence[Mapping[str, Any]], timeout_s: float | None = None
    ) -> FeatureRows:
        """Features of `events`; raises StoreUnavailable when the store read they need
        fails, is too slow (`timeout_s`), or the store is known down. A batch whose rows
        are all in memory (a whole view, the cache) needs no read: it is answered while
        the store is down too, within `max_staleness_s` as ever.

        The cache is probed here, on the event loop: only the misses go to the store
        thread, so a batch the cache answers costs no thread hand-off."""
        access = self.breaker.allow()
        if access is not Access.PROBE:
            return await self._fetch(events, timeout_s, access)
        try:
            return await self._fetch(events, timeout_s, access)
        finally:
            # A probe that did not report back (a bug, or its batch cancelled while it
            # read) would leave the breaker probing, every later read refused for good.
            self.breaker.probe_unused()

    async def _fetch(
        self, events: Sequence[Mapping[str, Any]], timeout_s: float | None, access: Access
    ) -> FeatureRows:
        # The probe of a store that was down must read it, even what memory holds; the
        # batches beside it are answered from memory as while it was down.
        probe = access is Access.PROBE
        now_s = self._clock()
        parts = [_ViewRead(view, events, now_s, use_cache=not probe) for view in self._views]
        reading = [part for part in parts if part.misses]
        if not reading:
            return self._rows(parts, len(events))
        try:
            if not access:
                raise StoreUnavailable(f"feature service {self.service!r}: the store is down")
            for part in reading:  # reads made, not those refused
                part.view.misses.inc(len(part.misses))
            fresh = self._read_at_once(reading)
            if fresh is None:
                fresh = await self._read_store(reading, timeout_s)
        except StoreUnavailable as exc:
            if probe:  # a failed probe still answers what memory holds (metered once)
                parts = [_ViewRead(view, events, now_s, metered=False) for view in self._views]
            exc.in_memory = self._in_memory(parts, len(events))
            raise
        for part, rows in zip(reading, fresh, strict=True):
            part.fill(rows)
        return self._rows(parts, len(events))

    def _in_memory(self, parts: list[_ViewRead], count: int) -> InMemory:
        """What the batch has without its read: the misses blank (NaN, not cached), and
        the events none of whose rows was a miss."""
        answered = [True] * count
        for part in parts:
            if part.misses:
                missed = set(part.misses)
                for event, slot in enumerate(part.slots):
                    if slot in missed:
                        answered[event] = False
                part.values[part.misses] = np.nan
                part.stamps[part.misses] = np.nan
        return InMemory(self._rows(parts, count), answered)

    def _read_at_once(self, parts: list[_ViewRead]) -> list | None:
        """The misses read here, on the event loop, where the store thread's hand-off
        costs more than the read: a local store (SQLite: a one-key read took 22 µs, the
        hand-off ~130 µs of CPU and latency), a few keys, the breaker closed. None when
        not, or when the store is locked or fails: the store thread's read then decides,
        within its time bound."""
        if (
            self.breaker.state is not BreakerState.CLOSED
            or sum(len(part.misses) for part in parts) > AT_ONCE_KEYS
            or not all(part.view.reader.reads_at_once for part in parts)
        ):
            return None
        try:
            fresh = [part.read_misses(wait=False) for part in parts]
        except Exception:  # locked, failed, or a bug: the store thread's read decides
            return None
        self.breaker.succeeded()  # as a read on the thread: failures count in a row
        return fresh

    async def _read_store(self, parts: list[_ViewRead], timeout_s: float | None) -> list:
        loop = asyncio.get_running_loop()
        read = loop.run_in_executor(self._executor, _read_misses, parts)
        try:
            fresh = await asyncio.wait_for(read, timeout_s)
        except TimeoutError as exc:
            self._timeouts.inc()
            why = f"a read took over {timeout_s * 1000:.0f} ms"
            self.breaker.failed(why)
            raise StoreUnavailable(f"feature service {self.service!r}: {why}") from exc
        except FeatureStoreError as exc:
            self._errors.inc()
            self.breaker.failed(str(exc))
            raise StoreUnavailable(f"feature service {self.service!r}: {exc}") from exc
        except Exception as exc:
            # A bug below: still a failed read, so that the breaker reports back (never
            # stuck probing) and the worker answers without the store instead of exiting.
            if not self._bug_logged:
                self._bug_logged = True
                log.exception("feature service %s: unexpected error in a store read (logged "
                              "once)", self.service)  # fmt: skip
            self._errors.inc()
            why = f"unexpected {type(exc).__name__}: {exc}"
            self.breaker.failed(why)
            raise StoreUnavailable(f"feature service {self.service!r}: {why}") from exc
        self.breaker.succeeded()
        return fresh

    def _breaker_changed(self, state: BreakerState, why: str) -> None:
        # One log line per outage and one per recovery; the probes in between are quiet.
        self._state.set(state.value)
        now = time.monotonic()
        if state is BreakerState.OPEN and self._down_since is None:
            self._down_since = now
            log.warning(
                "feature service %s: store unavailable (%s); answering without it and "
                "probing every %.1f s", self.service, why, self.breaker.probe_after_s,
            )  # fmt: skip
        elif state is BreakerState.CLOSED and self._down_since is not None:
            log.warning(
                "feature service %s: store back after %.1f s", self.service, now - self._down_since
            )
            self._down_since = None

    def warm(self, timeout_s: float) -> None:
        """Blocking: read each view once on the store thread, outside the cache (its
        connection, its first queries), and the views small enough to keep whole
        (`features/whole.py`, kept from here on), within `timeout_s`; a store that fails
        or is slow is logged, not raised: the breaker deals with it once events come."""
        deadline = time.monotonic() + timeout_s
        readers = [view.reader for view in self._views]
        warming = self._executor.submit(lambda: [reader.warm() for reader in readers])
        self._whole.start()
        try:
            warming.result(timeout_s)
        except FeatureStoreError as exc:
            log.warning("feature service %s: warm-up read failed: %s", self.service, exc)
        except TimeoutError:
            log.warning("feature service %s: warm-up read took over %.1f s; starting anyway",
                        self.service, timeout_s)  # fmt: skip
        if not self._whole.wait_loaded(max(0.0, deadline - time.monotonic())):
            log.warning("feature service %s: whole views not read within %.1f s; starting "
                        "anyway", self.service, timeout_s)  # fmt: skip

    def read(self, events: Sequence[Mapping[str, Any]]) -> FeatureRows:
        """Blocking: features of `events`, one store read per view for the cache misses."""
        now_s = self._clock()
        parts = [_ViewRead(view, events, now_s) for view in self._views]
        for part in parts:
            if part.misses:
                part.view.misses.inc(len(part.misses))
                part.fill(part.read_misses())
        return self._rows(parts, len(events))

    def _rows(self, parts: list[_ViewRead], count: int) -> FeatureRows:
        columns: dict[str, np.ndarray] = {}
        missing: list[list[str]] = [[] for _ in range(count)]
        now_s = self._clock()
        for part in parts:
            rows = part.values_at(now_s)
            if len(part.keys) < count:  # some events share a key: a row per event
                rows = rows[part.slots]
            for column, name in enumerate(part.view.columns):
                columns[name] = rows[:, column]
            if np.isnan(rows).any():  # rarely: which events miss the view, then
                for row in np.flatnonzero(np.isnan(rows).any(axis=1)):
                    missing[row].append(part.view.name)
        return FeatureRows(
            columns,
            [tuple(m) for m in missing],
            sum(len(part.keys) for part in parts),
            sum(len(part.misses) for part in parts),
        )

    def close(self) -> None:
        self._whole.stop()
        self._executor.shutdown(wait=True)


class _ViewRead:
    """One view's share of a batch: its distinct keys, their rows from the whole view or
    the cache, and the misses to read from the store. Built and filled on the thread
    that owns the cache (the event loop); only `read_misses` may run on the store thread."""

    def __init__(
        self, view: _View, events: Sequence[Mapping[str, Any]], now_s: float,
        use_cache: bool = True, metered: bool = True,
    ) -> None:  # fmt: skip
        self.view = view
        slot_of: dict[tuple, int] = {}
        self.slots = [slot_of.setdefault(view.key_of(event), len(slot_of)) for event in events]
        self.keys = list(slot_of)
        self.values = np.empty((len(self.keys), len(view.reader.features)))
        self.stamps = np.empty(len(self.keys))
        self.misses: list[int] = []
        stalest_s = 0.0
        whole = view.whole.current(now_s) if use_cache and view.whole is not None else None
        kept: dict[tuple, int] = whole[0].index if whole is not None else {}
        # A whole view that holds every stored entity answers for the absent ones too.
        complete = whole is not None and whole[0].complete
        slots, rows, absent, nulls = [], [], [], []
        for index, key in enumerate(self.keys):
            row = kept.get(key)
            if row is not None:
                slots.append(index)
                rows.append(row)
                continue
            if complete:
                absent.append(index)
                continue
            cached = view.cache.get(key) if use_cache else None
            if cached is None:
                if has_null(key):  # absent, as a whole view answers it: never read
                    nulls.append(index)
                else:
                    self.misses.append(index)
                continue
            self.values[index], self.stamps[index], staleness_s = cached
            stalest_s = max(stalest_s, staleness_s)
        if rows or absent:
            whole_rows, staleness_s = whole
            if len(rows) == len(self.keys):  # the usual batch: every row from the whole view
                self.values = whole_rows.rows.values[rows]
                self.stamps = whole_rows.rows.event_ts_s[rows]
            else:
                self.values[slots] = whole_rows.rows.values[rows]
                self.stamps[slots] = whole_rows.rows.event_ts_s[rows]
                self.values[absent] = np.nan
                self.stamps[absent] = np.nan
            stalest_s = max(stalest_s, staleness_s)
        if nulls:
            self.values[nulls] = np.nan
            self.stamps[nulls] = np.nan
        if metered:
            view.hits.inc(len(self.keys) - len(self.misses) - len(nulls))
            view.staleness.observe(stalest_s)

    def read_misses(self, wait: bool = True) -> Any:
        """Blocking: the store's rows of the misses (`wait`: see `OnlineViewReader.read`)."""
        started = time.perf_counter()
        fresh = self.view.reader.read([self.keys[i] for i in self.misses], wait)
        self.view.read_seconds.observe(time.perf_counter() - started)
        return fresh

    def fill(self, fresh: Any) -> None:
        cache = self.view.cache
        evicted = cache.evictions
        for row, index in enumerate(self.misses):
            self.values[index], self.stamps[index] = fresh.values[row], fresh.event_ts_s[row]
            cache.put(self.keys[index], fresh.values[row].copy(), fresh.event_ts_s[row])
        self.view.evictions.inc(cache.evictions - evicted)

    def values_at(self, now_s: float) -> np.ndarray:
        """(keys, features) values, rows older than the view's TTL blanked (NaN)."""
        ttl_s = self.view.reader.ttl_s
        if ttl_s is not None:
            expired = now_s - self.stamps > ttl_s
            if expired.any():
                self.view.expired.inc(int(expired.sum()))
                self.values[expired] = np.nan
        return self.values


def _read_misses(parts: list[_ViewRead]) -> list:
    return [part.read_misses() for part in parts]
