"""`headrace demo`: the whole data path on the embedded defaults, with a latency summary.

Starts a private broker on free ports, prepares the SQLite Feast store and the sample
model under the state folder, runs a worker process, sends synthetic events (and a
few malformed ones) at a fixed rate, reads every outcome back and stops everything.
"""

from __future__ import annotations

import itertools
import shutil
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import click
import numpy as np
from confluent_kafka import Producer

from features.sample_data import SampleWorld
from infra.kafka import KafkaBroker
from infra.kafka_clients import client_settings
from infra.ports import free_port
from infra.topics import ensure_topics
from models.train import fallback_path
from models.train_intent import intent_path
from schemas.catalogue import LocalCatalogue
from schemas.codec import AvroEncoder
from streams.app import create_topics
from tools.answers import answer_decoder, event_encoder
from tools.bench.cpu import CpuMeter
from tools.bench.latency import WARM_PER_S, WARM_S, warm_broker
from tools.collector import OutcomeCollector
from tools.deploy import (
    prepare_sample_assets,
    sample_config,
    start_worker,
    stop_worker,
    wait_until_ready,
    write_config,
)
from tools.loadgen import encoded, events_for, example_of, malformed_records, send_at_rate

WARMUP_S = 5.0
READY_TIMEOUT_S = 120.0
WARM_TOPIC = "headrace-demo-warm-up"


def run_demo(
    state_dir: Path,
    rate: float,
    duration_s: float,
    partitions: int,
    runtime: str = "faust",
    pipeline: str = "fraud",
) -> None:
    """One worker serves both example pipelines; the load goes to `pipeline`'s topic."""
    state_dir = state_dir.resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    step = _Steps()
    # A private broker, fresh every run: old outcomes must not count in this run's figures.
    KafkaBroker(state_dir / "kafka").stop()
    shutil.rmtree(state_dir / "kafka", ignore_errors=True)
    broker = KafkaBroker(state_dir / "kafka", free_port(), free_port())
    worker = None
    collector = None
    try:
        step("starting Kafka")
        took = broker.start()
        step.done(f"on {broker.bootstrap_servers} in {took:.1f} s")
        step(f"warming Kafka up ({WARM_PER_S:,.0f} records/s for {WARM_S:.0f} s, throwaway topic)")
        producer = Producer(
            {**client_settings(broker.bootstrap_servers, "producer"), "linger.ms": 1}
        )
        ensure_topics(broker.bootstrap_servers, {WARM_TOPIC: partitions})
        read = warm_broker(broker.bootstrap_servers, producer, WARM_TOPIC, _throwaway_records())
        step.done(f"{read:,} records written and read back")

        step("preparing Feast features (SQLite) and the sample models")
        world = SampleWorld()
        repo, model = prepare_sample_assets(state_dir, world)
        step.done(
            f"{world.n_users} users, {world.n_merchants} merchants, {world.n_products} products"
        )

        config_file = state_dir / "headrace.yaml"
        config = write_config(
            sample_config(
                broker.bootstrap_servers,
                repo,
                model,
                metrics_port=free_port(),
                runtime=runtime,
                fallback_model=fallback_path(model),
                clicks_model=intent_path(model),
            ),
            config_file,
        )
        spec = next(p for p in config.pipelines if p.name == pipeline)
        example = example_of(spec)
        create_topics(config, partitions)

        names = ", ".join(p.name for p in config.pipelines)
        step(f"starting the worker ({runtime} runtime; pipelines {names})")
        worker = start_worker(config_file, state_dir / "worker.log")
        catalogue = LocalCatalogue()
        encoder = event_encoder(config, spec, catalogue)
        collector = OutcomeCollector(
            broker.bootstrap_servers,
            spec.output_topic,
            spec.dead_letter_topic,
            answer_decoder(config, catalogue),
        ).start()
        # Events sent before the worker is ready would wait in Kafka past their deadline
        # and be shed. Then a warm-up at the demo's rate, not counted: caches, the JIT.
        if not wait_until_ready(worker, config.metrics.port, READY_TIMEOUT_S):
            raise click.ClickException(
                f"the worker was not ready within {READY_TIMEOUT_S:.0f} s; "
                f"see {state_dir / 'worker.log'}"
            )
        warmup = _encoded_ahead(spec, world, "warmup", encoder, int(rate * WARMUP_S))
        send_at_rate(producer, spec.input_topic, iter(warmup), rate, WARMUP_S)
        if len(collector.wait_for(len(warmup), 120)) < len(warmup):
            raise click.ClickException(
                f"the worker did not answer its warm-up; see {state_dir / 'worker.log'}"
            )
        step.done(f"serving (metrics on :{config.metrics.port}/metrics)")
        target = f"127.0.0.1:{config.metrics.port}"
        click.echo(
            f"  watch it live in another terminal: headrace top --target {target}\n"
            f"  (Prometheus with the SLO alerts: headrace monitor start --target {target})"
        )

        click.echo(
            f"sending {rate:.0f} {pipeline} events/s to {spec.input_topic} for "
            f"{duration_s:.0f} s, plus 5 malformed ones"
        )
        measured = _encoded_ahead(spec, world, "demo", encoder, int(rate * duration_s))
        valid = next(example.events(world, 0, None))
        for value in malformed_records(encoder, valid, example.invalid).values():
            producer.produce(spec.input_topic, value, b"malformed")
        started = time.time()
        meter = CpuMeter({"worker": worker.pid})
        cpu_before = meter.snapshot()
        report = send_at_rate(
            producer,
            spec.input_topic,
            iter(measured),
            rate,
            duration_s,
            on_tick=lambda sent: _progress(sent, collector, len(warmup)),
        )
        expected = len(warmup) + report.sent + 5
        outcomes = collector.wait_for(expected, 60)
        finished = time.time()
        cpu_after = meter.snapshot()
        click.echo("")
        counted = [p for p in outcomes.predictions if p["event_id"].startswith("demo-")]
        _summary(counted, outcomes, expected, finished - started)
        cpu_us = CpuMeter.per_event_us(cpu_before, cpu_after, report.sent).get("worker")
        if cpu_us is not None:
            cores = CpuMeter.cores(cpu_before, cpu_after)["worker"]
            click.echo(f"worker CPU: {cpu_us:.0f} µs per event ({cores:.2f} cores at {rate:.0f}/s)")
        if report.max_lag_ms > 50:
            click.echo(f"(the load generator fell up to {report.max_lag_ms:.0f} ms behind)")
        _save_metrics(config.metrics.port, state_dir / "worker-metrics.txt")
    finally:
        if collector is not None:
            collector.stop()
        if worker is not None:
            step("stopping the worker and Kafka")
            code = stop_worker(worker)
        broker.stop()
        if worker is not None:
            step.done(f"worker exit status {code}")


