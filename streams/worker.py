"""The headrace worker: a Faust app with one agent per configured pipeline.

Faust consumes (group membership, partitions, fetching, committing acked offsets);
each agent takes its input topic's records a fetch at a time (`streams/faust_feed.py`:
Faust's own per-record delivery cost more than the whole pipeline) and hands them to
its pipeline's `PipelineRunner`, which batches, overlaps the stages and acknowledges
each record through Faust's consumer once its outcome is written; Faust commits only
acknowledged offsets. Faust behaviours that shape this module (DESIGN.md, known traps):

- A batch that cannot be written ends the process at once (`os._exit`), so nothing
  unwritten is ever committed; Kafka replays it to the next worker.
- Faust's own `concurrency` must stay 1 per agent: more can commit past unprocessed offsets.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import tempfile
from collections.abc import Sequence
from contextlib import ExitStack
from typing import NoReturn

import faust

from features.lookup import CacheSettings, FeatureLookup
from features.store import open_store
from infra.topics import ensure_topics
from models.pool import SessionPool, warmup_sizes
from schemas.catalogue import load_schema, open_catalogue
from schemas.codec import AvroDecoder, AvroEncoder
from streams import metrics
from streams.batching import BatchPolicy, ServiceTimes
from streams.config import HeadraceConfig, ModelConfig, PipelineConfig
from streams.errors import ConfigError
from streams.faust_feed import FeedApp
from streams.flow import InFlight
from streams.pipeline import InputRecord, Pipeline
from streams.publisher import Publisher
from streams.runner import AckBatch, PipelineRunner

log = logging.getLogger(__name__)

# Exit status of a worker that stopped because a batch could not be written.
EXIT_BATCH_FAILED = 70


def build_pipelines(
    config: HeadraceConfig, publisher: Publisher, resources: ExitStack
) -> list[Pipeline]:
    """Open store, model pools and codecs for every pipeline; blocks while models warm up."""
    catalogue = open_catalogue(config.registry.url if config.registry else None)
    store = open_store(config.features.repo_path)
    event_fields = [f["name"] for f in load_schema("transaction.avsc")["fields"]]
    pipelines = []
    for spec in config.pipelines:
        pool = _session_pool(spec.model, spec.max_batch_size)
        resources.callback(pool.close)
        fallback = None
        if spec.degradation.fallback_model is not None:
            fallback = _session_pool(spec.degradation.fallback_model, spec.max_batch_size)
            resources.callback(fallback.close)
        lookup = FeatureLookup(
            store,
            spec.feature_service,
            spec.entity_fields,
            CacheSettings(spec.feature_cache.max_entries, spec.feature_cache.max_staleness_s),
        )
        resources.callback(lookup.close)
        pipelines.append(
            Pipeline(
                spec,
                AvroDecoder(catalogue, "transaction.avsc"),
                AvroEncoder(catalogue, "prediction.avsc", f"{spec.output_topic}-value"),
                lookup,
                pool,
                publisher,
                event_fields,
                fallback,
            )
        )
        log.info(
            "pipeline %s: %s -> %s, model %s v%s, sessions %s, fallback %s",
            spec.name,
            spec.input_topic,
            spec.output_topic,
            pool.metadata.name,
            pool.metadata.version,
            pool.providers,
            f"{fallback.metadata.name} v{fallback.metadata.version}" if fallback else "none",
        )
    return pipelines


def _session_pool(spec: ModelConfig, max_batch_size: int) -> SessionPool:
    return SessionPool(
        spec.path,
        cpu_sessions=spec.cpu_sessions,
        cuda_sessions=spec.cuda_sessions,
        intra_op_threads=spec.intra_op_threads,
        batch_sizes=warmup_sizes(max_batch_size),
    )


def batch_policy(spec: PipelineConfig) -> BatchPolicy:
    return BatchPolicy(
        max_batch_size=spec.max_batch_size,
        max_wait_s=spec.max_wait_ms / 1000,
        latency_budget_s=spec.latency_budget_ms / 1000,
        adaptive=spec.batching == "adaptive",
        stage_times=ServiceTimes(),
        completion_times=ServiceTimes(),
    )


def make_runner(pipeline: Pipeline, in_flight: InFlight, ack: AckBatch) -> PipelineRunner:
    spec = pipeline.config
    return PipelineRunner(
        pipeline,
        batch_policy(spec),
        in_flight,
        ack,
        exit_on_fatal,
        concurrent_inference=spec.model.cpu_sessions + spec.model.cuda_sessions,
    )


def exit_on_fatal(error: BaseException, records: Sequence[InputRecord]) -> NoReturn:
    """Log the batch that could not be written and end the process without committing it."""
    where = (
        f" from {records[0].topic}[{records[0].partition}]@{records[0].offset}" if records else ""
    )
    log.critical(
        "giving up on a batch of %d%s: %r. Exiting without committing it; "
        "a restarted worker answers it again.",
        len(records),
        where,
        error,
        exc_info=error,
    )
    logging.shutdown()
    os._exit(EXIT_BATCH_FAILED)


def build_app(config: HeadraceConfig, pipelines: list[Pipeline]) -> faust.App:
    app = FeedApp(
        config.app_id,
        fetch=(config.broker.fetch_max_wait_ms, config.broker.fetch_min_bytes),
        broker=f"kafka://{config.broker.bootstrap_servers}",
        store="memory://",
        datadir=tempfile.mkdtemp(prefix="headrace-faust-"),
        web_enabled=False,
        topic_disable_leader=True,
        topic_allow_declare=False,
        consumer_auto_offset_reset="earliest",
        broker_commit_interval=1.0,
        # A fetch is handed to an agent whole: its size bounds how far a chunk can go
        # past the in-flight bound (as the bare runtime's chunk does).
        broker_max_poll_records=max(p.config.max_batch_size for p in pipelines),
    )
    for pipeline in pipelines:
        _add_agent(app, pipeline)
    return app


def _add_agent(app: FeedApp, pipeline: Pipeline) -> None:
    spec: PipelineConfig = pipeline.config
    topic = app.topic(
        spec.input_topic,
        key_type=bytes,
        value_type=bytes,
        key_serializer="raw",
        value_serializer="raw",
    )

    # At the bound the agent stops taking chunks; its feed fills, Faust's fetch loop
    # waits on it and fetching stops (bounded by aiokafka's own buffer).
    in_flight = InFlight(spec.name, high=spec.max_in_flight, low=spec.resume_at)

    def ack(messages: list) -> None:
        # The outcomes are written: Faust may now commit these offsets.
        consumer_ack = app.consumer.ack
        for message in messages:
            consumer_ack(message)

    runner = make_runner(pipeline, in_flight, ack)
    app.add_feed(topic)

    async def consume(_stream) -> None:
        # The agent's stream stays unused: records arrive a fetch at a time on the feed.
        await runner.start()
        try:
            while True:
                messages = await app.take(spec.input_topic)
                runner.submit([_input_record(message) for message in messages], messages)
                # At the bound: take nothing more until drained to the low-water mark.
                await in_flight.wait_resumed()
        except asyncio.CancelledError:
            # Shutting down: write and ack what was taken before Faust commits.
            await runner.drain()
            raise
        finally:
            await runner.stop()

    app.agent(topic, name=f"headrace.{spec.name}", concurrency=1)(consume)


def _input_record(message) -> InputRecord:
    return InputRecord(
        topic=message.topic,
        partition=message.partition,
        offset=message.offset,
        # Faust reports the Kafka timestamp in (float) seconds.
        timestamp_ms=round(message.timestamp * 1000),
        key=message.key,
        value=message.value,
        headers=message.headers or (),
    )


def _stop_while_starting(_signum, _frame) -> NoReturn:
    log.info("stopped while starting: nothing was consumed")
    raise SystemExit(0)


def check_topics(config: HeadraceConfig) -> None:
    """Fail early, naming the topic, when an input or output topic does not exist."""
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": config.broker.bootstrap_servers})
    try:
        existing = admin.list_topics(timeout=15).topics
    except Exception as exc:
        raise ConfigError(
            f"cannot reach Kafka at {config.broker.bootstrap_servers}: {exc}"
        ) from exc
    for spec in config.pipelines:
        for topic in (spec.input_topic, spec.output_topic, spec.dead_letter_topic):
            if topic not in existing:
                raise ConfigError(
                    f"pipeline {spec.name}: topic {topic!r} does not exist; "
                    "hint: `headrace topics create -c CONFIG`"
                )


def create_topics(config: HeadraceConfig, partitions: int) -> list[str]:
    wanted = {}
    for spec in config.pipelines:
        wanted[spec.input_topic] = partitions
        wanted[spec.output_topic] = partitions
        wanted[spec.dead_letter_topic] = 1
    return ensure_topics(config.broker.bootstrap_servers, wanted)


def run_worker(config: HeadraceConfig, log_level: str = "info") -> None:
    """Run until SIGTERM or SIGINT; on a clean stop every answered input is committed."""
    # Until a runtime installs its own handlers nothing was consumed: a stop is clean.
    signal.signal(signal.SIGTERM, _stop_while_starting)
    check_topics(config)
    if config.event_loop == "uvloop":
        import uvloop

        # Before anything asks for a loop: Faust and the bare runtime both take the policy's.
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    logging.getLogger().setLevel({"warn": "WARNING"}.get(log_level, log_level.upper()))
    with ExitStack() as resources:
        publisher = Publisher(config.broker.bootstrap_servers)
        publisher.start()
        resources.callback(publisher.stop)
        pipelines = build_pipelines(config, publisher, resources)
        metrics.serve_metrics(config.metrics.port)
        log.info(
            "headrace worker ready: %d pipeline(s), %s runtime", len(pipelines), config.runtime
        )
        if config.runtime == "bare":
            from streams.bare import BareConsumer

            asyncio.run(BareConsumer(config, pipelines, make_runner).serve())
            return
        app = build_app(config, pipelines)
        worker = faust.Worker(app, loglevel=log_level, quiet=True)
        try:
            worker.execute_from_commandline()
        except SystemExit as exit_:
            if exit_.code not in (0, None):
                raise
