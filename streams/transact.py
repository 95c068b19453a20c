"""Exactly-once delivery (`delivery: exactly_once`, either runtime): a batch's outcome
records and its input offsets are committed in one Kafka transaction, so a consumer
reading with `isolation.level=read_committed` sees every input answered once, crashes
included. What the Faust runtime adds for it: `streams/consumers/faust_transactions.py`.

The model is KIP-447's. One transactional producer per worker writes every pipeline's
batches: begin, produce the records, send the input offsets (the next offset of each
input partition) with the consumer's group metadata while they are on their way, and
commit, which waits for their delivery (a record that fails fails the commit). A crash
before the commit leaves the transaction open: it is aborted (its records never become
visible to a read_committed reader) and its inputs, whose offsets it held, are answered
again.

Group commit. A producer has one transaction open at a time, and a transaction costs
a few round trips to the coordinator whatever it holds (measured here: 5-15 ms, with
tails of 50 ms on a busy machine). The batches handed over while one commits wait and
are committed together in the next, in the order they came (the runner hands over the
next batch while the last one commits), so throughput does not depend on how long a
commit takes, only latency does. After a commit the next transaction waits `SETTLE_S`:
one begun while Kafka still writes the last one's markers is refused
(CONCURRENT_TRANSACTIONS) and librdkafka retries only 20 ms later.

Fencing. The group coordinator takes offsets only from a member of the group's current
generation: a worker that lost its partitions (frozen past its session, cut off from
the group) cannot commit answers to inputs another worker owns now; its transaction
aborts. The new owner reads the committed offsets with `require_stable` (librdkafka
does under read_committed, its default; the Faust runtime reads them with librdkafka
too), so it waits for a transaction still open on its partitions to end instead of
reading past it. The transactional id is
`<app_id>.<broker.instance_id>` with static membership: a restarted worker aborts its
predecessor's open transaction at once and fences it, should it still be alive (it
ends, exit 70). Without an instance id it is unique per process, and a crashed worker's
open transaction blocks its partitions until Kafka aborts it (`transaction.timeout.ms`,
15 s, plus up to the broker's cleanup interval, 10 s by default).

Failures. A record Kafka refuses aborts the transaction; the topics' limits are read
again and the records are written anew on a new producer, one at a time, so that the
record at fault fails alone and is replaced by its dead letter (`streams/outgoing.py`).
Those one-at-a-time passes commit a few batches per transaction (`ALONE_CHUNK_RECORDS`),
so that none outlasts the transaction timeout.
A transaction that fails for the group's sake (a rebalance moved the generation on, or
the consumer joined again under its instance id with a new member id) is aborted and
written again with the consumer's current group metadata, less the answers to inputs
of partitions the consumer gave up (`give_up`: the group took them away meanwhile, and
their next owner answers those inputs). Anything else (a broker
away) aborts it and it is written again after a backoff, the same batches in the same
order (so no later batch passes an earlier one); TransactionFailed when that
does not help for ~15 s, TransactionFenced on a fatal error (this producer fenced by a
newer one). Both end the worker (exit 70) without committing anything more. Not so a
fence met by a transaction open past the transaction timeout: Kafka aborted it and
bumped the producer's epoch itself, which librdkafka reports the same way; a new
producer writes its batches again. A
transactional call that does not return `STUCK_GRACE_S` after its own timeout (a known
librdkafka fault after a broker outage) is left behind on its thread: a new producer
takes over and the attempt counts as failed. Not so a commit: one whose outcome stays
unknown (timed out three times, or never returned) may have committed, so it ends the
worker (TransactionFailed) instead of writing its batches again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import sys
import threading
import time
import uuid
from collections import Counter as Tally
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer, TopicPartition

from schemas.errors import HeadraceError
from streams.config import BrokerConfig, HeadraceConfig
from streams.errors import PublishError, TransactionFailed, TransactionFenced
from streams.metrics import LEFT_OUT
from streams.outgoing import TOO_LARGE, UNPUBLISHABLE, Outgoing, wire_bytes
from streams.publish import (
    _REFUSED,
    _SIZE,
    _STOPPED,
    Publisher,
    _Delivery,
    _Producer,
    produce_fitted,
)
from streams.records import InputRecord, partition_names

log = logging.getLogger(__name__)

# Longest a transaction may stay open before Kafka aborts it; also bounds how long a
# record may wait for delivery in one (librdkafka wants it no longer than this).
TRANSACTION_TIMEOUT_MS = 15_000
TRANSACTION_TIMEOUT_S = TRANSACTION_TIMEOUT_MS / 1000
# Longest one transactional call (init, send offsets, commit, abort) may block.
CALL_TIMEOUT_S = 10.0
# How long past its own timeout a transactional call is waited for before its producer
# is given up: librdkafka's send_offsets_to_transaction ignores its timeout while the
# group coordinator is away (librdkafka issues 5456, 5511) and can block for good,
# holding its transaction open; a successor producer fences it and aborts that.
STUCK_GRACE_S = 5.0
# How long Kafka usually takes to write a committed transaction's markers: the next
# transaction begins no sooner (measured on a local broker: 3 ms made a transaction
# of 64 records 10 ms instead of 29 ms).
SETTLE_S = 0.003
# Batches of a pipeline handed over while earlier ones commit (the runner's
# `publish_ahead`): the next transaction takes them together.
BATCHES_AHEAD = 16
# Records a transaction holds at most while each is sent alone (a round trip each,
# 1-2 ms here: a chunk's pass takes well under a second).
ALONE_CHUNK_RECORDS = 256
# Delays between attempts of a transaction Kafka could not take (as the runner's).
RETRY_DELAYS_S = (0.1, 0.3, 1.0, 3.0, 10.0)
# Attempts with fresh group metadata after the group moved on, and attempts after the
# records were failed for the producer's sake, before counting as a failed attempt.
_GROUP_ATTEMPTS = 5
_PURGED = 3
# Attempts of a commit that times out (each up to CALL_TIMEOUT_S) before its outcome
# counts as unknown.
_COMMIT_ATTEMPTS = 3
# What stands for a record not produced because librdkafka's queue was full.
_QUEUE_FULL = KafkaError(KafkaError._QUEUE_FULL)
# Longest a transaction waits for the consumer to be a member of its group (joining).
_MEMBER_WAIT_S = 10.0

_MAGIC = b"CGMDv2:"
# The offsets were sent for a generation or member the group no longer has.
_GROUP_MOVED = frozenset(
    {
        KafkaError.ILLEGAL_GENERATION,
        KafkaError.UNKNOWN_MEMBER_ID,
        KafkaError.REBALANCE_IN_PROGRESS,
    }
)

# Offsets refused for a member id the instance id no longer has (`_rejoined_since`).
_FENCED_INSTANCE = KafkaError.FENCED_INSTANCE_ID
# This producer fenced: by a newer one with its transactional id, or by Kafka aborting
# its transaction at the transaction timeout.
_FENCED = KafkaError._FENCED

GroupMetadata = Callable[[], Awaitable[bytes]]
"""Reads the consumer's group metadata (librdkafka's serialized form) where it is safe."""

# A record of a transaction: (its batch's position in the transaction, its index).
Where = tuple[int, int]
# Waits for the delivery reports of the records produced; their failures.
Reports = Callable[[], Awaitable[dict[Where, KafkaError]]]


def transactional_id(config: HeadraceConfig) -> str:
    """Stable across restarts with static membership (`broker.instance_id`), so that a
    restarted worker fences its predecessor and aborts what it left open; otherwise
    unique to this process."""
    instance = config.broker.instance_id or uuid.uuid4().hex
    return f"{config.app_id}.{instance}"


def next_offsets(inputs: Iterable[InputRecord]) -> list[TopicPartition]:
    """The offset to commit for each input partition: its last input's plus one."""
    last: dict[tuple[str, int], int] = {}
    for record in inputs:
        where = (record.topic, record.partition)
        if record.offset > last.get(where, -1):
            last[where] = record.offset
    return [TopicPartition(topic, partition, offset + 1)
            for (topic, partition), offset in last.items()]  # fmt: skip


