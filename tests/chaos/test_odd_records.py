"""Records any Kafka producer may write that are not the events a pipeline expects, on
both runtimes: tombstones, empty values, keyless records, odd or spoofed headers,
priorities that are not numbers, compressed record batches. Each gets one outcome, in
its partition's order, and none stops the partition."""

from __future__ import annotations

import pytest
from confluent_kafka import Producer

from schemas.catalogue import LocalCatalogue
from schemas.codec import AvroEncoder
from tests.chaos.conftest import input_offsets, outcomes_per_input, served_to_the_end
from tools.loadgen import sample_events

pytestmark = pytest.mark.integration

COMPRESSIONS = ("gzip", "snappy", "lz4", "zstd")


@pytest.mark.parametrize("runtime", ["bare", "faust"])
def test_odd_records_each_get_one_outcome_and_their_partition_flows(
    chaos_deploy, kafka, sample_assets, runtime
):
    deployment = chaos_deploy(runtime)
    spec = deployment.spec
    bootstrap = kafka.bootstrap_servers
    encoder = AvroEncoder(LocalCatalogue(), "transaction.avsc", f"{spec.input_topic}-value")
    events = sample_events(sample_assets.world, seed=41, prefix="odd")

    def valid() -> bytes:
        return encoder.encode(next(events))

    spoofed = [("headrace.error.reason", b"spoofed"), ("headrace.input.offset", b"-1")]
    # name -> (produce arguments, the dead letter's reason, or None for an answer)
    odd = {
        "tombstone": ({"value": None}, "truncated"),
        "empty": ({"value": b""}, "truncated"),
        "magic-only": ({"value": b"\x00"}, "truncated"),
        "spoofed-headers": ({"value": b"\xffjunk", "headers": spoofed}, "bad_magic"),
        "keyless": ({"value": valid(), "key": None}, None),
        "binary-header": ({"value": valid(), "headers": [("x", b"\xff\xfe\x00")]}, None),
        "null-header": ({"value": valid(), "headers": [("x", None)]}, None),
        "priority-text": ({"value": valid(), "headers": [("headrace-priority", b"abc")]}, None),
        "priority-huge": (
            {"value": valid(), "headers": [("headrace-priority", b"9" * 30)]},
            None,
        ),
        "priority-negative": (
            {"value": valid(), "headers": [("headrace-priority", b"-5")]},
            None,
        ),
    }
    # On one partition, each odd record between two valid events.
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    names: list[str] = []
    for name, (record, _) in odd.items():
        for what, arguments in (("valid", {"value": valid()}), (name, record)):
            producer.produce(spec.input_topic, partition=0, **{"key": b"odd", **arguments})
            names.append(what)
    producer.produce(spec.input_topic, valid(), b"odd", partition=0)
    names.append("valid")
    assert producer.flush(30) == 0
    # Valid events in record batches compressed each way, on the other partitions.
    for compression in COMPRESSIONS:
        compressed = Producer({"bootstrap.servers": bootstrap, "compression.type": compression,
                               "linger.ms": 20})  # fmt: skip
        for _ in range(5):
            compressed.produce(spec.input_topic, valid(), compression.encode(), partition=1)
        assert compressed.flush(30) == 0
    inputs = input_offsets(bootstrap, spec.input_topic)
    name_at = dict(enumerate(names))

    outcomes = served_to_the_end(deployment, inputs, timeout_s=120)
    counts = outcomes_per_input(outcomes, spec.input_topic)
    assert set(counts) == inputs, deployment.log_tail()
    assert set(counts.values()) == {1}

    letters = {int(d.headers["headrace.input.offset"]): d for d in outcomes.dead_letters}
    expected = {at: odd[name][1] for at, name in name_at.items() if name != "valid"}
    expected = {at: reason for at, reason in expected.items() if reason is not None}
    assert {at: d.headers["headrace.error.reason"] for at, d in letters.items()} == expected
    tombstone = letters[names.index("tombstone")]
    assert tombstone.value is None and tombstone.key == b"odd"
    assert "tombstone" in tombstone.headers["headrace.error.message"]
    spoof = letters[names.index("spoofed-headers")]
    assert spoof.headers["headrace.input.offset"] == str(names.index("spoofed-headers"))

    on_zero = [a for a in outcomes.predictions if a["input_partition"] == 0]
    assert [a["input_offset"] for a in sorted(on_zero, key=lambda a: a["input_offset"])] == [
        at for at in sorted(name_at) if at not in expected
    ]
    assert {a["status"] for a in outcomes.predictions} == {"OK"}
    keyless = [a for a in on_zero if a["input_offset"] == names.index("keyless")]
    assert keyless[0]["key"] is None
    # One key's answers, as read from its output partition, in their inputs' order.
    keyed = [a["input_offset"] for a in on_zero if a["key"] == b"odd"]
    assert keyed == sorted(keyed)
    assert sum(1 for a in outcomes.predictions if a["input_partition"] == 1) == 5 * len(
        COMPRESSIONS
    )
