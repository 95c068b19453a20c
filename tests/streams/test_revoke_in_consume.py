"""The bare runtime takes a poll's first record, then what is already fetched after it.
A revoke librdkafka serves in between finishes its partitions (waits for what was
handed over, commits) without that first record: a record of a revoked partition is
then not answered here, where its offset could no longer be stored (a repeat by its
next owner) or, with exactly-once, would be committed for a partition that has gone."""

from __future__ import annotations

import queue
from collections import Counter
from types import SimpleNamespace

from confluent_kafka import TopicPartition

from streams.consumers.confluent import BareConsumer


class Record:
    def __init__(self, partition: int, offset: int) -> None:
        self._partition, self.offset = partition, offset

    def topic(self) -> str:
        return "in"

    def partition(self) -> int:
        return self._partition

    def error(self) -> None:
        return None


def bare_consumer(consume) -> BareConsumer:
    """What `_with_what_is_here` and a revoke's `_finish` use of the consumer."""
    bare = object.__new__(BareConsumer)
    bare._consumer = SimpleNamespace(consume=consume)
    bare._max_chunk, bare._revoked_in_poll = 64, set()
    bare._health = SimpleNamespace(revoked=lambda: None, turned=lambda: None)
    bare._poller = None  # not this thread: the close (nothing held to give up)
    bare._unwritten, bare._calls, bare._transactions = Counter(), queue.Queue(), None
    return bare


def test_records_of_a_partition_revoked_while_they_were_taken_are_not_handed_over():
    first, kept = Record(0, 41), Record(1, 7)

    def consume(_count, _timeout):  # librdkafka serves partition 0's revoke in here
        bare._finish([TopicPartition("in", 0)], 0.0)
        return [kept]

    bare = bare_consumer(consume)
    assert bare._with_what_is_here(first) == [kept]


def test_without_a_revoke_everything_fetched_is_handed_over_in_order():
    first, rest = Record(0, 41), [Record(0, 42), Record(1, 7)]
    bare = bare_consumer(lambda _count, _timeout: rest)
    bare._revoked_in_poll.add(("in", 0))  # a revoke of an earlier poll: not this one's
    assert bare._with_what_is_here(first) == [first, *rest]


def test_the_close_after_a_drain_ran_out_of_time_leaves_at_once():
    """The runners are stopped: what they still held is never written. A revoke inside
    the close waited for it a whole session (6 s), past the 5 s the drain deadline keeps
    for the close: exit 70 before the group was left. Exactly-once ended the worker."""
    bare = bare_consumer(consume=None)
    bare._poller = object()  # the poll thread, gone: this is the close
    bare._unwritten[("in", 0)] = 3

    def waited(*_args, **_kwargs):
        raise AssertionError("waited for acknowledgements at the close")

    fatal = []
    bare._calls = SimpleNamespace(get=waited)
    bare._transactions, bare._on_fatal = object(), lambda error, _records: fatal.append(error)
    bare._finish([TopicPartition("in", 0)], 6.0)
    assert fatal == []
    assert ("in", 0) not in bare._unwritten
