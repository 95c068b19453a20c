"""The whole data path through a real broker, a real Feast store and the sample model."""

from __future__ import annotations

import itertools
import json

import numpy as np
import onnxruntime as ort
import pytest
from confluent_kafka import Producer

from features.store import open_store
from schemas.catalogue import LocalCatalogue
from schemas.codec import AvroDecoder, AvroEncoder
from tests.helpers import (
    PATIENT_BUDGET_MS,
    committed_lag,
    committed_offsets,
    produce_events,
    produce_raw,
    records_written,
    wait_until,
)
from tools.collector import OutcomeCollector
from tools.loadgen import malformed_records, sample_events

pytestmark = pytest.mark.integration

N_VALID = 400


def collector_for(deployment, **options) -> OutcomeCollector:
    """A started reader of the deployment's answers and dead letters (`options`: those of
    OutcomeCollector, e.g. isolation_level)."""
    spec = deployment.spec
    return OutcomeCollector(
        deployment.config.broker.bootstrap_servers,
        spec.output_topic,
        spec.dead_letter_topic,
        AvroDecoder(LocalCatalogue(), "prediction.avsc"),
        **options,
    ).start()


@pytest.fixture(scope="module")
def served(kafka, sample_assets, tmp_path_factory):
    """One worker run over N valid events and one event per way of being malformed."""
    # `deploy` is function-scoped; build the module's deployment by hand with the same parts.
    from infra.topics import delete_topics
    from streams.app import create_topics
    from tests.conftest import Deployment
    from tools.deploy import sample_config, write_config

    tmp = tmp_path_factory.mktemp("served")
    config = write_config(
        sample_config(
            kafka.bootstrap_servers,
            sample_assets.repo,
            sample_assets.model,
            suffix="-served",
            latency_budget_ms=PATIENT_BUDGET_MS,
        ),
        tmp / "headrace.yaml",
    )
    created = create_topics(config, 3)
    deployment = Deployment(config, tmp / "headrace.yaml", tmp / "worker.log")
    spec = deployment.spec
    encoder = AvroEncoder(LocalCatalogue(), "transaction.avsc", f"{spec.input_topic}-value")
    sent = produce_events(
        kafka.bootstrap_servers,
        spec.input_topic,
        sample_assets.world,
        N_VALID,
        seed=3,
        prefix="valid",
    )
    malformed = more_malformed(encoder, next(iter(sent.values())))
    produce_raw(kafka.bootstrap_servers, spec.input_topic, list(malformed.values()))
    collector = collector_for(deployment)
    with deployment.worker() as worker:
        outcomes = collector.wait_for(N_VALID + len(malformed), 120)
        # One more event after the malformed ones: the worker is still serving.
        later = produce_events(
            kafka.bootstrap_servers,
            spec.input_topic,
            sample_assets.world,
            1,
            seed=4,
            prefix="later",
        )
        after = collector.wait_for(N_VALID + len(malformed) + 1, 60)
        still_running = worker.poll() is None
    collector.stop()
    yield {
        "sent": sent,
        "malformed": malformed,
        "outcomes": outcomes,
        "after": after,
        "later": later,
        "still_running": still_running,
        "deployment": deployment,
    }
    delete_topics(kafka.bootstrap_servers, created)


def more_malformed(encoder: AvroEncoder, valid: dict) -> dict[str, bytes]:
    """The demo's malformed records and the reasons it does not send."""
    good = encoder.encode(valid)
    corrupt = bytearray(good)
    corrupt[6] = 0xFF  # the event id's first byte: not UTF-8
    return {
        **malformed_records(encoder, valid),
        "trailing_bytes": good + b"\x00\x01",
        "corrupt": bytes(corrupt),
        # Framed as a Prediction (local id 4): no Transaction can be read from it.
        "incompatible_schema": b"\x00" + (4).to_bytes(4, "big") + good[5:],
    }


