"""Workers of one group under load: a member that leaves and rejoins repeats nothing,
and a killed worker's partitions are served again within seconds, nothing missing and
nothing answered twice (or, with the read-back turned off, every repeat marked)."""

from __future__ import annotations

import statistics
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from confluent_kafka import Consumer, TopicPartition

from tests.chaos.conftest import input_offsets, outcomes_per_input
from tests.helpers import committed_offsets, paced_load, produce_events, wait_until
from tests.streams.test_worker import collector_for
from tools.audit import audit, format_report
from tools.deploy import group_spread, stop_worker

pytestmark = pytest.mark.integration


@contextmanager
def steady_load(kafka, deployment, world, per_s: int = 150) -> Iterator[None]:
    """Valid events at about `per_s` per second, from a thread, until the block ends."""
    stop = threading.Event()
    topic = deployment.spec.input_topic

    def send() -> None:
        chunk = max(1, per_s // 10)
        for seed in range(1_000_000):
            if stop.wait(0.1):
                return
            produce_events(kafka.bootstrap_servers, topic, world, chunk, seed=seed,
                           prefix=f"load{seed}-")  # fmt: skip

    sender = threading.Thread(target=send, name="steady-load")
    sender.start()
    try:
        yield
    finally:
        stop.set()
        sender.join(60)


def repeats_marked(answers: list[dict], excused=lambda first, repeat: False) -> list[dict]:
    """The answers of inputs answered before, in written order (an input's answers share
    its key, so its output partition), after checking that each is marked: a consumer
    that keeps the first answer per input and looks the marked ones up sees no repeat.
    Inputs with a repeat `excused(first, repeat)` are left out of the check."""
    firsts: dict[tuple[int, int], dict] = {}
    left_out = set()
    for answer in answers:
        first = firsts.setdefault(where(answer), answer)
        if first is not answer and excused(first, answer):
            left_out.add(where(answer))
    if left_out:
        print(f"{len(left_out)} inputs excused")
    answers = [answer for answer in answers if where(answer) not in left_out]
    later, unmarked, seen = [], Counter(), set()
    for answer in answers:
        unmarked[where(answer)] += not answer["redelivered"]
        if where(answer) in seen:
            later.append(answer)
        seen.add(where(answer))
    print(f"{len(later)} repeats of {len(seen)} inputs; "
          f"{sum(a['redelivered'] for a in answers)} answers marked")  # fmt: skip
    assert all(answer["redelivered"] for answer in later)
    assert max(unmarked.values(), default=0) <= 1  # one unmarked answer per input at most
    return later


def where(answer: dict) -> tuple[int, int]:
    return answer["input_partition"], answer["input_offset"]


def all_answered(collector, bootstrap: str, topic: str) -> bool:
    counts = outcomes_per_input(collector.snapshot(), topic)
    return input_offsets(bootstrap, topic) <= set(counts)


def answered(collector) -> int:
    return len(collector.snapshot().predictions)


@pytest.mark.parametrize(
    ("runtime", "delivery"),
    [("faust", "at_least_once"), ("bare", "at_least_once"), ("faust", "exactly_once")],
)
def test_a_member_that_leaves_and_rejoins_under_load_repeats_nothing(
    chaos_deploy, kafka, sample_assets, runtime, delivery
):
    deployment = chaos_deploy(runtime, delivery=delivery)
    topic = deployment.spec.input_topic
    collector = collector_for(deployment, isolation_level="read_committed")
    group = deployment.config.app_id
    try:
        with deployment.worker():
            second = deployment.start()
            with steady_load(kafka, deployment, sample_assets.world):
                assert wait_until(
                    lambda: len(group_spread(kafka.bootstrap_servers, group)) == 2, 120
                )
                assert wait_until(lambda: answered(collector) > 300, 120), deployment.log_tail()
                assert stop_worker(second) == 0  # leaves the group: the first takes over
                now = answered(collector)
                assert wait_until(lambda: answered(collector) > now + 300, 60)
                second = deployment.start()
                assert wait_until(
                    lambda: len(group_spread(kafka.bootstrap_servers, group)) == 2, 120
                )
                now = answered(collector)
                assert wait_until(lambda: answered(collector) > now + 300, 60)
            assert wait_until(
                lambda: all_answered(collector, kafka.bootstrap_servers, topic), 60
            ), deployment.log_tail()
            assert stop_worker(second) == 0
        counts = outcomes_per_input(collector.snapshot(), topic)
        repeated = {where: n for where, n in counts.items() if n > 1}
        assert not repeated, f"{len(repeated)} inputs answered more than once"
        (found,) = audit(deployment.config, timeout_s=120)
        assert found.exact, format_report([found])
    finally:
        collector.stop()


@pytest.mark.parametrize(
    ("runtime", "instance_id", "within_s"),
    [("faust", "worker-1", 10), ("bare", "worker-1", 10), ("bare", None, 20)],
    ids=["faust-static", "bare-static", "bare-dynamic"],
)
def test_a_killed_worker_is_replaced_within_seconds_and_nothing_is_missing(
    chaos_deploy, kafka, sample_assets, runtime, instance_id, within_s
):
    """A worker killed under load and started again answers within seconds: at once with
    a stable instance id (it takes its partitions back with no rebalance), after the old
    session (6 s) without one; start-up included."""
    deployment = chaos_deploy(runtime, instance_id=instance_id)
    topic, output = deployment.spec.input_topic, deployment.spec.output_topic
    collector = collector_for(deployment)
    try:
        with steady_load(kafka, deployment, sample_assets.world):
            worker = deployment.start()
            assert wait_until(lambda: answered(collector) > 300, 120), deployment.log_tail()
            worker.kill()  # SIGKILL: no drain, no commit, the session left to expire
            worker.wait()
            written = len(input_offsets(kafka.bootstrap_servers, output))  # all it wrote
            restarted_at = time.monotonic()
            with deployment.worker():
                assert wait_until(
                    lambda: len(input_offsets(kafka.bootstrap_servers, output)) > written, 60
                ), deployment.log_tail()
                back_after_s = time.monotonic() - restarted_at
                now = answered(collector)
                assert wait_until(lambda: answered(collector) > now + 50, 60)
        with deployment.worker():
            assert wait_until(
                lambda: all_answered(collector, kafka.bootstrap_servers, topic), 60
            ), deployment.log_tail()
        counts = outcomes_per_input(collector.snapshot(), topic)
        repeats = sum(n - 1 for n in counts.values())
        print(f"{runtime}, instance id {instance_id}: first answer {back_after_s:.1f} s after "
              f"the restart; {repeats} repeats of {len(counts)} inputs")  # fmt: skip
        assert back_after_s < within_s
        # What the killed worker answered but never committed is read again, found in
        # the outcome topics, and not answered twice.
        assert repeats == 0
        (found,) = audit(deployment.config, timeout_s=120)
        assert found.exact, format_report([found])
    finally:
        collector.stop()


def test_with_the_read_back_off_what_a_killed_worker_answered_is_repeated_marked(
    chaos_deploy, kafka, sample_assets
):
    # One input partition under steady load, committed every 2 s: the kill lands between
    # two commits, with answers written since the last one.
    deployment = chaos_deploy(
        "faust", input_partitions=1,
        broker={"replay_lookback_s": 0, "commit_interval_ms": 2_000},
    )  # fmt: skip
    topic = deployment.spec.input_topic
    group = deployment.config.app_id
    collector = collector_for(deployment)

    def uncommitted() -> int:
        """Inputs answered past the committed offset (0 before the first commit: a
        partition never committed is not marked)."""
        committed = committed_offsets(kafka.bootstrap_servers, group, topic, 1)[0]
        return answered(collector) - committed if committed >= 0 else 0

    def marked() -> bool:
        return any(answer["redelivered"] for answer in collector.snapshot().predictions)

    try:
        worker = deployment.start()
        with steady_load(kafka, deployment, sample_assets.world):
            assert wait_until(lambda: uncommitted() > 100, 120), deployment.log_tail()
            print(f"killed after {answered(collector)} answers")
            worker.kill()
            worker.wait()
        with deployment.worker():
            assert wait_until(marked, 120), deployment.log_tail()
            assert wait_until(
                lambda: all_answered(collector, kafka.bootstrap_servers, topic), 120
            ), deployment.log_tail()
        answers = collector.snapshot().predictions
    finally:
        collector.stop()
    later = repeats_marked(answers)
    assert later, "the kill left nothing answered and uncommitted: nothing was tested"


@pytest.mark.parametrize("runtime", ["faust", "bare"])
def test_committing_each_acknowledgement_keeps_the_committed_offset_about_a_batch_behind(
    chaos_deploy, kafka, sample_assets, runtime
):
    """`broker.commit_interval_ms: 0`: each batch's offsets are committed once it is
    acknowledged, so what a crash would leave to be read again (the inputs answered past
    the committed offset) stays about a batch; a 100 ms timer leaves 15 on average at
    300 events/s, a 2 s one 300."""
    deployment = chaos_deploy(runtime, input_partitions=1, broker={"commit_interval_ms": 0})
    topic, group = deployment.spec.input_topic, deployment.config.app_id
    collector = collector_for(deployment)
    offsets = Consumer({"bootstrap.servers": kafka.bootstrap_servers, "group.id": group})
    behind: list[int] = []

    def sample() -> bool:
        """One more look at how far the committed offset is behind the answers."""
        (committed,) = offsets.committed([TopicPartition(topic, 0)], 10)
        behind.append(answered(collector) - max(committed.offset, 0))
        return len(behind) >= 40

    try:
        with (
            deployment.worker(),
            paced_load(
                kafka.bootstrap_servers, topic, sample_assets.world, 300, "smooth", chunks_per_s=300
            ),
        ):
            assert wait_until(lambda: answered(collector) > 300, 120), deployment.log_tail()
            assert wait_until(sample, 60, interval_s=0.05)
    finally:
        offsets.close()
        collector.stop()
    print(f"{runtime}: answered past the committed offset {sorted(behind)}")
    assert statistics.median(behind) <= 5, behind
