"""Schema ids resolved off the event loop: a slow registry never blocks the loop and never
counts as decode time (what admission measures); an id the registry does not know
dead-letters its records, one it cannot answer for now is reported for a retry."""

from __future__ import annotations

import asyncio
import io
import struct
import time
from pathlib import Path

import fastavro

from schemas.catalogue import LocalCatalogue, load_schema
from schemas.codec import AvroDecoder, AvroEncoder
from schemas.errors import RegistryError, SchemaNotFoundError
from schemas.validation import EventRules
from streams import metrics
from streams.admit import Admission, Ladder, Tickets
from streams.config import PipelineConfig
from streams.decode import EventDecoder
from streams.records import InputRecord
from tools.deploy import sample_config

LOOKUP_S = 0.2  # a slow registry


class SlowRegistry:
    """Answers id 3 slowly, does not know id 4242, cannot be reached for id 77."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def schema_for_id(self, schema_id: int) -> dict:
        self.calls.append(schema_id)
        if schema_id == 77:
            raise RegistryError("registry unreachable")
        if schema_id != 3:
            raise SchemaNotFoundError(schema_id, "the test registry")
        time.sleep(LOOKUP_S)  # the slow answer itself, on the lookup's thread
        return load_schema("transaction.avsc")


def event_decoder(registry: SlowRegistry) -> EventDecoder:
    raw = sample_config("k:9092", Path("repo"), Path("m.onnx"))
    spec = PipelineConfig.model_validate(raw["pipelines"][0])
    ladder = Ladder(fallback_model=True, answer_cache=False, default_answer=False)
    admission = Admission(1.0, spec.priority.budget_shares, ladder)
    schema = load_schema("transaction.avsc")
    return EventDecoder(
        AvroDecoder(registry, schema), EventRules(spec.input.validate_fields, schema),
        Tickets(admission, spec.input, spec.priority), metrics.PipelineMetrics("decode-test"),
    )  # fmt: skip


def framed(schema_id: int) -> bytes:
    event = {"event_id": "e", "user_id": "u", "merchant_id": "m", "amount": 1.0,
             "hour_of_day": 3, "is_online": True, "event_time_ms": 0}  # fmt: skip
    body = AvroEncoder(LocalCatalogue(), "transaction.avsc", "in-value").encode(event)[5:]
    return struct.pack(">bI", 0, schema_id) + body


async def test_lookups_run_off_the_loop_and_never_count_as_decode_time():
    registry = SlowRegistry()
    decoder = event_decoder(registry)
    records = [InputRecord("in", 0, o, 0, b"k", framed(i)) for o, i in enumerate((3, 4242, 3))]
    assert decoder.lookup_ids(records) == [3, 4242, 3]
    ticks = 0
    lookup = asyncio.create_task(decoder.resolve({3, 4242}))
    started = time.perf_counter()
    while not lookup.done():
        await asyncio.sleep(0)  # the loop keeps turning while the registry answers
        ticks += 1
    assert await lookup == {} and time.perf_counter() - started >= LOOKUP_S
    assert ticks > 10
    assert decoder.lookup_ids(records) == [None, None, None] and not decoder.needs_lookup(records)
    items = decoder.decode_known(records, [0, 1, 2])
    assert [item.error is None for item in items] == [True, False, True]
    assert items[1].error.reason == "unknown_schema"  # dead-lettered, as before
    # Decode time is decoding alone: admission's estimates never see the lookup.
    assert all(item.decode_us < LOOKUP_S * 1e6 / 4 for item in items)


async def test_an_unreachable_registry_is_reported_per_id_and_asked_again():
    registry = SlowRegistry()
    decoder = event_decoder(registry)
    records = [InputRecord("in", 0, 0, 0, b"k", framed(77))]
    failed = await decoder.resolve({77, 4242})
    assert list(failed) == [77] and isinstance(failed[77], RegistryError)
    assert decoder.lookup_ids(records) == [77]  # still to resolve: its records wait
    await decoder.resolve({77})
    assert registry.calls.count(77) == 2 and registry.calls.count(4242) == 1


def with_time_field(schema: dict, event_time_type: dict, priority_type: list) -> EventDecoder:
    """A decoder of `schema` whose deadlines come from its `event_time_ms` and whose
    priority comes from its `priority` field, these fields typed as given."""
    for field in schema["fields"]:
        if field["name"] == "event_time_ms":
            field["type"] = event_time_type
        if field["name"] == "priority":
            field["type"] = priority_type
    raw = sample_config("k:9092", Path("repo"), Path("m.onnx"))
    raw["pipelines"][0]["input"]["event_time_field"] = "event_time_ms"
    raw["pipelines"][0]["priority"] = {"field": "priority"}
    spec = PipelineConfig.model_validate(raw["pipelines"][0])
    admission = Admission(1.0, spec.priority.budget_shares, Ladder())

    class Registry:
        def schema_for_id(self, _schema_id: int) -> dict:
            return schema

    return EventDecoder(
        AvroDecoder(Registry(), schema), EventRules(spec.input.validate_fields, schema),
        Tickets(admission, spec.input, spec.priority), metrics.PipelineMetrics("decode-test"),
    )  # fmt: skip


def test_an_event_time_of_avro_timestamp_type_and_a_priority_out_of_range_are_read():
    schema = load_schema("transaction.avsc")
    decoder = with_time_field(
        schema, {"type": "long", "logicalType": "timestamp-millis"}, ["null", "double"]
    )
    happened_ms = 1_700_000_000_000
    values = [float("inf"), float("nan"), 0.0]
    records = [
        InputRecord("in", 0, offset, 0, b"k", framed_as(schema, event_time_ms=happened_ms,
                                                        priority=value))
        for offset, value in enumerate(values)
    ]  # fmt: skip
    items = decoder.decode_known(records, [0, 1, 2])
    assert [item.error for item in items] == [None, None, None]
    # Its deadline is its own time plus the budget (1 s), not the Kafka timestamp's (0).
    assert {item.deadline_s for item in items} == {happened_ms / 1000 + 1.0}
    assert [item.priority for item in items] == [1, 1, 0]  # unusable: the default (1)


def framed_as(schema: dict, **fields) -> bytes:
    event = {"event_id": "e", "user_id": "u", "merchant_id": "m", "amount": 1.0,
             "hour_of_day": 3, "is_online": True, **fields}  # fmt: skip
    body = io.BytesIO()
    fastavro.schemaless_writer(body, fastavro.parse_schema(schema), event)
    return struct.pack(">bI", 0, 1) + body.getvalue()
