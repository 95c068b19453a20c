"""Structured logs: a live worker's lines are JSON objects carrying the pipeline, the
partition, offsets and trace id of the records they concern."""

from __future__ import annotations

import json
import logging
import re

import pytest
from confluent_kafka import Producer

from streams.logs import JsonFormatter, about
from streams.records import InputRecord
from tests.helpers import PATIENT_BUDGET_MS
from tools.collector import OutcomeCollector

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
LIBRDKAFKA_OWN = re.compile(r"^%\d\|\d+\.\d+\|")


def test_a_batch_line_names_each_partitions_first_and_last_offset():
    records = [InputRecord("t", p, o, 0, None, b"") for p, o in [(0, 7), (1, 3), (0, 9)]]
    line = logging.LogRecord("x", logging.WARNING, "f", 1, "a %s", ("b",), None)
    for name, value in about("fraud", records).items():
        setattr(line, name, value)
    parsed = json.loads(JsonFormatter().format(line))
    assert parsed["message"] == "a b" and parsed["level"] == "WARNING"
    assert parsed["pipeline"] == "fraud"
    assert parsed["offsets"] == {"t[0]": [7, 9], "t[1]": [3, 3]}
    assert "trace_id" not in parsed and "partition" not in parsed


@pytest.mark.integration
@pytest.mark.parametrize("runtime", ["bare", "faust"])
def test_a_live_workers_log_lines_are_json_with_the_records_they_concern(deploy, zipkin, runtime):
    deployment = deploy(
        runtime=runtime,
        latency_budget_ms=PATIENT_BUDGET_MS,
        log_format="json",
        tracing={"enabled": True, "endpoint": zipkin.spans_endpoint},
    )
    spec = deployment.spec
    bootstrap = deployment.config.broker.bootstrap_servers
    collector = OutcomeCollector(bootstrap, spec.output_topic, spec.dead_letter_topic, None)
    collector.start()
    try:
        with deployment.worker():
            producer = Producer({"bootstrap.servers": bootstrap})
            producer.produce(
                spec.input_topic, b"\x00not avro", b"k", headers=[("traceparent", TRACEPARENT)]
            )
            assert producer.flush(30) == 0
            dead_letters = collector.wait_for(1, 90).dead_letters
            assert len(dead_letters) == 1, deployment.log_tail()
            # It continues the input's trace.
            assert dead_letters[0].headers["traceparent"].split("-")[1] == TRACE_ID
    finally:
        collector.stop()

    # librdkafka writes to stderr itself, outside Python's logging, once a client is torn
    # down at exit (`%6|...|BGQUEUE|...`): not log records.
    lines = [
        line
        for line in deployment.log_file.read_text().splitlines()
        if line.strip() and not LIBRDKAFKA_OWN.match(line)
    ]
    parsed = []
    for line in lines:
        try:
            parsed.append(json.loads(line))
        except ValueError:
            pytest.fail(f"not a JSON line: {line!r}")
    dead_lettered = [line for line in parsed if line["message"].startswith("dead-lettering")]
    assert len(dead_lettered) == 1, parsed
    (line,) = dead_lettered
    assert line["pipeline"] == spec.name
    assert line["topic"] == spec.input_topic
    assert line["partition"] in range(3) and line["offset"] == 0
    assert line["trace_id"] == TRACE_ID
    assert {"time", "level", "logger"} <= line.keys()
