"""What every Kafka client headrace creates shares: a connection timeout, librdkafka's
logs routed through Python logging without floods, and a start-up check that names an
unreachable broker within seconds.

librdkafka retries a refused connection every ~50 ms and, left alone, prints each
failure to stderr (~290 lines while a worker waited 15 s for a broker that was down).
`client_settings` gives a confluent-kafka client a `logger` and an `error_cb` that log
to the `kafka` logger: errors and warnings at WARNING (a client retries them; what
gives up is reported by the code that gave up), each kind of message once when it
starts, then at most once a minute with a count while it lasts (`Repeats`). The same
policy is a `logging.Filter` (`RepeatFilter`) for libraries that log through Python
logging (aiokafka, under the Faust runtime).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

from confluent_kafka import (
    Consumer,
    ConsumerGroupTopicPartitions,
    KafkaError,
    KafkaException,
    Message,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient

from infra.errors import BrokerUnavailable

log = logging.getLogger("kafka")

DEFAULT_TIMEOUT_S = 5.0
"""How long a command waits for the brokers to answer at start (`broker.connect_timeout_ms`)."""

# librdkafka's thread prefix ("[thrd:main]: "), and what else changes between repeats of
# the same failure: durations ("after 0ms", "in 1.5 s"), fractions (drifts, seconds).
_THREAD = re.compile(r"^\[thrd:[^\]]*\]: ")
# librdkafka's note on a setting it calls experimental (its other CONFWARNs stay warnings).
_EXPERIMENTAL = re.compile(r"^CONFWARN: Configuration property \S+ is experimental")
_VARYING = re.compile(rf"{_THREAD.pattern}|\b\d+(\.\d+)?\s?(ms|s)\b|\b\d+\.\d+\b")


def kind_of(message: str) -> str:
    """A message with what varies between repeats of the same failure taken out."""
    return _VARYING.sub("#", message)


class Repeats:
    """Which of a stream of messages to show: the first of each kind, then at most one
    per `interval_s` while that kind keeps coming, with the count of those not shown. A
    kind not seen for `quiet_s` has ended; its next occurrence is shown at once (a
    broker that comes back and fails again is a new failure). Keeps the `max_kinds`
    most recent kinds. The clock is passed in; safe to call from several threads."""

    def __init__(
        self,
        interval_s: float = 60.0,
        quiet_s: float = 30.0,
        max_kinds: int = 1_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval_s = interval_s
        self._quiet_s = quiet_s
        self._max_kinds = max_kinds
        self._clock = clock
        self._lock = threading.Lock()
        # kind -> [shown at, last seen at, not shown since]
        self._kinds: OrderedDict[str, list[float]] = OrderedDict()

    def admit(self, kind: str) -> int | None:
        """None: do not show this one; else show it, with the number not shown before it."""
        now = self._clock()
        with self._lock:
            state = self._kinds.get(kind)
            if state is None or now - state[1] >= self._quiet_s:
                self._kinds[kind] = [now, now, 0]
                self._kinds.move_to_end(kind)
                if len(self._kinds) > self._max_kinds:
                    self._kinds.popitem(last=False)
                return 0
            self._kinds.move_to_end(kind)
            state[1] = now
            if now - state[0] < self.interval_s:
                state[2] += 1
                return None
            skipped = int(state[2])
            state[0], state[2] = now, 0
            return skipped


def _with_count(message: str, skipped: int, interval_s: float) -> str:
    if not skipped:
        return message
    return f"{message} (and {skipped} more like it in the last {interval_s:.0f} s)"


class RepeatFilter(logging.Filter):
    """Rate-limits the records of a logger by kind of message (`Repeats`)."""

    def __init__(self, repeats: Repeats | None = None) -> None:
        super().__init__()
        self._repeats = repeats or Repeats()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        message = record.getMessage()
        skipped = self._repeats.admit(f"{record.name} {kind_of(message)}")
        if skipped is None:
            return False
        if skipped:
            record.msg, record.args = _with_count(message, skipped, self._repeats.interval_s), ()
        return True


def quiet_repeats(prefixes: Iterable[str]) -> None:
    """Rate-limit every logger whose name starts with one of `prefixes` (those that exist:
    call after importing the library). A filter on each logger, so it holds whatever
    handlers a framework installs later (Faust replaces the root's)."""
    repeat_filter = RepeatFilter()
    prefixes = tuple(prefixes)
    names = [name for name in logging.root.manager.loggerDict if name.startswith(prefixes)]
    for name in {*names, *prefixes}:
        logging.getLogger(name).addFilter(repeat_filter)


class ClientLog:
    """The `logger` and `error_cb` of one confluent-kafka client (both are called from
    the client's `poll`, `consume` or `flush`). `quiet`: log at DEBUG only, for a probe
    whose caller reports the failure itself. Keeps the first error for that report."""

    def __init__(self, client: str, quiet: bool = False, repeats: Repeats | None = None) -> None:
        self.client = client
        self.quiet = quiet
        self.first_error: str | None = None
        self._repeats = repeats or Repeats()

    def log(self, level: int, message: str, *args: Any) -> None:
        """confluent-kafka's call: `logger.log(level, "%s [%s] %s", facility, name, text)`."""
        if len(args) == 3:
            facility, _name, text = args
            message = f"{facility}: {_THREAD.sub('', str(text))}"
            if facility == "CONFWARN" and _EXPERIMENTAL.search(message):
                # Every setting is headrace's own (the publisher's gapless guarantee is
                # experimental): at each start, nothing an operator could act on.
                level = logging.INFO
        elif args:
            message = message % args
        self._emit(min(level, logging.WARNING), message)

    def error(self, error: KafkaError) -> None:
        """A client-wide error (a broker down, all brokers down, a fatal producer error)."""
        if self.first_error is None:
            self.first_error = error.str()
        level = logging.ERROR if error.fatal() else logging.WARNING
        self._emit(level, f"{error.name()}: {error.str()}")

    def _emit(self, level: int, message: str) -> None:
        if self.quiet:
            log.debug("%s: %s", self.client, message)
            return
        if level < logging.WARNING:
            log.log(level, "%s: %s", self.client, message)
            return
        # The same failure comes as a log line and as an error: one kind, by its text.
        skipped = self._repeats.admit(kind_of(message.split(": ", 1)[-1]))
        if skipped is not None:
            message = _with_count(message, skipped, self._repeats.interval_s)
            log.log(level, "Kafka %s: %s", self.client, message)


def client_settings(
    bootstrap_servers: str,
    client: str,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    quiet: bool = False,
) -> dict[str, Any]:
    """The settings every confluent-kafka client gets; `client` names it in log lines."""
    client_log = ClientLog(client, quiet)
    return {
        "bootstrap.servers": bootstrap_servers,
        # An address that drops packets fails after this, not librdkafka's default 30 s.
        "socket.connection.setup.timeout.ms": max(1_000, int(timeout_s * 1000)),
        # librdkafka drops its bootstrap connection once it learns the brokers, and a
        # request made meanwhile waits half this backoff to be sent again: a new client's
        # first request took 55-63 ms on a local broker, 18-19 ms with 20 (default 100;
        # in an outage the backoff still doubles per failed attempt, up to 10 s).
        "reconnect.backoff.ms": 20,
        "logger": client_log,
        "error_cb": client_log.error,
    }


def list_topics(bootstrap_servers: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
    """The cluster's topics (name -> TopicMetadata); BrokerUnavailable, naming the broker and
    the reason, when it does not answer within `timeout_s`. Blocks up to `timeout_s`."""
    settings = client_settings(bootstrap_servers, "admin", timeout_s, quiet=True)
    admin = AdminClient(settings)
    try:
        return admin.list_topics(timeout=timeout_s).topics
    except KafkaException as exc:
        admin.poll(0)  # serves the error callbacks: why it failed
        reason = settings["logger"].first_error or exc.args[0].str()
        reason = _short(reason)
        raise unavailable(
            bootstrap_servers, f"could not be reached within {timeout_s:g} s ({reason})"
        ) from exc


def ask_group_offsets(
    admin: AdminClient,
    group: str,
    partitions: Iterable[tuple[str, int]],
    *,
    require_stable: bool,
    timeout_s: float,
) -> Future:
    """Ask the admin API for `group`'s committed offsets of `partitions`: a future of its
    answer, whose `topic_partitions` each carry an offset (-1001: none committed) or an
    error of their own. With `require_stable`, a partition whose offset an open
    transaction holds is answered at once with UNSTABLE_OFFSET_COMMIT; without, with its
    last committed offset (the consumer's own read, under read_committed, waits for the
    transaction instead). Serves the client's queued log lines first: nothing else polls
    an admin client."""
    admin.poll(0)
    request = ConsumerGroupTopicPartitions(
        group, [TopicPartition(topic, partition) for topic, partition in partitions]
    )
    (answer,) = admin.list_consumer_group_offsets(
        [request], require_stable=require_stable, request_timeout=timeout_s
    ).values()
    return answer


def _short(reason: str) -> str:
    """The cause alone: `h:p/bootstrap: Connect to ipv4#h:p failed: Connection refused
    (after 0ms in state CONNECT)` -> `Connection refused`."""
    reason = re.sub(r"^\S+/(bootstrap|\d+): ", "", reason)
    reason = re.sub(r" \(after \d+ms in state \w+\)$", "", reason)
    return reason.split(" failed: ", 1)[-1]


def unavailable(bootstrap_servers: str, what: str) -> BrokerUnavailable:
    """The error of a broker that did not answer, or failed a command half way."""
    return BrokerUnavailable(
        f"Kafka at {bootstrap_servers} {what}; hint: is the broker running? Check "
        "broker.bootstrap_servers in the config (a local broker: `headrace broker start`)"
    )


# What a consumer that reads ranges (`read_range`) sets. A broker answers one connection's
# requests in order, so a fetch waiting at the broker (librdkafka's default wait: 500 ms)
# held up the offset and metadata requests behind it: a worker's read-back at each
# assignment (`streams/replay.py`) spent 300-500 ms per topic there.
RANGE_READER_SETTINGS = {
    "enable.auto.commit": False,
    "enable.partition.eof": True,
    "fetch.wait.max.ms": 10,
}


def read_range(
    consumer: Consumer,
    topic: str,
    starts: dict[int, int],
    stops: dict[int, int],
    handle: Callable[[Message], None],
    deadline: float,
) -> None:
    """Hand `handle` every record of `topic` from `starts[p]` to below `stops[p]` per
    partition (a consumer with `RANGE_READER_SETTINGS`). The end of a partition is where
    Kafka says it is (an end-of-partition event), not its last record read: a topic
    written in transactions ends with a marker. TimeoutError (naming the partitions
    left) past `deadline` (monotonic seconds)."""
    pending = {p for p in starts if stops[p] > starts[p]}
    consumer.assign([TopicPartition(topic, p, starts[p]) for p in pending])
    while pending:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{topic!r}: partitions {sorted(pending)} not read to the end")
        # What is here, without waiting for 1,000 (`consume` waits its whole timeout
        # for fewer): the first record or event, then whatever came with it.
        first = consumer.poll(0.2)
        messages = [] if first is None else [first, *consumer.consume(1000, 0)]
        for message in messages:
            partition, offset = message.partition(), message.offset()
            error = message.error()
            if error is not None:
                if error.code() == KafkaError._PARTITION_EOF and offset >= stops[partition]:
                    pending.discard(partition)
                continue
            if offset < stops[partition]:
                handle(message)
            if offset >= stops[partition] - 1:
                pending.discard(partition)
    consumer.unassign()
