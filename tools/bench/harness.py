"""The benchmark run: setup, the sweeps of headrace and the baselines, and the verdicts.

Every system gets the same pre-encoded event stream, sent open-loop at each offered
rate (a warm-up, then a measured window), and is read back by a consumer that
measures end-to-end latency from each event's intended send time.

MLServer's Kafka mode is one of the systems (`mlserver`): its own environment, a custom
runtime doing headrace's feature read and model run, fed the same events as V2 JSON
(`tools/bench/mlserver/`); it is skipped, with the reason, where that environment
cannot be built.

The overload scenario (`scenario="overload"`) first finds a worker's capacity (the
highest rate of answers in full over a doubling ramp), then offers 0.5x, 1x, 2x and
4x that capacity and reports counts and percentiles per outcome status.

The capacity and scale-out scenarios (`tools/bench/scale.py`) run the same sweep on one
worker, and on 1, 2 and 3 workers of one group. The swap scenario (`tools/bench/swap.py`)
measures p99 across a model swap and the sustainable rate with a shadow candidate.
"""

from __future__ import annotations

import itertools
import math
import os
import shutil
import subprocess
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import click
import numpy as np
import onnxruntime as ort
from confluent_kafka import Producer
from pydantic import BaseModel, ConfigDict, Field

from features.sample_data import SampleWorld
from infra.kafka import KafkaBroker
from infra.kafka_clients import client_settings, list_topics
from infra.ports import free_port
from infra.topics import delete_topics, ensure_topics
from infra.zipkin import ZipkinServer
from models.config import ModelConfig
from models.session import load_session
from models.synthetic import write_heavy_model
from models.train import fallback_path
from schemas.catalogue import LocalCatalogue
from schemas.codec import AvroEncoder
from streams.config import BrokerConfig
from tools.bench import flame, relay
from tools.bench.cpu import CpuMeter
from tools.bench.latency import (
    LatencyLog,
    LatencySummary,
    prediction_reader,
    raw_reader,
    warm_broker,
)
from tools.bench.mlserver import system as mlserver
from tools.bench.mlserver.env import DEFAULT_VENV, MLServerUnavailable, ensure_venv
from tools.bench.profile import scrape, stage_profile
from tools.collector import TopicReader
from tools.deploy import (
    group_spread,
    prepare_sample_assets,
    sample_config,
    start_process,
    start_worker,
    stop_worker,
    write_config,
)
from tools.loadgen import Record, encoded, sample_events, send_at_rate

EVENT_POOL = 20_000
# How far past the sweep's top rate raw Kafka is swept (doubling until it fails).
RAW_KAFKA_REACH = 4
OVERLOAD_MULTIPLES = (0.5, 1.0, 2.0, 4.0)
# The raw ONNX run after an idle gap: the gap between batches at 100 events/s.
IDLE_GAP_S = 0.01
IDLE_GAP_RUNS = 100
# The capacity ramp stops at the first step answering less than this share in full.
RAMP_OK_SHARE = 0.9
# A sweep step is within budget when at least this share is answered in full (status OK)
# and the p99 of all answers is within the budget: the same 1% the p99 leaves out.
IN_FULL_SHARE = 0.99
# The sweep's workers keep the product's default latency budget: their deadlines
# only shed what the verdict's tighter p99 bound (`budget_ms`) would count as late anyway.
SWEEP_WORKER_BUDGET_MS = 100.0
# The overload scenario's default model: about 3 ms of compute per event on one core, so
# that the model, not Kafka or Python, bounds capacity (the case shedding is for).
HEAVY_MODEL = {"width": 1024, "layers": 128}
# Longest wait, before a step, for the answers of everything sent before it.
SETTLE_TIMEOUT_S = 120.0
# A system that can be restarted (MLServer: no backpressure, an overload backlog it may
# never work off) is restarted on new topics when it has not caught up after this long.
RESTART_AFTER_S = 30.0
# Workers also run one step at this rate, to compare runtimes' CPU per event at one load.
CPU_CHECK_PER_S = 1_000.0
# An idle worker's CPU is measured after this long without input.
IDLE_SETTLE_S = 3.0


class BenchSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    rates: tuple[float, ...] = ()
    """Offered rates (events/s) to run; empty means a geometric sweep."""
    sweep_start_per_s: float = Field(100.0, gt=0)
    sweep_factor: float = Field(2.0, gt=1)
    sweep_max_per_s: float = Field(25_600.0, gt=0)
    refine_steps: int = Field(3, ge=0, le=8)
    """Bisections between a system's highest passing and lowest failing rate."""
    repeats: int = Field(2, ge=1, le=5)
    """Runs of each refining rate; it passes only if every run does."""
    profile: bool = True
    """Sample each worker with py-spy at its sustainable rate (flame graph, stage split)."""
    idle_s: float = Field(5.0, ge=0)
    """Seconds over which an idle worker's CPU is measured (0: not measured)."""
    warmup_s: float = Field(2.0, ge=0)
    measure_s: float = Field(5.0, gt=0)
    drain_timeout_s: float = Field(15.0, gt=0)
    budget_ms: float = Field(50.0, gt=0)
    """p99 bound of the sustainable throughput."""
    partitions: int = Field(3, ge=1, le=64)
    max_batch_size: int = Field(64, ge=1, le=4096)
    max_wait_ms: float = Field(5.0, ge=0)
    fetch_min_bytes: int | None = Field(None, ge=1)
    """The workers' and the relay's `broker.fetch_min_bytes` (None: each runtime's own,
    the relay's bare's). With `fetch_max_wait_ms` 500 and 1 byte, every fetch is
    answered on its first byte: the latency-first setting."""
    fetch_max_wait_ms: int | None = Field(None, ge=0, le=1000)
    """The workers' and the relay's `broker.fetch_max_wait_ms` (None: as above)."""
    commit_interval_ms: int | None = Field(None, ge=0, le=60_000)
    """The workers' `broker.commit_interval_ms` (None: the default; 0: a commit on each
    acknowledgement)."""
    baselines: bool = True
    passes: int = Field(1, ge=1, le=4)
    """Sweeps of every system. Each pass runs them in the opposite order to the pass
    before, so that every pair is measured twice, once each way round, from runs near
    each other in time (the report gives each pass's verdicts side by side). Only the
    first pass is profiled."""
    systems: tuple[Literal["kafka", "relay", "headrace", "bare", "naive", "mlserver"], ...] = (
        "kafka", "relay", "headrace", "bare", "naive", "mlserver")  # fmt: skip
    """Systems the sweep runs, in this order (raw Kafka first: it also warms the broker);
    `baselines=False` keeps only headrace's runtimes among them (`headrace`, the Faust
    runtime, and `bare`). `relay` is a plain confluent-kafka relay (`relay.py`)."""
    mlserver_venv: Path = DEFAULT_VENV
    """MLServer's own environment, built there on first use."""
    mlserver_batch_time_ms: float = Field(2.0, ge=0)
    """MLServer's adaptive batching window (its batch size cap is `max_batch_size`)."""
    mlserver_freeze_heap: bool = True
    """MLServer's runtime freezes its start-up heap once loaded, as headrace's workers do."""
    scenario: Literal["sweep", "overload", "capacity", "scaleout", "swap"] = "sweep"
    runtimes: tuple[Literal["faust", "bare"], ...] = ("bare", "faust")
    """Runtimes the overload, capacity, scale-out and swap scenarios run."""
    target_per_s: float | None = Field(None, gt=0)
    """The capacity scenario plans for this input rate (None: a few multiples of one
    worker's rate)."""
    headroom: float = Field(0.5, gt=0, le=1)
    """Share of a worker's sustainable rate the capacity plan uses (the rest absorbs
    bursts, rebalances and a noisy neighbour)."""
    overload_model: Literal["heavy", "sample"] = "heavy"
    """The overload scenario's model: `heavy` (see HEAVY_MODEL) or the sample MLP."""
    delivery: Literal["at_least_once", "exactly_once"] = "at_least_once"
    """The workers' delivery (`exactly_once`: each batch's outcomes and offsets in one
    Kafka transaction, on both runtimes)."""
    tracing: bool = False
    """Workers trace at 100% sampling, every event its own sampled trace (a `traceparent`
    header), spans sent to a private in-memory Zipkin: what tracing costs."""
    state_dir: Path = Path(".headrace/bench")
    bootstrap_servers: str | None = None
    """Reuse a running broker instead of starting a private one."""

    def swept_systems(self) -> tuple[str, ...]:
        """The systems the sweep runs, in order (without baselines: headrace's runtimes)."""
        if self.baselines:
            return self.systems
        return tuple(s for s in self.systems if s in ("headrace", "bare")) or ("headrace",)

    def pass_orders(self) -> list[tuple[str, ...]]:
        """The order of the systems in each pass: as given, then reversed, and so on."""
        systems = self.swept_systems()
        return [systems if number % 2 == 0 else systems[::-1] for number in range(self.passes)]

    def offered_rates(self) -> list[float]:
        if self.rates:
            return sorted(self.rates)
        count = int(math.log(self.sweep_max_per_s / self.sweep_start_per_s, self.sweep_factor))
        return [self.sweep_start_per_s * self.sweep_factor**i for i in range(count + 1)]

    def raw_kafka_rates(self) -> list[float]:
        """The sweep's rates, doubled on to `RAW_KAFKA_REACH` times its top one: the
        ratio targets need raw Kafka's limit, and on 2 cores it passed every rate to
        25,600/s (51,200/s in a run of its own)."""
        rates = self.offered_rates()
        reach = self.sweep_max_per_s * RAW_KAFKA_REACH
        while not self.rates and rates[-1] * self.sweep_factor <= reach:
            rates.append(rates[-1] * self.sweep_factor)
        return rates


