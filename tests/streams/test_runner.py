"""The runner with fake stages and a fake clock: batches leave in order, a batch is
acknowledged only after its outcomes are published, transient failures are retried,
and anything else stops the worker without acknowledging."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from features.errors import FeatureStoreError
from schemas.errors import RegistryError
from streams import metrics
from streams.admit import Route
from streams.backpressure import InFlight
from streams.config import PipelineConfig
from streams.errors import PublishError
from streams.pipeline import Prepared
from streams.records import InputRecord, Item
from streams.replay import Replay
from streams.runner import PipelineRunner
from tools.deploy import sample_config

pytestmark = pytest.mark.timeout(30)


class FakeDecoder:
    def needs_lookup(self, records) -> bool:
        return records[0].offset % 8 == 4  # every other chunk of 4 takes the slow path

    def lookup_ids(self, records):
        return [None] * len(records)

    def decode_known(self, records, handles):
        if any(record.value == b"bug" for record in records):
            raise TypeError("a bug in decoding")
        pairs = zip(records, handles, strict=True)
        return [Item(record, handle, deadline_s=1e12, event={}) for record, handle in pairs]


class FakePool:
    warmup_seconds = {1: 0.001}


class FakeModel:
    pool = FakePool()


class FakePipeline:
    """Records what each stage saw; `fail` maps a stage to the errors it raises first."""

    def __init__(self, fail: dict[str, list[BaseException]] | None = None) -> None:
        raw = sample_config("k:9092", Path("repo"), Path("m.onnx"), max_batch_size=4)
        raw["pipelines"][0].update(batching="fixed", max_wait_ms=0)
        self.config = PipelineConfig.model_validate(raw["pipelines"][0])
        self.metrics = metrics.PipelineMetrics("runner-test")
        self.model, self.fallback = FakeModel(), None
        self.fail = fail or {}
        self.published: list[list[int]] = []
        self.log: list[str] = []
        self.publishing = asyncio.Event()
        self.publishing.set()
        self.publish_called = asyncio.Event()
        self.changed = asyncio.Event()
        """Set whenever something is acked or the worker gives up."""

    def _maybe_fail(self, stage: str) -> None:
        errors = self.fail.get(stage)
        if errors:
            raise errors.pop(0)

    def prepare(self, items):
        for item in items:
            item.route = Route.FULL
        return Prepared(items, admitted=list(items), timings={"decode_us": 0})

    def route(self, items, estimates, features_read: bool = False) -> None:
        pass

    def done(self, prepared) -> None:
        pass

    async def read_features(self, prepared) -> None:
        self._maybe_fail("features")
        prepared.timings["features_us"] = 0

    async def infer(self, prepared) -> None:
        self._maybe_fail("infer")
        prepared.run_seconds[Route.FULL] = 0.001

    async def publish(self, prepared) -> None:
        self.publish_called.set()
        await self.publishing.wait()
        self._maybe_fail("publish")
        offsets = [item.record.offset for item in prepared.items]
        self.published.append(offsets)
        self.log.append(f"published {offsets}")


def chunk(first: int, count: int) -> list[InputRecord]:
    return [InputRecord("in", 0, o, 0, b"k", b"v") for o in range(first, first + count)]


def runner(pipeline: FakePipeline, acked: list, fatal: list, **options) -> PipelineRunner:
    def ack(handles) -> None:
        acked.append(list(handles))
        pipeline.log.append(f"acked {list(handles)}")
        pipeline.changed.set()

    def on_fatal(error, records):
        fatal.append((error, [r.offset for r in records]))
        pipeline.changed.set()
        raise asyncio.CancelledError  # ends the stage, as the real exit would end the process

    return PipelineRunner(
        pipeline, FakeDecoder(), InFlight("runner-test", 1000, 500), ack, on_fatal,
        clock=lambda: 1000.0, wall_clock=lambda: 1_800_000_000.0, retry_delays_s=(0, 0, 0),
        **options,
    )  # fmt: skip


async def wait_for(pipeline: FakePipeline, condition, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            pipeline.changed.clear()
            await pipeline.changed.wait()


async def test_batches_are_published_and_acked_in_order_each_after_its_publish():
    pipeline, acked, fatal = FakePipeline(), [], []
    run = runner(pipeline, acked, fatal)
    await run.start()
    for first in (0, 4, 8):
        records = chunk(first, 4)
        run.submit(records, [r.offset for r in records])
    await run.drain()
    await run.stop()
    assert pipeline.published == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert acked == pipeline.published
    # Every ack follows the publish of the same batch.
    for offsets in acked:
        assert pipeline.log.index(f"published {offsets}") < pipeline.log.index(f"acked {offsets}")
    assert run.in_flight.count == 0 and not fatal


async def test_inputs_answered_before_are_acked_in_order_and_marked_not_to_answer():
    pipeline, acked, fatal = FakePipeline(), [], []
    run = runner(pipeline, acked, fatal)
    await run.start()
    # A check of the newly assigned partition found 1, 2 and 5 answered by a worker
    # that stopped before committing them, and could not see earlier answers of 1..6;
    # partition 1 was checked and had nothing.
    run.answered_before({("in", 0): Replay(frozenset({1, 2, 5}), range(1, 7)), ("in", 1): Replay()})
    skipped, redelivered = [], []
    publish = pipeline.publish

    async def publish_noting_marks(prepared) -> None:
        for item in prepared.items:
            if item.answered_before:
                skipped.append(item.record.offset)
            if item.redelivered:
                redelivered.append(item.record.offset)
        await publish(prepared)

    pipeline.publish = publish_noting_marks
    for first in (0, 4, 8):
        records = chunk(first, 4)
        run.submit(records, [r.offset for r in records])
    # Read again after a seek back: the check's findings are spent once passed.
    again = chunk(0, 4)
    run.submit(again, [r.offset for r in again])
    await run.drain()
    await run.stop()
    assert skipped == [1, 2, 5]
    assert redelivered == [3, 4, 6]  # unchecked and not found answered
    # All acknowledged, in order, once.
    assert acked == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [0, 1, 2, 3]]
    assert not fatal


async def test_nothing_is_acked_while_its_publish_is_pending():
    pipeline, acked, fatal = FakePipeline(), [], []
    pipeline.publishing.clear()
    run = runner(pipeline, acked, fatal)
    await run.start()
    records = chunk(0, 4)
    run.submit(records, [r.offset for r in records])
    await asyncio.wait_for(pipeline.publish_called.wait(), 10)
    assert acked == [] and run.in_flight.count == 4
    pipeline.publishing.set()
    await wait_for(pipeline, lambda: acked == [[0, 1, 2, 3]])
    await run.stop()


async def test_transient_failures_are_retried_and_acked_once():
    fail = {
        "features": [FeatureStoreError("store down")],
        "publish": [PublishError("broker away"), PublishError("still away")],
    }
    pipeline, acked, fatal = FakePipeline(fail), [], []
    run = runner(pipeline, acked, fatal)
    await run.start()
    records = chunk(0, 4)
    run.submit(records, [r.offset for r in records])
    await run.drain()
    await run.stop()
    assert acked == [[0, 1, 2, 3]] and pipeline.published == [[0, 1, 2, 3]]
    assert not fatal


async def test_a_publish_retried_after_a_freeze_past_the_session_is_marked():
    pipeline, acked, fatal = FakePipeline(), [], []
    frozen = False
    attempts: list[list[bool]] = []
    publish = pipeline.publish

    async def publish_across_a_freeze(prepared) -> None:
        nonlocal frozen
        attempts.append([item.redelivered for item in prepared.items])
        if len(attempts) == 1:
            frozen = True  # frozen past the client's delivery timeout: the records failed
            raise PublishError("timed out")
        await publish(prepared)

    pipeline.publish = publish_across_a_freeze
    run = runner(pipeline, acked, fatal, unsure=lambda: frozen)
    await run.start()
    records = chunk(0, 4)
    run.submit(records, [r.offset for r in records])
    await run.drain()
    await run.stop()
    assert attempts == [[False] * 4, [True] * 4]
    assert acked == [[0, 1, 2, 3]] and not fatal


async def test_a_bug_stops_the_worker_without_acking_the_batch():
    pipeline, acked, fatal = FakePipeline({"infer": [ValueError("a bug")]}), [], []
    run = runner(pipeline, acked, fatal)
    await run.start()
    records = chunk(0, 4)
    run.submit(records, [r.offset for r in records])
    await wait_for(pipeline, lambda: fatal)
    await run.stop()
    (error, offsets), *_ = fatal
    assert isinstance(error, ValueError) and offsets == [0, 1, 2, 3]
    assert acked == []


class CommittingPipeline(FakePipeline):
    """Each batch's publish returns when its own transaction commits (`commit`)."""

    def __init__(self) -> None:
        super().__init__()
        self.entered: list[int] = []
        self.commit: dict[int, asyncio.Event] = {}

    async def publish(self, prepared) -> None:
        first = prepared.items[0].record.offset
        self.commit[first] = asyncio.Event()
        self.entered.append(first)
        self.changed.set()
        await self.commit[first].wait()
        self.published.append([item.record.offset for item in prepared.items])
        self.changed.set()


