"""The bare consumer's check that librdkafka gave up the partitions of a lapsed session:
a new member id with no release since ends the worker."""

from __future__ import annotations

import pytest

from streams.membership import Membership, PartitionsKept
from streams.transact import group_metadata


def member(member_id: str, generation: int = 3) -> bytes:
    return group_metadata("g", generation, member_id, "worker-1")


def test_a_new_member_id_without_a_release_means_the_partitions_were_kept():
    membership = Membership()
    membership.assigned(member("m1"), holding=True)
    membership.check(member("m1", generation=9))  # rebalances keep the member id
    membership.check(member(""))  # the session lapsed: joining again, nothing to tell yet
    with pytest.raises(PartitionsKept, match=r"\(m1 -> m2\).*restart the worker"):
        membership.check(member("m2"))
    with pytest.raises(PartitionsKept):
        membership.assigned(member("m2"), holding=True)  # an assignment does not hide it


def test_a_new_member_id_after_a_release_is_expected():
    membership = Membership()
    membership.assigned(member("m1"), holding=True)
    membership.released()  # librdkafka's lost-assignment callback
    membership.check(member("m2"))
    membership.assigned(member("m2"), holding=True)
    with pytest.raises(PartitionsKept):
        membership.check(member("m3"))


def test_a_consumer_holding_nothing_keeps_nothing():
    membership = Membership()
    membership.check(member("m1"))  # before the first assignment
    membership.assigned(member("m1"), holding=False)  # more workers than partitions
    membership.check(member("m2"))
    membership.assigned(member("m2"), holding=True)
    membership.released()  # its last partitions revoked
    membership.assigned(member("m3"), holding=True)


def test_an_assignment_made_with_no_member_id_was_kept():
    membership = Membership()
    membership.assigned(member("m1"), holding=True)
    membership.released()
    # Its session lapsed while this assignment waited for the callback: librdkafka
    # skipped the lost-assignment callback.
    with pytest.raises(PartitionsKept, match=r"\(none -> none\)"):
        membership.assigned(member(""), holding=True)
    membership.assigned(member(""), holding=False)  # nothing held: nothing kept
