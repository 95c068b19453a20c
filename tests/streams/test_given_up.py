"""Exactly-once, both runtimes: partitions the group took away (a lapsed session) with
answers not yet committed are given up, not the worker; they come back only once every
record taken from them before is left out."""

from __future__ import annotations

import asyncio
import queue
from collections import Counter
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
from confluent_kafka import TopicPartition
from faust.types import TP

from streams.consumers import confluent, faust_transactions
from streams.consumers.confluent import BareConsumer
from streams.consumers.faust_transactions import LostPartitions
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


# The Faust runtime (`LostPartitions`): aiokafka revokes once the group dropped the worker.
FA, FB = TP("in", 0), TP("in", 1)


@dataclass(eq=False)
class Message:
    tp: TP
    offset: int
    acked: bool = False


def lost_partitions() -> tuple[LostPartitions, Transactions, list[BaseException]]:
    publisher, fatal = Transactions(), []
    lost = LostPartitions(publisher, lambda error, _records: fatal.append(error))
    return lost, publisher, fatal


def test_records_of_partitions_given_up_are_left_out_and_no_longer_fetched():
    lost, publisher, _ = lost_partitions()
    taken = [Message(FA, 1), Message(FB, 7)]
    lost.give_up({FA}, taken)
    assert publisher.given_up == {("in", 0)}
    queued = [Message(FA, 2), Message(FB, 8)]
    assert lost.dropped(queued) == [queued[1]]


async def test_a_partition_given_up_comes_back_once_what_was_taken_from_it_is_acknowledged():
    lost, publisher, fatal = lost_partitions()
    taken = [Message(FA, 1), Message(FA, 2)]
    lost.give_up({FA, FB}, taken)
    back = asyncio.ensure_future(lost.take_back({FA, FB}))
    await asyncio.sleep(0.05)
    assert not back.done()  # its records are still in the runner: they must go first
    for message in taken:
        message.acked = True  # left out by a transaction attempt
    await asyncio.wait_for(back, 5)
    assert fatal == []
    assert publisher.given_up == set()
    assert lost.partitions == set()
    assert lost.dropped([Message(FA, 3)]) != []


async def test_a_partition_not_assigned_again_stays_given_up():
    lost, publisher, _ = lost_partitions()
    lost.give_up({FA, FB}, [])
    await asyncio.wait_for(lost.take_back({FB}), 5)
    assert publisher.given_up == {("in", 0)}
    assert lost.partitions == {FA}


async def test_records_still_in_flight_when_their_partition_returns_end_the_worker(
    monkeypatch: pytest.MonkeyPatch,
):
    monkeypatch.setattr(faust_transactions, "LOST_WAIT_S", 0.1)
    lost, publisher, fatal = lost_partitions()
    lost.give_up({FA}, [Message(FA, 1, acked=True), Message(FA, 2)])
    await asyncio.wait_for(lost.take_back({FA}), 5)
    # A new record of A left out with the old one would be lost: end instead.
    assert [type(error) for error in fatal] == [UnfinishedRevoke]
    assert "1 records" in str(fatal[0])
    assert publisher.given_up == {("in", 0)}
