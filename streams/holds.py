"""Records waiting for their writer schema, held per partition: a registry that cannot
answer now stalls only the partitions that need it.

Order matters only within a partition. A record whose schema id is not resolved yet
holds back its partition (it and every later record of that partition, in offset
order) and nothing else: records of other partitions go on at once. Each id met is
looked up at once (the runner's decode stage, on a thread); a lookup that fails (the
registry unreachable) is tried again after a capped exponential backoff, for as long
as it takes. When the id resolves, the partition's records go on in order.

A partition whose first held record's lookup failed is *stalled* (the runner logs it
once, and once when it flows again). A held partition is *paused* (its consumer stops
fetching it) once it is stalled or holds `pause_at` records, so an outage fills
neither memory nor the pipeline's in-flight bound, and a lookup that answers in
milliseconds pauses nothing. It resumes when its last held record is released.

Pure policy: the clock is passed in; the runner looks ids up, decodes, and pauses.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from streams.records import InputRecord

Partition = tuple[str, int]
"""(topic, partition)"""

# First retry of a failed lookup after this, doubling up to the cap.
LOOKUP_BACKOFF_S = (0.2, 5.0)


@dataclass
class _Lookup:
    due_s: float
    failures: int = 0
    error: BaseException | None = None


@dataclass
class _Hold:
    records: deque[tuple[InputRecord, Any, int | None]] = field(default_factory=deque)
    stalled_s: float | None = None
    """When its first held record's lookup first failed; None: not stalled."""
    paused: bool = False
    held: int = 0
    """Records held since the hold began."""


@dataclass
class Stall:
    partition: Partition
    schema_id: int
    error: BaseException | None


@dataclass
class Flowing:
    partition: Partition
    stalled_s: float
    """How long it was stalled."""
    held: int


@dataclass
class Changes:
    """What `add`, `release` and `give_up` decided, for the runner to carry out."""

    ready: list[tuple[InputRecord, Any]] = field(default_factory=list)
    """Records (with handles) free to decode, in order per partition."""
    pause: list[Partition] = field(default_factory=list)
    resume: list[Partition] = field(default_factory=list)
    stalled: list[Stall] = field(default_factory=list)
    flowing: list[Flowing] = field(default_factory=list)


class PartitionHolds:
    def __init__(
        self,
        pause_at: int,
        backoff_s: tuple[float, float] = LOOKUP_BACKOFF_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._pause_at = pause_at
        self._first_s, self._cap_s = backoff_s
        self._clock = clock
        self._holds: dict[Partition, _Hold] = {}
        self._lookups: dict[int, _Lookup] = {}
        """Ids some held record waits for."""

    def __bool__(self) -> bool:
        return bool(self._holds)

    @property
    def held(self) -> int:
        """Records held now, over every partition."""
        return sum(len(hold.records) for hold in self._holds.values())

    @property
    def stalled(self) -> int:
        return sum(hold.stalled_s is not None for hold in self._holds.values())

    def add(
        self, records: Sequence[InputRecord], handles: Sequence[Any], ids: Sequence[int | None]
    ) -> Changes:
        """Take a consumed chunk: `ids` names, per record, the schema id it waits for (None:
        resolved). Returns the records free to decode now; holds the rest."""
        changes = Changes()
        holds, lookups, now = self._holds, self._lookups, self._clock()
        touched: set[Partition] = set()
        for record, handle, schema_id in zip(records, handles, ids, strict=True):
            key = (record.topic, record.partition)
            hold = holds.get(key)
            if hold is None:
                if schema_id is None:
                    changes.ready.append((record, handle))
                    continue
                hold = holds[key] = _Hold()
            if schema_id is not None and schema_id not in lookups:
                lookups[schema_id] = _Lookup(now)
            hold.records.append((record, handle, schema_id))
            hold.held += 1
            touched.add(key)
        for key in touched:
            hold = holds[key]
            if not hold.paused and len(hold.records) >= self._pause_at:
                hold.paused = True
                changes.pause.append(key)
        return changes

    def due(self) -> set[int]:
        """The ids to look up now: never tried, or failed and past their backoff."""
        now = self._clock()
        return {i for i, lookup in self._lookups.items() if lookup.due_s <= now}

    def next_due_s(self) -> float | None:
        """Seconds until the next lookup is due; None when no id is waited for."""
        if not self._lookups:
            return None
        return max(0.0, min(lookup.due_s for lookup in self._lookups.values()) - self._clock())

    def looked_up(self, ids: Iterable[int], failed: Mapping[int, BaseException]) -> None:
        """Record a lookup round: `failed` ids back off, the others are resolved."""
        now = self._clock()
        for schema_id in ids:
            lookup = self._lookups.get(schema_id)
            if lookup is None:
                continue
            error = failed.get(schema_id)
            if error is None:
                del self._lookups[schema_id]
                continue
            lookup.failures += 1
            lookup.error = error
            lookup.due_s = now + min(self._cap_s, self._first_s * 2 ** (lookup.failures - 1))

    def release(self) -> Changes:
        """Free each partition's held records up to the first whose id is unresolved;
        note the partitions that stall, pause, resume or flow again."""
        changes = Changes()
        lookups, now = self._lookups, self._clock()
        for key, hold in list(self._holds.items()):
            records = hold.records
            while records and (records[0][2] is None or records[0][2] not in lookups):
                record, handle, _ = records.popleft()
                changes.ready.append((record, handle))
            if not records:
                self._end(key, changes, now)
                continue
            schema_id = records[0][2]
            lookup = lookups[schema_id]
            if lookup.failures and hold.stalled_s is None:
                hold.stalled_s = now
                changes.stalled.append(Stall(key, schema_id, lookup.error))
            if hold.stalled_s is not None and not hold.paused:
                hold.paused = True
                changes.pause.append(key)
        return changes

    def give_up(self, partitions: Iterable[Partition] | None = None) -> Changes:
        """Drop the holds of `partitions` (None: all): their records go unanswered and
        unacknowledged (`Changes.ready` lists them); whoever calls owns their fetching
        from here on (no resume is noted)."""
        changes = Changes()
        keys = list(self._holds) if partitions is None else list(partitions)
        now = self._clock()
        for key in keys:
            hold = self._holds.pop(key, None)
            if hold is None:
                continue
            changes.ready.extend((record, handle) for record, handle, _ in hold.records)
            if hold.stalled_s is not None:
                changes.flowing.append(Flowing(key, now - hold.stalled_s, hold.held))
        waited = {i for hold in self._holds.values() for _, _, i in hold.records}
        for schema_id in set(self._lookups) - waited:
            del self._lookups[schema_id]
        return changes

    def _end(self, key: Partition, changes: Changes, now: float) -> None:
        hold = self._holds.pop(key)
        if hold.paused:
            changes.resume.append(key)
        if hold.stalled_s is not None:
            changes.flowing.append(Flowing(key, now - hold.stalled_s, hold.held))