def test_every_valid_event_gets_exactly_one_prediction(served):
    predictions = served["outcomes"].predictions
    ids = [p["event_id"] for p in predictions]
    assert sorted(ids) == sorted(served["sent"]), served["deployment"].log_tail()
    assert all(p["status"] == "OK" for p in predictions)
    # Keyed like the input, and naming the input record it answers.
    for prediction in predictions:
        event = served["sent"][prediction["event_id"]]
        assert prediction["key"] == event["user_id"].encode()
        assert prediction["input_topic"] == served["deployment"].spec.input_topic
    offsets = {(p["input_partition"], p["input_offset"]) for p in predictions}
    assert len(offsets) == len(predictions)


def test_each_malformed_event_is_dead_lettered_with_its_reason(served):
    letters = served["outcomes"].dead_letters
    assert len(letters) == len(served["malformed"])
    by_value = {letter.value: letter for letter in letters}
    expected_reason = {
        "random_bytes": "bad_magic",
        "bad_magic": "bad_magic",
        "unknown_schema": "unknown_schema",
        "truncated": "truncated",
        "invalid_field": "invalid_field",
        "trailing_bytes": "trailing_bytes",
        "corrupt": "corrupt",
        "incompatible_schema": "incompatible_schema",
    }
    for kind, raw in served["malformed"].items():
        letter = by_value[raw]  # the original bytes, untouched
        assert letter.headers["headrace.error.reason"] == expected_reason[kind]
        assert letter.headers["headrace.error.message"]
        assert letter.headers["headrace.input.topic"] == served["deployment"].spec.input_topic
    # Written in one go with one key: one partition, consecutive offsets, in order.
    where = [
        (by_value[raw].headers["headrace.input.partition"],
         int(by_value[raw].headers["headrace.input.offset"]))
        for raw in served["malformed"].values()
    ]  # fmt: skip
    assert len({partition for partition, _ in where}) == 1
    first = where[0][1]
    assert [offset for _, offset in where] == list(range(first, first + len(where)))


def test_worker_keeps_serving_after_bad_input(served):
    assert served["still_running"]
    later_id = next(iter(served["later"]))
    assert later_id in {p["event_id"] for p in served["after"].predictions}


def offline_scores(repo, spec, model_path, events: list[dict]) -> np.ndarray:
    """The model run outside headrace (plain ONNX Runtime, its metadata read by hand) on
    the event fields and Feast's own read."""
    store = open_store(repo)
    session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    props = session.get_modelmeta().custom_metadata_map
    names, defaults = json.loads(props["feature_names"]), json.loads(props["feature_defaults"])
    response = store.get_online_features(
        features=store.get_feature_service(spec.feature_service),
        entity_rows=[{"user_id": e["user_id"], "merchant_id": e["merchant_id"]} for e in events],
        full_feature_names=True,
    ).to_dict()
    matrix = np.array(
        [
            [
                event[name]
                if name in event
                else (default if response[name][row] is None else response[name][row])
                for name, default in zip(names, defaults, strict=True)
            ]
            for row, event in enumerate(events)
        ],
        dtype=np.float32,
    )
    _labels, probabilities = session.run(None, {session.get_inputs()[0].name: matrix})
    return probabilities[:, 1]


def test_scores_equal_the_model_run_offline_on_the_same_features(served, sample_assets):
    predictions = served["outcomes"].predictions
    events = [served["sent"][p["event_id"]] for p in predictions]
    offline = offline_scores(
        sample_assets.repo, served["deployment"].spec, sample_assets.model, events
    )
    served_scores = np.array([p["score"] for p in predictions], dtype=np.float32)
    np.testing.assert_allclose(served_scores, offline, rtol=1e-5, atol=1e-6)
    # The label is the score against the model's threshold (0.5 in its metadata).
    assert [p["label"] for p in predictions] == [bool(p["score"] >= 0.5) for p in predictions]
    assert {p["label"] for p in predictions} == {True, False}
    # Entities absent from Feast are flagged, not guessed silently.
    flagged = [p for p in predictions if p["missing_features"]]
    assert flagged, "the sample stream always holds a few unknown users or merchants"
    known_users = set(sample_assets.world.users()["user_id"])
    known_merchants = set(sample_assets.world.merchants()["merchant_id"])
    for prediction, event in zip(predictions, events, strict=True):
        unknown = event["user_id"] not in known_users or event["merchant_id"] not in known_merchants
        assert bool(prediction["missing_features"]) == unknown


