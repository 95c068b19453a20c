"""Kafka clients' logs without floods: each kind of failure once when it starts, then at
most once a minute with a count; and a broker nothing listens on, named in seconds."""

from __future__ import annotations

import logging
import time
import uuid

import pytest
from confluent_kafka import Consumer, KafkaException, Producer
from confluent_kafka.admin import AdminClient

from infra.errors import BrokerUnavailable
from infra.kafka_clients import (
    RANGE_READER_SETTINGS,
    ClientLog,
    RepeatFilter,
    Repeats,
    client_settings,
    kind_of,
    list_topics,
    read_range,
)
from infra.ports import free_port
from infra.topics import delete_topics, ensure_topics

CONNECT_FAILED = (
    "[thrd:127.0.0.1:9/bootstrap]: 127.0.0.1:9/bootstrap: Connect to ipv4#127.0.0.1:9 "
    "failed: Connection refused (after {ms}ms in state CONNECT)"
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_first_of_a_kind_is_shown_then_one_a_minute_with_a_count():
    clock = FakeClock()
    repeats = Repeats(interval_s=60, quiet_s=30, clock=clock)
    shown = []
    for second in range(0, 150):  # the same failure every 0.5 s for 150 s
        for half in (0.0, 0.5):
            clock.now = second + half
            skipped = repeats.admit("refused")
            if skipped is not None:
                shown.append((clock.now, skipped))
    assert shown == [(0.0, 0), (60.0, 119), (120.0, 119)]


def test_a_kind_that_stopped_and_comes_back_is_shown_at_once():
    clock = FakeClock()
    repeats = Repeats(interval_s=60, quiet_s=30, clock=clock)
    assert repeats.admit("refused") == 0
    clock.now = 10
    assert repeats.admit("refused") is None
    assert repeats.admit("all brokers down") == 0  # another kind: its own line
    clock.now = 45  # quiet for 35 s: the outage ended; this is a new one
    assert repeats.admit("refused") == 0


def test_only_the_most_recent_kinds_are_kept():
    repeats = Repeats(max_kinds=2, clock=FakeClock())
    for kind in ("a", "b", "c"):
        assert repeats.admit(kind) == 0
    assert repeats.admit("c") is None
    assert repeats.admit("a") == 0  # forgotten: shown again


def test_what_varies_between_repeats_is_not_part_of_the_kind():
    assert kind_of(CONNECT_FAILED.format(ms=0)) == kind_of(CONNECT_FAILED.format(ms=12))
    assert kind_of("drift of +0.31 s") == kind_of("drift of +1.07 s")
    assert kind_of("node with id 1 down") != kind_of("node with id 2 down")


def test_librdkafka_lines_and_errors_become_one_warning(caplog):
    class Error:
        def __init__(self, name: str, text: str) -> None:
            self._name, self._text = name, text

        def name(self) -> str:
            return self._name

        def str(self) -> str:
            return self._text

        def fatal(self) -> bool:
            return False

    client = ClientLog("publisher")
    with caplog.at_level(logging.DEBUG, logger="kafka"):
        for ms in range(100):  # as librdkafka logs a refused connection, every ~50 ms
            client.log(logging.ERROR, "%s [%s] %s", "FAIL", "rdkafka#producer-1",
                       CONNECT_FAILED.format(ms=ms))  # fmt: skip
            client.error(Error("_TRANSPORT", CONNECT_FAILED.format(ms=ms).split("]: ", 1)[1]))
        client.error(Error("_ALL_BROKERS_DOWN", "1/1 brokers are down"))
        client.log(logging.DEBUG, "%s [%s] %s", "BROKER", "rdkafka#producer-1", "details")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage() for r in warnings] == [
        "Kafka publisher: FAIL: 127.0.0.1:9/bootstrap: Connect to ipv4#127.0.0.1:9 failed: "
        "Connection refused (after 0ms in state CONNECT)",
        "Kafka publisher: _ALL_BROKERS_DOWN: 1/1 brokers are down",
    ]
    assert client.first_error.endswith("Connection refused (after 0ms in state CONNECT)")
    assert [r.levelno for r in caplog.records if "details" in r.getMessage()] == [logging.DEBUG]