def _save_metrics(port: int, path: Path) -> None:
    """The worker's /metrics as the run left them, for a look at where time went."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
            path.write_bytes(answer.read())
    except OSError as exc:
        click.echo(f"(could not read the worker's metrics: {exc})")
        return
    click.echo(f"the worker's metrics at the end: {path}")


def _throwaway_records() -> Iterator[tuple[bytes, bytes]]:
    """Records the size of an event, for warming the broker up (nobody decodes them)."""
    return itertools.repeat((b"warm-up", bytes(120)))


def _encoded_ahead(spec, world: SampleWorld, prefix: str, encoder: AvroEncoder, count: int) -> list:
    """Events encoded before sending, so encoding cannot delay the load's schedule."""
    events = events_for(spec, world, time.time_ns(), prefix)
    return list(itertools.islice(encoded(events, encoder), count))


def _progress(sent: int, collector: OutcomeCollector, skip: int) -> None:
    answered = len(collector.snapshot()) - skip
    click.echo(f"\r  sent {sent:>7}  answered {answered:>7}", nl=False)


def _summary(measured: list[dict], outcomes, expected: int, elapsed_s: float) -> None:
    """Outcomes of the measured events by status, the rest in one line, then latency."""
    click.echo("outcomes of the measured events:")
    for status in ("OK", "DEGRADED", "SHED"):
        answers = [p for p in measured if p["status"] == status]
        if status == "OK":
            missing = sum(1 for p in answers if p["missing_features"])
            detail = f"({missing} scored with default features for a missing entity)"
        else:
            detail = str(dict(Counter(p["degraded_by"] or p["reason"] for p in answers)))
        click.echo(f"  {status:<12} {len(answers):>7}  {detail if answers else ''}")
    reasons = Counter(d.headers.get("headrace.error.reason", "?") for d in outcomes.dead_letters)
    click.echo(f"  dead letters {len(outcomes.dead_letters):>7}  {dict(reasons)}")
    click.echo(f"  unanswered   {max(0, expected - len(outcomes)):>7}  (warm-up included)")
    counted = {id(p) for p in measured}
    warmup = Counter(p["status"] for p in outcomes.predictions if id(p) not in counted)
    click.echo(f"warm-up (not counted): {dict(warmup)}")
    answered = [p for p in measured if p["status"] == "OK"]
    if answered and "top_classes" in answered[0]:
        click.echo(f"classes answered in full: {dict(Counter(p['label'] for p in answered))}")
    latencies = np.array([p["latency_ms"] for p in answered])
    if len(latencies):
        p50, p95, p99 = np.percentile(latencies, [50, 95, 99])
        click.echo(
            f"measured window: {len(latencies) / elapsed_s:,.0f} answers in full (OK) per s; "
            f"their end-to-end latency (Kafka timestamp to answer read): p50 {p50:.1f} ms, "
            f"p95 {p95:.1f} ms, p99 {p99:.1f} ms, max {latencies.max():.1f} ms"
        )


class _Steps:
    def __init__(self) -> None:
        self._started = time.monotonic()

    def __call__(self, what: str) -> None:
        self._started = time.monotonic()
        click.echo(f"- {what} ...", nl=False)

    def done(self, detail: str) -> None:
        click.echo(f" ok, {detail} [{time.monotonic() - self._started:.1f} s]")
