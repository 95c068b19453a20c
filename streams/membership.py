"""Noticing that librdkafka kept partitions its group took away (the bare runtime).

When a consumer's group session lapses (the process frozen, the coordinator out of
reach), librdkafka forgets its member id and hands its partitions back through the
lost-assignment callback before it joins again; the next owner reads them from the
committed offsets. It skips that callback when the lapse comes while a rebalance is
under way (`rd_kafka_cgrp_revoke_all_rejoin_maybe`, librdkafka 2.x): the consumer joins
again as a new member still holding its partitions, their fetch positions and what it
fetched from them, and the group may leave them with it, with no callback at all.
Meanwhile another member answered them and committed; this one answers them again from
where it stood, and under exactly-once its next transaction commits its older offsets
under the new generation, which the group takes. Seen here once: a worker frozen for
10 s during a rebalance answered 845 inputs a second time.

So under exactly-once the consumer remembers the member id its partitions were assigned
under (at least once marks what a lapsed session may repeat: `streams/freeze.py`). Another
member id with no lost-assignment callback since, or an assignment made while it has no
member id at all (its membership lapsed while the assignment waited for the callback),
means librdkafka kept them, and the worker ends (exit 70) before it commits anything
more: a restarted worker starts from the committed offsets. The consumer checks at each
assignment and revoke, every `CHECK_EVERY_S` while it polls, and whenever it reads its
group metadata for a transaction. A transaction's cached metadata names the old member:
the group takes it only while it still has that member at that generation (nothing
moved), and otherwise refuses it, and the retry reads the metadata again, checked.
"""

from __future__ import annotations

from schemas.errors import HeadraceError
from streams.transact import member_identity

# How often the poll thread compares the member id (a read costs ~40 us).
CHECK_EVERY_S = 0.1


class PartitionsKept(HeadraceError):
    """The consumer's membership lapsed and librdkafka kept its partitions (see the
    module docstring)."""

    def __init__(self, was: bytes | None, now: bytes) -> None:
        change = f"{_named(was)} -> {_named(now)}"
        super().__init__(
            f"the consumer's group session lapsed and its member id changed ({change}) "
            "without it giving up its partitions (librdkafka skips the lost-assignment "
            "callback when the session lapses during a rebalance): what it answers from "
            "them now may repeat another member's answers; hint: restart the worker (it "
            "reads the committed offsets); a worker stalled past session_timeout_ms, by "
            "the machine or by a long pause, is what lets the session lapse"
        )


def _named(member_id: bytes | None) -> str:
    return member_id.decode(errors="replace") if member_id else "none"


class Membership:
    """The member id of the consumer's current assignment. Used by the thread that owns
    the consumer: the poll thread, or the event loop's once that has ended (the close)."""

    def __init__(self) -> None:
        self._assigned_under: bytes | None = None

    def assigned(self, metadata: bytes, holding: bool) -> None:
        """Partitions were assigned (`metadata`: the consumer's now; `holding`: whether
        it holds any now): PartitionsKept where the member id changed since the last
        assignment with no release between, or where it has none while it holds
        partitions (its membership lapsed while this assignment waited)."""
        self.check(metadata)
        identity = member_identity(metadata)
        if not holding:
            self._assigned_under = None  # nothing to keep: a new member id is harmless
        elif identity is not None and not identity[1]:
            raise PartitionsKept(self._assigned_under, identity[1])
        elif identity is not None:
            self._assigned_under = identity[1]

    def released(self) -> None:
        """The consumer holds no partition any more (librdkafka's lost-assignment
        callback, or a revoke of all it held): a new member id is expected next."""
        self._assigned_under = None

    def check(self, metadata: bytes) -> None:
        """PartitionsKept where `metadata` names another member than the assignment's."""
        identity = member_identity(metadata)
        if identity is None or self._assigned_under is None:
            return
        member = identity[1]
        if member and member != self._assigned_under:
            raise PartitionsKept(self._assigned_under, member)
