"""A burst far beyond a slow model's capacity: memory stays bounded, fetching pauses
and resumes, every event is answered once, and outputs keep their order per key."""

from __future__ import annotations

import contextlib
import time
import urllib.request

import psutil
import pytest
from confluent_kafka import Producer
from prometheus_client.parser import text_string_to_metric_families

from infra.ports import free_port
from models.synthetic import write_heavy_model
from schemas.catalogue import LocalCatalogue
from schemas.codec import AvroEncoder
from tests.helpers import PATIENT_BUDGET_MS
from tests.streams.test_worker import collector_for
from tools.loadgen import encoded, sample_events

pytestmark = pytest.mark.integration

BURST = 25_000
MAX_IN_FLIGHT = 1_000
# The worker's documented bound with max_in_flight 1000 (README, "Tuning").
RSS_BOUND_MB = 600


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


@pytest.mark.parametrize("runtime", ["faust", "bare"])
def test_a_burst_stays_bounded_and_is_answered_in_order(
    deploy, kafka, sample_assets, tmp_path, runtime
):
    slow = write_heavy_model(sample_assets.model, tmp_path / "slow.onnx")
    port = free_port()
    deployment = deploy(
        runtime=runtime,
        metrics_port=port,
        max_in_flight=MAX_IN_FLIGHT,
        max_batch_size=64,
        model_path=slow,
        latency_budget_ms=PATIENT_BUDGET_MS,
    )
    spec = deployment.spec
    encoder = AvroEncoder(LocalCatalogue(), "transaction.avsc", f"{spec.input_topic}-value")
    producer = Producer({"bootstrap.servers": kafka.bootstrap_servers, "linger.ms": 20})
    for key, value in _take(encoded(sample_events(sample_assets.world, 11, "burst"), encoder)):
        while True:
            try:
                producer.produce(spec.input_topic, value, key)
                break
            except BufferError:
                producer.poll(0.1)
    assert producer.flush(60) == 0

    collector = collector_for(deployment)
    peak_rss_mb = 0.0
    peak_in_flight = 0.0
    try:
        with deployment.worker() as worker:
            process = psutil.Process(worker.pid)
            deadline = time.monotonic() + 600
            while len(collector.snapshot()) < BURST and time.monotonic() < deadline:
                assert worker.poll() is None, deployment.log_tail()
                peak_rss_mb = max(peak_rss_mb, process.memory_info().rss / 2**20)
                with contextlib.suppress(OSError):  # the endpoint starts with the worker
                    peak_in_flight = max(
                        peak_in_flight, scrape(port).get("headrace_in_flight_events", 0)
                    )
                collector.wait_for(BURST, 0.5)
            metrics = scrape(port)
        outcomes = collector.snapshot()
    finally:
        collector.stop()

    predictions = outcomes.predictions
    assert len(predictions) == BURST, deployment.log_tail()
    assert len({(p["input_partition"], p["input_offset"]) for p in predictions}) == BURST
    assert peak_rss_mb < RSS_BOUND_MB
    assert peak_in_flight <= MAX_IN_FLIGHT + spec.max_batch_size
    assert metrics["headrace_fetch_pauses_total"] >= 1
    assert metrics["headrace_fetch_paused"] == 0  # resumed once drained
    # Order per key: a key's outputs come in the order of its input offsets.
    last_offset: dict[bytes, int] = {}
    for prediction in predictions:
        key = prediction["key"]
        assert prediction["input_offset"] > last_offset.get(key, -1)
        last_offset[key] = prediction["input_offset"]


def _take(records):
    for _ in range(BURST):
        yield next(records)
