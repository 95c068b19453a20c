"""The control follower against a fake one-partition control topic: where a restarted
worker starts, which desired states it applies, records that do not parse, a guardrail's
rollback whose write fails, and a control topic deleted and recreated."""

from __future__ import annotations

import itertools
import json
import logging
import threading
import uuid
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

import pytest
from confluent_kafka import OFFSET_BEGINNING, KafkaError, KafkaException

from streams import control
from streams.config import HeadraceConfig
from streams.control import ControlFollower, Desired, desired_states
from streams.guardrail import Guardrail
from tests.helpers import wait_until
from tools.deploy import sample_config

CONFIG = HeadraceConfig.model_validate(sample_config("k:9092", Path("repo"), Path("m.onnx")))
KEY = f"{CONFIG.app_id}/fraud".encode()
TOPIC = CONFIG.control.topic


class Message:
    def __init__(self, offset: int, key: bytes | None, value: bytes | None, error=None) -> None:
        self._offset, self._key, self._value, self._error = offset, key, value, error

    def key(self):
        return self._key

    def value(self):
        return self._value

    def offset(self):
        return self._offset

    def error(self):
        return self._error


class Topic:
    """The control topic: one partition, records appended by the test or the producer."""

    def __init__(self) -> None:
        self.records: list[tuple[bytes, bytes]] = []
        self.changed = threading.Condition()
        self.id = uuid.uuid4().hex
        self.failures: list[KafkaError] = []
        """What the next writes of the control topic fail with (then they succeed)."""
        self.attempts = 0
        """Writes of the control topic tried, failed ones included."""

    def append(self, value: bytes, key: bytes = KEY) -> None:
        with self.changed:
            self.records.append((key, value))
            self.changed.notify_all()

    def recreate(self) -> None:
        """Deleted and created again: empty, a new id, offsets from 0 again."""
        with self.changed:
            self.records = []
            self.id = uuid.uuid4().hex


class FakeConsumer:
    def __init__(self, topic: Topic) -> None:
        self.topic = topic
        self.position = 0
        self.at_end = False

    def assign(self, partitions) -> None:
        [partition] = partitions
        self.position = 0 if partition.offset == OFFSET_BEGINNING else partition.offset
        self.topic.starts.append(self.position)

    def list_topics(self, name, timeout=None):
        class Metadata:
            topics = {name: type("TopicMetadata", (), {"error": None})()}

        return Metadata()

    def poll(self, timeout: float):
        with self.topic.changed:
            if self.position >= len(self.topic.records) and self.at_end:
                self.topic.changed.wait(timeout)  # as a consumer waits on its broker
            if self.position < len(self.topic.records):
                key, value = self.topic.records[self.position]
                self.position += 1
                self.at_end = False
                return Message(self.position - 1, key, value)
            if not self.at_end:
                self.at_end = True
                return Message(self.position, None, None, KafkaError(KafkaError._PARTITION_EOF))
            return None

    def close(self) -> None:
        pass


class FakeProducer:
    """The control topic's writer: transactions only (`change_desired`), each write
    failing at its commit as `Topic.failures` says. Heartbeats (the status topic) are
    dropped."""

    def __init__(self, topic: Topic, _settings: dict) -> None:
        self.topic = topic
        self.open: list[tuple[bytes, bytes]] = []

    def init_transactions(self, _timeout=None) -> None:
        pass

    def begin_transaction(self) -> None:
        self.open = []

    def commit_transaction(self, _timeout=None) -> None:
        self.topic.attempts += 1
        if self.topic.failures:
            raise KafkaException(self.topic.failures.pop(0))
        for key, value in self.open:
            self.topic.append(value, key)

    def produce(self, topic, value, key=None, **_) -> None:
        if topic == TOPIC:
            self.open.append((key.encode() if isinstance(key, str) else key, value))

    def poll(self, _timeout) -> int:
        return 0

    def flush(self, _timeout=None) -> int:
        return 0


class FakeAdmin:
    """Describes the control topic: its id."""

    def __init__(self, topic: Topic) -> None:
        self.topic = topic

    def describe_topics(self, topics, request_timeout=None):
        answer = Future()
        answer.set_result(SimpleNamespace(topic_id=self.topic.id))
        return {name: answer for name in topics.topic_names}

    def poll(self, _timeout) -> int:
        return 0


@pytest.fixture
def topic(monkeypatch) -> Topic:
    found = Topic()
    found.starts = []  # where each consumer was assigned
    monkeypatch.setattr(control, "Consumer", lambda _settings: FakeConsumer(found))
    monkeypatch.setattr(control, "Producer", lambda settings: FakeProducer(found, settings))
    monkeypatch.setattr(control, "ensure_control_topics", lambda _config: [])
    monkeypatch.setattr(control, "AdminClient", lambda _settings: FakeAdmin(found))
    return found