def is_member(metadata: bytes) -> bool:
    """Whether group metadata names a member of a generation. librdkafka writes it as
    `CGMDv2:`, the generation (int32, host order), the group id and the member id
    (each NUL-terminated), then the instance id. A consumer that has not joined (or
    lost its membership) has generation -1 or no member id; offsets sent with
    generation -1 skip the coordinator's generation check, so they must never be sent."""
    identity = member_identity(metadata)
    if identity is None:
        return True  # a format this code does not know: leave the check to the broker
    generation, member_id = identity
    return generation >= 0 and member_id != b""


def member_identity(metadata: bytes) -> tuple[int, bytes] | None:
    """(generation, member id) of librdkafka's group metadata; None for another format."""
    if not metadata.startswith(_MAGIC) or len(metadata) < len(_MAGIC) + 4:
        return None
    at = len(_MAGIC)
    generation = int.from_bytes(metadata[at : at + 4], sys.byteorder, signed=True)
    group_end = metadata.find(b"\0", at + 4)
    member_end = metadata.find(b"\0", group_end + 1)
    if group_end < 0 or member_end < 0:
        return None
    return generation, metadata[group_end + 1 : member_end]


def group_metadata(
    group_id: str, generation: int, member_id: str, instance_id: str | None
) -> bytes:
    """A member's group metadata in librdkafka's form (see `is_member`; then a byte
    saying whether the instance id is null and, if not, the NUL-terminated instance id),
    for a consumer librdkafka cannot serialize itself (aiokafka's, on the Faust runtime)."""
    instance = b"\1" if instance_id is None else b"\0" + instance_id.encode() + b"\0"
    generation_bytes = generation.to_bytes(4, sys.byteorder, signed=True)
    return b"".join((_MAGIC, generation_bytes, group_id.encode() + b"\0",
                     member_id.encode() + b"\0", instance))  # fmt: skip


