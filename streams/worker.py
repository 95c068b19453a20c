"""The headrace worker: a Faust app with one batching agent per configured pipeline.

Faust consumes (group membership, partitions, offsets); each agent hands raw-byte
micro-batches to `Pipeline.process`, which writes every outcome before returning.
Two Faust behaviours shape this module (see DESIGN.md, known traps):

- `take_events` acks a batch in a `finally`, so also when the agent is cancelled
  during shutdown or raises. A batch in progress is therefore finished before the
  cancellation goes on, and a batch that cannot be finished ends the process at once
  (`os._exit`), so that nothing unwritten is ever committed. Kafka replays it on restart.
- Faust's own `concurrency` must stay 1 per agent: more can commit past unprocessed offsets.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
from contextlib import ExitStack

import faust

from features.errors import FeatureStoreError
from features.lookup import FeatureLookup
from features.store import open_store
from infra.topics import ensure_topics
from models.errors import ModelError
from models.session import ModelSession
from schemas.catalogue import load_schema, open_catalogue
from schemas.codec import AvroDecoder, AvroEncoder
from schemas.errors import RegistryError
from streams import metrics
from streams.config import HeadraceConfig, PipelineConfig
from streams.errors import ConfigError, PublishError
from streams.pipeline import InputRecord, Pipeline
from streams.publisher import Publisher

log = logging.getLogger(__name__)

# Exit status of a worker that stopped because a batch could not be written.
EXIT_BATCH_FAILED = 70
RETRY_DELAYS_S = (0.1, 0.3, 1.0, 3.0, 10.0)
_TRANSIENT = (FeatureStoreError, ModelError, PublishError, RegistryError)


def build_pipelines(
    config: HeadraceConfig, publisher: Publisher, resources: ExitStack
) -> list[Pipeline]:
    """Open store, models and codecs for every pipeline; blocks while models warm up."""
    catalogue = open_catalogue(config.registry.url if config.registry else None)
    store = open_store(config.features.repo_path)
    event_fields = [f["name"] for f in load_schema("transaction.avsc")["fields"]]
    pipelines = []
    for spec in config.pipelines:
        model = ModelSession(
            spec.model.path,
            spec.model.device,
            spec.model.intra_op_threads,
            warmup_batch_sizes=(1, spec.max_batch_size),
        )
        resources.callback(model.close)
        lookup = FeatureLookup(store, spec.feature_service, spec.entity_fields)
        resources.callback(lookup.close)
        pipelines.append(
            Pipeline(
                spec,
                AvroDecoder(catalogue, "transaction.avsc"),
                AvroEncoder(catalogue, "prediction.avsc", f"{spec.output_topic}-value"),
                lookup,
                model,
                publisher,
                event_fields,
            )
        )
        log.info(
            "pipeline %s: %s -> %s, model %s v%s on %s",
            spec.name,
            spec.input_topic,
            spec.output_topic,
            model.metadata.name,
            model.metadata.version,
            model.providers,
        )
    return pipelines


def build_app(config: HeadraceConfig, pipelines: list[Pipeline]) -> faust.App:
    app = faust.App(
        config.app_id,
        broker=f"kafka://{config.broker.bootstrap_servers}",
        store="memory://",
        datadir=tempfile.mkdtemp(prefix="headrace-faust-"),
        web_enabled=False,
        topic_disable_leader=True,
        topic_allow_declare=False,
        consumer_auto_offset_reset="earliest",
        broker_commit_interval=1.0,
    )
    for pipeline in pipelines:
        _add_agent(app, pipeline)
    return app


def _add_agent(app: faust.App, pipeline: Pipeline) -> None:
    spec: PipelineConfig = pipeline.config
    topic = app.topic(
        spec.input_topic,
        key_type=bytes,
        value_type=bytes,
        key_serializer="raw",
        value_serializer="raw",
    )
    # take_events with no timeout may stall; 0 ms still waits for what is already buffered.
    within_s = max(spec.max_wait_ms, 0.1) / 1000

    async def consume(stream) -> None:
        async for events in stream.take_events(spec.max_batch_size, within=within_s):
            records = [_input_record(event.message) for event in events]
            batch = asyncio.ensure_future(_process_or_exit(pipeline, records))
            try:
                await asyncio.shield(batch)
            except asyncio.CancelledError:
                # Shutting down: finish writing this batch before take_events acks it.
                await batch
                raise

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
    )


async def _process_or_exit(pipeline: Pipeline, records: list[InputRecord]) -> None:
    """Process a batch, retrying store, model and Kafka errors; exit the process if it fails."""
    name = pipeline.config.name
    for attempt, delay_s in enumerate((*RETRY_DELAYS_S, None), start=1):
        try:
            await pipeline.process(records)
            return
        except _TRANSIENT as exc:
            if delay_s is None:
                failure: BaseException = exc
                break
            log.warning("pipeline %s: batch attempt %d failed (%s); retrying", name, attempt, exc)
            metrics.RETRIES.labels(name).inc()
            await asyncio.sleep(delay_s)
        except Exception as exc:  # a bug: never ack what it may have skipped
            failure = exc
            break
    first = records[0]
    log.critical(
        "pipeline %s: giving up on a batch of %d from %s[%d]@%d: %r. Exiting without "
        "committing it; a restarted worker reprocesses it.",
        name,
        len(records),
        first.topic,
        first.partition,
        first.offset,
        failure,
        exc_info=failure,
    )
    logging.shutdown()
    os._exit(EXIT_BATCH_FAILED)


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
    """Run until SIGTERM or SIGINT; on a clean stop every acked batch is committed."""
    check_topics(config)
    with ExitStack() as resources:
        publisher = Publisher(config.broker.bootstrap_servers)
        publisher.start()
        resources.callback(publisher.stop)
        pipelines = build_pipelines(config, publisher, resources)
        app = build_app(config, pipelines)
        metrics.serve_metrics(config.metrics.port)
        log.info("headrace worker ready: %d pipeline(s)", len(pipelines))
        worker = faust.Worker(app, loglevel=log_level, quiet=True)
        try:
            worker.execute_from_commandline()
        except SystemExit as exit_:
            if exit_.code not in (0, None):
                raise
