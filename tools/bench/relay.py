"""The floor of Kafka's client cost on a machine: a plain confluent-kafka relay.

The relay consumes each record and produces it again (same key, value and timestamp;
idempotent producer, `acks=all`, offsets stored on delivery), and does nothing else.
Its CPU per event is what any Python worker on this machine pays for Kafka alone, and
its round trip is the latency floor of one more hop. It fetches as the bare runtime
does by default. `headrace bench` sweeps it beside the workers (system `relay`); run it
alone to read a worker's figures against it, or with other consumer settings to see
what they cost:

    python -m tools.bench.relay --bootstrap 127.0.0.1:9092 --rate 100 --seconds 15
    python -m tools.bench.relay --bootstrap 127.0.0.1:9092 --rate 100 --seconds 15 \\
        --fetch-min-bytes 16384 --fetch-max-wait-ms 5 --one-key

Prints the relay process's CPU per event, its idle cores, and the round trip's
percentiles (from each input's intended send time to the moment its copy is read).
"""

from __future__ import annotations

import math
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import click
from confluent_kafka import Consumer, Producer

from infra.kafka_clients import client_settings
from infra.topics import delete_topics, ensure_topics
from streams.config import RUNTIME_FETCH
from tools.bench.cpu import cpu_seconds
from tools.bench.latency import LatencyLog, LatencySummary, raw_reader
from tools.deploy import start_process
from tools.loadgen import send_at_rate

STOP = b"relay-stop"


@dataclass(frozen=True)
class RelayResult:
    cpu_us_per_event: float
    idle_cores: float
    p50_ms: float
    p99_ms: float
    answered: int
    sent: int

    def line(self) -> str:
        return (
            f"{self.cpu_us_per_event:.0f} us CPU per event, idle {self.idle_cores:.3f} "
            f"cores; round trip p50 {self.p50_ms:.1f} ms, p99 {self.p99_ms:.1f} ms "
            f"({self.answered} of {self.sent} read back)"
        )


def serve(bootstrap: str, source: str, sink: str, consumer_settings: dict[str, object]):
    """The relay itself (its own process): until a record whose value is `STOP`."""
    consumer = Consumer({
        **client_settings(bootstrap, "relay-consumer"),
        "group.id": source, "auto.offset.reset": "earliest", "enable.auto.offset.store": False,
        **consumer_settings,
    })  # fmt: skip
    producer = Producer({**client_settings(bootstrap, "relay-producer"), "linger.ms": 1,
                         "enable.idempotence": True, "acks": "all"})  # fmt: skip
    consumer.subscribe([source])
    try:
        while True:
            message = consumer.poll(0.05)
            if message is None or message.error():
                continue
            if message.value() == STOP:
                return

            def stored(error, _record, message=message) -> None:
                if error is None:
                    consumer.store_offsets(message)

            producer.produce(sink, message.value(), message.key(),
                             timestamp=message.timestamp()[1], on_delivery=stored)  # fmt: skip
            producer.poll(0)
    finally:
        producer.flush(10)
        consumer.close()


def start(
    bootstrap: str, source: str, sink: str, consumer_settings: dict[str, object],
    log_file: Path | None = None,
) -> subprocess.Popen:  # fmt: skip
    """A relay process from `source` to `sink` (ended by SIGTERM or `STOP`)."""
    arguments = ["-m", "tools.bench.relay", "--serve", "--bootstrap", bootstrap,
                 "--source", source, "--sink", sink,
                 *(f"--set={key}={value}" for key, value in consumer_settings.items())]  # fmt: skip
    if log_file is not None:
        return start_process(arguments, log_file)
    return subprocess.Popen([sys.executable, *arguments])


