"""The naive baseline: the per-event loop a user would write by hand.

For each event: poll one record, decode it, read its features with one Feast call,
run ONNX at batch size 1, produce the prediction. Same libraries, model, features and
wire format as headrace; no batching, no pipelining, auto-commit. Runs until SIGTERM:

    python -m tools.bench.naive CONFIG
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import numpy as np
from confluent_kafka import Consumer, Producer

from features.store import open_store
from models.session import ModelSession
from schemas.answer import answer_schema
from schemas.catalogue import LocalCatalogue, read_schema_file
from schemas.codec import AvroDecoder, AvroEncoder
from schemas.errors import DecodeError
from schemas.validation import EventRules
from streams.config import load_config


def main(config_path: str) -> None:
    config = load_config(Path(config_path))
    spec = config.pipelines[0]
    catalogue = LocalCatalogue()
    schema = read_schema_file(spec.input.schema_path)
    decoder = AvroDecoder(catalogue, schema)
    rules = EventRules(spec.input.validate_fields, schema)
    model = ModelSession(spec.model)
    model_input = model.signature.inputs[0]
    answers = answer_schema(schema, spec.included_fields, model.signature.output.task)
    encoder = AvroEncoder(catalogue, answers, f"{spec.output_topic}-value")
    store = open_store(config.features.repo_path)
    service = store.get_feature_service(spec.feature_service)
    consumer = Consumer(
        {
            "bootstrap.servers": config.broker.bootstrap_servers,
            "group.id": config.app_id,
            "auto.offset.reset": "earliest",
        }
    )
    producer = Producer({"bootstrap.servers": config.broker.bootstrap_servers})
    consumer.subscribe([spec.input_topic])
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    while not stopping:
        message = consumer.poll(0.1)
        if message is None or message.error():
            continue
        try:
            event = decoder.decode(message.value())
            rules.check(event)
        except DecodeError:
            continue
        features = store.get_online_features(
            features=service,
            entity_rows=[{key: event[field] for key, field in spec.entity_fields.items()}],
            full_feature_names=True,
        ).to_dict()
        row = [
            event[c.source] if c.source in event else features[c.source][0]
            for c in model_input.columns
        ]
        row = [c.default if v is None else v for v, c in zip(row, model_input.columns, strict=True)]
        (answer,) = model.run({model_input.name: np.array([row], dtype=np.float32)})
        value = encoder.encode(
            {
                **{name: event[name] for name in spec.included_fields},
                "input_topic": message.topic(),
                "input_partition": message.partition(),
                "input_offset": message.offset(),
                "event_timestamp_ms": message.timestamp()[1],
                "model_name": model.signature.name,
                "model_version": model.signature.version,
                **answer,
                "status": "OK",
                "reason": None,
                "degraded_by": None,
                "missing_features": [],
                "timings": {"batch_size": 1, "decode_us": 0, "features_us": 0, "inference_us": 0},
            }
        )
        producer.produce(spec.output_topic, value, message.key())
        producer.poll(0)
    producer.flush(30)
    consumer.close()
    model.close()


if __name__ == "__main__":
    main(sys.argv[1])
