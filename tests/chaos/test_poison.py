"""Poison inputs against a real broker, on both runtimes: inputs too large to be
dead-lettered as they are, one larger than a default fetch, and an answer too large
for its topic. None may stop its partition, repeat an outcome or end the worker."""

from __future__ import annotations

import hashlib
import os

import pytest

from infra.topics import set_topic_config
from schemas.catalogue import LocalCatalogue
from schemas.codec import AvroEncoder
from streams.publish import topic_limits
from tests.chaos.conftest import (
    BIG_INPUT_BYTES,
    input_offsets,
    outcomes_per_input,
    produce_in_order,
    served_to_the_end,
)
from tests.helpers import produce_events, wait_until
from tests.streams.test_worker import collector_for
from tools.audit import audit, format_report
from tools.loadgen import sample_events

pytestmark = pytest.mark.integration

# Kafka's default max.message.bytes (topics created without one): 1 MiB + 12 bytes.
DEFAULT_TOPIC_BYTES = 1_048_588


def junk(size: int) -> bytes:
    """`size` bytes that are not the wire format (first byte 0xFF: bad_magic)."""
    return b"\xff" + os.urandom(size - 1)


def audited(deployment, produced: int) -> None:
    """`headrace audit`: exact, and not vacuously (every input committed and counted)."""
    (found,) = audit(deployment.config, timeout_s=120)
    report = format_report([found])
    assert found.exact, report
    assert found.inputs == produced, report
    assert sum(p.uncommitted for p in found.partitions) == 0, report


@pytest.mark.parametrize("runtime", ["bare", "faust"])
def test_oversized_inputs_are_dead_lettered_and_their_partition_flows(
    chaos_deploy, kafka, sample_assets, runtime
):
    deployment = chaos_deploy(runtime, {"max.message.bytes": str(BIG_INPUT_BYTES)})
    spec = deployment.spec
    bootstrap = kafka.bootstrap_servers
    encoder = AvroEncoder(LocalCatalogue(), "transaction.avsc", f"{spec.input_topic}-value")
    events = sample_events(sample_assets.world, seed=21, prefix="around")
    huge_answer = {**next(events), "event_id": "x" * 1_500_000}
    poison = {
        # The case: it fits a dead letter on a default topic, whole.
        "1000000": junk(1_000_000),
        # Its dead letter would not fit the dead-letter topic: written cut, with its hash.
        "1MiB": junk(1_048_576),
        # Larger than a default fetch (1 MiB per partition) as well.
        "5MB": junk(5_000_000),
        # A valid event whose answer (it copies event_id) does not fit the output topic.
        "answer": encoder.encode(huge_answer),
    }
    # On one partition: valid events around each poison input, in this order.
    sequence: list[tuple[str, bytes]] = []
    for name, value in poison.items():
        sequence += [("valid", encoder.encode(next(events))) for _ in range(5)]
        sequence.append((name, value))
    sequence += [("valid", encoder.encode(next(events))) for _ in range(5)]
    offsets = produce_in_order(
        bootstrap, spec.input_topic, [(b"same-key", value) for _, value in sequence], partition=0
    )
    where = {name: offset for (name, _), offset in zip(sequence, offsets, strict=True)}
    # Valid events on every partition besides.
    produce_events(bootstrap, spec.input_topic, sample_assets.world, 30, seed=22, prefix="other")
    inputs = input_offsets(bootstrap, spec.input_topic)
    assert len(inputs) == len(sequence) + 30

    outcomes = served_to_the_end(deployment, inputs, timeout_s=180)
    counts = outcomes_per_input(outcomes, spec.input_topic)
    assert set(counts) == inputs
    assert [where for where, count in counts.items() if count != 1] == []

    letters = {
        int(letter.headers["headrace.input.offset"]): letter for letter in outcomes.dead_letters
    }
    assert set(letters) == {where[name] for name in poison}
    whole = letters[where["1000000"]]
    assert whole.headers["headrace.error.reason"] == "bad_magic"
    assert whole.value == poison["1000000"]
    for name in ("1MiB", "5MB", "answer"):
        letter, original = letters[where[name]], poison[name]
        assert letter.headers["headrace.error.reason"] == "too_large", letter.headers
        assert int(letter.headers["headrace.value.size"]) == len(original)
        assert letter.headers["headrace.value.sha256"] == hashlib.sha256(original).hexdigest()
        assert len(letter.value) < len(original)
        assert original.startswith(letter.value)
        assert letter.key == b"same-key"
    assert letters[where["1MiB"]].headers["headrace.error.cause"] == "bad_magic"
    assert letters[where["5MB"]].headers["headrace.error.cause"] == "bad_magic"
    answers = [a for a in outcomes.predictions if a["key"] == b"same-key"]
    assert all(a["status"] == "OK" for a in answers)
    # The valid events around the poison ones, answered in their order.
    assert [a["input_offset"] for a in answers] == sorted(
        offset for (name, _), offset in zip(sequence, offsets, strict=True) if name == "valid"
    )
    audited(deployment, len(inputs))


