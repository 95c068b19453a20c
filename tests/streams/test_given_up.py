"""Exactly-once on the bare runtime: partitions the group took away (a lapsed session)
with answers not yet committed are given up, not the worker; they come back only once
every record taken from them before is left out."""

from __future__ import annotations

import queue
from collections import Counter
from types import SimpleNamespace

from confluent_kafka import TopicPartition

from streams.consumers import confluent
from streams.consumers.confluent import BareConsumer
from streams.transact import UnfinishedRevoke

A, B = ("in", 0), ("in", 1)


class Transactions:
    def __init__(self) -> None:
        self.given_up: set[tuple[str, int]] = set()

    def give_up(self, partitions) -> None:
        self.given_up.update(partitions)

    def take_back(self, partitions) -> None:
        self.given_up.difference_update(partitions)


def consumer_with(unwritten: dict[tuple[str, int], int]) -> tuple[BareConsumer, list]:
    """What losing and regaining partitions use of the consumer; the fatal errors."""
    fatal: list[BaseException] = []
    bare = object.__new__(BareConsumer)
    bare._health = SimpleNamespace(revoked=lambda: None, turned=lambda: None)
    bare._revoked_in_poll = set()
    bare._give_up_held = lambda revoked: None
    bare._closing = lambda: False
    bare._unwritten = Counter(unwritten)
    bare._given_up = set()
    bare._transactions = Transactions()
    bare._on_fatal = lambda error, _records: fatal.append(error)
    bare._calls = queue.SimpleQueue()
    return bare, fatal


def acked(bare: BareConsumer, where: tuple[str, int], count: int) -> None:
    """A batch's acknowledgement, queued for the poll thread as the runners queue it."""
    bare._calls.put(lambda: bare._unwritten.subtract({where: count}))


def lost(*partitions: tuple[str, int]) -> list[TopicPartition]:
    return [TopicPartition(topic, partition) for topic, partition in partitions]


def test_a_lost_partition_with_answers_not_committed_is_given_up_not_the_worker():
    bare, fatal = consumer_with({A: 3, B: 0})
    bare._finish(lost(A, B), timeout_s=0.0, give_up=True)
    assert fatal == []
    assert bare._transactions.given_up == {A}  # B had nothing left
    assert bare._unwritten[A] == 3  # counted down as its answers are left out


def test_a_partition_given_up_comes_back_once_what_was_taken_from_it_is_left_out():
    bare, fatal = consumer_with({A: 3})
    bare._finish(lost(A), timeout_s=0.0, give_up=True)
    acked(bare, A, 2)
    acked(bare, A, 1)
    bare._take_back([A, B])
    assert fatal == []
    assert bare._transactions.given_up == set()
    assert bare._calls.empty()
    assert A not in bare._unwritten


def test_a_partition_given_up_whose_records_are_still_in_flight_ends_the_worker_at_its_return(
    monkeypatch,
):
    monkeypatch.setattr(confluent, "LOST_WAIT_S", 0.1)
    bare, fatal = consumer_with({A: 3})
    bare._finish(lost(A), timeout_s=0.0, give_up=True)
    acked(bare, A, 2)
    bare._take_back([A])
    # A new record of A left out with the old ones would be lost: end instead.
    assert [type(error) for error in fatal] == [UnfinishedRevoke]
    assert bare._transactions.given_up == {A}


def test_a_revoked_partition_with_answers_not_committed_still_ends_the_worker():
    bare, fatal = consumer_with({A: 3})
    bare._finish(lost(A), timeout_s=0.0)
    assert [type(error) for error in fatal] == [UnfinishedRevoke]
    assert bare._transactions.given_up == set()
