"""What a pipeline's own code costs, apart from Kafka: CPU per batch, hot and paced.

    python -m tools.bench.stages -c worker.yaml

wires the config's first pipeline as a worker does (decoder, Feast store, models,
encoder), with a publisher that acknowledges every batch at once and no consumer, and
runs batches of its example events (`tools/loadgen.py`) through a `PipelineRunner`:
decode, admit, features, infer, encode, acknowledge. For each batch size it reports
the process's CPU per batch, the minimum and the median of its windows (the
machines are noisy; the minimum is nearest the code's own cost), two ways:

- hot: batches back to back, as at a worker's limit;
- paced: a pause between batches, as at light load, where a worker sleeps between
  fetches. The same Python work costs more CPU after a sleep (cold caches, a vCPU the
  host descheduled): on the 2-core machines of our benchmarks, about twice as much
  after 5 ms, for any process, so a light-load figure in `headrace bench` is partly the
  machine's. Run `--pause-ms 0` to see the code alone.

What a worker's figures in `headrace bench` add to these is Kafka's: fetching,
producing, delivery reports and commits, and the wake-ups they cause.
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import click

from features.sample_data import SampleWorld
from schemas.catalogue import open_catalogue
from schemas.codec import AvroEncoder
from streams.app import (
    WARM_UP_TIMEOUT_S,
    input_schema,
    open_store_for,
    use_event_loop,
    wire_pipeline,
)
from streams.backpressure import InFlight
from streams.config import HeadraceConfig, load_config
from streams.outgoing import Outgoing
from streams.records import InputRecord
from streams.runner import PipelineRunner
from tools.loadgen import events_for

BATCH_SIZES = (1, 4, 45)
WINDOWS = 12
WINDOW_S = 0.4
DISTINCT_EVENTS = 20_000


@dataclass(frozen=True)
class StageCost:
    batch_size: int
    pause_ms: float
    min_us: float
    median_us: float
    """The process's CPU per batch, over the windows."""

    def line(self) -> str:
        pace = f"paced {self.pause_ms:g} ms" if self.pause_ms else "hot"
        return (
            f"batch {self.batch_size:3d}, {pace:>12}: {self.min_us:7.0f} µs CPU per batch "
            f"(median {self.median_us:.0f}), {self.min_us / self.batch_size:6.1f} µs per event"
        )


class _AcknowledgingPublisher:
    """Kafka's part left out: every outcome counts as written at once."""

    async def publish(self, outgoing: Outgoing) -> None:
        outgoing.delivered = [True] * len(outgoing.records)


def measure(
    config: HeadraceConfig,
    batch_sizes: tuple[int, ...] = BATCH_SIZES,
    pause_ms: tuple[float, ...] = (0.0, 5.0),
    windows: int = WINDOWS,
) -> list[StageCost]:
    """The cost of each batch size at each pause, in that order (blocks while it runs)."""
    spec = config.pipelines[0]
    catalogue = open_catalogue(config.registry)
    with ExitStack() as resources:
        wired = wire_pipeline(
            spec, catalogue, open_store_for(config), _AcknowledgingPublisher(), resources
        )
        if wired.lookup is not None:
            wired.lookup.warm(WARM_UP_TIMEOUT_S)  # as a worker: its views kept whole
        encoder = AvroEncoder(catalogue, input_schema(spec, catalogue), f"{spec.input_topic}-value")
        events = events_for(spec, SampleWorld(), seed=7)
        values = [encoder.encode(event) for event in itertools.islice(events, DISTINCT_EVENTS)]
        runner = PipelineRunner(wired.pipeline, wired.decoder, InFlight(spec.name, 10**6, 10**5),
                                ack=lambda handles: None, on_fatal=_raise)  # fmt: skip
        use_event_loop(config)  # as a worker's: hand-offs cost what they cost there
        return asyncio.run(_run(runner, values, batch_sizes, pause_ms, windows))


async def _run(runner, values, batch_sizes, pause_ms, windows) -> list[StageCost]:
    await runner.start()
    offsets = itertools.count()
    costs = []
    try:
        for size in batch_sizes:
            for pause in pause_ms:
                per_batch = []
                for window in range(windows + 1):  # the first warms up
                    cpu_s, batches = await _window(runner, values, offsets, size, pause / 1000)
                    if window:
                        per_batch.append(cpu_s / batches * 1e6)
                costs.append(StageCost(size, pause, min(per_batch), statistics.median(per_batch)))
    finally:
        await runner.stop()
    return costs


async def _window(runner, values, offsets, size, pause_s) -> tuple[float, int]:
    in_flight = runner.in_flight
    cpu_started, started = time.process_time(), time.perf_counter()
    batches = 0
    while time.perf_counter() - started < WINDOW_S:
        now_ms = int(time.time() * 1000)
        records = []
        for _ in range(size):
            offset = next(offsets)
            records.append(
                InputRecord("bench", 0, offset, now_ms, b"k", values[offset % len(values)])
            )
        runner.submit(records, [record.offset for record in records])
        await in_flight.wait_below(1)  # this batch answered
        batches += 1
        if pause_s:
            await asyncio.sleep(pause_s)
    return time.process_time() - cpu_started, batches


def _raise(error: BaseException, _records) -> None:
    raise error


@click.command()
@click.option(
    "-c",
    "--config",
    "config_path",
    type=click.Path(exists=True, path_type=Path),
    required=True,
    help="A worker config; its first pipeline is measured.",
)
@click.option("--batch-sizes", default=",".join(map(str, BATCH_SIZES)), show_default=True)
@click.option(
    "--pause-ms",
    default="0,5",
    show_default=True,
    help="Pauses between batches to measure (0: back to back).",
)
def main(config_path: Path, batch_sizes: str, pause_ms: str) -> None:  # fmt: skip
    """CPU per batch of a pipeline's own code, without Kafka."""
    costs = measure(
        load_config(config_path),
        tuple(int(size) for size in batch_sizes.split(",")),
        tuple(float(pause) for pause in pause_ms.split(",")),
    )
    for cost in costs:
        click.echo(cost.line())


if __name__ == "__main__":
    main()
