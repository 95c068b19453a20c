"""Starts MLServer (`mlserver start FOLDER`) in its Kafka mode, with two shims the
benchmark needs and nothing else changed. Runs only in MLServer's environment:

    python -m tools.bench.mlserver.serve FOLDER

- **The input's Kafka timestamp reaches the runtime.** The bench measures latency from
  each input's Kafka timestamp (its intended send time) to the moment its answer is
  read, for every system. MLServer's Kafka mode passes the runtime only a record's key,
  value and headers, and adaptive batching keeps one request's headers per batch, so
  the shim adds the timestamp to each request as one more input (`kafka_timestamp_ms`),
  which the runtime answers back: one dict per record, next to MLServer's own JSON
  parse and pydantic validation of the request.
- **Its consumer starts at the beginning of the topic.** MLServer's consumer has no
  group and would start at the end of the topic, so events sent while it joins were
  never read; the bench's topics are new, so the earliest offset is the first event.
"""

from __future__ import annotations

import functools
import sys

from aiokafka import AIOKafkaConsumer
from mlserver.cli.main import main
from mlserver.kafka import server
from mlserver.kafka.message import KafkaMessage

from tools.bench.mlserver import v2


def install_shims() -> None:
    server.AIOKafkaConsumer = functools.partial(AIOKafkaConsumer, auto_offset_reset="earliest")
    parse = KafkaMessage.from_kafka_record.__func__

    def from_kafka_record(cls, record) -> KafkaMessage:
        message = parse(cls, record)
        message.value = v2.with_kafka_timestamp(message.value, record.timestamp)
        return message

    KafkaMessage.from_kafka_record = classmethod(from_kafka_record)


if __name__ == "__main__":
    install_shims()
    sys.argv = ["mlserver", "start", sys.argv[1]]
    main()
