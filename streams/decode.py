"""Decode and validate: wire format -> event, validation rules -> dead letters; each
event's deadline and priority, computed here once (`streams/admit.py: Tickets`).

Decoding runs on the event loop, but resolving a schema id it has not seen may ask the
registry (blocking HTTP): those lookups run on a thread first, so the loop never waits
on the network. A registry that cannot be reached raises RegistryError for the runner
to retry; an id it does not know dead-letters its records (`unknown_schema`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

from schemas.codec import AvroDecoder
from schemas.errors import DecodeError
from schemas.validation import EventRules
from streams import metrics
from streams.admit import Tickets
from streams.records import InputRecord, Item


class EventDecoder:
    def __init__(
        self,
        codec: AvroDecoder,
        rules: EventRules,
        tickets: Tickets,
        measure: metrics.PipelineMetrics,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._codec = codec
        self._rules = rules
        self._tickets = tickets
        self._metrics = measure
        self._clock = clock

    def needs_lookup(self, records: Sequence[InputRecord]) -> bool:
        """Whether decoding `records` would first ask the registry (an id not seen yet)."""
        return bool(self._codec.unknown_ids(record.value for record in records))

    async def decode(self, records: Sequence[InputRecord], handles: Sequence[Any]) -> list[Item]:
        """An item per record, in order: an event with its deadline and priority, or the
        error that dead-letters it. Unknown schema ids are looked up on a thread first."""
        unknown = self._codec.unknown_ids(record.value for record in records)
        if unknown:
            await asyncio.to_thread(self._codec.learn, unknown)
        return self.decode_known(records, handles)

    def decode_known(self, records: Sequence[InputRecord], handles: Sequence[Any]) -> list[Item]:
        """`decode` for records whose schema ids are all resolved: never blocks."""
        started = time.perf_counter()
        now_s = self._clock()
        metrics.observe_many(
            self._metrics.admission_lag,
            [max(0.0, now_s - r.timestamp_ms / 1000) for r in records],
        )
        decode, check, tickets = self._codec.decode, self._rules.check, self._tickets
        items = []
        for record, handle in zip(records, handles, strict=True):
            try:
                event = decode(record.value)
                check(event)
            except DecodeError as exc:
                items.append(Item(record, handle, tickets.deadline_s(record, None), error=exc))
                continue
            items.append(
                Item(record, handle, tickets.deadline_s(record, event), event,
                     priority=tickets.priority(record, event))
            )  # fmt: skip
        seconds = time.perf_counter() - started
        self._metrics.stage["decode"].observe(seconds)
        micros = int(seconds * 1e6)
        for item in items:
            item.decode_us = micros
        return items