def measure(
    bootstrap: str,
    rate: float,
    seconds: float,
    consumer_settings: dict[str, object],
    idle_s: float = 5.0,
    one_key: bool = False,
) -> RelayResult:
    """Start a relay process on new topics, measure it idle then at `rate`, stop it."""
    tag = uuid.uuid4().hex[:8]
    source, sink = f"relay-in-{tag}", f"relay-out-{tag}"
    ensure_topics(bootstrap, {source: 3, sink: 3})
    relay = start(bootstrap, source, sink, consumer_settings)
    log = LatencyLog()
    reader = raw_reader(bootstrap, [sink], log).start()
    producer = Producer({**client_settings(bootstrap, "relay-load"), "linger.ms": 1})
    try:
        # Until the relay answers, it is still starting or joining its group.
        warm_up = send_at_rate(producer, source, _records(b"warm-up"), 20, 1.0)
        if reader.wait_for(1, 60) < 1:
            raise RuntimeError("the relay answered nothing within 60 s")
        reader.wait_for(warm_up.sent, 10)
        idle_before = cpu_seconds(relay.pid)
        time.sleep(idle_s)
        idle_cores = (cpu_seconds(relay.pid) - idle_before) / idle_s
        before = cpu_seconds(relay.pid)
        records = _records(b"x" * 200, one_key)
        report = send_at_rate(producer, source, records, rate, seconds)
        reader.wait_for(warm_up.sent + report.sent, 30)
        cpu_s = cpu_seconds(relay.pid) - before
        for partition in range(3):
            producer.produce(source, STOP, partition=partition)
        producer.flush(10)
        relay.wait(30)
    finally:
        if relay.poll() is None:
            relay.kill()
        reader.stop()
        delete_topics(bootstrap, [source, sink])
    started_ms = math.floor(report.started_s * 1000)  # Kafka stamps whole milliseconds
    latencies_us, _ = log.window(started_ms, started_ms + report.elapsed_s * 1000 + 1)
    summary = LatencySummary.of(latencies_us)
    return RelayResult(cpu_s / report.sent * 1e6, idle_cores, summary.p50_ms, summary.p99_ms,
                       summary.count, report.sent)  # fmt: skip


def _records(value: bytes, one_key: bool = False) -> Iterator[tuple[bytes, bytes]]:
    """Keys spread over the partitions, or (`one_key`) all on one of them."""
    number = 0
    while True:
        yield (b"0" if one_key else str(number).encode()), value
        number += 1


@click.command()
@click.option("--bootstrap", required=True, help="A running broker.")
@click.option("--rate", type=float, default=100.0, show_default=True)
@click.option("--seconds", type=float, default=15.0, show_default=True)
@click.option("--fetch-min-bytes", type=int, default=RUNTIME_FETCH["bare"][1], show_default=True)
@click.option("--fetch-max-wait-ms", type=int, default=RUNTIME_FETCH["bare"][0], show_default=True)
@click.option(
    "--set",
    "settings",
    multiple=True,
    metavar="KEY=VALUE",
    help="A librdkafka consumer setting over those; repeatable.",
)
@click.option("--one-key", is_flag=True, help="Every record on one partition of the three.")
@click.option("--serve", "serve_relay", is_flag=True, hidden=True)
@click.option("--source", hidden=True)
@click.option("--sink", hidden=True)
def main(bootstrap, rate, seconds, fetch_min_bytes, fetch_max_wait_ms, settings, one_key,
         serve_relay, source, sink):  # fmt: skip
    """Measure a plain confluent-kafka relay: the Kafka floor of a worker's figures."""
    overrides = {}
    for setting in settings:
        key, separator, value = setting.partition("=")
        if not separator:
            raise click.BadParameter(f"{setting!r} is not KEY=VALUE", param_hint="--set")
        overrides[key] = value
    if serve_relay:  # the measuring process passes every setting
        serve(bootstrap, source, sink, overrides)
        return
    consumer_settings = {"fetch.min.bytes": str(fetch_min_bytes),
                         "fetch.wait.max.ms": str(fetch_max_wait_ms), **overrides}  # fmt: skip
    result = measure(bootstrap, rate, seconds, consumer_settings, one_key=one_key)
    described = ", ".join(f"{key} {value}" for key, value in consumer_settings.items())
    click.echo(f"relay at {rate:g}/s ({described}): {result.line()}")


if __name__ == "__main__":
    main()
