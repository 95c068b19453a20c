"""A chunk the Faust runtime fetched before an assignment's seek is never answered:
its records are fetched again from the seek's positions (answered from both, they were
answered twice under exactly-once, after a broker crash)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from streams.consumers.faust_feed import FEED_CHUNKS, Chunk, FeedApp


class Consumer:
    def __init__(self) -> None:
        self.seeks = 1
        self._unacked_messages: set = set()

    def track(self, messages: list) -> None:
        self._unacked_messages.update(messages)


def feed_app() -> SimpleNamespace:
    """What `FeedApp.take` and `FeedApp.unfinished` use of the app: its feeds and consumer."""
    return SimpleNamespace(feeds={"in": asyncio.Queue(maxsize=FEED_CHUNKS)}, consumer=Consumer())


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