@pytest.mark.parametrize("runtime", ["bare", "faust"])
def test_answers_kafka_refuses_once_running_are_found_and_dead_lettered(
    chaos_deploy, kafka, sample_assets, runtime
):
    """The output topic's limit is lowered under a running worker: its first record
    batches holding a long answer are refused whole; the worker finds the answers at
    fault, dead-letters them and writes the others once, in their order."""
    deployment = chaos_deploy(runtime)
    spec = deployment.spec
    bootstrap = kafka.bootstrap_servers
    encoder = AvroEncoder(LocalCatalogue(), "transaction.avsc", f"{spec.input_topic}-value")
    events = sample_events(sample_assets.world, seed=31, prefix="refused")
    collector = collector_for(deployment)
    try:
        with deployment.worker() as worker:
            first = [(b"same-key", encoder.encode(next(events))) for _ in range(5)]
            produce_in_order(bootstrap, spec.input_topic, first, partition=0)
            assert len(collector.wait_for(5, 120)) == 5, deployment.log_tail()
            set_topic_config(bootstrap, spec.output_topic, {"max.message.bytes": "4000"})
            assert wait_until(
                lambda: topic_limits(bootstrap, [spec.output_topic])[spec.output_topic] == 4000,
                timeout_s=30,
            )
            # Answers of about 250 bytes, and two of about 6 kB (long event ids).
            names = ["short"] * 12 + ["long"] + ["short"] * 6 + ["long"] + ["short"] * 12
            sequence = [
                encoder.encode(
                    {**next(events), **({"event_id": "L" * 6_000} if n == "long" else {})}
                )
                for n in names
            ]
            offsets = produce_in_order(
                bootstrap, spec.input_topic, [(b"same-key", v) for v in sequence], partition=0
            )
            wait_until(
                lambda: len(collector.snapshot()) >= 5 + len(sequence) or worker.poll() is not None,
                timeout_s=120,
            )
            assert worker.poll() is None, f"the worker ended:\n{deployment.log_tail()}"
        outcomes = collector.snapshot()
    finally:
        collector.stop()
    inputs = input_offsets(bootstrap, spec.input_topic)
    counts = outcomes_per_input(outcomes, spec.input_topic)
    assert set(counts) == inputs and set(counts.values()) == {1}, deployment.log_tail()
    long_offsets = {o for n, o in zip(names, offsets, strict=True) if n == "long"}
    letters = {int(d.headers["headrace.input.offset"]): d for d in outcomes.dead_letters}
    assert set(letters) == long_offsets
    for offset, letter in letters.items():
        assert letter.headers["headrace.error.reason"] == "too_large"
        assert letter.value == sequence[offsets.index(offset)]  # it fits whole
    answered = [a["input_offset"] for a in outcomes.predictions if a["key"] == b"same-key"]
    assert answered == sorted(set(inputs_on(inputs, 0)) - long_offsets)
    assert "a new Kafka producer takes over" in deployment.log_tail(200)
    audited(deployment, len(inputs))


def inputs_on(inputs: set[tuple[int, int]], partition: int) -> list[int]:
    return sorted(offset for p, offset in inputs if p == partition)
