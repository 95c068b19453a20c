"""Exactly-once on the Faust runtime: what the transactional publisher
(`streams/transact.py`, librdkafka) needs from Faust's consumer (aiokafka).

The model stays KIP-447's, as on the bare runtime: one transactional producer per
worker, each transaction sending its input offsets with the group metadata of the
consumer that read them. Three things differ, because aiokafka consumes:

- **Group metadata.** librdkafka can only serialize the metadata of its own consumers.
  `transact.group_metadata` writes the same bytes from aiokafka's coordinator (group id,
  generation, member id, instance id), so the group coordinator checks the generation
  of every offset sent, and a worker that lost its partitions cannot commit answers to
  them: its transaction aborts.
- **Stable offsets.** A new owner must not read a partition's committed offset while a
  transaction of its previous owner still holds offsets of it (the answers would come
  twice once that transaction commits). librdkafka's offset fetch asks the broker to
  wait for such transactions (`require_stable`); aiokafka's cannot. `StableOffsets`
  reads them with a confluent-kafka consumer of the group that never joins it, and
  Faust's seek to the committed offsets, which it makes after every assignment before
  fetching resumes, seeks there (`faust_feed._LoopConsumer.seek_to_committed`).
- **No commits of Faust's own.** Each batch's offsets are committed in its transaction;
  a commit of Faust's, made beside them, could move an offset back.

On a rebalance Faust waits for every record the agents took to be acknowledged, which
here means committed in a transaction; records still unacknowledged after half a
session when the partitions must go end the worker (exit 70, as on the bare runtime):
committing them later could repeat the answers of their next owner. The waits are
`faust_feed.BulkConsumer.wait_empty` and `faust._commit_in_transactions`.

Not so when the group dropped the worker (its session lapsed: the broker away longer
than the session, the worker frozen): the group refuses its offsets already, so what it
took from those partitions is given up at once, as on the bare runtime (`LostPartitions`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient
from faust.types import TP, Message

from infra.kafka_clients import ask_group_offsets, client_settings
from schemas.errors import HeadraceError
from streams.config import BrokerConfig
from streams.publish import LOST_WAIT_S
from streams.records import partition_names
from streams.transact import TransactionalPublisher, UnfinishedRevoke, group_metadata

log = logging.getLogger(__name__)

# How long an assignment may wait for the transactions of the partitions' previous owner
# to end: Kafka aborts one left open after `transact.TRANSACTION_TIMEOUT_MS` (15 s) plus
# its abort scan (every 10 s by default). Below Faust's own limit on the seek (90 s).
STABLE_WAIT_S = 60.0
# How often partitions held by an open transaction are asked about while they wait.
STABLE_POLL_S = 0.5


def aiokafka_group_metadata(consumer: Any) -> bytes:
    """The group metadata of an aiokafka consumer as its coordinator knows it now
    (generation -1 and no member id while it is not a member of a generation)."""
    coordinator = consumer._coordinator
    return group_metadata(
        coordinator.group_id,
        coordinator.generation,
        coordinator.member_id,
        coordinator._group_instance_id,
    )


class StableOffsets:
    """The group's committed offsets, read once no transaction holds offsets of the
    partitions asked (librdkafka's read_committed offset fetch), and which partitions
    such a transaction holds now (`held`, asked every `STABLE_POLL_S` while they wait).
    Blocks: call from a thread. A read has a consumer of its own, closed after it
    (assignments are rare); `held` keeps one admin client, whose log lines wait for its
    next question."""

    def __init__(self, group_id: str, broker: BrokerConfig) -> None:
        self._group_id = group_id
        self._timeout_s = broker.connect_timeout_s
        self._client = client_settings(
            broker.bootstrap_servers, "stable-offsets", broker.connect_timeout_s
        )
        self._settings = {
            **self._client,
            "group.id": group_id,
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
        }
        self._admin: AdminClient | None = None
        self._admin_made = threading.Lock()

    def __call__(self, partitions: Iterable[tuple[str, int]]) -> Mapping[tuple[str, int], int]:
        """(topic, partition) -> the committed offset, -1 where the group has none;
        waits up to `STABLE_WAIT_S` for the transactions that hold them, then raises
        UnstableOffsets."""
        wanted = [TopicPartition(topic, partition) for topic, partition in partitions]
        if not wanted:
            return {}
        # Never subscribes: it asks the group's coordinator, it does not join the group.
        consumer = Consumer(self._settings)
        try:
            committed = consumer.committed(wanted, STABLE_WAIT_S)
        except KafkaException as exc:
            raise UnstableOffsets(wanted, exc.args[0].str()) from exc
        finally:
            consumer.close()
        return {(tp.topic, tp.partition): max(tp.offset, -1) for tp in committed}

    def held(self, partitions: Iterable[tuple[str, int]]) -> set[tuple[str, int]]:
        """The partitions whose committed offset an open transaction holds now, asked
        with the admin API, which answers for each partition at once where the
        consumer's read waits for all of them. KafkaException or TimeoutError when it
        cannot tell."""
        wanted = list(partitions)
        if not wanted:
            return set()
        with self._admin_made:  # a cancelled wait's thread may still be asking
            if self._admin is None:
                self._admin = AdminClient(self._client)
        answer = ask_group_offsets(
            self._admin, self._group_id, wanted, require_stable=True, timeout_s=self._timeout_s
        )
        held = set()
        for tp in answer.result(timeout=self._timeout_s + 5).topic_partitions:
            if tp.error is not None:
                if tp.error.code() != KafkaError.UNSTABLE_OFFSET_COMMIT:
                    raise KafkaException(tp.error)
                held.add((tp.topic, tp.partition))
        return held


async def released(reader: StableOffsets, partitions: Iterable[tuple[str, int]]) -> None:
    """Return once no open transaction holds the committed offsets of `partitions`,
    asking every `STABLE_POLL_S` on a thread (each question short, so that a stop never
    waits long for one); UnstableOffsets naming those still held past `STABLE_WAIT_S`."""
    waiting = set(partitions)
    deadline = asyncio.get_running_loop().time() + STABLE_WAIT_S
    while waiting:
        await asyncio.sleep(STABLE_POLL_S)
        with contextlib.suppress(KafkaException, TimeoutError):  # cannot tell now: ask again
            waiting = await asyncio.to_thread(reader.held, waiting)
        if waiting and asyncio.get_running_loop().time() > deadline:
            still = [TopicPartition(topic, partition) for topic, partition in sorted(waiting)]
            raise UnstableOffsets(still, "still held")


class LostPartitions:
    """Partitions the group took away with a lapsed session, given up rather than the
    worker, as on the bare runtime (`BareConsumer._finish_lost`).

    A worker the group dropped cannot commit from them any more (the coordinator refuses
    offsets of a generation gone), and aiokafka revokes them before it joins again. What
    the agents took from them is given up at once: the publisher leaves those answers and
    their offsets out of every later transaction, the records still queued for the agents
    are dropped, and their next owner answers those inputs. A transaction whose offsets
    the group took before it dropped the worker may still commit; those answers then
    count once, as committed. The next assignment seeks every partition to its committed
    offset; a partition given up comes back there (`take_back`) once every record taken
    from it before is left out or committed (acknowledged), so that none of its new
    records is left out with them."""

    def __init__(
        self,
        publisher: TransactionalPublisher,
        on_fatal: Callable[[BaseException, list[Any]], Any],
    ) -> None:
        self._publisher = publisher
        self._on_fatal = on_fatal
        self.partitions: set[TP] = set()
        # Taken from them before they were given up; left out as their batches come.
        self._leaving: list[Message] = []

    def give_up(self, partitions: Iterable[TP], taken: Iterable[Message]) -> None:
        """Give up `partitions`, from which the unacknowledged records `taken` came."""
        partitions = set(partitions)
        self._publisher.give_up((tp.topic, tp.partition) for tp in partitions)
        self.partitions |= partitions
        leaving = [message for message in taken if message.tp in partitions]
        self._leaving += leaving
        if leaving:
            log.warning("%d records of partitions the group took away were not committed: "
                        "their answers are left out of every transaction, and their next "
                        "owner answers them", len(leaving))  # fmt: skip

    def dropped(self, messages: list[Message]) -> list[Message]:
        """`messages` less those of partitions given up (fetched before they were)."""
        if not self.partitions:
            return messages
        return [message for message in messages if message.tp not in self.partitions]

    async def take_back(self, assigned: Iterable[TP]) -> None:
        """Before the seek of an assignment: partitions given up and assigned again come
        back once every record taken from them before is acknowledged. That waits at most
        for a transaction attempt; one that outlasts `LOST_WAIT_S` ends the worker (exit
        70) rather than answer those inputs twice."""
        self._leaving = [message for message in self._leaving if not message.acked]
        back = self.partitions & set(assigned)
        if not back:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + LOST_WAIT_S
        while left := [m for m in self._leaving if m.tp in back and not m.acked]:
            if loop.time() > deadline:
                where = sorted((tp.topic, tp.partition) for tp in back)
                self._on_fatal(UnfinishedRevoke(len(left), where), [])
                return
            await asyncio.sleep(0.005)  # acks come as attempts leave them out
        self._publisher.take_back((tp.topic, tp.partition) for tp in back)
        self.partitions -= back
        names = partition_names(sorted((tp.topic, tp.partition) for tp in back))
        log.info("%s back: their answers go in transactions again", names)


class UnstableOffsets(HeadraceError):
    """The committed offsets of newly assigned partitions could not be read stable."""

    def __init__(self, partitions: list[TopicPartition], reason: str) -> None:
        where = ", ".join(f"{tp.topic}[{tp.partition}]" for tp in partitions)
        super().__init__(
            f"could not read the committed offsets of {where} within {STABLE_WAIT_S:.0f} s "
            f"({reason}): a transaction of their previous owner may still be open; "
            "hint: Kafka aborts it after transaction.timeout.ms"
        )
