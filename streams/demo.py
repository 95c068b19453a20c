"""`headrace demo`: the whole data path on the embedded defaults, with a latency summary.

Starts a private broker on free ports, prepares the SQLite Feast store and the sample
model under the state folder, runs a worker process, sends synthetic events (and a
few malformed ones) at a fixed rate, reads every outcome back and stops everything.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import click
import numpy as np
import yaml
from confluent_kafka import Producer

from features.sample_data import SampleWorld
from features.store import prepare_sample_store
from infra.kafka import KafkaBroker
from infra.ports import free_port
from models.train import fallback_path
from schemas.catalogue import LocalCatalogue
from schemas.codec import AvroDecoder, AvroEncoder
from streams.bench.cpu import CpuMeter
from streams.collector import OutcomeCollector
from streams.config import HeadraceConfig, parse_config
from streams.loadgen import encoded, malformed_records, sample_events, send_at_rate
from streams.worker import create_topics

WARMUP_S = 5.0


def sample_config(
    bootstrap_servers: str,
    repo_path: Path,
    model_path: Path,
    *,
    suffix: str = "",
    registry_url: str | None = None,
    metrics_port: int = 0,
    max_batch_size: int = 64,
    max_wait_ms: float = 2.0,
    latency_budget_ms: float = 100.0,
    runtime: str = "faust",
    max_in_flight: int = 2_000,
    fallback_model: Path | None = None,
    default_score: float | None = None,
    priority: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The sample fraud pipeline's config as a plain dict (what a YAML file would hold).

    Without `fallback_model` and `default_score` the ladder has only the answer cache
    above shedding."""
    config: dict[str, Any] = {
        "app_id": f"headrace{suffix}",
        "runtime": runtime,
        "broker": {"bootstrap_servers": bootstrap_servers},
        "features": {"repo_path": str(repo_path)},
        "metrics": {"port": metrics_port},
        "pipelines": [
            {
                "name": "fraud",
                "input_topic": f"transactions{suffix}",
                "output_topic": f"fraud-scores{suffix}",
                "dead_letter_topic": f"transactions-dlq{suffix}",
                "feature_service": "fraud_scoring",
                "entity_fields": {"user_id": "user_id", "merchant_id": "merchant_id"},
                "model": {"path": str(model_path)},
                "latency_budget_ms": latency_budget_ms,
                "max_in_flight": max_in_flight,
                "max_batch_size": max_batch_size,
                "max_wait_ms": max_wait_ms,
                "priority": priority or {},
                "degradation": {
                    "fallback_model": {"path": str(fallback_model)} if fallback_model else None,
                    "default_score": default_score,
                },
            }
        ],
    }
    if registry_url:
        config["registry"] = {"url": registry_url}
    return config


def prepare_sample_assets(state_dir: Path, world: SampleWorld) -> tuple[Path, Path]:
    """Feast repo with materialized features and the trained models (the full one,
    returned, and its fallback beside it) under `state_dir`."""
    from models.train import train

    repo = state_dir / "features"
    prepare_sample_store(repo, world)
    model = state_dir / "models" / "fraud-mlp.onnx"
    if not model.exists() or not fallback_path(model).exists():
        train(model, world)
    return repo, model


def start_worker(config_file: Path, log_file: Path) -> subprocess.Popen:
    return start_process(
        ["-m", "streams.cli", "worker", "-c", str(config_file), "-l", "warn"], log_file
    )


def start_process(arguments: list[str], log_file: Path) -> subprocess.Popen:
    """A Python child process logging to `log_file`, without Feast's metrics variables."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("PROMETHEUS_MULTIPROC")}
    with open(log_file, "ab") as log:
        return subprocess.Popen(
            [sys.executable, *arguments],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=environment,
        )


def stop_worker(worker: subprocess.Popen, timeout_s: float = 60.0) -> int:
    """SIGTERM (a clean stop that commits), SIGKILL if it does not end in time."""
    if worker.poll() is None:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(timeout_s)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
    return worker.returncode


def write_config(config: dict[str, Any], path: Path) -> HeadraceConfig:
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return parse_config(config, str(path), path.parent)


def run_demo(
    state_dir: Path, rate: float, duration_s: float, partitions: int, runtime: str = "faust"
) -> None:
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

        step("preparing Feast features (SQLite) and the sample model")
        world = SampleWorld()
        repo, model = prepare_sample_assets(state_dir, world)
        step.done(f"{world.n_users} users, {world.n_merchants} merchants")

        config_file = state_dir / "headrace.yaml"
        config = write_config(
            sample_config(
                broker.bootstrap_servers,
                repo,
                model,
                metrics_port=free_port(),
                runtime=runtime,
                fallback_model=fallback_path(model),
            ),
            config_file,
        )
        spec = config.pipelines[0]
        create_topics(config, partitions)

        step(f"starting the worker ({runtime} runtime)")
        worker = start_worker(config_file, state_dir / "worker.log")
        catalogue = LocalCatalogue()
        encoder = AvroEncoder(catalogue, "transaction.avsc", f"{spec.input_topic}-value")
        collector = OutcomeCollector(
            broker.bootstrap_servers,
            spec.output_topic,
            spec.dead_letter_topic,
            AvroDecoder(catalogue, "prediction.avsc"),
        ).start()
        producer = Producer({"bootstrap.servers": broker.bootstrap_servers, "linger.ms": 1})
        # Serving once it answers one event (sent before then, the warm-up would wait in
        # Kafka past its deadline and be shed); then a warm-up at the demo's rate, not
        # counted: caches, the broker's JIT.
        warmup = _encoded_ahead(world, "warmup", encoder, int(rate * WARMUP_S) + 1)
        send_at_rate(producer, spec.input_topic, iter(warmup[:1]), 1, 1)
        collector.wait_for(1, 120)
        send_at_rate(producer, spec.input_topic, iter(warmup[1:]), rate, WARMUP_S)
        if len(collector.wait_for(len(warmup), 120)) < len(warmup):
            raise click.ClickException(
                f"the worker did not answer its warm-up; see {state_dir / 'worker.log'}"
            )
        step.done(f"serving (metrics on :{config.metrics.port}/metrics)")

        click.echo(f"sending {rate:.0f} events/s for {duration_s:.0f} s, plus 5 malformed ones")
        measured = _encoded_ahead(world, "demo", encoder, int(rate * duration_s))
        for value in malformed_records(encoder, next(sample_events(world, 0))).values():
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
    finally:
        if collector is not None:
            collector.stop()
        if worker is not None:
            step("stopping the worker and Kafka")
            code = stop_worker(worker)
        broker.stop()
        if worker is not None:
            step.done(f"worker exit status {code}")


def _encoded_ahead(world: SampleWorld, prefix: str, encoder: AvroEncoder, count: int) -> list:
    """Events encoded before sending, so encoding cannot delay the load's schedule."""
    return list(
        itertools.islice(encoded(sample_events(world, time.time_ns(), prefix), encoder), count)
    )


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
    latencies = np.array([p["latency_ms"] for p in measured if p["status"] == "OK"])
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