def test_a_setting_librdkafka_calls_experimental_is_not_a_warning_at_every_start(caplog):
    experimental = (
        "Configuration property enable.gapless.guarantee is experimental: When set to "
        "`true`, any error that could result in a gap in the produced message series when a "
        "batch of messages fails, will raise a fatal error (ERR__GAPLESS_GUARANTEE) and stop "
        "the producer."
    )
    ignored = (
        "Configuration property fetch.wait.max.ms is a consumer property and will be ignored "
        "by this producer instance"
    )
    client = ClientLog("publisher")
    with caplog.at_level(logging.DEBUG, logger="kafka"):
        for text in (experimental, ignored):
            client.log(logging.WARNING, "%s [%s] %s", "CONFWARN", "rdkafka#producer-1",
                       f"[thrd:app]: {text}")  # fmt: skip
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.INFO, f"publisher: CONFWARN: {experimental}"),
        (logging.WARNING, f"Kafka publisher: CONFWARN: {ignored}"),
    ]


def test_a_python_logger_is_rate_limited_by_kind(caplog):
    clock = FakeClock()
    logger = logging.getLogger("tests.flood")
    logger.addFilter(RepeatFilter(Repeats(interval_s=60, clock=clock)))
    with caplog.at_level(logging.INFO, logger="tests.flood"):
        for step in range(130):
            clock.now = step * 0.5
            logger.error("Unable connect to node with id %s: %s", 1, "Connection refused")
            logger.info("progress %s", step)  # below WARNING: never limited
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == [
        "Unable connect to node with id 1: Connection refused",
        "Unable connect to node with id 1: Connection refused "
        "(and 119 more like it in the last 60 s)",
    ]
    assert sum(r.levelno == logging.INFO for r in caplog.records) == 130


def test_a_broker_nothing_listens_on_is_named_within_the_timeout():
    started = time.monotonic()
    with pytest.raises(BrokerUnavailable) as refused:
        list_topics(f"127.0.0.1:{free_port()}", timeout_s=1.0)
    assert time.monotonic() - started < 5
    assert "could not be reached within 1 s (Connection refused); hint: " in str(refused.value)
    assert refused.value.exit_status == 69


def test_a_real_client_logs_an_unreachable_broker_once(caplog):
    admin = AdminClient(client_settings(f"127.0.0.1:{free_port()}", "admin", timeout_s=1.0))
    with caplog.at_level(logging.WARNING, logger="kafka"), pytest.raises(KafkaException):
        admin.list_topics(timeout=1.5)  # librdkafka retries about 30 times meanwhile
    with caplog.at_level(logging.WARNING, logger="kafka"):
        admin.poll(0)  # serves the log lines and errors
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "Connection refused" in lines[0] and "brokers are down" in lines[1]


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_reading_a_range_then_asking_about_the_next_topic_waits_for_nothing(kafka):
    """A worker's read-back at an assignment reads ranges of several topics in turn: a
    batch read that waits its whole timeout for more records, or a fetch left waiting at
    the broker in front of the next metadata request, cost it 0.2-0.5 s per topic."""
    bootstrap = kafka.bootstrap_servers
    first, second = (f"range-{uuid.uuid4().hex[:8]}" for _ in range(2))
    ensure_topics(bootstrap, {first: 1, second: 1})
    producer = Producer(client_settings(bootstrap, "test"))
    for i in range(5):
        producer.produce(first, b"%d" % i, partition=0)
    assert producer.flush(10) == 0
    consumer = Consumer(
        {**client_settings(bootstrap, "test"), "group.id": "range-test", **RANGE_READER_SETTINGS}
    )
    try:
        consumer.list_topics(timeout=10)  # connected: only the reads below are timed
        read: list[int] = []
        started = time.monotonic()
        read_range(consumer, first, {0: 1}, {0: 4}, lambda m: read.append(m.offset()),
                   time.monotonic() + 10)  # fmt: skip
        consumer.list_topics(second, timeout=10)
        took_s = time.monotonic() - started
    finally:
        consumer.close()
        delete_topics(bootstrap, [first, second])
    assert read == [1, 2, 3]
    assert took_s < 0.15, f"{took_s * 1000:.0f} ms"
