"""Publish: a batch's outcome records written with confluent-kafka, each record's
delivery tracked, and what Kafka refuses replaced by a form that fits
(`streams/outgoing.py`).

Delivery. librdkafka delivers in its own threads and reports each record through a
callback served by `poll()`; one thread owned by the publisher polls. A batch's reports
mark its records delivered in that thread and the last one wakes the loop that
produced them, once per batch. The batch (`Outgoing`) keeps what Kafka acknowledged:
a retry sends only the rest, never an outcome already written. Each run of a batch's
records without headers is handed to librdkafka in one call (`produce_together`), so
that with `linger.ms` 0 they leave at once and together.

Sizes. A topic takes record batches of up to its `max.message.bytes`, read from Kafka
at start (or `broker.max_message_bytes`). The producer's `message.max.bytes` is the
largest of those limits and its `batch.size` the smallest, so librdkafka accepts what
some topic takes and never groups records into a batch a topic refuses. A record that
does not fit its own topic is replaced by a smaller form before it is sent.

Refusals. A record batch Kafka refuses anyway (a topic's limit lowered while the
worker runs, a record it finds invalid) fails every record in it, guilty or not. The
undelivered records are then sent again in halves, each half written before the next
is sent, until a record refused on its own is found; that one is replaced by a
smaller form (reason `too_large`, or `unpublishable`) and the others are written as
they are. Any other failure (a broker away, a topic gone) raises PublishError for the
runner to retry with backoff; only a Kafka that stays unwritable ends the worker.

Order per key. Outcomes of one key go to one partition and must stay in their order
there. librdkafka's idempotent producer keeps a partition's records in order through
its own retries and reports a record failed only when it gives up on it. When it gives
up on a refused record batch, it would go on to write the records queued behind it (on
the test broker: 10 records, 1 refused, 10 more: the last 10 were written after the
gap), and our retry of the refused batch's innocent records would then land after
later records of their keys. `enable.gapless.guarantee` prevents that: on such a
refusal the producer fails everything it has not written and stops for good, so no
record passes a failed one of its partition. The publisher then starts a new producer
(reading the topics' limits again: a refusal is how a lowered limit shows) and sends
the undelivered records again in their order; when it splits them it writes a half
before sending the next. The runner publishes a pipeline's batches one after another,
so no later batch passes a failed one either. Not covered: records that time out
(`delivery.timeout.ms`, a broker away that long). A batch's records are produced
within a millisecond and time out together, but a broker back within that millisecond
could take the later ones before the retry writes the earlier ones.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer
from confluent_kafka.admin import AdminClient, ConfigResource, ResourceType

from infra.kafka_clients import client_settings
from streams.config import BrokerConfig
from streams.errors import PublishError
from streams.outgoing import TOO_LARGE, UNPUBLISHABLE, Outgoing, wire_bytes
from streams.records import OutRecord

log = logging.getLogger(__name__)

DEFAULT_PRODUCER_CONFIG: dict[str, Any] = {
    "enable.idempotence": True,
    "acks": "all",
    # Send at once: a batch's records are handed over in one call (`produce_together`),
    # so they still leave in one request per partition. librdkafka's linger timer ticks
    # in milliseconds: 1 ms (or 0.2) added 1.0-1.1 ms to every publish.
    "linger.ms": 0,
    "delivery.timeout.ms": 30_000,
    # A refused record batch stops the producer rather than let later records of its
    # partition pass the refused ones (see "Order per key" above).
    "enable.gapless.guarantee": True,
}
# How long lost partitions wait for their answers to be written: as long as the
# publisher waits for Kafka to take one (`delivery.timeout.ms`), and a little more.
LOST_WAIT_S = DEFAULT_PRODUCER_CONFIG["delivery.timeout.ms"] / 1000 + 5
# librdkafka's own `batch.size` default, kept where every topic takes more.
MAX_BATCH_BYTES = 1_000_000
# A topic's limit when it cannot be read: librdkafka's default `message.max.bytes`,
# below Kafka's default `max.message.bytes` (1,048,588).
FALLBACK_LIMIT_BYTES = 1_000_000

# Records librdkafka may hold before a batch's records are produced one by one: half its
# default `queue.buffering.max.messages`, so that a call producing many at once is
# never refused part way (see `produce_together`).
QUEUE_ROOM = 50_000

# Consecutive attempts that fail only because the producer stopped, before giving up
# to the runner's backoff.
_MAX_RESTARTS = 3
# Waits of the delivery thread's poll (see `_poll`): an idle worker wakes 5 times a
# second, not 20. Not over 200 ms: confluent-kafka cuts a longer wait into chunks, and
# then returns only at its end, even after serving a report (2.13 to at least 2.16).
POLL_S = 0.2
RETIRING_POLL_S = 0.05

# A record batch refused for what it holds: sent alone, the record at fault is found.
_SIZE = frozenset({KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.RECORD_LIST_TOO_LARGE})
_REFUSED = _SIZE | {KafkaError.INVALID_RECORD, KafkaError.INVALID_TIMESTAMP}
# A record failed for another's sake: its producer stopped (gapless) or purged it.
_STOPPED = frozenset(
    {
        KafkaError._FATAL,
        KafkaError._GAPLESS_GUARANTEE,
        KafkaError._PURGE_QUEUE,
        KafkaError._PURGE_INFLIGHT,
        KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER,
    }
)


def topic_limits(bootstrap_servers: str, topics: Sequence[str], timeout_s: float = 10.0) -> dict:
    """Each topic's `max.message.bytes` (its own, or the broker's default), read with
    the admin API. Blocks up to about `timeout_s`; KafkaException when it cannot."""
    found = topic_settings(bootstrap_servers, topics, "max.message.bytes", timeout_s)
    return {topic: int(value) for topic, value in found.items()}


def topic_settings(
    bootstrap_servers: str, topics: Sequence[str], setting: str, timeout_s: float = 10.0
) -> dict[str, str]:
    """Each topic's value of a topic config (its own, or the broker's default), read
    with the admin API. Blocks up to about `timeout_s`; KafkaException when it cannot."""
    # Its librdkafka log lines go to the worker's log, not raw to stderr.
    admin = AdminClient(client_settings(bootstrap_servers, "admin", timeout_s))
    resources = [ConfigResource(ResourceType.TOPIC, topic) for topic in topics]
    futures = admin.describe_configs(resources, request_timeout=timeout_s)
    return {
        resource.name: future.result(timeout=timeout_s)[setting].value
        for resource, future in futures.items()
    }


class _Producer:
    """One librdkafka producer, and whether it stopped for good (a fatal error)."""

    def __init__(self, producer: Any) -> None:
        self.producer = producer
        self.stopped = False

    def poll(self, timeout_s: float) -> None:
        try:
            self.producer.poll(timeout_s)
        except KafkaException as exc:  # confluent-kafka raises a fatal error from poll
            if not self.stopped:
                log.warning("Kafka producer stopped: %s", exc.args[0].str())
            self.stopped = True


class Publisher:
    """`await publish(batch)` returns once Kafka has acknowledged every record of the
    batch, itself or a dead letter in its place. Writes to `topics` (each pipeline's
    output and dead-letter topics), whose size limits it reads when constructed
    (blocks up to ~10 s); `make_producer` and `read_limits` are for tests."""

    def __init__(
        self,
        broker: BrokerConfig,
        topics: Iterable[str],
        overrides: Mapping[str, Any] | None = None,
        *,
        make_producer: Callable[[dict[str, Any]], Any] = Producer,
        read_limits: Callable[[Sequence[str]], Mapping[str, int]] | None = None,
    ) -> None:
        self._bootstrap_servers = broker.bootstrap_servers
        self._fixed_limit = broker.max_message_bytes
        self._topics = sorted(set(topics))
        self._read_limits = read_limits or partial(topic_limits, broker.bootstrap_servers)
        self._overrides = dict(overrides or {})
        self._make_producer = make_producer
        self.limits: dict[str, int] = self._limits(FALLBACK_LIMIT_BYTES)
        """Each written topic's largest record batch, in bytes."""
        self._current = self._new_producer()
        # Replaced producers, polled until each has reported every record it held.
        self._retiring: list[_Producer] = []
        self._retiring_lock = threading.Lock()
        self._restarting = asyncio.Lock()
        self._stopping = threading.Event()
        self._poller: threading.Thread | None = None

    def _limits(self, fallback: int | None) -> dict[str, int]:
        """The topics' limits, read again; where they cannot be read, `fallback` for
        each (None: the limits known so far)."""
        if self._fixed_limit is not None:
            return dict.fromkeys(self._topics, self._fixed_limit)
        try:
            return {topic: int(size) for topic, size in self._read_limits(self._topics).items()}
        except Exception as exc:  # any failure to read: a conservative limit, not an exit
            kept = self.limits if fallback is None else dict.fromkeys(self._topics, fallback)
            log.warning(
                "could not read max.message.bytes of %s (%s); writing records of at most "
                "%s bytes; hint: set broker.max_message_bytes where the worker may not "
                "read topic configs", self._topics, exc, min(kept.values(), default=fallback),
            )  # fmt: skip
            return kept

    def _new_producer(self) -> _Producer:
        limits = self.limits.values()
        config = {
            **DEFAULT_PRODUCER_CONFIG,
            "bootstrap.servers": self._bootstrap_servers,
            # librdkafka refuses locally what no topic takes, and builds no record batch
            # larger than the smallest topic limit (a larger record is still sent alone).
            "message.max.bytes": max(limits, default=FALLBACK_LIMIT_BYTES),
            "batch.size": min([MAX_BATCH_BYTES, *limits]),
            **self._overrides,
        }
        return _Producer(self._make_producer(config))

    def warm(self, timeout_s: float) -> None:
        """Blocking, up to `timeout_s` in all: learn where each written topic's partitions
        live, so that the first batch does not wait for the producer's connections and
        metadata (a cold first write took 8-15 ms on a warm broker, 3-4 ms after this).
        Only the written topics: a cluster's whole metadata can be megabytes. Logged,
        not raised."""
        deadline = time.monotonic() + timeout_s
        try:
            for topic in self._topics:
                left_s = max(0.001, deadline - time.monotonic())
                self._current.producer.list_topics(topic, timeout=left_s)
        except KafkaException as exc:
            log.warning("Kafka publisher: could not read the topics' metadata: %s", exc)

    def start(self) -> None:
        if self._poller is None:
            self._poller = threading.Thread(target=self._poll, name="kafka-delivery", daemon=True)
            self._poller.start()

    async def publish(self, batch: Outgoing) -> None:
        """Write the records of `batch` Kafka has not acknowledged yet, in order;
        returns once each is acknowledged, itself or a dead letter in its place
        (`batch.rewritten`). Raises PublishError when Kafka cannot take them now (a
        broker away, a topic gone); `batch` keeps what was acknowledged, so calling
        again sends only the rest."""
        pending = batch.undelivered()
        if pending:
            await self._write(batch, pending)

    async def _write(self, batch: Outgoing, indexes: list[int]) -> None:
        """Write the records `indexes` (undelivered, in batch order) or raise."""
        restarts = 0
        suspects: set[int] = set()
        while True:
            failures = await self._attempt(batch, indexes)
            if not failures:
                return
            pending = [index for index in indexes if not batch.delivered[index]]
            codes = {index: failures[index].code() for index in pending}
            broken = [index for index in pending if codes[index] not in _REFUSED | _STOPPED]
            if broken or restarts >= _MAX_RESTARTS:
                first = failures[(broken or pending)[0]]
                raise PublishError(
                    f"{len(pending)} of {len(batch)} records were not delivered "
                    f"({first.str()}); the {len(batch) - len(batch.undelivered())} delivered "
                    "are not sent again"
                )
            refused = [index for index in pending if codes[index] in _REFUSED]
            if not refused:
                # Failed only because the producer stopped (for another record's refusal,
                # maybe of another batch): send them again, in order, on its successor.
                restarts += 1
                indexes = pending
                continue
            restarts = 0
            if len(pending) == 1:
                (index,) = pending
                if index not in suspects:
                    # Refused in a record batch that may have held another batch's records
                    # (one topic, published at once): once more before it is the one at fault.
                    suspects.add(index)
                    indexes = pending
                    continue
                record, error = batch.records[index], failures[index]
                batch.reduce(
                    index,
                    TOO_LARGE if error.code() in _SIZE else UNPUBLISHABLE,
                    f"{record.topic} refused its {wire_bytes(record)} bytes: {error.str()}",
                )
                indexes = pending
                continue
            # Several failed with the record batch that held them: find the one at fault.
            # Each half is written before the next is sent, so none passes an earlier one.
            half = len(pending) // 2
            await self._write(batch, pending[:half])
            await self._write(batch, pending[half:])
            return

    async def _attempt(self, batch: Outgoing, indexes: list[int]) -> dict[int, KafkaError]:
        """Produce the records `indexes` once, in order, and wait for every report; the
        failures by index (the delivered ones are marked in `batch`)."""
        current = self._current
        producer = current.producer
        delivery = _Delivery(asyncio.get_running_loop(), batch)
        failures: dict[int, KafkaError] = {}
        sent = 0
        position = 0
        try:
            while position < len(indexes):
                run = self._plain_run(batch, indexes, position)
                if len(run) > 1 and len(producer) + len(run) <= QUEUE_ROOM:
                    queued, first, error = produce_together(producer, batch, run, delivery.report)
                    sent += queued
                    position += first
                    if error is None:
                        continue
                    if error.code() == KafkaError._QUEUE_FULL and queued == first:
                        await asyncio.sleep(0.005)  # the queue is full: as for BufferError
                        continue
                    failures.update(dict.fromkeys(indexes[position:], error))
                    break
                index = indexes[position]
                self._fitting(batch, index)
                while True:
                    try:
                        error = produce_fitted(producer.produce, batch, index, delivery.report)
                        break
                    except BufferError:
                        # librdkafka's local queue is full: let deliveries drain it, then retry.
                        await asyncio.sleep(0.005)
                if error is not None:
                    # The producer stopped, or cannot write that topic: so for the rest.
                    failures.update(dict.fromkeys(indexes[position:], error))
                    break
                sent += 1
                position += 1
        finally:
            # Even when giving up half way (no form of a record fits), wait for what was
            # produced: a retry must never send again a record still in flight.
            failures.update(await delivery.seal(sent))
        codes = {error.code() for error in failures.values()}
        if current.stopped or codes & (_STOPPED | _REFUSED):
            # A refusal stops a gapless producer: its successor takes the retry.
            await self._restart(current)
        return failures

    def _plain_run(self, batch: Outgoing, indexes: list[int], position: int) -> list[int]:
        """The records from `indexes[position]` on that one `produce_batch` call can
        take: consecutive, of one topic, without headers (it cannot send those), each
        fitting its topic as it is."""
        records = batch.records
        run: list[int] = []
        for index in indexes[position:]:
            record = records[index]
            limit = self.limits.get(record.topic)
            if (
                record.headers
                or (limit is not None and wire_bytes(record) > limit)
                or (run and record.topic != records[run[0]].topic)
            ):
                break
            run.append(index)
        return run

    def _fitting(self, batch: Outgoing, index: int) -> OutRecord:
        """Record `index`, replaced by a smaller form while it does not fit its topic."""
        record = batch.records[index]
        limit = self.limits.get(record.topic)
        while limit is not None and (size := wire_bytes(record)) > limit:
            record = batch.reduce(
                index, TOO_LARGE, f"its {size} bytes exceed {record.topic}'s limit of {limit}"
            )
            limit = self.limits.get(record.topic)
        return record

    async def _restart(self, stopped: _Producer) -> None:
        """Replace a stopped producer (once, whichever batch sees it first); it is polled
        until it has reported every record it held."""
        async with self._restarting:
            if stopped is not self._current:
                return
            if self._fixed_limit is None:
                self.limits = await asyncio.to_thread(self._limits, None)
            successor = self._new_producer()
            with self._retiring_lock:
                self._retiring.append(stopped)
            self._current = successor
            log.warning("a new Kafka producer takes over; topic limits: %s", self.limits)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Deliver what is queued (up to `timeout_s`), then stop the poll thread. Safe twice."""
        with self._retiring_lock:
            retiring, self._retiring = self._retiring, []
        for held in (self._current, *retiring):
            try:
                held.producer.flush(timeout_s)
            except KafkaException as exc:  # a stopped producer raises its fatal error once
                log.warning("Kafka producer stopped: %s", exc.args[0].str())
        self._stopping.set()
        if self._poller is not None:
            self._poller.join()
            self._poller = None

    def _poll(self) -> None:
        while not self._stopping.is_set():
            # A poll returns as soon as a delivery report comes: its wait bounds only how
            # soon a stop, or a retiring producer's reports, are seen.
            self._current.poll(RETIRING_POLL_S if self._retiring else POLL_S)
            if self._retiring:
                with self._retiring_lock:
                    retiring = list(self._retiring)
                for old in retiring:
                    old.poll(0)
                    if len(old.producer) == 0:
                        with self._retiring_lock:
                            if old in self._retiring:
                                self._retiring.remove(old)


def produce_fitted(
    produce: Callable[..., None],
    batch: Outgoing,
    index: int,
    report: Callable[[int, KafkaError | None, Any], None],
) -> KafkaError | None:
    """Produce record `index` of `batch` in the form it has now; a form that
    librdkafka's own count finds too large is replaced by the next smaller one and
    produced again. None once produced, else the error that stops the rest of the
    attempt (the producer stopped, or cannot write that topic). `BufferError`
    (librdkafka's local queue is full) is the caller's to handle."""
    while True:
        record = batch.records[index]
        try:
            produce(
                record.topic,
                record.value,
                record.key,
                headers=record.headers,
                on_delivery=partial(report, index),
            )
            return None
        except KafkaException as exc:
            error = exc.args[0]
            if error.code() not in _SIZE:
                return error
            batch.reduce(index, TOO_LARGE, error.str())


def produce_together(
    producer: Any,
    batch: Outgoing,
    run: list[int],
    report: Callable[[int, KafkaError | None, Any], None],
) -> tuple[int, int, KafkaError | None]:
    """Produce records `run` of `batch` (see `Publisher._plain_run`) in one call.
    Returns how many librdkafka queued, how many of the first it queued, and the error
    of the first it did not (None: it queued them all).

    One call hands librdkafka the whole run at once, so with `linger.ms` 0 its first
    request carries the run; produced one by one, the sender wakes on the first record
    and sends the rest in more requests."""
    records = batch.records
    messages = [
        {"key": records[i].key, "value": records[i].value, "callback": partial(report, i)}
        for i in run
    ]
    queued = producer.produce_batch(records[run[0]].topic, messages)
    if queued == len(run):
        return queued, queued, None
    first = next(n for n, message in enumerate(messages) if "_error" in message)
    if queued > first:
        # It queued records behind one it refused (its queue freed meanwhile): the
        # refused record's retry lands after them. QUEUE_ROOM keeps this from happening.
        log.warning("librdkafka queued records behind one it refused: their order may break")
    return queued, first, messages[first]["_error"]


class _Delivery:
    """The delivery reports of one attempt: each marks its record in the batch (in the
    poll thread); the last one wakes the loop, once."""

    def __init__(self, loop: asyncio.AbstractEventLoop, batch: Outgoing) -> None:
        self._loop = loop
        self._delivered = batch.delivered
        self._lock = threading.Lock()
        self._expected: int | None = None
        self._reported = 0
        self._failures: dict[int, KafkaError] = {}
        self._done: asyncio.Future[dict[int, KafkaError]] = loop.create_future()

    def report(self, index: int, error: KafkaError | None, _message: Any) -> None:
        # Runs in the poll thread only (librdkafka serves callbacks from `poll`).
        if error is None:
            self._delivered[index] = True
        else:
            self._failures[index] = error
        with self._lock:
            self._reported += 1
            last = self._reported == self._expected
        if last:
            self._loop.call_soon_threadsafe(self._settle)

    def seal(self, expected: int) -> asyncio.Future[dict[int, KafkaError]]:
        """Called once every record of the attempt was produced: `expected` reports."""
        with self._lock:
            self._expected = expected
            last = self._reported == expected
        if last:
            self._settle()
        return self._done

    def _settle(self) -> None:
        if not self._done.done():  # not cancelled meanwhile
            self._done.set_result(self._failures)
