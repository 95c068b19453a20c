"""Decode and validate: wire format -> event, validation rules -> dead letters; each
event's deadline and priority, computed here once (`streams/admit.py: Tickets`).

Decoding runs on the event loop, but resolving a schema id it has not seen may ask the
registry (blocking HTTP): those lookups run on a thread first (`resolve`), so the loop
never waits on the network and lookup time never counts as decode time (what admission
measures). A registry that cannot be reached leaves the id unresolved, for the runner
to retry while its records wait (`streams/holds.py`); an id the registry does not know
dead-letters its records (`unknown_schema`).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from schemas.codec import AvroDecoder, schema_id_of
from schemas.errors import DecodeError, RegistryError
from schemas.validation import EventRules
from streams import metrics
from streams.admit import Tickets
from streams.records import InputRecord, Item
from streams.tracing import NO_TRACING, NoTracing, Tracing


def _settle(future: asyncio.Future, set_outcome: Callable[[Any], None], value: Any) -> None:
    if not future.cancelled():
        set_outcome(value)


class EventDecoder:
    def __init__(
        self,
        codec: AvroDecoder,
        rules: EventRules,
        tickets: Tickets,
        measure: metrics.PipelineMetrics,
        tracing: Tracing | NoTracing = NO_TRACING,
    ) -> None:
        self._codec = codec
        self._tracing = tracing
        self._rules = rules
        self._tickets = tickets
        self._metrics = measure

    def needs_lookup(self, records: Sequence[InputRecord]) -> bool:
        """Whether decoding `records` would first ask the registry (an id not seen yet)."""
        return bool(self._codec.unknown_ids(record.value for record in records))

    def lookup_ids(self, records: Sequence[InputRecord]) -> list[int | None]:
        """Per record, the schema id to resolve before it decodes (None: nothing to)."""
        unknown = self._codec.unknown_ids(record.value for record in records)
        if not unknown:
            return [None] * len(records)
        return [i if (i := schema_id_of(r.value)) in unknown else None for r in records]

    async def resolve(self, schema_ids: Iterable[int]) -> dict[int, RegistryError]:
        """Look these ids up on a thread, each on its own (one that fails holds back no
        other). Returns the ids that failed (registry unreachable) with their errors; an
        id the registry does not know is resolved too (its records dead-letter).

        The thread is a daemon of its own, not the loop's executor: a lookup cannot be
        cancelled, and a stop must not wait for a registry that does not answer."""
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[dict[int, RegistryError]] = loop.create_future()
        ids = list(schema_ids)

        def look_up() -> None:
            try:
                outcome = (answer.set_result, self._resolve(ids))
            except BaseException as exc:  # a bug: the caller meets it
                outcome = (answer.set_exception, exc)
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: a stop
                loop.call_soon_threadsafe(_settle, answer, *outcome)

        threading.Thread(target=look_up, name="registry-lookup", daemon=True).start()
        return await answer

    def _resolve(self, schema_ids: list[int]) -> dict[int, RegistryError]:
        failed = {}
        for schema_id in schema_ids:
            try:
                self._codec.learn([schema_id])
            except RegistryError as exc:
                failed[schema_id] = exc
        return failed

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
        self._tracing.read(records, items, seconds)
        return items
