"""A restarted worker's first answers: as fast as its later ones, or shed?

A worker serves the sample fraud pipeline, answers a few events (so its group has
committed offsets, as in any restart) and stops cleanly. It is started again, and from
the moment it reports ready (`/healthz/ready`) events come at a steady rate. The
report gives the latency of the first answers, what was shed, and the latency of the
rest of the run for comparison; and a plain consumer reading the input beside it
shows when the events were there to be read:

    python -m tools.bench.restart --bootstrap 127.0.0.1:9092 --runtime faust
    python -m tools.bench.restart --bootstrap 127.0.0.1:9092 --runtime bare --rate 400

Each run makes its own topics and consumer group on the broker, and deletes them.
"""

from __future__ import annotations

import itertools
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np
from confluent_kafka import Producer

from features.sample_data import SampleWorld
from infra.kafka_clients import client_settings
from infra.ports import free_port
from infra.topics import delete_topics
from schemas.catalogue import LocalCatalogue
from streams.app import create_topics
from tools.answers import answer_decoder, event_encoder
from tools.bench.latency import LatencyLog, raw_reader
from tools.collector import OutcomeCollector
from tools.deploy import (
    fallback_path,
    prepare_sample_assets,
    sample_config,
    start_worker,
    stop_worker,
    wait_until_ready,
    write_config,
)
from tools.loadgen import encoded, events_for, send_at_rate

FIRST_LIFE_EVENTS = 20
FIRST_ANSWERS = 50
READY_TIMEOUT_S = 120.0


@click.command()
@click.option("--bootstrap", required=True, help="a running broker, HOST:PORT")
@click.option("--runtime", type=click.Choice(["faust", "bare"]), default="faust")
@click.option("--rate", type=float, default=200.0, help="events per second after the restart")
@click.option("--seconds", type=float, default=3.0, help="how long the load runs")
def main(bootstrap: str, runtime: str, rate: float, seconds: float) -> None:
    with tempfile.TemporaryDirectory(prefix="headrace-restart-") as state:
        click.echo(restart_run(bootstrap, runtime, rate, seconds, Path(state)).lines())


def restart_run(
    bootstrap: str, runtime: str, rate: float, seconds: float, state: Path
) -> RestartResult:
    world = SampleWorld()
    repo, model = prepare_sample_assets(state, world)
    suffix = f"-restart-{uuid.uuid4().hex[:8]}"
    port = free_port()
    raw = sample_config(bootstrap, repo, model, suffix=suffix, metrics_port=port,
                        runtime=runtime, fallback_model=fallback_path(model))  # fmt: skip
    config = write_config(raw, state / "headrace.yaml")
    spec = config.pipelines[0]
    created = [spec.input_topic, spec.output_topic, spec.dead_letter_topic]
    create_topics(config, partitions=4)
    catalogue = LocalCatalogue()
    encoder = event_encoder(config, spec, catalogue)
    producer = Producer({**client_settings(bootstrap, "restart-load"), "linger.ms": 1})
    collector = OutcomeCollector(
        bootstrap, spec.output_topic, spec.dead_letter_topic, answer_decoder(config, catalogue)
    ).start()
    arrivals = LatencyLog()
    input_reader = raw_reader(bootstrap, [spec.input_topic], arrivals).start()
    try:
        first = encoded(events_for(spec, world, 1, "first"), encoder)
        worker = start_worker(state / "headrace.yaml", state / "first-life.log")
        send_at_rate(producer, spec.input_topic, itertools.islice(first, FIRST_LIFE_EVENTS),
                     50, FIRST_LIFE_EVENTS / 50)  # fmt: skip
        answered = len(collector.wait_for(FIRST_LIFE_EVENTS, READY_TIMEOUT_S))
        stop_worker(worker)
        if answered < FIRST_LIFE_EVENTS:
            raise click.ClickException(
                f"the worker's first life answered {answered} of {FIRST_LIFE_EVENTS} events; "
                f"see {state / 'first-life.log'}"
            )

        total = int(rate * seconds)
        load = list(itertools.islice(encoded(events_for(spec, world, 2, "load"), encoder), total))
        started = time.monotonic()
        worker = start_worker(state / "headrace.yaml", state / "worker.log")
        try:
            if not wait_until_ready(worker, port, READY_TIMEOUT_S):
                raise click.ClickException(
                    f"the worker was not ready within {READY_TIMEOUT_S:.0f} s; "
                    f"see {state / 'worker.log'}"
                )
            ready_s = time.monotonic() - started
            load_from_ms = int(time.time() * 1000)  # events are stamped in whole ms
            send_at_rate(producer, spec.input_topic, iter(load), rate, seconds)
            outcomes = collector.wait_for(FIRST_LIFE_EVENTS + total, 60)
        finally:
            stop_worker(worker)
    finally:
        input_reader.stop()
        collector.stop()
        delete_topics(bootstrap, created)
    answers = sorted(
        (p for p in outcomes.predictions if p["event_id"].startswith("load")),
        key=lambda p: p["event_timestamp_ms"],
    )
    arrival_us, _ = arrivals.window(load_from_ms, float("inf"))
    return RestartResult(
        runtime, rate, ready_s, total, dict(Counter(a["status"] for a in answers)),
        np.array([a["latency_ms"] for a in answers]), arrival_us / 1000,
    )  # fmt: skip


@dataclass(frozen=True)
class RestartResult:
    runtime: str
    rate: float
    ready_s: float
    sent: int
    statuses: dict[str, int]
    latencies_ms: np.ndarray
    """Of the answers, in the order their events were sent."""
    arrivals_ms: np.ndarray
    """How long after its send each event reached a plain reader of the input."""

    @property
    def answered(self) -> int:
        return len(self.latencies_ms)

    def lines(self) -> str:
        first, rest = self.latencies_ms[:FIRST_ANSWERS], self.latencies_ms[FIRST_ANSWERS:]
        lines = [
            f"{self.runtime} runtime, restarted: ready after {self.ready_s:.1f} s; then "
            f"{self.rate:.0f} events/s",
            f"  outcomes: {self.statuses}, {self.sent - self.answered} of {self.sent} not answered",
        ]
        if len(first):
            lines.append(f"  first {len(first)} answers: first {first[0]:.1f} ms, "
                         f"p50 {np.median(first):.1f} ms, max {first.max():.1f} ms")  # fmt: skip
        if len(rest):
            p50, p99 = np.percentile(rest, [50, 99])
            lines.append(f"  the rest: p50 {p50:.1f} ms, p99 {p99:.1f} ms")
        if len(self.arrivals_ms):
            seen = self.arrivals_ms[:FIRST_ANSWERS]
            lines.append(f"  a plain reader of the input saw the first {len(seen)} events "
                         f"after p50 {np.median(seen):.1f} ms")  # fmt: skip
        return "\n".join(lines)


if __name__ == "__main__":
    main()