@dataclass
class StepResult:
    system: str
    offered_per_s: float
    measured: int
    """Events sent inside the measured window."""
    answered: int
    unanswered: int
    achieved_per_s: float
    latency: LatencySummary
    statuses: dict[str, int]
    send_lag_ms: float
    within_budget: bool
    """Nothing lost, at least 99% answered in full (status OK), p99 within the budget."""
    overloaded: bool
    by_status: dict[str, LatencySummary] = field(default_factory=dict)
    multiple: float | None = None
    """Offered load over the measured capacity (overload scenario)."""
    profile: dict[str, float] = field(default_factory=dict)
    cpu_us_per_event: dict[str, float] = field(default_factory=dict)
    """CPU µs per event sent in the step (warm-up, window and drain), per process."""
    cpu_cores: dict[str, float] = field(default_factory=dict)
    """Mean cores each process used over the step."""
    machine_cores: dict[str, float] = field(default_factory=dict)
    """Mean cores the whole machine kept busy (`busy`) and its host took (`stolen`)
    over the step (`CpuMeter.machine_cores`)."""
    phase: str = "sweep"
    """sweep, refine (bisecting near the limit), or check (a fixed rate after the sweep)."""
    pass_number: int = 1
    """The pass of the run the step belongs to (`BenchSettings.passes`)."""


@dataclass
class SystemUnderTest:
    name: str
    input_topic: str
    reader: TopicReader
    log: LatencyLog
    sent: int = 0
    profile_port: int | None = None
    pid: int | None = None
    """The worker's process, for its CPU time and profile."""
    records: Iterator[Record] | None = None
    """What the load generator sends it, if not the bench's Avro events."""
    process: subprocess.Popen | None = None
    restart: Callable[[], None] | None = None
    """Replaces the process, topics and reader with fresh ones (None: cannot)."""
    restarts: int = 0
    workers: list[subprocess.Popen] = field(default_factory=list)
    """The worker processes of one group, where there are several (`process` is the first)."""
    group: str | None = None
    profiled: bool = True
    """Whether its sweep ends with a py-spy profile (not for the relay: no stages)."""