async def test_with_transactions_later_batches_are_handed_over_while_one_commits():
    pipeline, acked = CommittingPipeline(), []
    run = PipelineRunner(
        pipeline, FakeDecoder(), InFlight("runner-test", 1000, 500),
        lambda handles: (acked.append(list(handles)), pipeline.changed.set()),
        lambda error, records: pytest.fail(f"the worker gave up: {error!r}"),
        clock=lambda: 1000.0, wall_clock=lambda: 1_800_000_000.0, publish_ahead=4,
    )  # fmt: skip
    await run.start()
    for first in (0, 4, 8):
        records = chunk(first, 4)
        run.submit(records, [r.offset for r in records])
    # All three in the publisher at once, in order: one transaction may take them all.
    await wait_for(pipeline, lambda: pipeline.entered == [0, 4, 8])
    pipeline.commit[4].set()
    pipeline.commit[8].set()
    await wait_for(pipeline, lambda: len(pipeline.published) == 2)
    assert acked == []  # acknowledged in order: not before the batch ahead of them
    pipeline.commit[0].set()
    await run.drain()
    await run.stop()
    assert acked == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert run.in_flight.count == 0


async def test_retries_that_never_succeed_give_up_without_acking():
    pipeline, acked, fatal = FakePipeline({"publish": [PublishError("gone")] * 4}), [], []
    run = runner(pipeline, acked, fatal)
    await run.start()
    records = chunk(0, 4)
    run.submit(records, [r.offset for r in records])
    await wait_for(pipeline, lambda: fatal)
    await run.stop()
    assert isinstance(fatal[0][0], PublishError) and acked == []