def test_predictions_from_redis_features_match_the_offline_computation(
    deploy, kafka, sample_assets, redis_repo
):
    deployment = deploy(repo_path=redis_repo, latency_budget_ms=PATIENT_BUDGET_MS)
    spec = deployment.spec
    sent = produce_events(kafka.bootstrap_servers, spec.input_topic, sample_assets.world,
                          150, seed=8, prefix="redis")  # fmt: skip
    collector = collector_for(deployment)
    try:
        with deployment.worker():
            outcomes = collector.wait_for(150, 120)
    finally:
        collector.stop()
    predictions = outcomes.predictions
    assert sorted(p["event_id"] for p in predictions) == sorted(sent), deployment.log_tail()
    events = [sent[p["event_id"]] for p in predictions]
    np.testing.assert_allclose(
        np.array([p["score"] for p in predictions], dtype=np.float32),
        offline_scores(redis_repo, spec, sample_assets.model, events),
        rtol=1e-5,
        atol=1e-6,
    )


@pytest.mark.parametrize("runtime", ["faust", "bare"])
def test_restart_resumes_from_committed_offsets_without_repeats(
    deploy, kafka, sample_assets, runtime, tmp_path, monkeypatch
):
    deployment = deploy(runtime=runtime, latency_budget_ms=PATIENT_BUDGET_MS)
    spec = deployment.spec
    first = produce_events(
        kafka.bootstrap_servers, spec.input_topic, sample_assets.world, 200, seed=5, prefix="first"
    )
    collector = collector_for(deployment)
    # The worker's own temporary directory, to see what a run leaves behind in it.
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    left_behind = lambda: sorted(path.name for path in scratch.glob("headrace-*"))  # noqa: E731
    try:
        with deployment.worker():
            assert len(collector.wait_for(200, 120)) == 200, deployment.log_tail()
            if runtime == "faust":
                assert left_behind(), "Faust's data directory is not under TMPDIR"
        # A clean stop commits everything it answered, and removes its data directory.
        assert left_behind() == []
        assert (
            committed_lag(kafka.bootstrap_servers, deployment.config.app_id, spec.input_topic, 3)
            == 0
        )
        second = produce_events(
            kafka.bootstrap_servers,
            spec.input_topic,
            sample_assets.world,
            150,
            seed=6,
            prefix="second",
        )
        with deployment.worker():
            assert len(collector.wait_for(350, 120)) == 350, deployment.log_tail()
            assert wait_until(
                lambda: (
                    committed_lag(
                        kafka.bootstrap_servers, deployment.config.app_id, spec.input_topic, 3
                    )
                    == 0
                ),
                timeout_s=30,
            )
        ids = [p["event_id"] for p in collector.snapshot().predictions]
        assert sorted(ids) == sorted([*first, *second])
    finally:
        collector.stop()


@pytest.mark.parametrize("runtime", ["faust", "bare"])
def test_a_clean_stop_in_the_middle_of_a_backlog_repeats_nothing(
    deploy, kafka, sample_assets, runtime
):
    # A low in-flight bound: the first worker must stop with most of the backlog unread.
    deployment = deploy(runtime=runtime, latency_budget_ms=PATIENT_BUDGET_MS, max_in_flight=300)
    spec = deployment.spec
    sent = produce_events(kafka.bootstrap_servers, spec.input_topic, sample_assets.world,
                          3000, seed=12, prefix="backlog")  # fmt: skip
    collector = collector_for(deployment)
    try:
        with deployment.worker():
            # Stop while batches are still in flight.
            assert len(collector.wait_for(100, 120)) >= 100, deployment.log_tail()
        unread = committed_lag(kafka.bootstrap_servers, deployment.config.app_id,
                               spec.input_topic, 3)  # fmt: skip
        assert unread > 0, "the first worker answered the whole backlog before its stop"
        with deployment.worker():
            assert len(collector.wait_for(3000, 180)) >= 3000, deployment.log_tail()
            assert wait_until(
                lambda: committed_lag(kafka.bootstrap_servers, deployment.config.app_id,
                                      spec.input_topic, 3) == 0,
                timeout_s=30,
            )  # fmt: skip
        ids = [p["event_id"] for p in collector.snapshot().predictions]
        assert sorted(ids) == sorted(sent)
    finally:
        collector.stop()