class Follower:
    """A ControlFollower of pipeline fraud that records what it applies."""

    def __init__(self, guard=list, config: HeadraceConfig = CONFIG, clock=None) -> None:
        self.applied: list[Desired] = []
        clocked = {"clock": clock} if clock is not None else {}
        self.follower = ControlFollower(
            config, ["fraud"], self.applied.append, list, guard, **clocked
        )

    def __enter__(self) -> Follower:
        self.follower.catch_up()
        self.follower.start()
        return self

    def __exit__(self, *_) -> None:
        self.follower.stop()

    def revisions(self) -> list[int]:
        return [desired.revision for desired in self.applied]


def history() -> list[Desired]:
    """Revisions 1 (serve v2), 2 (a guarded canary v3), 3 (its rollback), 4 (serve v4)."""
    first = Desired("fraud").deploy("2", None, 0)
    canary = first.deploy("3", "canary", 10, Guardrail(max_p99_increase_ms=20))
    rolled_back = canary.rollback("guardrail: latency")
    return [first, canary, rolled_back, rolled_back.deploy("4", None, 0)]


def test_a_restarted_worker_applies_the_latest_state_once_not_the_history_before_it(topic):
    for desired in history():
        topic.append(desired.to_json())
    latest = history()[-1]
    with Follower() as worker:
        assert worker.revisions() == [4]  # caught up
        # A stale record (an old worker's late write) then a deploy: only the deploy.
        topic.append(history()[1].to_json())
        topic.append(latest.deploy("5", None, 0).to_json())
        assert wait_until(lambda: worker.revisions()[-1:] == [5], 10), worker.revisions()
    assert worker.revisions() == [4, 5]
    assert topic.starts[-1] == 4  # the follower went on where catch-up ended


def test_a_guardrail_rollback_of_an_older_revision_is_not_written(topic):
    for desired in history():
        topic.append(desired.to_json())
    canary = history()[-1].deploy("5", "canary", 10, Guardrail(max_p99_increase_ms=20))
    topic.append(canary.to_json())
    decided = iter([[history()[1].rollback("guardrail: stale")], [canary.rollback("guardrail")]])
    with Follower(lambda: next(decided, [])) as worker:
        assert wait_until(lambda: worker.revisions()[-1:] == [6], 10), worker.revisions()
    written = [Desired.from_json(value) for _, value in topic.records[5:]]
    assert [(d.revision, d.reason) for d in written] == [(6, "guardrail")]


def test_records_that_do_not_parse_are_skipped_and_the_follower_goes_on(topic, caplog):
    first, canary, *_ = history()
    newer_cli = json.dumps({**json.loads(canary.to_json()), "min_version": 2}).encode()
    zero_window = json.loads(canary.deploy("3", "canary", 10).to_json())
    zero_window["revision"] = 3
    zero_window["guardrail"] = {"window_s": 0, "max_p99_increase_ms": 20}
    topic.append(first.to_json())
    topic.append(b"not json")
    topic.append(newer_cli)  # an unknown field: ignored, the rest applies
    topic.append(json.dumps(zero_window).encode())  # an invalid guardrail: skipped
    with caplog.at_level(logging.WARNING, "streams.control"):
        # The operator's view: the latest state that parses, so a deploy builds on it.
        assert desired_states(CONFIG)["fraud"] == canary
        with Follower() as worker:
            assert worker.applied == [canary]
            topic.append(b"\xff")
            topic.append(canary.rollback().to_json())
            assert wait_until(lambda: worker.revisions()[-1:] == [3], 10), worker.revisions()
            assert worker.follower._thread.is_alive()
    skipped = [r.getMessage() for r in caplog.records if "record skipped" in r.getMessage()]
    assert any(f"{TOPIC} offset 1:" in line for line in skipped), skipped
    assert any(f"{TOPIC} offset 3:" in line and "window_s" in line for line in skipped), skipped
    assert any(f"{TOPIC} offset 4:" in line for line in skipped), skipped


def test_unknown_fields_of_a_newer_writer_are_logged_once_not_at_every_read(caplog):
    """`models status --wait` reads the status topic twice a second: a newer worker's
    heartbeat would log the same warning each time."""
    raw = json.dumps({"pipeline": "fraud", "serving": "2", "from_a_newer_cli": 1}).encode()
    with caplog.at_level(logging.WARNING, logger="streams.control"):
        for _ in range(5):
            assert Desired.from_json(raw).serving == "2"
    assert sum("from_a_newer_cli" in r.getMessage() for r in caplog.records) <= 1


def guarded_canary() -> Desired:
    """Revision 5: a guarded canary v5 after `history()`."""
    return history()[-1].deploy("5", "canary", 10, Guardrail(max_p99_increase_ms=20))