async def test_a_bug_in_decoding_stops_the_worker_instead_of_reaching_the_consumer():
    pipeline, acked, fatal = FakePipeline(), [], []
    run = runner(pipeline, acked, fatal)
    await run.start()
    records = [InputRecord("in", 0, 0, 0, b"k", b"bug")]
    run.submit(records, [0])  # must not raise into the consumer (Faust would ack it)
    await wait_for(pipeline, lambda: fatal)
    await run.stop()
    assert isinstance(fatal[0][0], TypeError) and fatal[0][1] == [0]
    assert acked == []


class RegistryDecoder(FakeDecoder):
    """Records name their schema id in their value (b"7"); ids not known yet are looked
    up in a fake registry, which fails while `down`."""

    def __init__(self, changed: asyncio.Event, known: set[int]) -> None:
        self.changed = changed
        self.known = set(known)
        self.down = True
        self.attempts: list[int] = []

    def needs_lookup(self, records) -> bool:
        return any(i is not None for i in self.lookup_ids(records))

    def lookup_ids(self, records):
        return [None if int(r.value) in self.known else int(r.value) for r in records]

    async def resolve(self, ids):
        self.attempts += ids
        self.changed.set()
        if self.down:
            return {i: RegistryError(f"registry down for id {i}") for i in ids}
        self.known |= set(ids)
        return {}

    def decode_known(self, records, handles):
        unresolved = [r.offset for r in records if int(r.value) not in self.known]
        assert not unresolved, f"decoded before their ids resolved: {unresolved}"
        return super().decode_known(records, handles)


