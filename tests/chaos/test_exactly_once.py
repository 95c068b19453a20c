"""`kill -9` mid-stream at 300 events/s, then a restart: with
`delivery: exactly_once` a read_committed reader of the whole output and dead-letter
topics sees every input answered once; with at_least_once every input is answered and
the repeats all lie in the window the group had not committed when the worker died."""

from __future__ import annotations

import math
import signal
import time
from contextlib import ExitStack

import pytest
from confluent_kafka import Consumer, TopicPartition

from tests.chaos.conftest import input_offsets, outcomes_per_input, read_outcomes
from tests.chaos.test_broker_outage import OUTAGE_S, crash_broker
from tests.chaos.test_failover import all_answered, answered, steady_load
from tests.helpers import wait_until
from tests.streams.test_worker import collector_for
from tools.audit import audit, format_report
from tools.collector import OutcomeCollector
from tools.deploy import group_spread, start_process, stop_worker

pytestmark = pytest.mark.integration

RATE_PER_S = 300


def committed_offsets(bootstrap: str, group: str, topic: str) -> dict[int, int]:
    """The group's committed offset per partition of `topic` (0 where none)."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    try:
        partitions = consumer.list_topics(topic, timeout=30).topics[topic].partitions
        wanted = [TopicPartition(topic, p) for p in partitions]
        return {tp.partition: max(tp.offset, 0) for tp in consumer.committed(wanted, 30)}
    finally:
        consumer.close()


def caught_up(reader: OutcomeCollector, bootstrap: str, topic: str) -> bool:
    """More than a second of the load answered, and under a quarter second behind it."""
    done = answered(reader)
    return done > RATE_PER_S and len(input_offsets(bootstrap, topic)) - done < RATE_PER_S // 4


def each_answered_once(bootstrap: str, deployment, what: str) -> None:
    """A read_committed reader of the outputs sees each input answered exactly once."""
    topic = deployment.spec.input_topic
    inputs = input_offsets(bootstrap, topic)
    outcomes = read_outcomes(deployment, "read_committed")
    counts = outcomes_per_input(outcomes, topic)
    missing = inputs - set(counts)
    repeated = {where: n for where, n in counts.items() if n > 1}
    print(f"{what}: {len(inputs)} inputs, {len(missing)} missing, {len(repeated)} repeated")
    assert not missing, f"{len(missing)} inputs without an answer"
    # Each repeat's answers with where and when they were written (partition, offset,
    # Kafka timestamp): one transaction's, or two workers' apart.
    written = sorted(
        ((answer["input_partition"], answer["input_offset"]), answer["written_at"])
        for answer in outcomes.predictions
        if (answer["input_partition"], answer["input_offset"]) in repeated
    )
    assert not repeated, f"{len(repeated)} inputs answered more than once: {written}"


def ended_as_it_must(deployment, code: int) -> None:
    """A worker ends cleanly (0), or gives up (exit 70) saying so in one line: what it gave
    up on, why, and a hint, with no traceback (one is kept for headrace's own bugs)."""
    assert code in (0, 70), deployment.log_tail()
    if code == 0:
        return
    lines = deployment.log_file.read_text(errors="replace").splitlines()
    at = [index for index, line in enumerate(lines) if "Exiting (70)" in line]
    assert len(at) == 1, deployment.log_tail()
    said, after = lines[at[0]], lines[at[0] + 1 : at[0] + 2]
    assert "CRITICAL" in said and "giving up on" in said and "hint: " in said, said
    assert not any(line.startswith("Traceback") for line in after), deployment.log_tail()


def kill_mid_stream_and_restart(
    kafka, deployment, world, look_at_commits: bool = False
) -> dict[int, int]:
    """Under steady load a worker answers, is killed (SIGKILL) and a worker of the same
    config takes over; the load stops and it answers the rest. Returns the group's
    committed offsets just after the kill (with `look_at_commits`: under exactly-once,
    offsets a killed worker's open transaction holds cannot be read until the next
    worker aborts it)."""
    bootstrap = kafka.bootstrap_servers
    topic = deployment.spec.input_topic
    reader = collector_for(deployment, isolation_level="read_committed")
    committed: dict[int, int] = {}
    try:
        with ExitStack() as load:
            load.enter_context(steady_load(kafka, deployment, world, per_s=RATE_PER_S))
            worker = deployment.start()
            try:
                # Answering, past its start-up backlog: under a quarter of a second behind.
                assert wait_until(lambda: caught_up(reader, bootstrap, topic), 120), (
                    deployment.log_tail()
                )
            finally:
                worker.kill()  # SIGKILL mid-stream: no drain, no commit
                worker.wait()
            if look_at_commits:
                committed = committed_offsets(bootstrap, deployment.config.app_id, topic)
            with deployment.worker():
                now = answered(reader)
                assert wait_until(lambda: answered(reader) > now + RATE_PER_S, 60), (
                    deployment.log_tail()
                )
                load.close()  # the load stops; the restarted worker answers the rest
                assert wait_until(lambda: all_answered(reader, bootstrap, topic), 60), (
                    deployment.log_tail()
                )
    finally:
        reader.stop()
    return committed


@pytest.mark.parametrize("runtime", ["bare", "faust"])
def test_exactly_once_a_read_committed_reader_sees_each_input_once_after_kill_9(
    chaos_deploy, kafka, sample_assets, runtime
):
    deployment = chaos_deploy(runtime, delivery="exactly_once", instance_id="worker-1")
    spec = deployment.spec
    kill_mid_stream_and_restart(kafka, deployment, sample_assets.world)
    inputs = input_offsets(kafka.bootstrap_servers, spec.input_topic)
    counts = outcomes_per_input(read_outcomes(deployment, "read_committed"), spec.input_topic)
    # Everything written, aborted transactions too: what the killed worker left open.
    written = outcomes_per_input(read_outcomes(deployment, "read_uncommitted"), spec.input_topic)
    missing = inputs - set(counts)
    repeated = {where: n for where, n in counts.items() if n > 1}
    aborted = sum(written.values()) - sum(counts.values())
    print(f"{runtime} exactly_once: {len(inputs)} inputs, {len(missing)} missing, {len(repeated)} "
          f"repeated; {aborted} outcomes of aborted transactions (read_uncommitted)")  # fmt: skip
    assert not missing, f"{len(missing)} inputs without an answer"
    assert not repeated, f"{len(repeated)} inputs answered more than once"
    assert set(counts) == inputs
    (found,) = audit(deployment.config, timeout_s=120)
    assert found.exact and found.inputs == len(inputs), format_report([found])


def agree(first: dict, repeat: dict) -> bool:
    """Two answers of one input with the same status and score (NaN, a shed answer's
    score, agreeing with NaN)."""
    scores = (first["score"], repeat["score"])
    same_score = scores[0] == scores[1] or all(math.isnan(score) for score in scores)
    return first["status"] == repeat["status"] and same_score


@pytest.mark.parametrize("runtime", ["bare", "faust"])
def test_at_least_once_repeats_only_what_was_not_committed_at_kill_9(
    chaos_deploy, kafka, sample_assets, runtime
):
    """At least once: nothing missing; an input answered twice lies past what the group
    had committed when the worker died, and its answers agree (same status and score)
    or the later one is marked `redelivered`, so a reader keeping the first loses no
    score."""
    deployment = chaos_deploy(runtime, instance_id="worker-1")
    spec = deployment.spec
    committed = kill_mid_stream_and_restart(
        kafka, deployment, sample_assets.world, look_at_commits=True
    )
    inputs = input_offsets(kafka.bootstrap_servers, spec.input_topic)
    outcomes = read_outcomes(deployment, "read_committed")
    counts = outcomes_per_input(outcomes, spec.input_topic)
    missing = inputs - set(counts)
    repeated = {where: n for where, n in counts.items() if n > 1}
    print(f"{runtime} at_least_once: {len(inputs)} inputs, {len(missing)} missing, "
          f"{len(repeated)} repeated; committed at the kill: {committed}")  # fmt: skip
    assert not missing, f"{len(missing)} inputs without an answer"
    # Answered again only past what the group had committed when the worker died.
    assert all(offset >= committed[partition] for partition, offset in repeated), repeated
    assert max(repeated.values(), default=1) <= 2
    answers: dict[tuple[int, int], list[dict]] = {}
    for answer in outcomes.predictions:  # in written order per input (one key, one partition)
        answers.setdefault((answer["input_partition"], answer["input_offset"]), []).append(answer)
    for where in repeated:
        if where not in answers:
            continue  # dead-lettered twice: nothing to contradict
        first, *later = answers[where]
        for repeat in later:
            assert agree(first, repeat) or repeat["redelivered"], (first, repeat)


@pytest.mark.parametrize("runtime", ["bare", "faust"])
def test_exactly_once_a_worker_frozen_past_its_session_commits_nothing_twice(
    chaos_deploy, kafka, sample_assets, runtime
):
    """Two workers share the input; one freezes (SIGSTOP) past its session with
    transactions open or about to be, and its partitions move to the other. Whatever
    the frozen one commits when it runs again (a transaction whose offsets it sent in
    time) the new owner must not answer again, and what it can no longer commit (its
    generation moved on) it must not write: a read_committed reader sees each input
    once. Either runtime gives up what it can no longer commit and goes on serving."""
    deployment = chaos_deploy(runtime, delivery="exactly_once")
    bootstrap = kafka.bootstrap_servers
    topic = deployment.spec.input_topic
    frozen_s = deployment.config.broker.session_timeout_ms / 1000 + 4
    reader = collector_for(deployment, isolation_level="read_committed")
    try:
        with deployment.worker():
            zombie = deployment.start()
            with steady_load(kafka, deployment, sample_assets.world, per_s=RATE_PER_S):
                assert wait_until(
                    lambda: len(group_spread(bootstrap, deployment.config.app_id)) == 2, 120
                ), deployment.log_tail()
                assert wait_until(lambda: answered(reader) > RATE_PER_S, 120), deployment.log_tail()
                zombie.send_signal(signal.SIGSTOP)
                time.sleep(frozen_s)  # the fault itself: frozen past the session timeout
                zombie.send_signal(signal.SIGCONT)
                now = answered(reader)
                assert wait_until(lambda: answered(reader) > now + RATE_PER_S, 60), (
                    deployment.log_tail()
                )
            assert wait_until(lambda: all_answered(reader, bootstrap, topic), 60), (
                deployment.log_tail()
            )
            # It gave up what it could no longer commit and went on serving.
            ended = stop_worker(zombie)
            ended_as_it_must(deployment, ended)
            assert ended == 0, deployment.log_tail()
    finally:
        reader.stop()
    each_answered_once(bootstrap, deployment, f"{runtime} exactly_once, frozen {frozen_s:.0f} s")


def stopped(process) -> bool:
    """Whether `process` is stopped (SIGSTOP)."""
    with open(f"/proc/{process.pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] == "T"


def test_exactly_once_a_worker_frozen_inside_a_rebalance_commits_nothing_twice(
    chaos_deploy, kafka, sample_assets
):
    """Bare runtime: a worker stops itself at the end of the revoke a second worker's
    join starts, still inside the rebalance, for longer than its session. librdkafka
    then skips its lost-assignment callback: the worker wakes holding its other
    partitions and their old positions, and joins again as a new member. It must end
    (exit 70) before it commits from them: `its member id changed ... without it
    giving up its partitions` (streams/membership.py), or, where the group revokes
    them first, `revoked with N records not yet committed`. A read_committed reader
    sees each input once."""
    deployment = chaos_deploy("bare", delivery="exactly_once")
    bootstrap = kafka.bootstrap_servers
    topic = deployment.spec.input_topic
    frozen_s = deployment.config.broker.session_timeout_ms / 1000 + 4
    reader = collector_for(deployment, isolation_level="read_committed")
    config = str(deployment.config_file)
    arguments = ["-m", "tests.chaos.frozen_in_revoke", "worker", "-c", config, "-l", "warn"]
    try:
        frozen = start_process(arguments, deployment.log_file)
        deployment.started.append(frozen)
        with ExitStack() as load:
            world = sample_assets.world
            load.enter_context(steady_load(kafka, deployment, world, per_s=RATE_PER_S))
            assert wait_until(lambda: answered(reader) > RATE_PER_S, 120), deployment.log_tail()
            with deployment.worker():  # its join starts the rebalance
                assert wait_until(lambda: stopped(frozen), 60), deployment.log_tail()
                time.sleep(frozen_s)  # the fault itself: frozen past the session timeout
                frozen.send_signal(signal.SIGCONT)
                now = answered(reader)
                assert wait_until(lambda: answered(reader) > now + RATE_PER_S, 60), (
                    deployment.log_tail()
                )
                load.close()
                assert wait_until(lambda: all_answered(reader, bootstrap, topic), 60), (
                    deployment.log_tail()
                )
                ended = stop_worker(frozen)
            ended_as_it_must(deployment, ended)
    finally:
        reader.stop()
    kept = "its member id changed" in deployment.log_file.read_text(errors="replace")
    what = f"bare frozen in a rebalance: exit {ended}, partitions kept {kept}"
    each_answered_once(bootstrap, deployment, what)


@pytest.mark.parametrize("runtime", ["bare", "faust"])
def test_exactly_once_a_broker_crash_ends_in_answers_or_an_exit_and_each_input_once(
    chaos_deploy, kafka, sample_assets, runtime
):
    """The broker killed for longer than the group session under exactly-once. A worker
    that kept its partitions answers again once the broker is back. One whose partitions
    the group took away with answers not yet committed gives those answers up (their
    inputs are answered again, once, when the partitions come back) and goes on. A
    worker whose transaction outlived Kafka's transaction timeout meanwhile ends (exit
    70): Kafka aborted it and fenced its producer. One that ended is
    started again, as a supervisor would. Neither hangs:
    before librdkafka's send_offsets_to_transaction was given up on past its timeout, a
    bare worker waited on it for good in three runs of five. Either way a read_committed
    reader sees each input answered once."""
    deployment = chaos_deploy(runtime, delivery="exactly_once", instance_id="worker-1")
    bootstrap = kafka.bootstrap_servers
    topic = deployment.spec.input_topic
    reader = collector_for(deployment, isolation_level="read_committed")
    try:
        with ExitStack() as load:
            load.enter_context(steady_load(kafka, deployment, sample_assets.world, per_s=100))
            worker = deployment.start()
            try:
                assert wait_until(lambda: answered(reader) > 200, 120), deployment.log_tail()
                crash_broker(kafka)
                before = answered(reader)
                assert wait_until(
                    lambda: worker.poll() is not None or answered(reader) > before + 200, 60
                ), deployment.log_tail()
                if worker.poll() is None:
                    load.close()
                    assert wait_until(lambda: all_answered(reader, bootstrap, topic), 90), (
                        deployment.log_tail()
                    )
            finally:
                ended = stop_worker(worker)
            ended_as_it_must(deployment, ended)
            if ended == 70:
                with deployment.worker():
                    load.close()
                    assert wait_until(lambda: all_answered(reader, bootstrap, topic), 120), (
                        deployment.log_tail()
                    )
    finally:
        reader.stop()
    each_answered_once(
        bootstrap, deployment, f"{runtime} exactly_once, broker down {OUTAGE_S} s, exit {ended}"
    )