@pytest.mark.parametrize("runtime", ["faust", "bare"])
def test_inputs_compressed_and_written_in_transactions_are_answered_once(
    deploy, kafka, sample_assets, runtime
):
    """Input as other clients write it. Java producers often compress (the broker keeps
    their batches as written, so the worker must read every codec), and upstream
    exactly-once jobs write in transactions: a commit marker takes an offset no record
    has (a worker that only commits offsets it answered stops committing at the first
    one), and an aborted transaction's records were never written, as far as a
    read_committed reader knows: they get no answer."""
    deployment = deploy(runtime=runtime, latency_budget_ms=PATIENT_BUDGET_MS)
    spec = deployment.spec
    bootstrap = kafka.bootstrap_servers
    encoder = AvroEncoder(LocalCatalogue(), "transaction.avsc", f"{spec.input_topic}-value")

    def write(producer: Producer, events: list[dict]) -> None:
        for event in events:
            producer.produce(spec.input_topic, encoder.encode(event), event["user_id"].encode())
        assert producer.flush(30) == 0

    committed = []
    for codec in ("gzip", "snappy", "lz4", "zstd"):
        producer = Producer({"bootstrap.servers": bootstrap, "compression.type": codec,
                             "transactional.id": f"test-{codec}-{runtime}"})  # fmt: skip
        producer.init_transactions(30)
        for outcome in ("commit", "abort"):
            events = list(itertools.islice(sample_events(sample_assets.world, 13,
                                                         f"{codec}-{outcome}"), 8))  # fmt: skip
            producer.begin_transaction()
            write(producer, events)  # written before the abort (which drops unsent ones)
            if outcome == "commit":
                producer.commit_transaction(30)
                committed += [event["event_id"] for event in events]
            else:
                producer.abort_transaction(30)
    # Plain records after them on every partition: each marker lies between records.
    plain = produce_events(bootstrap, spec.input_topic, sample_assets.world, 30, seed=10,
                           prefix="plain")  # fmt: skip
    expected = committed + list(plain)
    collector = collector_for(deployment)
    try:
        with deployment.worker() as worker:
            answers = collector.wait_for(len(expected), 120).predictions
            group = deployment.config.app_id
            assert wait_until(
                lambda: committed_lag(bootstrap, group, spec.input_topic, 3) == 0, timeout_s=30
            ), committed_offsets(bootstrap, group, spec.input_topic, 3)
            # Every input read was answered before its offset was committed: these are all.
            written = records_written(bootstrap, spec.output_topic, 3)
            assert worker.poll() is None, deployment.log_tail()
    finally:
        collector.stop()
    assert sorted(a["event_id"] for a in answers) == sorted(expected), deployment.log_tail()
    assert written == len(expected)


@pytest.mark.parametrize("runtime", ["faust", "bare"])
def test_events_without_a_key_are_answered_without_one(deploy, kafka, sample_assets, runtime):
    """Many producers send no key (Kafka then spreads records over the partitions)."""
    deployment = deploy(runtime=runtime, latency_budget_ms=PATIENT_BUDGET_MS)
    spec = deployment.spec
    encoder = AvroEncoder(LocalCatalogue(), "transaction.avsc", f"{spec.input_topic}-value")
    events = list(itertools.islice(sample_events(sample_assets.world, 8, "keyless"), 30))
    producer = Producer({"bootstrap.servers": kafka.bootstrap_servers})
    for event in events:
        producer.produce(spec.input_topic, encoder.encode(event))
    assert producer.flush(30) == 0
    collector = collector_for(deployment)
    try:
        with deployment.worker():
            outcomes = collector.wait_for(len(events), 120)
    finally:
        collector.stop()
    assert outcomes.dead_letters == []
    answers = outcomes.predictions
    assert sorted(a["event_id"] for a in answers) == sorted(e["event_id"] for e in events)
    assert {(a["status"], a["key"]) for a in answers} == {("OK", None)}