def records_of(partition: int, first: int, ids: list[int]) -> list[InputRecord]:
    return [InputRecord("in", partition, first + n, 0, b"k", b"%d" % i) for n, i in enumerate(ids)]


async def test_an_unresolvable_id_stalls_only_its_partition_which_flows_in_order_once_resolved():
    pipeline, acked, paused = FakePipeline(), [], []
    decoder = RegistryDecoder(pipeline.changed, known={1})

    def on_fatal(error, records):
        raise AssertionError(f"the worker gave up: {error!r}")

    run = PipelineRunner(
        pipeline, decoder, InFlight("runner-test", 1000, 500),
        lambda handles: (acked.extend(handles), pipeline.changed.set()), on_fatal,
        clock=time.monotonic, wall_clock=lambda: 1_800_000_000.0,
        pause=lambda *args: paused.append(args), lookup_backoff_s=(0.001, 0.01),
    )  # fmt: skip
    stalled = metrics.REGISTRY_STALLED.labels(pipeline.config.name)

    def answered(partition: int) -> list[int]:
        return [offset for p, offset in acked if p == partition]

    def submit(chunk: list[InputRecord]) -> None:
        run.submit(chunk, [(r.partition, r.offset) for r in chunk])

    await run.start()
    # Partition 1 meets id 2, which the registry cannot give now; partition 0 knows its id.
    submit(records_of(0, 0, [1, 1]) + records_of(1, 0, [1, 2, 1]) + records_of(0, 2, [1]))
    await wait_for(pipeline, lambda: answered(0) == [0, 1, 2] and answered(1) == [0])
    await wait_for(pipeline, lambda: decoder.attempts.count(2) >= 3)  # retried, never given up
    assert paused == [("in", 1, True)] and stalled._value.get() == 1
    submit(records_of(0, 3, [1, 1]) + records_of(1, 3, [1]))
    await wait_for(pipeline, lambda: answered(0) == [0, 1, 2, 3, 4])
    assert answered(1) == [0] and run.in_flight.count == 3  # held, still counted in flight
    decoder.down = False
    await wait_for(pipeline, lambda: answered(1) == [0, 1, 2, 3])
    assert paused == [("in", 1, True), ("in", 1, False)] and stalled._value.get() == 0
    await run.drain()
    await run.stop()
    assert run.in_flight.count == 0


async def test_records_held_for_the_registry_count_against_no_in_flight_bound():
    """Stalled partitions pause themselves; were their records counted against the bound
    (4 here), three stalled partitions would pause every partition that flows."""
    pipeline, acked = FakePipeline(), []
    decoder = RegistryDecoder(pipeline.changed, known={1})
    in_flight = InFlight("runner-test", 4, 2)
    run = PipelineRunner(
        pipeline, decoder, in_flight,
        lambda handles: (acked.extend(handles), pipeline.changed.set()),
        lambda error, records: pytest.fail(f"the worker gave up: {error!r}"),
        clock=time.monotonic, wall_clock=lambda: 1_800_000_000.0,
        pause=lambda *args: None, lookup_backoff_s=(0.001, 0.01),
    )  # fmt: skip

    def submit(chunk: list[InputRecord]) -> None:
        run.submit(chunk, [(r.partition, r.offset) for r in chunk])

    await run.start()
    submit(records_of(1, 0, [2, 2]) + records_of(2, 0, [2, 2]) + records_of(3, 0, [2, 2]))
    await wait_for(pipeline, lambda: decoder.attempts.count(2) >= 2)
    assert (in_flight.count, in_flight.held, in_flight.paused) == (6, 6, False)
    submit(records_of(0, 0, [1, 1, 1]))
    await wait_for(pipeline, lambda: len(acked) == 3)
    assert not in_flight.paused
    decoder.down = False  # released: six records in flight, over the bound until answered
    await wait_for(pipeline, lambda: len(acked) == 9)
    assert (in_flight.count, in_flight.held, in_flight.paused) == (0, 0, False)
    await run.drain()
    await run.stop()