def _count_left_out(batches: list[Outgoing], kept: list[Where]) -> None:
    """Count and log, once their transaction committed (or had nothing to commit), the
    answers of `batches` an attempt left out (`TransactionalPublisher.give_up`)."""
    if len(kept) == sum(map(len, batches)):
        return
    kept_per_batch = Tally(position for position, _ in kept)
    for position, batch in enumerate(batches):
        if left_out := len(batch) - kept_per_batch[position]:
            LEFT_OUT.labels(batch.pipeline).inc(left_out)
    log.warning("%d answers to inputs of partitions taken away before they were committed "
                "were left out of the transaction: their next owner answers those inputs",
                sum(map(len, batches)) - len(kept))  # fmt: skip


class UnfinishedRevoke(HeadraceError):
    """Partitions were revoked before the transactions of everything taken from them were
    committed: committing those later could repeat the answers of their next owner."""

    def __init__(self, left: int, partitions: Sequence[tuple[str, int]]) -> None:
        where = partition_names(partitions)
        super().__init__(
            f"{where} revoked with {left} records not yet committed: ending without "
            "committing them, so that their next owner answers them once"
        )


class TransactionalPublisher(Publisher):
    """`await publish(batch)` returns once the batch's records and its input offsets are
    committed, in one transaction with the batches handed over while the last one
    committed. Blocks while constructed (topic limits, then `init_transactions`, which
    aborts a transaction its predecessor left open). Call `attach` with the consumer's
    group metadata reader before the first publish."""

    def __init__(
        self,
        broker: BrokerConfig,
        topics: Iterable[str],
        overrides: Mapping[str, Any] | None = None,
        *,
        transactional_id: str,
        make_producer: Callable[[dict[str, Any]], Any] = Producer,
        read_limits: Callable[[Sequence[str]], Mapping[str, int]] | None = None,
        retry_delays_s: Sequence[float] = RETRY_DELAYS_S,
    ) -> None:
        transactional = {
            **(overrides or {}),
            "transactional.id": transactional_id,
            "transaction.timeout.ms": TRANSACTION_TIMEOUT_MS,
            "delivery.timeout.ms": TRANSACTION_TIMEOUT_MS,
            # The first retry of a coordinator's transient answer (a transaction still
            # completing, say) after 10 ms, not 100 (about 1% of transactions took 100 ms
            # longer); retries back off exponentially from there, to 1 s.
            "retry.backoff.ms": 10,
            # Its records are produced one by one; the commit sends what lingers at once.
            "linger.ms": 1,
        }

        def make_transactional(config: dict[str, Any]) -> Any:
            # A failed record aborts its whole transaction, so no later record can pass
            # it: the gapless guarantee (and librdkafka's warning about it) is not needed.
            config.pop("enable.gapless.guarantee", None)
            return make_producer(config)

        super().__init__(
            broker, topics, transactional, make_producer=make_transactional,
            read_limits=read_limits,
        )  # fmt: skip
        self.transactional_id = transactional_id
        self._retry_delays_s = tuple(retry_delays_s)
        self._caller = _Caller()
        try:
            _initialize(self._current)
        except KafkaException as exc:
            raise PublishError(
                f"could not initialize the transactional producer {transactional_id!r}: "
                f"{exc.args[0].str()}; hint: delivery: exactly_once needs Kafka 2.5 or later "
                "with its transaction state log (on one broker: "
                "transaction.state.log.replication.factor=1, transaction.state.log.min.isr=1)"
            ) from exc
        self._group_metadata: GroupMetadata | None = None
        self._metadata: bytes | None = None
        # Batches handed over, each with the future its transaction's end settles.
        self._waiting: list[tuple[Outgoing, asyncio.Future[None]]] = []
        self._one_at_a_time = asyncio.Lock()
        self._open = False
        self._begun_at = 0.0
        self._ended_at = 0.0
        # A producer Kafka fenced by aborting its transaction at the timeout (`_check_fatal`):
        # replaced before the next attempt.
        self._timed_out: _Producer | None = None
        # Input partitions whose answers no transaction holds any more (`give_up`).
        self._given_up: set[tuple[str, int]] = set()

    def attach(self, group_metadata: GroupMetadata) -> None:
        """Where to read the consumer's group metadata (the consumer's poll thread)."""
        self._group_metadata = group_metadata

    def give_up(self, partitions: Iterable[tuple[str, int]]) -> None:
        """Leave the answers to inputs of `partitions`, and their offsets, out of every
        transaction from the next attempt on: the group took those partitions away before
        their answers were committed, and their next owner answers them (this worker,
        should they come back). A transaction whose offsets the group took before it did
        may still commit: those answers then count once, as committed. Such answers
        count as written for the runner. From any thread, until `take_back`."""
        self._given_up.update(partitions)

    def take_back(self, partitions: Iterable[tuple[str, int]]) -> None:
        """Answers of `partitions` go in transactions again: call once every input taken
        from them before `give_up` is answered or left out, and none since."""
        self._given_up.difference_update(partitions)

    async def publish(self, batch: Outgoing) -> None:
        """Commit the batch's records (each itself, or a dead letter in its place) with
        its input offsets, in the next transaction, after those of the batches handed
        over before it. TransactionFailed when Kafka could not take them for ~15 s,
        TransactionFenced when this producer can never commit again: nothing of the
        batch is then committed, and the worker must end."""
        committed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append((batch, committed))  # at once: the order batches came in
        async with self._one_at_a_time:
            if committed.done():  # in a transaction led by a batch before it
                return committed.result()
            group, self._waiting = self._waiting, []
            try:
                await self._commit_with_retries([batch for batch, _ in group])
            except BaseException as exc:
                for _batch, other in group:
                    if other is committed or other.done():
                        continue
                    if isinstance(exc, asyncio.CancelledError):
                        other.cancel()  # a stop: its transaction was left open, aborted
                    else:
                        other.set_exception(exc)
                raise
            for _batch, other in group:
                other.set_result(None)

    async def _commit_with_retries(self, batches: list[Outgoing]) -> None:
        if await self._with_retries(batches, one_by_one=False):
            return
        # Kafka refused a record batch whole: its records go alone, each waiting for its
        # delivery, to find the one at fault. Such a pass costs a round trip a record,
        # so the group is committed a few batches at a time, each chunk a transaction of
        # its own: a pass ends well inside the transaction timeout however large the
        # group, and a record found at fault sends only its own chunk again.
        for chunk in _chunks(batches, ALONE_CHUNK_RECORDS):
            await self._with_retries(chunk, one_by_one=True)

    async def _with_retries(self, batches: list[Outgoing], one_by_one: bool) -> bool:
        """Commit `batches` with their input offsets, retried with backoff. False when
        Kafka refused a record batch whole (not `one_by_one`): nothing was committed."""
        size = sum(len(batch) for batch in batches)
        for attempt, delay_s in enumerate((*self._retry_delays_s, None), start=1):
            try:
                return await self._transact(batches, one_by_one)
            except PublishError as exc:
                if delay_s is None:
                    raise TransactionFailed(
                        f"a transaction of {size} records failed {attempt} times; last: {exc}"
                    ) from exc
                log.warning("a transaction of %d records failed (attempt %d: %s); retrying",
                            size, attempt, exc)  # fmt: skip
                await asyncio.sleep(delay_s)

    async def _transact(self, batches: list[Outgoing], one_by_one: bool) -> bool:
        """One attempt: the records of `batches` and their input offsets in a
        transaction (less those given up), written again at once where that can help;
        True once committed. False when Kafka refused a record batch whole and the
        records must go `one_by_one` (the topics' limits are read again first).
        PublishError where only time can help.

        The offsets go to the transaction while the records are on their way; the
        commit waits for their delivery reports here, since librdkafka's own wait (in
        `commit_transaction`) checks in steps of 10 ms for reports this publisher's
        poll thread takes."""
        group_attempts = purged = 0
        while True:
            # Membership first: a worker waiting to be a member again (its session
            # lapsed) must not hold a transaction open meanwhile, which would hide every
            # later answer on its output partitions from read_committed readers.
            metadata = await self._member_metadata()
            if self._timed_out is not None:
                await self._replace(self._timed_out, read_limits=False)
                self._timed_out = None
            await self._settle()
            current = self._current
            records, offsets = self._kept(batches)
            if not records:
                _count_left_out(batches, records)
                return True  # every answer given up: nothing to commit
            self._call(current.producer.begin_transaction)
            self._open = True
            self._begun_at = time.monotonic()
            try:
                failures, reports = await self._send(current, batches, records, one_by_one)
            except PublishError as exc:
                # Even a record's smallest dead letter exceeds its topic's limit: no
                # retry can write it; the error names the topic.
                await self._abort(current)
                raise TransactionFailed(str(exc)) from exc
            commit_error = None
            if not failures:
                try:
                    await self._blocking(
                        current, current.producer.send_offsets_to_transaction,
                        offsets, metadata, CALL_TIMEOUT_S,
                    )  # fmt: skip
                except KafkaException as exc:
                    commit_error = exc.args[0]
                    if commit_error.code() != _FENCED_INSTANCE:  # checked once aborted
                        self._check_fatal(commit_error)
            reported = commit_error is None
            if reported:
                failures.update(await reports())  # every record delivered, or failed
                if not failures:
                    try:
                        await self._commit(current)
                    except KafkaException as exc:
                        commit_error = exc.args[0]
                        self._check_fatal(commit_error)
            if failures or commit_error is not None:
                await self._abort(current)  # which fails what is still queued (purged)
            if not reported:
                failures.update(await reports())
            if not failures and commit_error is None:
                _count_left_out(batches, records)
                return True
            for error in failures.values():
                self._check_fatal(error)
            fenced = commit_error is not None and commit_error.code() == _FENCED_INSTANCE
            if fenced and not await self._rejoined_since(metadata):
                self._check_fatal(commit_error)  # another process holds the instance id
            refused = sorted(at for at, error in failures.items() if error.code() in _REFUSED)
            if refused and one_by_one and len(refused) == 1:
                # Sent alone, after everything before it was delivered: at fault.
                ((position, index),) = refused
                batch, error = batches[position], failures[refused[0]]
                batch.reduce(
                    index,
                    TOO_LARGE if error.code() in _SIZE else UNPUBLISHABLE,
                    f"{batch.records[index].topic} refused its "
                    f"{wire_bytes(batch.records[index])} bytes: {error.str()}",
                )
            elif refused:
                # A record batch refused whole: limits may have been lowered. A new
                # producer sized by them sends each record alone to find the one.
                await self._replace(current, read_limits=True)
                if not one_by_one:
                    return False
            elif commit_error is not None and (commit_error.code() in _GROUP_MOVED or fenced):
                if group_attempts == _GROUP_ATTEMPTS:
                    raise PublishError(f"the group kept moving on: {commit_error.str()}")
                # The group has a new generation (a rebalance): ask for it and retry.
                group_attempts += 1
                self._metadata = None
                log.info("the group moved on (%s): writing it again", commit_error.name())
            elif {error.code() for error in failures.values()} <= _STOPPED and purged < _PURGED:
                # Failed for the producer's sake (purged while it reset itself after an
                # abort), not for anything they hold: send them again.
                purged += 1
            else:
                first = commit_error or failures[min(failures)]
                raise PublishError(f"the transaction was aborted: {first.str()}")

    def _kept(self, batches: list[Outgoing]) -> tuple[list[Where], list[TopicPartition]]:
        """The records of an attempt, in order, and their input offsets: all but those
        answering inputs of partitions given up, which count as written. Nothing of an
        aborted attempt was written: every record kept goes again."""
        given_up = frozenset(self._given_up)  # a copy: `give_up` may run on another thread
        records: list[Where] = []
        for position, batch in enumerate(batches):
            for index, source in enumerate(batch.inputs):
                left_out = (source.topic, source.partition) in given_up
                batch.delivered[index] = left_out
                if not left_out:
                    records.append((position, index))
        offsets = next_offsets(batches[position].inputs[index] for position, index in records)
        return records, offsets

    async def _send(
        self, current: _Producer, batches: list[Outgoing], records: list[Where], one_by_one: bool
    ) -> tuple[dict[Where, KafkaError], Reports]:
        """Produce `records` of `batches` in order. Returns the failures so far and what
        waits for the other records' reports (call it once); with `one_by_one`, each
        record's report is waited for before the next is sent, and the first failure
        ends it."""
        if not one_by_one:
            return self._produce_records(current, batches, records)
        for record in records:
            failures, reports = self._produce_records(current, batches, [record])
            failures.update(await reports())
            if failures:
                return failures, _no_reports  # the transaction aborts: the rest waits
        return {}, _no_reports

    def _produce_records(
        self, current: _Producer, batches: list[Outgoing], records: list[Where]
    ) -> tuple[dict[Where, KafkaError], Reports]:
        loop = asyncio.get_running_loop()
        produce = current.producer.produce
        deliveries = [_Delivery(loop, batch) for batch in batches]
        sent = [0] * len(batches)
        failures: dict[Where, KafkaError] = {}
        for at, (position, index) in enumerate(records):
            batch = batches[position]
            self._fitting(batch, index)
            try:
                error = produce_fitted(produce, batch, index, deliveries[position].report)
            except BufferError:
                # librdkafka's local queue is full (more than a transaction should
                # hold): count the rest as failed for now; the attempt is retried.
                error = _QUEUE_FULL
            if error is not None:
                # The transaction failed, or the producer: so for the rest.
                failures.update(dict.fromkeys(records[at:], error))
                break
            sent[position] += 1

        async def reports() -> dict[Where, KafkaError]:
            # Each record produced is reported, delivered or failed (an abort fails
            # what is still queued): a retry never overlaps a record still in flight.
            reported: dict[Where, KafkaError] = {}
            for position, delivery in enumerate(deliveries):
                for index, error in (await delivery.seal(sent[position])).items():
                    reported[(position, index)] = error
            return reported

        return failures, reports

    async def _settle(self) -> None:
        """Wait until the last commit is `SETTLE_S` old (see the module docstring)."""
        wait_s = self._ended_at + SETTLE_S - asyncio.get_running_loop().time()
        if wait_s > 0:
            await asyncio.sleep(wait_s)

    async def _rejoined_since(self, sent: bytes) -> bool:
        """Whether offsets refused as FENCED_INSTANCE_ID were refused because this
        worker's own consumer joined again since `sent` was read: with static membership
        a consumer whose session lapsed (a broker outage longer than the session) comes
        back under the same instance id with a new member id, which fences the old one.
        Then the group only moved on, as after a rebalance. Otherwise another process
        holds the instance id: this worker is the zombie (TransactionFenced). Asked once
        the attempt's transaction is aborted: while the consumer is still joining this
        waits, and an open transaction would hold read_committed readers back meanwhile."""
        if self._group_metadata is None:
            return False
        self._metadata = None
        try:
            now = member_identity(await self._member_metadata())  # a member again
        except PublishError:
            return False
        was = member_identity(sent)
        return now is not None and was is not None and now[1] != was[1]

    async def _member_metadata(self) -> bytes:
        """The consumer's group metadata, once it is a member of a generation."""
        if self._metadata is not None:
            return self._metadata
        if self._group_metadata is None:
            raise RuntimeError("TransactionalPublisher.attach was not called")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _MEMBER_WAIT_S
        while True:
            metadata = await self._group_metadata()
            if is_member(metadata):
                self._metadata = metadata
                return metadata
            if loop.time() > deadline:
                raise PublishError(
                    f"the consumer has not been a member of its group for {_MEMBER_WAIT_S:.0f} s "
                    "(joining, or its session lapsed): offsets cannot be committed"
                )
            await asyncio.sleep(0.05)

    async def _commit(self, current: _Producer) -> None:
        """Commit the open transaction. One that times out is still under way: librdkafka
        resumes it when asked again. One whose outcome stays unknown ends the worker
        (TransactionFailed): it may have committed, so writing its batches again could
        answer them twice, while a restart reads the offsets as they were committed."""
        for attempt in range(1, _COMMIT_ATTEMPTS + 1):
            try:
                await self._off_loop(current.producer.commit_transaction, CALL_TIMEOUT_S)
                self._open = False
                self._ended_at = asyncio.get_running_loop().time()
                return
            except KafkaException as exc:
                error = exc.args[0]
                if not error.retriable():
                    raise  # aborted: nothing of it was committed
                if attempt == _COMMIT_ATTEMPTS:
                    raise TransactionFailed(
                        f"committing a transaction failed {attempt} times ({error.str()}): "
                        "whether it committed is unknown"
                    ) from exc
                log.warning("committing a transaction: %s; trying again", error.str())
            except TimeoutError as exc:
                raise TransactionFailed(
                    f"{exc}: whether the transaction committed is unknown"
                ) from exc

    async def _abort(self, current: _Producer) -> None:
        """Abort the open transaction; where that fails (a broker away), replace the
        producer: its successor's `init_transactions` aborts it."""
        try:
            await self._blocking(current, current.producer.abort_transaction, CALL_TIMEOUT_S)
        except KafkaException as exc:
            self._check_fatal(exc.args[0])
            log.warning("could not abort a transaction (%s): replacing the producer",
                        exc.args[0].str())  # fmt: skip
            await self._replace(current, read_limits=False)
        self._open = False
        self._ended_at = asyncio.get_running_loop().time()

    async def _replace(self, stopped: _Producer, read_limits: bool) -> None:
        """A new producer with the same transactional id: its initialization fences the
        old one and aborts what it left open."""
        if stopped is not self._current:
            return
        if read_limits and self._fixed_limit is None:
            self.limits = await asyncio.to_thread(self._limits, None)
        successor = self._new_producer()
        try:
            await self._off_loop(successor.producer.init_transactions, CALL_TIMEOUT_S)
        except KafkaException as exc:
            raise PublishError(f"a new transactional producer: {exc.args[0].str()}") from exc
        except TimeoutError as exc:
            raise PublishError(f"a new transactional producer: {exc}") from exc
        with self._retiring_lock:
            self._retiring.append(stopped)
        self._current = successor
        log.warning("a new transactional producer takes over; topic limits: %s", self.limits)

    def _call(self, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except KafkaException as exc:
            self._check_fatal(exc.args[0])
            raise PublishError(f"Kafka transaction: {exc.args[0].str()}") from exc

    async def _blocking(self, current: _Producer, call: Callable[..., Any], *args: Any) -> Any:
        """A transactional call of `current`, which blocks until the coordinator answers,
        on a thread. Where it is stuck past its timeout, `current` is replaced (which aborts
        its transaction) and PublishError raised: the attempt is tried again."""
        try:
            return await self._off_loop(call, *args)
        except TimeoutError as exc:
            log.warning("%s; a new transactional producer takes over", exc)
            self._open = False
            await self._replace(current, read_limits=False)
            raise PublishError(str(exc)) from exc

    async def _off_loop(self, call: Callable[..., Any], *args: Any) -> Any:
        """`call(*args)` on the caller thread; TimeoutError where it is stuck past its
        timeout, and later calls go to a new caller thread."""
        try:
            return await self._caller.call(call, *args)
        except TimeoutError:
            self._caller = _Caller()  # the spent one's thread stays with the stuck call
            raise

    def _check_fatal(self, error: KafkaError) -> None:
        if not error.fatal() and error.code() not in (_FENCED, _FENCED_INSTANCE):
            return
        open_s = time.monotonic() - self._begun_at
        if error.code() == _FENCED and self._open and open_s >= TRANSACTION_TIMEOUT_S:
            # Kafka aborts a transaction open past its timeout (a broker away meanwhile) and
            # bumps the producer's epoch, which librdkafka reports as a newer instance. A
            # newer one it may also be, but then its own transactions and the group refuse
            # this worker's next ones (it ends then): a new producer writes these again.
            self._open, self._metadata, self._timed_out = False, None, self._current
            raise PublishError(
                f"the transaction was open {open_s:.0f} s, past Kafka's transaction "
                f"timeout, and Kafka aborted it ({error.str()})"
            )
        raise TransactionFenced(
            f"the transactional producer {self.transactional_id!r} can write no more "
            f"({error.str()}): a newer worker with this id (or with this worker's "
            "broker.instance_id) took over; nothing more is committed"
        )

    def stop(self, timeout_s: float = 30.0) -> None:
        """Abort a transaction left open (a stop while a batch failed), then as
        Publisher.stop. Safe twice."""
        if self._open:
            try:
                self._current.producer.abort_transaction(min(timeout_s, CALL_TIMEOUT_S))
            except KafkaException as exc:
                log.warning("could not abort the open transaction: %s", exc.args[0].str())
            self._open = False
        self._caller.stop()
        super().stop(timeout_s)


class _Caller:
    """A daemon thread that makes the transactional calls, one at a time. A call that
    never returns is left there with its thread, which holds neither the loop, nor a pool
    thread, nor the process's exit; the publisher then makes a new `_Caller`."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[Any] = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="headrace-transactions", daemon=True).start()

    async def call(self, call: Callable[..., Any], *args: Any) -> Any:
        """`call(*args)` (its last argument its timeout in seconds), waited for up to
        `STUCK_GRACE_S` past that timeout; TimeoutError then, and this caller is spent."""
        loop = asyncio.get_running_loop()
        outcome: asyncio.Future[Any] = loop.create_future()
        self._calls.put((call, args, loop, outcome))
        limit_s = args[-1] + STUCK_GRACE_S
        try:
            return await asyncio.wait_for(outcome, limit_s)
        except TimeoutError:
            self.stop()  # its thread ends, should the call ever return
            name = getattr(call, "__name__", "call")
            raise TimeoutError(
                f"librdkafka's {name} has not returned after {limit_s:.0f} s, past its "
                f"timeout of {args[-1]:.0f} s"
            ) from None

    def stop(self) -> None:
        """Its thread ends once the calls asked for before are made. Safe twice."""
        self._calls.put(None)

    def _serve(self) -> None:
        while (work := self._calls.get()) is not None:
            call, args, loop, outcome = work
            try:
                result, error = call(*args), None
            except BaseException as exc:  # handed to the loop, raised there
                result, error = None, exc
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(_settle, outcome, result, error)


def _chunks(batches: list[Outgoing], records: int) -> Iterator[list[Outgoing]]:
    """`batches` in order, in runs of whole batches of about `records` records each."""
    chunk: list[Outgoing] = []
    size = 0
    for batch in batches:
        chunk.append(batch)
        size += len(batch)
        if size >= records:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _settle(outcome: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if outcome.done():  # given up on meanwhile
        return
    if error is None:
        outcome.set_result(result)
    else:
        outcome.set_exception(error)


def _initialize(current: _Producer) -> None:
    """`init_transactions` (blocks): fences older producers with this transactional id
    and aborts the transaction they left open. KafkaException when it cannot."""
    current.producer.init_transactions(CALL_TIMEOUT_S)


async def _no_reports() -> dict[Where, KafkaError]:
    return {}
