"""Consumer lag and the oldest unanswered input, from what a consumer reads and answers."""

from __future__ import annotations

import contextlib
from concurrent.futures import Future

import pytest
from confluent_kafka import TopicPartition
from prometheus_client import REGISTRY

from infra.kafka import describe_group
from infra.ports import free_port
from streams.lag import QUERY_AFTER_S, REFRESH_S, ConfluentMarks, InputProgress
from streams.records import InputRecord
from tests.helpers import PATIENT_BUDGET_MS, produce_events, scrape, total, wait_until


class Clock:
    def __init__(self, now: float = 1_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def records(partition: int, first: int, count: int, topic: str = "in", ts_ms: int = 0):
    return [
        InputRecord(topic, partition, offset, ts_ms + offset, b"k", b"v")
        for offset in range(first, first + count)
    ]


def progress(name: str) -> tuple[InputProgress, Clock, Clock]:
    wall, monotonic = Clock(1_000.0), Clock(50.0)
    return InputProgress(name, clock=wall, monotonic=monotonic), wall, monotonic


def exported(pipeline: str, partition: int, topic: str = "in") -> float | None:
    return REGISTRY.get_sample_value(
        "headrace_consumer_lag_records",
        {"pipeline": pipeline, "topic": topic, "partition": str(partition)},
    )


def test_lag_counts_from_the_first_unanswered_record_to_the_high_water_mark():
    tracked, _, _ = progress("lag-basic")
    tracked.read(records(0, 10, 10))  # offsets 10..19
    tracked.update({("in", 0): (30, None)})
    assert tracked.lag(("in", 0)) == 20
    tracked.answered({("in", 0): 14})
    assert tracked.lag(("in", 0)) == 15
    tracked.answered({("in", 0): 19})
    assert tracked.lag(("in", 0)) == 10  # nothing in hand: from the next offset to read
    assert exported("lag-basic", 0) == 10
    tracked.read(records(0, 20, 10))
    tracked.answered({("in", 0): 29})
    assert exported("lag-basic", 0) == 0


def test_runs_of_partitions_in_one_chunk_are_kept_apart():
    tracked, _, _ = progress("lag-mixed")
    tracked.read([*records(0, 0, 3), *records(1, 0, 2), *records(0, 3, 2)])
    tracked.update({("in", 0): (5, None), ("in", 1): (2, None)})
    tracked.answered({("in", 0): 3, ("in", 1): 1})
    assert tracked.lags() == {("in", 0): 1, ("in", 1): 0}


def test_before_anything_is_read_the_position_counts_then_no_longer():
    tracked, _, _ = progress("lag-position")
    tracked.update({("in", 0): (None, None)})
    assert tracked.unplaced() == [("in", 0)]
    assert exported("lag-position", 0) is None  # unknown is not exported as 0
    tracked.update({("in", 0): (100, 40)})
    assert tracked.lag(("in", 0)) == 60
    assert tracked.unplaced() == []
    tracked.read(records(0, 40, 5))
    tracked.answered({("in", 0): 44})
    tracked.update({("in", 0): (100, 40)})  # a stale position is ignored once read
    assert tracked.lag(("in", 0)) == 55


def test_a_revoked_partition_is_forgotten_and_no_longer_exported():
    tracked, _, _ = progress("lag-revoke")
    tracked.read(records(0, 0, 5))
    tracked.read(records(1, 0, 5))
    tracked.update({("in", 0): (5, None), ("in", 1): (9, None)})
    assert exported("lag-revoke", 1) == 9
    tracked.update({("in", 0): (5, None)})
    assert exported("lag-revoke", 1) is None
    tracked.answered({("in", 1): 4})  # late acknowledgement of a revoked partition
    assert tracked.lags() == {("in", 0): 5}


def test_records_read_again_after_a_seek_back_replace_what_was_read():
    tracked, _, _ = progress("lag-seek")
    tracked.read(records(0, 0, 10))
    tracked.answered({("in", 0): 3})
    tracked.read(records(0, 6, 10))  # Faust seeks back to the committed offset 6
    tracked.update({("in", 0): (16, None)})
    assert tracked.lag(("in", 0)) == 12  # 4 and 5 still unanswered, then 6..15
    tracked.answered({("in", 0): 15})
    assert tracked.lag(("in", 0)) == 0


def test_the_oldest_unanswered_input_is_the_first_unanswered_of_any_partition():
    tracked, wall, _ = progress("lag-oldest")
    assert tracked.oldest_unanswered_s() == 0.0
    tracked.read(records(0, 0, 4, ts_ms=990_000))  # timestamps 990.000 .. 990.003 s
    tracked.read(records(1, 0, 4, ts_ms=995_000))
    assert tracked.oldest_unanswered_s() == 10.0
    tracked.answered({("in", 0): 1})
    assert round(tracked.oldest_unanswered_s(), 6) == 9.998
    tracked.answered({("in", 0): 3})
    assert tracked.oldest_unanswered_s() == 5.0
    wall.now += 2
    assert (
        REGISTRY.get_sample_value("headrace_oldest_unanswered_seconds", {"pipeline": "lag-oldest"})
        == 7.0
    )
    tracked.answered({("in", 1): 3})
    assert tracked.oldest_unanswered_s() == 0.0


def test_a_lagging_mark_that_does_not_move_is_asked_of_the_broker_now_and_then():
    tracked, _, monotonic = progress("lag-stale")
    tracked.read(records(0, 0, 10))
    tracked.update({("in", 0): (10, None), ("in", 1): (0, 0)})
    assert tracked.stale() == []
    monotonic.now += QUERY_AFTER_S
    assert tracked.stale() == [("in", 0)]  # lagging; partition 1 is idle at its end
    tracked.queried({("in", 0): 25})
    assert tracked.lag(("in", 0)) == 25
    assert tracked.stale() == []
    tracked.update({("in", 0): (10, None), ("in", 1): (0, 0)})  # the stale cached mark
    assert tracked.lag(("in", 0)) == 25
    monotonic.now += QUERY_AFTER_S
    assert tracked.stale() == [("in", 0)]
    tracked.answered({("in", 0): 9})
    tracked.read(records(0, 10, 15))
    tracked.answered({("in", 0): 24})
    assert tracked.stale() == []  # caught up


class IdleConsumer:
    """A consumer assigned partitions it has delivered nothing from (no position yet),
    each with 10 records; its own `committed()` would wait, so it must not be called."""

    def __init__(self, partitions: list[int], topic: str = "in") -> None:
        self._assigned = [TopicPartition(topic, partition) for partition in partitions]

    def assignment(self) -> list[TopicPartition]:
        return self._assigned

    def position(self, partitions: list[TopicPartition]) -> list[TopicPartition]:
        return [TopicPartition(tp.topic, tp.partition, -1001) for tp in partitions]

    def get_watermark_offsets(self, tp, timeout=None, cached=False) -> tuple[int, int]:
        return 0, 10

    def committed(self, *_args, **_kwargs):
        raise AssertionError("the poll thread waited on the consumer's committed offsets")


def test_idle_partitions_committed_offsets_are_asked_and_their_answer_taken_later():
    tracked, _, monotonic = progress("lag-idle")
    asks: list[tuple[list, Future]] = []

    def ask(partitions: list) -> Future:
        asks.append((partitions, Future()))
        return asks[-1][1]

    marks = ConfluentMarks(IdleConsumer([0, 1]), {"in": tracked}, ask, monotonic=monotonic)
    marks.refresh()
    assert [partitions for partitions, _ in asks] == [[("in", 0), ("in", 1)]]
    assert tracked.lag(("in", 0)) is None  # unknown until answered
    monotonic.now += REFRESH_S
    marks.refresh()
    assert len(asks) == 1  # one question at a time, whatever the wait
    asks[0][1].set_exception(RuntimeError("the coordinator moved"))
    monotonic.now += REFRESH_S
    marks.refresh()
    assert len(asks) == 2  # a failed answer: asked again
    asks[1][1].set_result({("in", 0): 4, ("in", 1): -1001})
    monotonic.now += REFRESH_S
    marks.refresh()
    assert tracked.lag(("in", 0)) == 6  # high-water mark 10, committed 4
    assert tracked.lag(("in", 1)) == 10  # nothing committed: from the log start
    monotonic.now += REFRESH_S
    marks.refresh()
    assert len(asks) == 2  # placed: not asked again


def committed_rows(deployment) -> list:
    """Kafka's consumer-groups tool's rows of the input, once it shows every partition."""
    group, topic = deployment.config.app_id, deployment.spec.input_topic
    rows = [row for row in describe_group(deployment.config.broker.bootstrap_servers, group)
            if row.topic == topic]  # fmt: skip
    return rows if len(rows) == 3 and all(row.lag == 0 for row in rows) else []


@pytest.mark.integration
@pytest.mark.parametrize("runtime", ["faust", "bare"])
def test_at_rest_the_lag_is_what_kafkas_consumer_groups_tool_shows(
    deploy, kafka, sample_assets, runtime
):
    port = free_port()
    deployment = deploy(runtime=runtime, latency_budget_ms=PATIENT_BUDGET_MS, metrics_port=port)
    spec = deployment.spec
    world = sample_assets.world
    produce_events(kafka.bootstrap_servers, spec.input_topic, world, 400, seed=3, prefix="lag")

    def lags(answered: int) -> dict[int, float]:
        """Each partition's exported lag, once `answered` inputs are answered."""
        with contextlib.suppress(OSError):  # the endpoint starts with the worker
            samples = scrape(port)
            if total(samples, "headrace_outcomes_total") >= answered:
                return {
                    int(s.labels["partition"]): s.value
                    for s in samples
                    if s.name == "headrace_consumer_lag_records"
                    and s.labels["topic"] == spec.input_topic
                }
        return {}

    with deployment.worker():
        assert wait_until(lambda: len(lags(400)) == 3, 90), deployment.log_tail()
        # More while it runs: read, answered and committed as they come.
        produce_events(kafka.bootstrap_servers, spec.input_topic, world, 200, seed=4, prefix="more")
        assert wait_until(lambda: (found := lags(600)) and sum(found.values()) == 0, 60)
        # Committed within broker.commit_interval_ms of the last answer.
        rows = wait_until(lambda: committed_rows(deployment), 30)
        ours = lags(600)
        samples = scrape(port)
    assert sorted(row.partition for row in rows) == [0, 1, 2], rows
    assert sum(row.log_end_offset for row in rows) == 600
    for row in rows:
        assert abs(ours[row.partition] - row.lag) <= spec.max_batch_size, (ours, rows)
        assert ours[row.partition] == row.lag == 0
    assert total(samples, "headrace_oldest_unanswered_seconds", pipeline=spec.name) == 0
    # Start times of the series are not rendered: a scrape's cost is the worker's.
    assert not [s.name for s in samples if s.name.endswith("_created")]
    assert total(samples, "headrace_answered_in_budget_total", pipeline=spec.name) == 600
