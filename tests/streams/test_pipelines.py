"""Both example pipelines in one worker, through a real broker, registry, Feast store and
ONNX Runtime: every event answered once, answers equal to the artifacts run offline on
the same rows, an evolved writer schema answered, and the click pipeline's answers
readable by a registry client and by a plain fastavro reader given only `headrace schema
show`."""

from __future__ import annotations

import copy
import io
import json

import fastavro
import numpy as np
import onnxruntime as ort
import pytest
from click.testing import CliRunner
from confluent_kafka import Consumer, Producer
from confluent_kafka.schema_registry import SchemaRegistryClient, topic_subject_name_strategy
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.serialization import MessageField, SerializationContext

from features.store import open_store
from models.train_intent import INTENT_DEFAULTS, intent_path
from schemas.catalogue import SCHEMA_DIR, read_schema_file
from tests.helpers import PATIENT_BUDGET_MS, wait_until
from tests.streams.test_worker import offline_scores
from tools.cli import cli
from tools.loadgen import example_of

pytestmark = pytest.mark.integration

N_EACH = 150
N_EVOLVED = 20


def evolved(schema: dict) -> dict:
    """The producers' next version: an added optional field."""
    newer = copy.deepcopy(schema)
    newer["fields"].append({"name": "campaign", "type": ["null", "string"], "default": None})
    return newer


def produce(bootstrap, client, spec, world, count, seed, prefix, schema) -> dict[str, dict]:
    """Events of the pipeline's example written with confluent-kafka's own serializer."""
    example = example_of(spec)
    # The subject strategy named (`<topic>-value`), not left to the client's default,
    # whose first request (subject associations) Apicurio does not answer.
    serialize = AvroSerializer(
        client, json.dumps(schema), conf={"subject.name.strategy": topic_subject_name_strategy}
    )
    producer = Producer({"bootstrap.servers": bootstrap})
    events = example.events(world, seed, prefix)
    sent = {}
    for _ in range(count):
        event = next(events)
        if any(f["name"] == "campaign" for f in schema["fields"]):
            event = {**event, "campaign": "spring"}
        value = serialize(event, SerializationContext(spec.input_topic, MessageField.VALUE))
        producer.produce(spec.input_topic, value, event[example.key_field].encode())
        sent[event["event_id"]] = event
    assert producer.flush(30) == 0
    return sent


def offline_intents(repo, spec, model_path, events: list[dict]) -> list[dict]:
    """The click model run outside headrace: plain ONNX Runtime on the event fields and
    Feast's own read, missing products filled with the model's defaults."""
    store = open_store(repo)
    response = store.get_online_features(
        features=store.get_feature_service(spec.feature_service),
        entity_rows=[{"product_id": e["product_id"]} for e in events],
        full_feature_names=True,
    ).to_dict()
    session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    feeds = {}
    for port in session.get_inputs():
        if port.name == "page_type":
            feeds[port.name] = np.array([[e["page_type"]] for e in events], dtype=object)
        elif port.name == "dwell_ms":
            feeds[port.name] = np.array([[e["dwell_ms"]] for e in events], dtype=np.int64)
        else:
            values = [INTENT_DEFAULTS[port.name] if v is None else v for v in response[port.name]]
            feeds[port.name] = np.array(values, dtype=np.float32).reshape(-1, 1)
    labels, probabilities = session.run(["output_label", "output_probability"], feeds)
    return [
        {"label": str(label), "probabilities": p}
        for label, p in zip(labels, probabilities, strict=True)
    ]


