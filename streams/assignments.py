"""Which of its partition's assignments each consumed record was read under.

A worker counts, per input partition, the times the partition left it (revoked, or
lost when its group session lapsed: a broker outage longer than the session, a frozen
process). Each record is stamped with that count (`InputRecord.epoch`) when it is read,
so one read before its partition left is stale from then on, even when the partition
comes back and the same offsets are read again.

Under exactly-once the transactional publisher leaves stale records out of every
transaction it begins after they went stale, their outcomes and their offsets: the
partition's next owner (this worker again, maybe) reads them from the committed offset
and answers them once. So a worker whose partitions went while answers to them were
still uncommitted goes on serving instead of ending. A transaction that sent a stale
record's offset before its partition left, while the group still took it, may commit:
its next owner's offset fetch waits for that transaction (a stable read), so it starts
after what it committed.

Partitions leave in the consumer's rebalance callbacks, which run before the consumer
joins the group again; so group metadata of the new generation is only ever read after
the count moved, and a transaction that reads it sees the records gone stale.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from streams.records import InputRecord

Partition = tuple[str, int]


class Assignments:
    """Per input partition, how many times it left this worker. Written by the thread that
    runs the consumer's rebalance callbacks, read anywhere (a dict read is atomic)."""

    def __init__(self) -> None:
        self._left: dict[Partition, int] = {}

    def current(self) -> Mapping[Partition, int]:
        """A copy of the counts, for stamping what one fetch read (0 where absent)."""
        return dict(self._left)

    def epoch(self, topic: str, partition: int) -> int:
        return self._left.get((topic, partition), 0)

    def leave(self, partitions: Iterable[Partition]) -> None:
        """`partitions` left this worker: every record read from them so far is stale."""
        for where in partitions:
            self._left[where] = self._left.get(where, 0) + 1

    def stale(self, record: InputRecord) -> bool:
        return record.epoch != self._left.get((record.topic, record.partition), 0)