class Bench:
    """One benchmark run; `run()` returns everything the report needs."""

    def __init__(self, settings: BenchSettings, echo: Callable[..., None] = click.echo) -> None:
        self.settings = settings
        self.echo = echo
        self.run_id = uuid.uuid4().hex[:6]
        self.state_dir = settings.state_dir.resolve()
        self._topics: list[str] = []
        self.pass_number = 1

    def run(self) -> dict:
        settings = self.settings
        self.state_dir.mkdir(parents=True, exist_ok=True)
        broker = self._broker()
        self.bootstrap = settings.bootstrap_servers or broker.bootstrap_servers
        if broker is None:  # a broker of the caller's: one clear line if it is not there
            list_topics(self.bootstrap)
        # One producer sends every system's load: the same client for every figure.
        self.producer = Producer({**client_settings(self.bootstrap, "bench-load"), "linger.ms": 1})
        self.broker_pid = broker.process.pid() if broker is not None else None
        started = time.time()
        self.zipkin = self._zipkin()
        try:
            self.echo("preparing features (SQLite Feast) and the sample model")
            self.world = world = SampleWorld()
            self.repo, self.model_path = prepare_sample_assets(self.state_dir, world)
            self.records = _event_pool(world, self.run_id, traced=settings.tracing)
            results: dict = {"settings": settings.model_dump(mode="json"), "steps": []}
            self.systems: dict[str, dict] = {}
            results["systems"] = self.systems
            if settings.scenario == "overload":
                results["overload"] = {}
                for runtime in settings.runtimes:
                    capacity, steps = self._run_overload(runtime)
                    results["overload"][runtime] = capacity
                    results["steps"] += steps
                results["onnx"] = []
                results["elapsed_s"] = time.time() - started
                return results
            if settings.scenario in ("capacity", "scaleout", "swap"):
                from tools.bench import scale, swap  # they build on this module

                run_scenario = {"capacity": scale.capacity, "scaleout": scale.scaleout,
                                "swap": swap.swap}[settings.scenario]  # fmt: skip
                self._warm_broker()
                results[settings.scenario], results["steps"] = run_scenario(self)
                results["elapsed_s"] = time.time() - started
                return results
            if settings.baselines:
                # The bare session: what ONNX Runtime itself costs, without our answers.
                session = load_session(ModelConfig(path=self.model_path))
                results["onnx"] = self._raw_onnx(session)
                results["onnx_after_idle"] = self._raw_onnx_after_idle(session)
            self._warm_broker()
            results["passes"] = []
            first_run_id = self.run_id
            for number, order in enumerate(settings.pass_orders(), 1):
                # Each pass on topics and groups of its own (their names carry the run id).
                self.run_id = first_run_id if number == 1 else f"{first_run_id}p{number}"
                self.pass_number = number
                self.systems = {}
                if settings.passes > 1:
                    self.echo(f"pass {number} of {settings.passes}: {', '.join(order)}")
                steps = self._sweep_systems(order)
                for step in steps:
                    step.pass_number = number
                results["steps"] += steps
                results["passes"].append({"order": list(order), "systems": self.systems})
            results["systems"] = results["passes"][0]["systems"]
            results["elapsed_s"] = time.time() - started
            return results
        finally:
            if self._topics:
                delete_topics(self.bootstrap, self._topics)
            if broker is not None:
                broker.stop()
            if self.zipkin is not None:
                self.zipkin.stop()

    # Systems --------------------------------------------------------------------

    def _sweep_systems(self, order: tuple[str, ...]) -> list[StepResult]:
        """One pass: each system swept in `order`, its summary in `self.systems`."""
        steps: list[StepResult] = []
        for system in order:
            if system == "kafka":
                steps += self._run_raw_kafka(self.settings.raw_kafka_rates())
            elif system == "relay":
                steps += self._run_relay()
            elif system == "naive":
                steps += self._run_naive()
            elif system == "mlserver":
                steps += self._run_mlserver()
            else:
                runtime = "faust" if system == "headrace" else "bare"
                steps += self._run_worker(system, runtime)
        return steps

    def sweep_workers(self, name: str, runtime: str, workers: int = 1) -> list[StepResult]:
        """The sweep of `workers` worker processes in one group sharing its topics; the
        sustainable rate and bracket go to `self.systems[name]`, with the partitions each
        worker held (`partitions_per_worker`)."""
        system, _ = self._start_pipeline_process(name, worker=True, runtime=runtime,
                                                 workers=workers)  # fmt: skip
        try:
            spread = group_spread(self.bootstrap, system.group)
            steps = self._sweep(system, self.settings.offered_rates())
            self.systems[name]["partitions_per_worker"] = spread
            return steps
        finally:
            for process in system.workers:
                stop_worker(process)
            system.reader.stop()

    def _run_worker(self, name: str, runtime: str) -> list[StepResult]:
        system, worker = self._start_pipeline_process(name, worker=True, runtime=runtime)
        system.process = worker
        return self._measure_worker(system)

    def _measure_worker(self, system: SystemUnderTest) -> list[StepResult]:
        """Idle CPU, the sweep, the CPU check at 1,000/s and the profile of a started
        worker process (`system.process`), stopped at the end."""
        name = system.name
        try:
            idle = self._idle_cores(system)
            steps = self._sweep(system, self.settings.offered_rates())
            summary = self.systems[name]
            summary["idle_cores"] = idle
            if summary["sustainable_per_s"] >= CPU_CHECK_PER_S:
                # The issue's fixed point for comparing runtimes' CPU per event.
                check = self._step(system, CPU_CHECK_PER_S)
                check.phase = "check"
                steps.append(check)
            profiled = self.settings.profile and system.profiled and self.pass_number == 1
            if profiled and flame.available():
                summary["flame"] = self._profile(system, summary["sustainable_per_s"])
            if system.restart is not None:
                summary["restarts"] = system.restarts
            return steps
        finally:
            if system.process is not None:
                stop_worker(system.process)
            system.reader.stop()

    def _idle_cores(self, system: SystemUnderTest) -> float | None:
        """Cores the worker uses with no input, after its warm-up settled."""
        if not self.settings.idle_s:
            return None
        meter = CpuMeter({"worker": system.pid})
        time.sleep(IDLE_SETTLE_S)
        before = meter.snapshot()
        time.sleep(self.settings.idle_s)
        cores = CpuMeter.cores(before, meter.snapshot())
        self.echo(
            f"  {system.name}: idle worker uses {cores.get('worker', float('nan')):.3f} cores"
        )
        return cores.get("worker")

    def _profile(self, system: SystemUnderTest, rate: float) -> dict | None:
        """A step at `rate` with py-spy sampling the worker: flame graph and stage split."""
        if rate <= 0 or system.pid is None:
            return None
        raw = self.state_dir / f"{system.name}-{self.run_id}.stacks"
        seconds = self.settings.warmup_s + self.settings.measure_s
        recording = threading.Thread(target=flame.record, args=(system.pid, seconds, raw))
        recording.start()
        step = self._step(system, rate)
        recording.join()
        if not raw.exists():
            self.echo(f"  {system.name}: py-spy could not sample the worker")
            return None
        stacks = flame.read_stacks(raw)
        return {
            "rate_per_s": rate,
            "stacks": str(raw),
            "by_stage": flame.by_stage(stacks),
            "top_functions": flame.top_functions(stacks),
            "cpu_us_per_event": step.cpu_us_per_event,
        }

    def _run_overload(self, runtime: str) -> tuple[float, list[StepResult]]:
        name = f"overload-{runtime}"
        model = self.model_path
        if self.settings.overload_model == "heavy":
            heavy = self.state_dir / "models" / "heavy.onnx"
            model = write_heavy_model(model, heavy, **HEAVY_MODEL)
        system, worker = self._start_pipeline_process(
            name, worker=True, runtime=runtime, model_path=model,
            latency_budget_ms=self.settings.budget_ms,
        )  # fmt: skip
        try:
            capacity = self._capacity(system)
            self.echo(f"  {name}: capacity {capacity:.0f} answers in full per second")
            steps = []
            for multiple in OVERLOAD_MULTIPLES:
                step = self._step(system, multiple * capacity)
                step.multiple = multiple
                ok = step.by_status.get("OK")
                self.echo(
                    f"\r  {name:>8} {multiple:>4}x {step.offered_per_s:>7.0f}/s  "
                    f"statuses {step.statuses}  OK p99 {ok.p99_ms if ok else float('nan'):.1f} ms"
                    f"  unanswered {step.unanswered}"
                )
                steps.append(step)
            return capacity, steps
        finally:
            stop_worker(worker)
            system.reader.stop()

    def _capacity(self, system: SystemUnderTest) -> float:
        """The highest rate of answers in full (OK within the budget) over a doubling ramp."""
        settings = self.settings
        best = 0.0
        rate = settings.sweep_start_per_s
        while rate <= settings.sweep_max_per_s:
            step = self._step(system, rate)
            ok = step.statuses.get("OK", 0)
            self.echo(f"\r  ramp {rate:>8.0f}/s  answered in full {ok}/{step.measured}")
            best = max(best, ok / settings.measure_s)
            if ok < RAMP_OK_SHARE * step.measured:
                break
            rate *= settings.sweep_factor
        return best

    def _run_mlserver(self) -> list[StepResult]:
        """MLServer's Kafka mode doing the sample pipeline's work (see
        `tools/bench/mlserver/`), measured as the workers are; skipped with the reason
        where its environment cannot be built or it does not start.

        MLServer reads without backpressure (a task per record), so after an overloaded
        step it may never work off its backlog; rather than measure the next steps on
        that backlog, the bench restarts it on new topics (counted in the report), which
        gives it its best case at every rate."""
        try:
            python = ensure_venv(self.settings.mlserver_venv, self.echo)
        except MLServerUnavailable as exc:
            return self._skip("mlserver", str(exc))
        # The same events as the other systems', as V2 JSON (MLServer reads no Avro).
        events = itertools.islice(sample_events(self.world, 1, f"bench-{self.run_id}"),
                                  EVENT_POOL)  # fmt: skip
        pool = itertools.cycle(list(mlserver.records(events)))
        log = LatencyLog()
        try:
            system = self._launch_mlserver(python, log, pool, generation=0)
        except (MLServerUnavailable, click.ClickException) as exc:
            return self._skip("mlserver", str(exc))

        def restart() -> None:
            # Thrown away: no clean stop to wait for.
            stop_worker(system.process, timeout_s=5.0)
            system.reader.stop()
            system.process = None
            system.restarts += 1
            fresh = self._launch_mlserver(python, log, pool, generation=system.restarts)
            for name in ("input_topic", "reader", "sent", "pid", "process"):
                setattr(system, name, getattr(fresh, name))

        system.restart = restart
        try:
            return self._measure_worker(system)
        except (MLServerUnavailable, click.ClickException) as exc:
            return self._skip("mlserver", f"it did not restart: {exc}")

    def _launch_mlserver(
        self, python: Path, log: LatencyLog, records: Iterator[Record], generation: int
    ) -> SystemUnderTest:
        """MLServer started on new topics, answers read into `log`, warmed up. On
        failure nothing of it keeps running."""
        name = "mlserver"
        topics = f"{name}{generation or ''}"
        input_topic = self._topic(f"{topics}-in", self.settings.partitions)
        output_topic = self._topic(f"{topics}-out", self.settings.partitions)
        spec = sample_config(self.bootstrap, self.repo, self.model_path)["pipelines"][0]
        folder = self.state_dir / name / mlserver.v2.MODEL_NAME
        http_port = mlserver.write_model_folder(
            folder,
            bootstrap=self.bootstrap,
            input_topic=input_topic,
            output_topic=output_topic,
            repo_path=self.repo,
            feature_service=spec["feature_service"],
            entity_fields=spec["entity_fields"],
            model_path=self.model_path,
            max_batch_size=self.settings.max_batch_size,
            max_batch_time_ms=self.settings.mlserver_batch_time_ms,
            freeze_heap=self.settings.mlserver_freeze_heap,
        )
        reader = mlserver.answer_reader(self.bootstrap, [output_topic], log).start()
        system = SystemUnderTest(name, input_topic, reader, log, records=records)
        log_file = self.state_dir / f"{name}.log"
        self.echo(f"starting {name}")
        system.process = mlserver.start(python, folder, log_file)
        system.pid = system.process.pid
        try:
            mlserver.wait_ready(system.process, http_port, log_file)
            self._warm_up(system, log_file)
        except (MLServerUnavailable, click.ClickException):
            stop_worker(system.process)
            reader.stop()
            raise
        return system

    def _skip(self, name: str, reason: str) -> list[StepResult]:
        self.echo(f"  {name}: skipped: {reason}")
        self.systems[name] = {"skipped": reason}
        return []

    def _run_naive(self) -> list[StepResult]:
        system, process = self._start_pipeline_process("naive", worker=False)
        try:
            return self._sweep(system, self.settings.offered_rates())
        finally:
            stop_worker(process)
            system.reader.stop()

    def _warm_broker(self) -> None:
        """Load a throwaway topic before the first system is measured (JIT, page cache)."""
        topic = self._topic("warm", self.settings.partitions)
        warm_broker(self.bootstrap, self.producer, topic, self.records,
                    drain_timeout_s=self.settings.drain_timeout_s)  # fmt: skip

    def _run_raw_kafka(self, rates: list[float]) -> list[StepResult]:
        topic = self._topic("raw", self.settings.partitions)
        log = LatencyLog()
        system = SystemUnderTest("kafka", topic, raw_reader(self.bootstrap, [topic], log), log)
        system.reader.start()
        try:
            return self._sweep(system, rates)
        finally:
            system.reader.stop()

    def _fetch_settings(self) -> dict[str, int]:
        """The fetch settings the run sets for workers and relay (the others: defaults)."""
        chosen = {"fetch_min_bytes": self.settings.fetch_min_bytes,
                  "fetch_max_wait_ms": self.settings.fetch_max_wait_ms}  # fmt: skip
        return {name: value for name, value in chosen.items() if value is not None}

    def _run_relay(self) -> list[StepResult]:
        """A plain confluent-kafka relay (consume, produce, nothing else) fetching as the
        run's bare workers do: in the same run as the workers, the Kafka floor of
        their CPU per event and latency, and the ceiling of their rate."""
        source = self._topic("relay-in", self.settings.partitions)
        sink = self._topic("relay-out", self.settings.partitions)
        wait_ms, min_bytes = BrokerConfig(**self._fetch_settings()).fetching("bare")
        fetch = {"fetch.min.bytes": min_bytes, "fetch.wait.max.ms": wait_ms}
        log = LatencyLog()
        system = SystemUnderTest("relay", source, raw_reader(self.bootstrap, [sink], log), log,
                                 profiled=False)  # fmt: skip
        system.reader.start()
        log_file = self.state_dir / "relay.log"
        self.echo("starting relay")
        system.process = relay.start(self.bootstrap, source, sink, fetch, log_file)
        system.pid = system.process.pid
        try:
            self._warm_up(system, log_file)
        except click.ClickException:
            stop_worker(system.process)
            system.reader.stop()
            raise
        return self._measure_worker(system)

    def _raw_onnx(self, session: ort.InferenceSession) -> list[dict]:
        """The compute floor: the model on in-memory matrices at each batch size."""
        self.echo("raw ONNX Runtime at each batch size")
        (model_input,) = session.get_inputs()
        rng = np.random.default_rng(0)
        sizes = sorted({1, *(2**i for i in range(13) if 2**i <= self.settings.max_batch_size),
                        self.settings.max_batch_size})  # fmt: skip
        rows = []
        for size in sizes:
            feeds = {model_input.name: rng.random((size, model_input.shape[1]), dtype=np.float32)}
            timings = []
            deadline = time.perf_counter() + 0.5
            while time.perf_counter() < deadline or len(timings) < 20:
                began = time.perf_counter_ns()
                session.run(None, feeds)
                timings.append((time.perf_counter_ns() - began) / 1000)
            p50, p99 = np.percentile(timings, [50, 99])
            rows.append({"batch_size": size, "runs": len(timings), "p50_us": p50,
                         "p99_us": p99, "per_event_us": p50 / size,
                         "events_per_s": size / p50 * 1e6})  # fmt: skip
        return rows

    def _raw_onnx_after_idle(self, session: ort.InferenceSession) -> dict:
        """The model at batch size 1, CPU time per run back to back and after each idle
        gap: at light load a worker runs each small batch after such a gap, and on a
        shared machine its caches are cold by then, which no code of ours can avoid."""
        (model_input,) = session.get_inputs()
        feeds = {model_input.name: np.ones((1, model_input.shape[1]), dtype=np.float32)}

        def cpu_us(gap_s: float) -> float:
            timings = []
            for _ in range(IDLE_GAP_RUNS):
                if gap_s:
                    time.sleep(gap_s)
                began = time.thread_time_ns()
                session.run(None, feeds)
                timings.append((time.thread_time_ns() - began) / 1000)
            return float(np.median(timings))

        return {
            "gap_ms": IDLE_GAP_S * 1000,
            "runs": IDLE_GAP_RUNS,
            "hot_cpu_p50_us": cpu_us(0.0),
            "after_gap_cpu_p50_us": cpu_us(IDLE_GAP_S),
        }

    # Mechanics ------------------------------------------------------------------

    def _start_pipeline_process(
        self,
        name: str,
        worker: bool,
        runtime: str = "faust",
        model_path: Path | None = None,
        latency_budget_ms: float = SWEEP_WORKER_BUDGET_MS,
        workers: int = 1,
        amend: Callable[[dict], None] | None = None,
    ):
        """A worker (or the naive loop) on new topics, answers read, warmed up; with
        `workers` > 1 that many workers of one group (only the first serves metrics),
        warm-up once all hold partitions. `amend` edits the config before it is written."""
        suffix = f"-bench-{name}-{self.run_id}"
        port = free_port()
        config = sample_config(
            self.bootstrap,
            self.repo,
            model_path or self.model_path,
            suffix=suffix,
            metrics_port=port if worker else 0,
            max_batch_size=self.settings.max_batch_size,
            max_wait_ms=self.settings.max_wait_ms,
            runtime=runtime,
            latency_budget_ms=latency_budget_ms,
            fallback_model=fallback_path(self.model_path),
            delivery=self.settings.delivery if worker else "at_least_once",
            tracing=self._tracing() if worker else None,
        )
        config["broker"].update(self._fetch_settings())
        if self.settings.commit_interval_ms is not None:
            config["broker"]["commit_interval_ms"] = self.settings.commit_interval_ms
        if amend is not None:
            amend(config)
        config_file = self.state_dir / f"{name}.yaml"
        parsed = write_config(config, config_file)
        spec = parsed.pipelines[0]
        partitions = self.settings.partitions
        self._topic(spec.input_topic, partitions, exact=True)
        self._topic(spec.output_topic, partitions, exact=True)
        self._topic(spec.dead_letter_topic, 1, exact=True)
        log = LatencyLog()
        reader = prediction_reader(self.bootstrap, [spec.output_topic], log).start()
        system = SystemUnderTest(
            name, spec.input_topic, reader, log, profile_port=port if worker else None,
            group=parsed.app_id,
        )  # fmt: skip
        self.echo(f"starting {name}" + (f" ({workers} workers)" if workers > 1 else ""))
        log_file = self.state_dir / f"{name}.log"
        if worker:
            system.workers.append(start_worker(config_file, log_file))
            if workers > 1:
                others = self.state_dir / f"{name}-others.yaml"
                write_config({**config, "metrics": {"port": 0}}, others)
                system.workers += [start_worker(others, log_file) for _ in range(workers - 1)]
        else:
            system.workers.append(
                start_process(["-m", "tools.bench.naive", str(config_file)], log_file)
            )
        process = system.workers[0]
        system.pid = process.pid
        try:
            if workers > 1:
                self._wait_for_members(system, workers, log_file)
            self._warm_up(system, log_file)
        except click.ClickException:
            for started in system.workers:
                stop_worker(started)
            reader.stop()
            raise
        return system, process

    def _wait_for_members(self, system: SystemUnderTest, count: int, log_file: Path) -> None:
        """Until `count` members of the system's group hold partitions (start-up, joins)."""
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while len(group_spread(self.bootstrap, system.group)) < count:
            if time.monotonic() > deadline:
                raise click.ClickException(
                    f"{system.name}: {count} workers did not all join within "
                    f"{SETTLE_TIMEOUT_S:.0f} s; see {log_file}"
                )
            time.sleep(0.5)

    def _warm_up(self, system: SystemUnderTest, log_file: Path) -> None:
        """Send until answers flow: group join, partition assignment, first reads."""
        send_at_rate(self.producer, system.input_topic, system.records or self.records, 100, 2)
        system.sent += 200
        if system.reader.wait_for(system.sent, 120) < system.sent:
            raise click.ClickException(f"{system.name} did not answer its warm-up; see {log_file}")

    def _sweep(self, system: SystemUnderTest, rates: list[float]) -> list[StepResult]:
        """Step through `rates` until a step overloads the system, then bisect between
        the highest passing and the lowest failing rate, running each new rate
        `repeats` times (it passes only if every run does). A failing step of the sweep
        runs again and the second run stands (both are reported): on a shared machine
        one noisy step would otherwise set the bracket. Records the sustainable rate and
        that bracket in `self.systems`."""
        settings = self.settings
        steps: list[StepResult] = []
        passed = 0.0
        for rate in rates:
            step = self._run_step(system, rate, "sweep")
            if not step.within_budget:
                steps.append(step)
                step = self._run_step(system, rate, "sweep")
            steps.append(step)
            if step.within_budget:
                passed = max(passed, rate)
            if step.overloaded:
                break
        # The bracket to refine: the highest pass and the lowest failure above it (a noisy
        # failure below a pass does not move the sustainable rate down).
        failed = min((s.offered_per_s for s in steps if not s.within_budget
                      and s.offered_per_s > passed), default=None)  # fmt: skip
        for _ in range(settings.refine_steps if failed is not None else 0):
            rate = round((passed + failed) / 2) if passed else failed / settings.sweep_factor
            runs = []
            for _ in range(settings.repeats):
                runs.append(self._run_step(system, rate, "refine"))
                if not runs[-1].within_budget:
                    break
            steps += runs
            if all(run.within_budget for run in runs):
                passed = rate
            else:
                failed = rate
        self.systems[system.name] = {
            "sustainable_per_s": passed,
            "first_failing_per_s": failed,
            "capped": failed is None,
        }
        return steps

    def _run_step(
        self, system: SystemUnderTest, rate: float, phase: str,
        at_window: Callable[[], None] | None = None,
    ) -> StepResult:  # fmt: skip
        step = self._step(system, rate, at_window)
        step.phase = phase
        verdict = "ok" if step.within_budget else "over budget"
        cpu = step.cpu_us_per_event.get("worker")
        self.echo(
            f"\r  {system.name:>8} {rate:>8.0f}/s  p50 {step.latency.p50_ms:7.1f} ms  "
            f"p99 {step.latency.p99_ms:7.1f} ms  answered {step.answered}/{step.measured}"
            + (f"  worker {cpu:5.0f} us/event" if cpu is not None else "")
            + f"  {verdict} ({phase})"
        )
        return step

    def _step(
        self, system: SystemUnderTest, rate: float, at_window: Callable[[], None] | None = None
    ) -> StepResult:
        """One step at `rate`: warm-up, measured window, drain. `at_window` runs (on a
        thread) as the measured window opens: something the window must include."""
        settings = self.settings
        # Start from a caught-up system: a backlog left by an overloaded step would
        # count against this one.
        settle_s = SETTLE_TIMEOUT_S if system.restart is None else RESTART_AFTER_S
        if system.reader.wait_for(system.sent, settle_s) < system.sent:
            self.echo(f"\r  {system.name}: still behind after {settle_s:.0f} s")
            if system.restart is not None:
                self.echo(f"  {system.name}: restarting it on new topics")
                system.restart()
        before = scrape(system.profile_port) if system.profile_port else None
        workers = (
            {f"worker {i}": p.pid for i, p in enumerate(system.workers, 1)}
            if len(system.workers) > 1
            else {"worker": system.pid}
        )
        meter = CpuMeter(
            {**workers, "broker": self.broker_pid, "load generator": os.getpid()},
            by_thread=frozenset({"worker"}),
        )
        cpu_before = meter.snapshot()
        action = threading.Timer(settings.warmup_s, at_window) if at_window else None
        if action is not None:
            action.start()
        report = send_at_rate(
            self.producer,
            system.input_topic,
            system.records or self.records,
            rate,
            settings.warmup_s + settings.measure_s,
            on_tick=lambda sent: self.echo(
                f"\r  {system.name:>8} {rate:>8.0f}/s  sent {sent}", nl=False
            ),
        )
        system.sent += report.sent
        if action is not None:
            action.join()
        system.reader.wait_for(system.sent, settings.drain_timeout_s)
        cpu_after = meter.snapshot()
        profile = stage_profile(before, scrape(system.profile_port)) if before is not None else {}

        stamps_ms = ((report.started_s + np.arange(report.sent) / rate) * 1000).astype(np.int64)
        window_start = int((report.started_s + settings.warmup_s) * 1000)
        window_end = int((report.started_s + settings.warmup_s + settings.measure_s) * 1000)
        measured = int(((stamps_ms >= window_start) & (stamps_ms < window_end)).sum())
        latencies, statuses = system.log.window(window_start, window_end)
        summary = LatencySummary.of(latencies)
        unanswered = max(0, measured - len(latencies))
        counts = Counter(statuses)
        status_array = np.asarray(statuses)
        by_status = {
            status: LatencySummary.of(latencies[status_array == status]) for status in counts
        }
        answered_in_full = counts.get("OK", 0) + counts.get("RAW", 0)
        return StepResult(
            system=system.name,
            offered_per_s=rate,
            measured=measured,
            answered=len(latencies),
            unanswered=unanswered,
            achieved_per_s=len(latencies) / settings.measure_s,
            latency=summary,
            statuses=dict(counts),
            send_lag_ms=report.max_lag_ms,
            within_budget=unanswered == 0
            and answered_in_full >= IN_FULL_SHARE * measured
            and summary.p99_ms <= settings.budget_ms,
            overloaded=unanswered > 0
            or summary.p99_ms > 4 * settings.budget_ms
            or answered_in_full < measured / 2,
            by_status=by_status,
            profile=profile,
            cpu_us_per_event=CpuMeter.per_event_us(cpu_before, cpu_after, report.sent),
            cpu_cores=CpuMeter.cores(cpu_before, cpu_after),
            machine_cores=CpuMeter.machine_cores(cpu_before, cpu_after),
        )

    def _topic(self, name: str, partitions: int, exact: bool = False) -> str:
        topic = name if exact else f"bench-{name}-{self.run_id}"
        ensure_topics(self.bootstrap, {topic: partitions})
        self._topics.append(topic)
        return topic

    def _zipkin(self) -> ZipkinServer | None:
        if not self.settings.tracing:
            return None
        zipkin = ZipkinServer(self.state_dir / "zipkin", free_port())
        self.echo("starting a private Zipkin (tracing on)")
        zipkin.start()
        return zipkin

    def _tracing(self) -> dict | None:
        if self.zipkin is None:
            return None
        return {"enabled": True, "sample_ratio": 1.0, "endpoint": self.zipkin.spans_endpoint}

    def _broker(self) -> KafkaBroker | None:
        if self.settings.bootstrap_servers:
            return None
        kafka_dir = self.state_dir / "kafka"
        KafkaBroker(kafka_dir).stop()
        shutil.rmtree(kafka_dir, ignore_errors=True)
        broker = KafkaBroker(kafka_dir, free_port(), free_port())
        self.echo("starting a private Kafka broker")
        broker.start()
        return broker


def _event_pool(world: SampleWorld, run_id: str, traced: bool = False) -> Iterator[Record]:
    """The same encoded events for every system, cycled; encoding stays off the send path.
    `traced`: each with a `traceparent` of a sampled trace of its own."""
    encoder = AvroEncoder(LocalCatalogue(), "transaction.avsc", "bench-value")
    pool: list[Record] = list(itertools.islice(
        encoded(sample_events(world, 1, f"bench-{run_id}"), encoder), EVENT_POOL))  # fmt: skip
    if traced:
        pool = [(key, value, [("traceparent", _traceparent())]) for key, value in pool]
    return itertools.cycle(pool)


def _traceparent() -> bytes:
    return f"00-{os.urandom(16).hex()}-{os.urandom(8).hex()}-01".encode()
