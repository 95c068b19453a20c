"""The records that travel through a pipeline: a consumed input, the item it becomes
on its way through the stages, and an outcome record to write."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from schemas.errors import DecodeError

if TYPE_CHECKING:
    from streams.admit import Route


class InputRecord(NamedTuple):
    """A consumed Kafka record, as the pipeline needs it. A tuple: one is built per
    consumed record, and a frozen dataclass costs several times as much to build."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int
    key: bytes | None
    value: bytes | None
    headers: Sequence[tuple[str, bytes]] = ()


@dataclass(frozen=True)
class OutRecord:
    topic: str
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]] = field(default_factory=list)


@dataclass(slots=True)
class Item:
    """One input on its way: decoded (or failed), admitted, answered."""

    record: InputRecord
    handle: Any
    """What the consumer wants back when the record is acknowledged."""
    deadline_s: float
    """Epoch seconds by which its answer should be written (computed once, at decode)."""
    event: dict[str, Any] | None = None
    error: DecodeError | None = None
    """Why it cannot be answered (it is dead-lettered); None when it decoded."""
    priority: int = 0
    decode_us: int = 0
    """Microseconds its chunk took to decode."""
    route: Route | None = None
    reason: str | None = None
    cache_key: tuple = ()
    cached: dict[str, Any] | None = None
    """A fresh answer for the same input from the answer cache."""
    row: int | None = None
    """Its row in the batch's feature rows, where it needed store features."""
    candidate: bool = False
    """Whether a canary candidate answers it instead of the serving model."""
    answer: dict[str, Any] | None = None
    """The model's answer fields."""
    trace: Any = None
    """Its trace context and decode window, with tracing on (`streams/tracing.py`)."""
    answered_before: bool = False
    """Already answered, by a worker that stopped before committing it (`streams/replay.py`):
    acknowledged with its batch, never answered again."""
    redelivered: bool = False
    """Read again after a handover whose check could not see an earlier answer
    (`streams/replay.py`): its outcome carries the `headrace.redelivered` header."""


def partition_names(partitions: Iterable[tuple[str, int]]) -> str:
    """`topic[partition]` of each, as the worker's log lines and errors name them."""
    return ", ".join(f"{topic}[{partition}]" for topic, partition in partitions)
