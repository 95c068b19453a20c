"""A chunk the Faust runtime fetched before an assignment's seek is never answered:
its records are fetched again from the seek's positions (answered from both, they were
answered twice under exactly-once, after a broker crash). Nor are records behind records
given up to the schema registry at a rebalance: answered, they would be committed past
them (with exactly-once, the records given up were then never answered)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import NamedTuple

from faust.types import TP

from streams.consumers.faust_feed import FEED_CHUNKS, BulkConsumer, Chunk, FeedApp
from streams.consumers.faust_transactions import LostPartitions


class Consumer:
    def __init__(self) -> None:
        self.seeks = 1
        self._unacked_messages: set = set()
        self.given_up = BulkConsumer.given_up

    def track(self, messages: list) -> None:
        self._unacked_messages.update(messages)


def feed_app(lost: LostPartitions | None = None) -> SimpleNamespace:
    """What `FeedApp.take` and `FeedApp.unfinished` use of the app: its feeds and consumer,
    and with exactly-once the partitions given up (`lost`)."""
    queue = asyncio.Queue(maxsize=FEED_CHUNKS)
    return SimpleNamespace(feeds={"in": queue}, consumer=Consumer(), lost=lost)


def test_a_chunk_fetched_before_the_last_seek_is_dropped_and_the_next_taken():
    async def scenario() -> None:
        app = feed_app()
        await app.feeds["in"].put(Chunk(["a-132", "a-133"], seeks=1))
        app.consumer.seeks = 2  # a rebalance: the assignment's seek to the committed offsets
        await app.feeds["in"].put(Chunk(["a-132", "a-133", "a-134"], seeks=2))  # fetched again
        assert FeedApp.unfinished(app) == ["a-132", "a-133", "a-134"]
        taken = await asyncio.wait_for(FeedApp.take(app, "in"), 5)
        assert taken == ["a-132", "a-133", "a-134"]
        assert app.consumer._unacked_messages == {"a-132", "a-133", "a-134"}
        assert app.feeds["in"].empty()

    asyncio.run(scenario())


def test_a_chunk_of_the_current_assignment_is_taken_and_tracked():
    async def scenario() -> None:
        app = feed_app()
        await app.feeds["in"].put(Chunk(["b-7"], seeks=1))
        assert await asyncio.wait_for(FeedApp.take(app, "in"), 5) == ["b-7"]
        assert app.consumer._unacked_messages == {"b-7"}

    asyncio.run(scenario())


class Message(NamedTuple):
    tp: tuple[str, int]
    offset: int


def test_records_behind_records_given_up_to_the_registry_wait_for_the_next_seek():
    held, later, other = Message(("in", 0), 7), Message(("in", 0), 13), Message(("in", 1), 4)

    async def give_up() -> list[Message]:  # a runner's records waiting for the registry
        return [held]

    async def scenario() -> None:
        app = feed_app()
        consumer = object.__new__(BulkConsumer)  # what `wait_empty` uses of Faust's consumer
        consumer.app = SimpleNamespace(
            holders=[give_up],
            on_unfinished=lambda left: None,
            conf=SimpleNamespace(broker_session_timeout=10.0),
        )
        consumer.seeks, consumer._unacked_messages = 1, {held}
        await consumer.wait_empty()  # a rebalance: partition 0 gives up offset 7
        assert consumer._unacked_messages == set()
        app.consumer.given_up = consumer.given_up
        # Queued before the rebalance paused fetching, taken while it settles.
        await app.feeds["in"].put(Chunk([later, other], seeks=1))
        assert await asyncio.wait_for(FeedApp.take(app, "in"), 5) == [other]
        app.consumer.seeks = 2  # the assignment's seek to the committed offsets
        await app.feeds["in"].put(Chunk([held, later], seeks=2))  # fetched again from 7
        assert await asyncio.wait_for(FeedApp.take(app, "in"), 5) == [held, later]
        assert app.consumer._unacked_messages == {other, held, later}

    asyncio.run(scenario())


def test_records_of_partitions_the_group_took_away_are_neither_taken_nor_waited_for():
    taken, queued, other = Message(TP("in", 0), 7), Message(TP("in", 0), 8), Message(TP("in", 1), 4)
    publisher = SimpleNamespace(give_up=lambda partitions: list(partitions))

    async def scenario() -> None:
        app = feed_app(LostPartitions(publisher, on_fatal=lambda error, records: None))
        app.consumer.track([taken])
        app.lost.give_up({TP("in", 0)}, [taken])  # a lapsed session, under exactly-once
        app.consumer._unacked_messages.discard(taken)
        # Queued before the revoke, taken while it settles: fetched again after the seek.
        await app.feeds["in"].put(Chunk([queued, other], seeks=1))
        assert FeedApp.unfinished(app) == [other]
        assert await asyncio.wait_for(FeedApp.take(app, "in"), 5) == [other]
        assert app.consumer._unacked_messages == {other}

    asyncio.run(scenario())


def test_records_held_after_the_first_give_up_are_given_up_as_they_come():
    # Taken from a chunk queued before the rebalance, held for the registry after the
    # first give-up: the wait for acknowledgements would otherwise never end.
    later = Message(("in", 2), 9)
    asked = []

    async def give_up() -> list[Message]:
        asked.append(len(asked))
        return [later] if len(asked) == 2 else []

    async def scenario() -> None:
        consumer = object.__new__(BulkConsumer)
        consumer.app = SimpleNamespace(
            holders=[give_up],
            on_unfinished=lambda left: None,
            conf=SimpleNamespace(broker_session_timeout=60.0),
        )
        consumer.seeks, consumer._unacked_messages = 1, {later}
        consumer._stopped, consumer._crashed = asyncio.Event(), asyncio.Event()
        await asyncio.wait_for(consumer.wait_empty(), 5)
        assert consumer._unacked_messages == set()
        assert consumer.given_up == (1, frozenset({("in", 2)}))

    asyncio.run(scenario())


def test_the_offsets_after_a_partitions_first_record_that_hold_no_record_are_a_gap():
    # Offset 0, then an aborted transaction's records and marker (1 to 3), then 4: the
    # gap is committed past, or commits stop at offset 1 for the rest of the run.
    gaps = []

    async def add_gap(tp, first: int, last: int) -> None:
        gaps.append((tp, first, last))

    async def scenario() -> None:
        consumer = object.__new__(BulkConsumer)
        consumer._add_gap, consumer.seeks, consumer._read_offset = add_gap, 1, {}
        consumer.app = SimpleNamespace(
            topics=SimpleNamespace(acks_enabled_for=lambda _: True), consumer_generation_id=1
        )
        first, after = Message(TP("in", 0), 0), Message(TP("in", 0), 4)
        consumer._read_offset[TP("in", 0)] = None
        assert await consumer._in_order(TP("in", 0), [first, after], 1) == [first, after]
        assert gaps == [(TP("in", 0), 1, 3)]

    asyncio.run(scenario())


class Thread:
    """What `BulkConsumer.seek_to_committed` uses of Faust's consumer thread: its seek,
    which leaves out the partitions an open transaction holds (`held`)."""

    def __init__(self, held_per_seek: list[frozenset]) -> None:
        self._held_per_seek = held_per_seek
        self.held: frozenset = frozenset()
        self.seeking = 0
        self.overlapped = False

    async def seek_to_committed(self) -> dict:
        self.seeking += 1
        self.overlapped |= self.seeking > 1
        held = self._held_per_seek.pop(0)
        await asyncio.sleep(0.01)  # the stable offsets, read on a thread
        self.held = held  # one attribute for every seek
        self.seeking -= 1
        return {}


def test_seeks_made_at_once_run_one_after_the_other_each_with_its_own_held_partitions():
    """After a rejoin Faust seeks twice at once. A partition the first seek found held and
    the second did not must end sought and fetched, not paused for good; and neither seek
    may take the other's held partitions for its own."""
    p1 = TP("in", 1)
    paused, resumed = set(), set()

    async def wait_for_good(_held) -> None:
        await asyncio.Event().wait()  # until cancelled by the next seek

    async def scenario() -> None:
        consumer = object.__new__(BulkConsumer)
        consumer.app = SimpleNamespace(lost=None)
        consumer._thread = Thread([frozenset({p1}), frozenset()])
        consumer._seeking, consumer.seeks = asyncio.Lock(), 0
        consumer.pause_partitions = paused.update
        consumer.resume_partitions = resumed.update
        consumer._seek_once_stable = wait_for_good
        await asyncio.gather(consumer.seek_to_committed(), consumer.seek_to_committed())
        assert not consumer._thread.overlapped
        assert consumer.seeks == 2
        assert paused == {p1} and resumed == {p1}  # held by the first, sought by the second
        assert consumer._stabilizing is None

    asyncio.run(scenario())