@pytest.fixture(scope="module")
def served(kafka, registry, sample_assets, tmp_path_factory):
    from infra.topics import delete_topics
    from streams.app import create_topics
    from tests.conftest import Deployment
    from tools.deploy import sample_config, write_config

    tmp = tmp_path_factory.mktemp("pipelines")
    config = write_config(
        sample_config(
            kafka.bootstrap_servers,
            sample_assets.repo,
            sample_assets.model,
            suffix="-both",
            registry_url=registry.url,
            latency_budget_ms=PATIENT_BUDGET_MS,
            clicks_model=intent_path(sample_assets.model),
        ),
        tmp / "headrace.yaml",
    )
    created = create_topics(config, 3)
    deployment = Deployment(config, tmp / "headrace.yaml", tmp / "worker.log")
    client = SchemaRegistryClient({"url": registry.url, "timeout": 10})
    sent, evolved_ids = {}, {}
    for index, spec in enumerate(config.pipelines):
        schema = read_schema_file(spec.input.schema_path)
        sent[spec.name] = produce(kafka.bootstrap_servers, client, spec, sample_assets.world,
                                  N_EACH, 40 + index, f"{spec.name}-now", schema)  # fmt: skip
        newer = produce(kafka.bootstrap_servers, client, spec, sample_assets.world, N_EVOLVED,
                        50 + index, f"{spec.name}-evolved", evolved(schema))  # fmt: skip
        evolved_ids[spec.name] = set(newer)
        sent[spec.name].update(newer)
    # Producers not yet moved to the current schema: its first version, without `priority`.
    fraud, first = config.pipelines[0], SCHEMA_DIR / "history/transaction-1.avsc"
    older = produce(kafka.bootstrap_servers, client, fraud, sample_assets.world, N_EVOLVED, 60,
                    "fraud-older", read_schema_file(first))  # fmt: skip
    older_ids = set(older)
    sent[fraud.name].update(older)

    deserialize = AvroDeserializer(client)
    consumer = Consumer(
        {
            "bootstrap.servers": kafka.bootstrap_servers,
            "group.id": "pipelines-test-reader",
            "auto.offset.reset": "earliest",
        }
    )
    outputs = {spec.output_topic: spec.name for spec in config.pipelines}
    dead_topics = [spec.dead_letter_topic for spec in config.pipelines]
    consumer.subscribe([*outputs, *dead_topics])
    answers = {name: {} for name in sent}
    raw = {name: [] for name in sent}
    dead = []

    def read_some() -> bool:
        for message in consumer.consume(500, 0.5):
            if message.error():
                continue
            if message.topic() in dead_topics:
                dead.append(dict(message.headers()))
                continue
            name = outputs[message.topic()]
            context = SerializationContext(message.topic(), MessageField.VALUE)
            answer = deserialize(message.value(), context)
            answers[name][answer["event_id"]] = answer
            raw[name].append(message.value())
        return all(len(answers[n]) >= len(sent[n]) for n in sent) or bool(dead)

    with deployment.worker():
        assert wait_until(read_some, 180), deployment.log_tail()
    consumer.close()
    yield {"config": config, "deployment": deployment, "sent": sent, "answers": answers,
           "raw": raw, "dead": dead, "evolved": evolved_ids, "older": older_ids}  # fmt: skip
    delete_topics(kafka.bootstrap_servers, created)


def test_every_event_of_both_pipelines_is_answered_once_in_full(served):
    assert served["dead"] == []
    for name, sent in served["sent"].items():
        answers = served["answers"][name]
        assert set(answers) == set(sent), name
        assert {a["status"] for a in answers.values()} == {"OK"}


def test_an_evolved_writer_schema_is_answered_not_dead_lettered(served):
    for name, ids in served["evolved"].items():
        assert ids <= set(served["answers"][name]), name


def test_an_older_writer_schema_is_answered_not_dead_lettered(served):
    """Events written with the input schema's first version, fetched from the registry by
    their id, are read with the current one (its added field takes its default)."""
    assert served["older"] and served["older"] <= set(served["answers"]["fraud"])


def test_fraud_scores_equal_the_artifact_run_offline(served, sample_assets):
    spec = served["config"].pipelines[0]
    answers = served["answers"]["fraud"]
    events = [served["sent"]["fraud"][event_id] for event_id in answers]
    offline = offline_scores(sample_assets.repo, spec, sample_assets.model, events)
    served_scores = np.array([a["score"] for a in answers.values()], dtype=np.float32)
    np.testing.assert_allclose(served_scores, offline, rtol=1e-5, atol=1e-6)


def test_click_intents_equal_the_artifact_run_offline(served, sample_assets):
    spec = served["config"].pipelines[1]
    answers = served["answers"]["clicks"]
    events = [served["sent"]["clicks"][event_id] for event_id in answers]
    offline = offline_intents(sample_assets.repo, spec, intent_path(sample_assets.model), events)
    for answer, event, expected in zip(answers.values(), events, offline, strict=True):
        assert answer["label"] == expected["label"]
        assert answer["session_id"] == event["session_id"]
        assert answer["score"] == pytest.approx(
            expected["probabilities"][answer["label"]], abs=1e-5
        )
        top = answer["top_classes"]
        assert [c["probability"] for c in top] == sorted(
            (c["probability"] for c in top), reverse=True
        )
        for entry in top:
            assert entry["probability"] == pytest.approx(
                expected["probabilities"][entry["label"]], abs=1e-5
            )
    # Products missing from the store are flagged and answered with the defaults.
    assert any(a["missing_features"] == ["product_stats"] for a in answers.values())


def test_click_answers_decode_with_only_the_schema_headrace_shows(served):
    deployment = served["deployment"]
    result = CliRunner().invoke(
        cli, ["schema", "show", "-c", str(deployment.config_file), "--pipeline", "clicks"]
    )
    assert result.exit_code == 0, result.output
    shown = json.loads(result.stdout)
    assert shown["name"] == "IntentPrediction"
    parsed = fastavro.parse_schema(shown)
    for value in served["raw"]["clicks"][:20]:
        body = io.BytesIO(value[5:])  # Confluent framing: magic byte and schema id
        answer = fastavro.schemaless_reader(body, parsed, None)
        assert body.tell() == len(value) - 5
        assert answer["event_id"] in served["answers"]["clicks"]