async def test_a_stop_gives_up_what_waits_for_the_registry_without_acknowledging_it():
    pipeline, acked = FakePipeline(), []
    decoder = RegistryDecoder(pipeline.changed, known={1})
    run = PipelineRunner(
        pipeline, decoder, InFlight("runner-test", 1000, 500),
        lambda handles: (acked.extend(handles), pipeline.changed.set()),
        lambda error, records: pytest.fail(f"the worker gave up: {error!r}"),
        clock=time.monotonic, wall_clock=lambda: 1_800_000_000.0, lookup_backoff_s=(0.001, 0.01),
    )  # fmt: skip
    await run.start()
    chunk = records_of(0, 0, [1, 2, 1]) + records_of(1, 0, [1])
    run.submit(chunk, [(r.partition, r.offset) for r in chunk])
    await wait_for(pipeline, lambda: len(decoder.attempts) >= 2)
    async with asyncio.timeout(10):
        given_up = await run.drain()  # does not wait for the registry
    await run.stop()
    assert sorted(acked) == [(0, 0), (1, 0)] and given_up == [(0, 1), (0, 2)]
    assert run.in_flight.count == 0


class SlowRegistryDecoder(RegistryDecoder):
    """A registry that answers once `answer` is set (a lookup that takes its timeout); a
    record whose value is b"bug" breaks decoding."""

    def __init__(self, changed: asyncio.Event, known: set[int]) -> None:
        super().__init__(changed, known)
        self.down = False
        self.answer = asyncio.Event()

    def lookup_ids(self, records):
        return [None if r.value == b"bug" or int(r.value) in self.known else int(r.value)
                for r in records]  # fmt: skip

    async def resolve(self, ids):
        self.attempts += ids
        self.changed.set()
        await self.answer.wait()
        self.known |= set(ids)
        return {}


async def test_what_follows_a_decoding_bug_is_not_answered_while_a_lookup_delays_the_exit():
    pipeline, acked, fatal = FakePipeline(), [], []
    decoder = SlowRegistryDecoder(pipeline.changed, known={1})

    def on_fatal(error, records):
        fatal.append((error, [(r.partition, r.offset) for r in records]))
        pipeline.changed.set()
        raise asyncio.CancelledError  # ends the stage, as the real exit ends the process

    run = PipelineRunner(
        pipeline, decoder, InFlight("runner-test", 1000, 500),
        lambda handles: (acked.extend(handles), pipeline.changed.set()), on_fatal,
        clock=time.monotonic, wall_clock=lambda: 1_800_000_000.0, lookup_backoff_s=(0.001, 0.01),
    )  # fmt: skip

    def submit(chunk: list[InputRecord]) -> None:
        run.submit(chunk, [(r.partition, r.offset) for r in chunk])

    await run.start()
    submit(records_of(1, 0, [2]))  # partition 1 meets an id: the decode stage looks it up
    await wait_for(pipeline, lambda: decoder.attempts)
    submit([InputRecord("in", 0, 0, 0, b"k", b"bug")])  # partition 0, offset 0: a bug
    taken = run.in_flight.count
    submit(records_of(0, 1, [1, 1, 1]))  # what follows it on partition 0
    # Not taken in: answered and acknowledged, they would commit past offset 0, which the
    # worker, ending, never answered.
    assert run.in_flight.count == taken
    decoder.answer.set()
    await wait_for(pipeline, lambda: fatal)
    await run.stop()
    assert fatal[0][1] == [(0, 0)]
    assert [handle for handle in acked if handle[0] == 0] == []


def test_a_runner_names_its_pipeline_for_the_health_checks():
    # `Health` keeps progress per pipeline: the bare runtime registers a runner by it.
    pipeline = FakePipeline()
    assert runner(pipeline, [], []).name == pipeline.config.name