def test_a_guardrail_rollback_whose_write_fails_is_written_again_until_it_is(
    topic, monkeypatch, caplog
):
    """A rollback decided once, its first writes failing: written the fourth time, and
    the failure logged once, not at every attempt."""
    for desired in [*history(), guarded_canary()]:
        topic.append(desired.to_json())
    monkeypatch.setattr(control, "ROLLBACK_RETRY_S", 0.01)
    topic.failures = [KafkaError(KafkaError._MSG_TIMED_OUT)] * 3
    decided = iter([[guarded_canary().rollback("guardrail: latency")]])
    with (
        caplog.at_level(logging.WARNING, "streams.control"),
        Follower(lambda: next(decided, [])) as worker,
    ):
        assert wait_until(lambda: worker.revisions()[-1:] == [6], 10), worker.revisions()
    written = [Desired.from_json(value) for _, value in topic.records[5:]]
    assert [(d.revision, d.reason) for d in written] == [(6, "guardrail: latency")]
    assert topic.attempts == 4
    failed = [r for r in caplog.records if "could not be written" in r.getMessage()]
    assert len(failed) == 1 and failed[0].levelname == "ERROR", failed


def test_a_failing_rollback_is_retried_with_a_bounded_backoff_until_a_newer_revision(topic):
    """Pauses double up to the cap; a newer revision read makes the rollback obsolete."""
    for desired in [*history(), guarded_canary()]:
        topic.append(desired.to_json())
    topic.failures = [KafkaError(KafkaError._MSG_TIMED_OUT)] * 1_000
    now = [0.0]
    decided = iter([[guarded_canary().rollback("guardrail: latency")]])
    worker = Follower(lambda: next(decided, []), clock=lambda: now[0])
    worker.follower.catch_up()  # not started: the test drives it
    tried_at = []
    while now[0] < 200:
        before = topic.attempts
        worker.follower._write_rollbacks()
        tried_at += [now[0]] * (topic.attempts - before)
        now[0] = round(now[0] + 0.1, 1)
    pauses = [round(b - a, 1) for a, b in itertools.pairwise(tried_at)]
    assert pauses[:8] == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0], pauses
    assert max(pauses) == control.ROLLBACK_RETRY_MAX_S
    # An operator's deploy of revision 6 read: the rollback is no longer written.
    worker.follower._follow("fraud", guarded_canary().deploy("7", None, 0))
    tried = topic.attempts
    for _ in range(700):
        worker.follower._write_rollbacks()
        now[0] += 0.1
    assert topic.attempts == tried


def test_a_change_written_after_the_guardrail_decided_is_not_undone_by_its_rollback(topic, caplog):
    """An operator's deploy lands before the rollback is written (the follower has not
    read it yet): the rollback, built on the revision before it, is not written. Written
    plainly, it would land after the deploy, and undo a change its command said was done."""
    for desired in [*history(), guarded_canary()]:
        topic.append(desired.to_json())
    decided = iter([[guarded_canary().rollback("guardrail: latency")]])
    worker = Follower(lambda: next(decided, []))
    worker.follower.catch_up()  # at revision 5; not started: the test drives it
    operators = guarded_canary().deploy("6", None, 0)
    topic.append(operators.to_json())
    with caplog.at_level(logging.WARNING, "streams.control"):
        worker.follower._write_rollbacks()
    assert Desired.from_json(topic.records[-1][1]) == operators
    assert not worker.follower._rollbacks  # not retried either
    assert any("it is at revision 6 now" in r.getMessage() for r in caplog.records)


def test_a_rollback_is_not_written_into_a_control_topic_recreated_since_it_was_decided(topic):
    for desired in [*history(), guarded_canary()]:
        topic.append(desired.to_json())
    decided = iter([[guarded_canary().rollback("guardrail: latency")]])
    worker = Follower(lambda: next(decided, []))
    worker.follower.catch_up()
    topic.recreate()  # the new topic holds no deploy: there is nothing to roll back
    worker.follower._write_rollbacks()
    assert topic.records == []


def test_a_recreated_control_topic_is_followed_from_its_start(topic):
    """Revisions start again at 1 in the new topic: its deploy is followed, and older
    revisions are history again within it."""
    quick = CONFIG.model_copy(
        update={"control": CONFIG.control.model_copy(update={"heartbeat_interval_s": 0.05})}
    )
    for desired in history():
        topic.append(desired.to_json())
    with Follower(config=quick) as worker:
        assert worker.revisions() == [4]
        topic.recreate()
        first = Desired("fraud").deploy("7", None, 0)
        topic.append(first.to_json())
        topic.append(first.deploy("8", None, 0).to_json())
        assert wait_until(lambda: worker.revisions()[-1:] == [2], 10), worker.revisions()
        topic.append(first.to_json())  # a late write of revision 1: history
        topic.append(first.deploy("8", None, 0).deploy("9", None, 0).to_json())
        assert wait_until(lambda: worker.revisions()[-1:] == [3], 10), worker.revisions()
    # Revision 1 applied too where the recreation was noticed before revision 2 came.
    assert worker.revisions()[1:] in ([2, 3], [1, 2, 3]), worker.revisions()
    assert worker.applied[-1].serving == "9"
