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
from schemas.catalogue import LocalCatalogue
from schemas.codec import AvroDecoder, AvroEncoder
from schemas.errors import DecodeError
from schemas.validation import validate_transaction
from streams.config import load_config
from streams.pipeline import InputRecord, prediction


def main(config_path: str) -> None:
    config = load_config(Path(config_path))
    spec = config.pipelines[0]
    catalogue = LocalCatalogue()
    decoder = AvroDecoder(catalogue, "transaction.avsc")
    encoder = AvroEncoder(catalogue, "prediction.avsc", f"{spec.output_topic}-value")
    store = open_store(config.features.repo_path)
    service = store.get_feature_service(spec.feature_service)
    model = ModelSession(spec.model.path, intra_op_threads=spec.model.intra_op_threads)
    meta = model.metadata
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
            validate_transaction(event)
        except DecodeError:
            continue
        features = store.get_online_features(
            features=service,
            entity_rows=[{key: event[field] for key, field in spec.entity_fields.items()}],
            full_feature_names=True,
        ).to_dict()
        row = [event[name] if name in event else features[name][0] for name in meta.feature_names]
        row = [
            default if v is None else v
            for v, default in zip(row, meta.feature_defaults, strict=True)
        ]
        score = float(model.predict(np.array([row], dtype=np.float32))[0])
        record = InputRecord(
            message.topic(),
            message.partition(),
            message.offset(),
            message.timestamp()[1],
            message.key(),
            message.value(),
        )
        untimed = {"batch_size": 1, "decode_us": 0, "features_us": 0, "inference_us": 0}
        value = encoder.encode(prediction(event, record, meta, score, [], untimed))
        producer.produce(spec.output_topic, value, message.key())
        producer.poll(0)
    producer.flush(30)
    consumer.close()
    model.close()


if __name__ == "__main__":
    main(sys.argv[1])
