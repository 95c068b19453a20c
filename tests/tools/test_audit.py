"""`headrace audit` on hand-written outcomes: it finds what is missing and what is repeated."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from click.testing import CliRunner
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource

from schemas.catalogue import LocalCatalogue
from schemas.codec import AvroEncoder
from tests.helpers import produce_raw
from tools.audit import audit, format_report
from tools.cli import cli

pytestmark = pytest.mark.integration

TIMINGS = {"batch_size": 1, "decode_us": 0, "features_us": 0, "inference_us": 0}


def commit_as_the_workers(deployment, bootstrap: str, offset: int) -> None:
    """Commit partition 0 of the input topic up to `offset`, as the workers' group."""
    group = Consumer({"bootstrap.servers": bootstrap, "group.id": deployment.config.app_id})
    group.commit(offsets=[TopicPartition(deployment.spec.input_topic, 0, offset)],
                 asynchronous=False)  # fmt: skip
    group.close()


def answering(producer: Producer, spec) -> Callable[..., None]:
    """Writes an answer to input `offset` of partition 0, as a worker would."""
    encoder = AvroEncoder(LocalCatalogue(), "prediction.avsc", f"{spec.output_topic}-value")

    def answer(offset: int, status: str = "OK") -> None:
        value = {
            "event_id": f"e{offset}", "input_topic": spec.input_topic, "input_partition": 0,
            "input_offset": offset, "event_timestamp_ms": 0, "model_name": "m",
            "model_version": "1", "score": 0.5, "label": False, "status": status,
            "reason": None, "degraded_by": None, "missing_features": [], "timings": TIMINGS,
        }  # fmt: skip
        producer.produce(spec.output_topic, encoder.encode(value), b"k")

    return answer


def test_audit_reports_inputs_without_an_outcome_and_with_several(deploy, kafka):
    deployment = deploy(partitions=1)
    spec = deployment.spec
    bootstrap = kafka.bootstrap_servers
    produce_raw(bootstrap, spec.input_topic, [b"i0", b"i1", b"i2", b"i3", b"i4"])
    producer = Producer({"bootstrap.servers": bootstrap})
    answer = answering(producer, spec)
    answer(0)
    answer(1, "SHED")
    answer(1, "SHED")  # answered twice
    headers = [("headrace.input.topic", spec.input_topic.encode()),
               ("headrace.input.partition", b"0"), ("headrace.input.offset", b"3")]  # fmt: skip
    producer.produce(spec.dead_letter_topic, b"i3", b"k", headers=headers)
    # Offset 2 has no outcome; offset 4 is answered but not committed (still in flight).
    answer(4)
    assert producer.flush(30) == 0
    commit_as_the_workers(deployment, bootstrap, 4)

    (found,) = audit(deployment.config)
    (partition,) = found.partitions
    assert (partition.committed, partition.inputs) == (4, 4)
    assert (partition.missing, partition.duplicated) == ([2], [1])
    assert dict(partition.outcomes) == {"OK": 1, "SHED": 2, "DEAD_LETTER": 1}
    assert partition.uncommitted == 1
    assert not found.exact
    assert "NOT EXACT" in format_report([found])

    result = CliRunner().invoke(cli, ["audit", "-c", str(deployment.config_file), "--json"])
    assert result.exit_code == 1, result.output
    assert json.loads(result.output)[0]["partitions"][0]["first_missing"] == [2]


def test_a_group_that_committed_nothing_is_not_called_exact(deploy, kafka):
    deployment = deploy(partitions=1)
    produce_raw(kafka.bootstrap_servers, deployment.spec.input_topic, [b"i0", b"i1"])
    (found,) = audit(deployment.config)
    (partition,) = found.partitions
    assert (partition.inputs, partition.never_committed) == (0, 2)
    assert not found.exact
    assert "committed nothing of its 2 inputs" in format_report([found])


def test_an_empty_topic_and_no_commits_is_exact(deploy):
    (found,) = audit(deploy(partitions=1).config)
    assert found.exact


def test_records_that_are_no_answers_make_the_audit_unable_to_call_it_exact(deploy, kafka):
    """Another producer's Avro record in the output topic (it names no input), and a dead
    letter whose headers name none: counted unreadable, never a traceback; an output the
    audit cannot read may be a repeat, so it does not say exact."""
    deployment = deploy(partitions=1)
    spec = deployment.spec
    bootstrap = kafka.bootstrap_servers
    produce_raw(bootstrap, spec.input_topic, [b"i0"])
    producer = Producer({"bootstrap.servers": bootstrap})
    letter = [("headrace.input.topic", spec.input_topic.encode()),
              ("headrace.input.partition", b"0"), ("headrace.input.offset", b"0")]  # fmt: skip
    producer.produce(spec.dead_letter_topic, b"i0", b"k", headers=letter)
    foreign = AvroEncoder(LocalCatalogue(), "transaction.avsc", f"{spec.output_topic}-value")
    event = {"event_id": "x", "user_id": "u", "merchant_id": "m", "amount": 1.0,
             "hour_of_day": 1, "is_online": False, "event_time_ms": 0}  # fmt: skip
    producer.produce(spec.output_topic, foreign.encode(event), b"k")
    nameless = [("headrace.input.topic", None), ("headrace.input.partition", b"0")]
    producer.produce(spec.dead_letter_topic, b"?", b"k", headers=nameless)
    assert producer.flush(30) == 0
    commit_as_the_workers(deployment, bootstrap, 1)

    (found,) = audit(deployment.config)
    (partition,) = found.partitions
    assert (partition.missing, partition.duplicated) == ([], [])
    assert found.unreadable_outputs == 1
    assert not found.exact
    assert "may hide repeats" in format_report([found])


def test_answers_of_inputs_retention_deleted_are_expired_and_a_compacted_output_is_named(
    deploy, kafka
):
    deployment = deploy(partitions=1)
    spec = deployment.spec
    bootstrap = kafka.bootstrap_servers
    produce_raw(bootstrap, spec.input_topic, [b"i0", b"i1", b"i2", b"i3"])
    producer = Producer({"bootstrap.servers": bootstrap})
    answer = answering(producer, spec)
    for offset in (0, 1, 3):  # offset 2 has no answer
        answer(offset)
    assert producer.flush(30) == 0
    commit_as_the_workers(deployment, bootstrap, 4)
    admin = AdminClient({"bootstrap.servers": bootstrap})
    # Retention deleted inputs 0 and 1 (their answers stay); the output is compacted.
    (deleted,) = admin.delete_records([TopicPartition(spec.input_topic, 0, 2)]).values()
    deleted.result(30)
    compact = ConfigResource(
        "topic", spec.output_topic,
        incremental_configs=[ConfigEntry("cleanup.policy", "compact",
                                         incremental_operation=AlterConfigOpType.SET)],
    )  # fmt: skip
    (altered,) = admin.incremental_alter_configs([compact]).values()
    altered.result(30)

    (found,) = audit(deployment.config)
    (partition,) = found.partitions
    assert (partition.inputs, partition.missing) == (2, [2])
    assert (partition.expired, partition.uncommitted) == (2, 0)
    assert found.compacted_output
    report = format_report([found])
    assert "compacted away" in report and "retention deleted" in report
