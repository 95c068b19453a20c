"""Wires a worker together: config -> pipelines (schemas, features, models, codecs,
stages) -> runners -> a consumer runtime. The only module that does.

A batch that cannot be written ends the process at once (`os._exit`), so nothing
unwritten is ever committed; Kafka replays it to the next worker.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, NoReturn

from features.lookup import FeatureLookup
from features.store import open_store
from infra.kafka_clients import client_settings, list_topics, quiet_repeats
from infra.topics import ensure_topics
from models.config import ModelConfig
from models.pool import SessionPool, warmup_sizes
from models.registry import resolve_model
from models.session import graph_ports, load_session, signature_of
from models.signature import Signature, batch_problems
from schemas.catalogue import LocalCatalogue, SchemaCatalogue, open_catalogue, read_schema_file
from schemas.codec import AvroDecoder, AvroEncoder
from schemas.errors import HeadraceError
from schemas.validation import EventRules, field_types
from streams import heap, metrics
from streams.admit import Admission, Ladder, Tickets
from streams.backpressure import InFlight
from streams.config import HeadraceConfig, PipelineConfig
from streams.control import ControlFollower, ensure_control_topics
from streams.decode import EventDecoder
from streams.encode import AnswerEncoder, derived_schema
from streams.errors import ConfigError, PublishError, TransactionFailed, TransactionFenced
from streams.freeze import FreezeWatch
from streams.health import Health
from streams.infer import Model
from streams.logs import about, use_json_logs
from streams.pipeline import Pipeline, task_problems
from streams.publish import Publisher
from streams.records import InputRecord
from streams.replay import AnsweredBefore, OutcomeTopics
from streams.runner import AckBatch, PausePartition, PipelineRunner
from streams.shadow import ShadowScorer
from streams.swap import ModelSwitcher
from streams.tracing import open_provider, tracing_for
from streams.transact import BATCHES_AHEAD, TransactionalPublisher, transactional_id

log = logging.getLogger(__name__)

# Exit status of a worker that stopped because a batch could not be written.
EXIT_BATCH_FAILED = 70
# Each warm-up step's limit: a store or broker that is slow at start is the breaker's and
# the publisher's to handle once events come, not a reason to wait longer.
WARM_UP_TIMEOUT_S = 5.0


def input_schema(spec: PipelineConfig, catalogue: SchemaCatalogue) -> dict[str, Any]:
    """The reader schema of a pipeline's events: its `.avsc`, or the latest version of
    its subject in the registry. Blocks on the registry."""
    if spec.input.schema_path is not None:
        schema = read_schema_file(spec.input.schema_path)
    elif hasattr(catalogue, "latest"):
        schema = catalogue.latest(spec.input.subject)
    else:
        raise ConfigError(
            f"pipeline {spec.name}: input.subject needs a registry; set registry.url, or "
            "give input.schema (an .avsc file)"
        )
    if isinstance(catalogue, LocalCatalogue):
        # Without a registry, producers frame events with the schema's computed id.
        catalogue.id_for(f"{spec.input_topic}-value", schema)
    return schema


def check_fields(spec: PipelineConfig, schema: dict[str, Any]) -> list[str]:
    """Problems with the fields the config names, against the input schema's fields."""
    types = field_types(schema)
    fields = list(types)
    named = [
        ("input.event_id_field", spec.input.event_id_field),
        ("input.event_time_field", spec.input.event_time_field),
        ("priority.field", spec.priority.field),
        *((f"entity_fields.{key}", field) for key, field in spec.entity_fields.items()),
    ]
    problems = [
        f"pipeline {spec.name}: {role} {name!r} is not a field of the input schema "
        f"(fields: {list(fields)})"
        for role, name in named
        if name is not None and name not in fields
    ]
    time_field = spec.input.event_time_field
    if time_field in fields and not types[time_field] & {"int", "long", "float", "double"}:
        problems.append(
            f"pipeline {spec.name}: input.event_time_field {time_field!r} must be a number "
            f"(epoch milliseconds), its type is {sorted(types[time_field])}"
        )
    return problems


def answer_schema_of(spec: PipelineConfig, catalogue: SchemaCatalogue) -> dict[str, Any]:
    """A pipeline's derived answer schema, from its input schema and its model's task
    (loads the model, without warm-up). Blocks on the registry."""
    model = resolve_model(spec.model)
    task = signature_of(model, load_session(model)).output.task
    return derived_schema(spec, input_schema(spec, catalogue), task)


@dataclass
class Inspection:
    """A pipeline's parts as loaded without Kafka, and every problem found on the way:
    what `headrace check` prints and what a worker refuses to start with."""

    spec: PipelineConfig
    problems: list[str] = field(default_factory=list)
    schema: dict[str, Any] | None = None
    rules: EventRules | None = None
    lookup: FeatureLookup | None = None
    signature: Signature | None = None
    fallback: Signature | None = None
    model: ModelConfig | None = None
    """The model's config, naming a local file (a registry version looked up)."""
    fallback_model: ModelConfig | None = None
    answers: dict[str, Any] | None = None
    """The derived answer schema."""

    @property
    def fields(self) -> list[str]:
        return [f["name"] for f in self.schema["fields"]] if self.schema else []

    @property
    def feature_refs(self) -> list[str]:
        return self.lookup.feature_refs if self.lookup is not None else []


def inspect_pipeline(
    spec: PipelineConfig, catalogue: SchemaCatalogue, store: Any, resources: ExitStack
) -> Inspection:
    """Load the schema, feature service and models' signatures of a pipeline (blocks on
    the registry and the store; no warm-up), checking each against the others."""
    found = Inspection(spec)

    def attempt(step: Callable[[], Any]) -> Any:
        try:
            return step()
        except HeadraceError as exc:
            found.problems.append(str(exc))
            return None

    found.schema = attempt(lambda: input_schema(spec, catalogue))
    if found.schema is not None:
        found.problems += check_fields(spec, found.schema)
    if spec.feature_service is not None:
        found.lookup = attempt(lambda: FeatureLookup(
            store, spec.feature_service, spec.entity_fields, spec.feature_cache))  # fmt: skip
        if found.lookup is not None:
            resources.callback(found.lookup.close)
    found.model = attempt(lambda: resolve_model(spec.model))
    if found.model is not None:
        found.signature = attempt(lambda: _checked_signature(spec, found.model, found.problems))
    if spec.degradation.fallback_model is not None:
        found.fallback_model = attempt(lambda: resolve_model(spec.degradation.fallback_model))
    fallback = found.fallback_model
    if fallback is not None:
        found.fallback = attempt(lambda: _checked_signature(spec, fallback, found.problems))
    if found.signature is not None:
        found.problems += task_problems(spec, found.signature, found.fallback)
    for signature in (found.signature, found.fallback):
        if signature is not None and found.schema is not None:
            found.problems += signature.source_problems(found.fields, found.feature_refs)
    if found.schema is not None:
        float32_fields = [
            column.source
            for signature in (found.signature, found.fallback) if signature is not None
            for tensor in signature.inputs if tensor.dtype == "float32"
            for column in tensor.columns
        ]  # fmt: skip
        found.rules = attempt(
            lambda: EventRules(spec.input.validate_fields, found.schema, float32_fields)
        )
        # Without a resolved model, still check what the answers would carry (any task).
        task = found.signature.output.task if found.signature else "regression"
        answers = attempt(lambda: derived_schema(spec, found.schema, task))
        found.answers = answers if found.signature else None
    return found


def _checked_signature(spec: PipelineConfig, model: ModelConfig, problems: list[str]) -> Signature:
    """The model's signature; and, into `problems`, a batch size its graph cannot take."""
    session = load_session(model)
    signature = signature_of(model, session)
    problems += batch_problems(
        signature.name, graph_ports(session.get_inputs()), spec.max_batch_size
    )
    return signature


@dataclass
class Wired:
    """One pipeline's parts, as its runner needs them."""

    pipeline: Pipeline
    decoder: EventDecoder
    sessions: int
    lookup: FeatureLookup | None
    codec: AvroEncoder | None = None
    """Frames its answers (a shadow candidate's too)."""
    fields: list[str] = field(default_factory=list)
    feature_refs: list[str] = field(default_factory=list)
    shadow: ShadowScorer | None = None


def wire_pipeline(
    spec: PipelineConfig,
    catalogue: SchemaCatalogue,
    store: Any,
    publisher: Publisher,
    resources: ExitStack,
    tracer_provider: Any = None,
) -> Wired:
    """Open a pipeline's schema, features, models and codecs; blocks while models warm
    up. Raises ConfigError listing everything that does not fit. Without a
    `tracer_provider` its stages trace nothing."""
    found = inspect_pipeline(spec, catalogue, store, resources)
    if found.problems:
        # One line per problem (a problem's own list flattened), one line for just one.
        lines = [" ".join(part.strip() for part in p.splitlines()) for p in found.problems]
        sep = " " if len(lines) == 1 else "\n  "
        raise ConfigError(f"pipeline {spec.name} cannot start:{sep}" + "\n  ".join(lines))
    fields, refs = found.fields, found.feature_refs
    model = _model(found.model, spec, fields, refs, resources)
    fallback = None
    if found.fallback_model is not None:
        fallback = _model(found.fallback_model, spec, fields, refs, resources)
    codec = AvroEncoder(catalogue, found.answers, f"{spec.output_topic}-value")
    measure = metrics.PipelineMetrics(spec.name)
    degradation = spec.degradation
    budget_s = spec.latency_budget_ms / 1000
    admission = Admission(
        budget_s,
        spec.priority.budget_shares,
        Ladder(
            fallback_model=fallback is not None,
            answer_cache=degradation.answer_cache.max_entries > 0,
            default_answer=degradation.default_score is not None,
        ),
    )
    tickets = Tickets(admission, spec.input, spec.priority)
    tracing = tracing_for(tracer_provider, spec)
    decoder = EventDecoder(
        AvroDecoder(catalogue, found.schema), found.rules, tickets, measure, tracing=tracing
    )
    encoder = AnswerEncoder(codec, spec.output_topic, spec.included_fields)
    pipeline = Pipeline(spec, admission, found.lookup, model, encoder, publisher, measure,
                        fallback, tracing=tracing)  # fmt: skip
    log.info(
        "pipeline %s: %s -> %s (answers: schema id %d), model %s v%s (%s), sessions %s, "
        "fallback %s",
        spec.name, spec.input_topic, spec.output_topic, codec.schema_id, model.signature.name,
        model.signature.version, model.signature.output.task, model.pool.providers,
        f"{fallback.signature.name} v{fallback.signature.version}" if fallback else "none",
    )  # fmt: skip
    sessions = spec.model.cpu_sessions + spec.model.cuda_sessions
    return Wired(pipeline, decoder, sessions, found.lookup, codec, fields, refs)


def _model(config, spec: PipelineConfig, fields, refs, resources: ExitStack) -> Model:
    pool = SessionPool(config, warmup_sizes(spec.max_batch_size))
    resources.callback(pool.close)
    return Model(pool, fields, refs)


def open_store_for(config: HeadraceConfig) -> Any:
    """The Feast store, where some pipeline reads features (None otherwise)."""
    needs_store = any(spec.feature_service for spec in config.pipelines)
    return open_store(config.features.repo_path) if needs_store else None


def wire_pipelines(
    config: HeadraceConfig,
    publisher: Publisher,
    resources: ExitStack,
    catalogue: SchemaCatalogue | None = None,
) -> dict[str, Wired]:
    catalogue = catalogue or open_catalogue(config.registry)
    store = open_store_for(config)
    provider = open_provider(config.tracing, config.app_id)
    if provider is not None:
        resources.callback(provider.shutdown)  # sends the spans still waiting
    return {
        spec.name: wire_pipeline(spec, catalogue, store, publisher, resources, provider)
        for spec in config.pipelines
    }


def answered_before_check(
    config: HeadraceConfig, catalogue: SchemaCatalogue
) -> AnsweredBefore | None:
    """What reads the outcome topics back at each assignment (`streams/replay.py`; with
    a lookback of 0 it only marks what is read again); None with exactly-once delivery
    (its transactions leave nothing to find)."""
    lookback_s = config.broker.replay_lookback_s
    if config.delivery == "exactly_once":
        return None
    broker = config.broker
    return AnsweredBefore(
        client_settings(broker.bootstrap_servers, "replay-check", broker.connect_timeout_s),
        config.app_id,
        {spec.input_topic: OutcomeTopics(spec.output_topic, spec.dead_letter_topic)
         for spec in config.pipelines},
        AvroDecoder(catalogue, None),
        lookback_s,
    )  # fmt: skip


def warm_paths(publisher: Publisher, wired: dict[str, Wired]) -> None:
    """Before the worker joins its group, what a first batch would otherwise pay for
    besides the models (warm already): the feature stores' connections and first
    reads, the publisher's connections and metadata. On a cold worker the first
    batches spent 3-5x their later time there and were shed as if that were their cost."""
    started = time.monotonic()
    publisher.warm(WARM_UP_TIMEOUT_S)
    for parts in wired.values():
        if parts.lookup is not None:
            parts.lookup.warm(WARM_UP_TIMEOUT_S)
    log.info("feature reads and publisher warmed in %.0f ms", (time.monotonic() - started) * 1000)


def exit_on_fatal(error: BaseException, records: Sequence[InputRecord]) -> NoReturn:
    """Log what could not be written and end the process (exit 70) without committing
    it: one line with a hint for the failures headrace names (Kafka stayed unwritable,
    the producer was fenced, ...), a traceback only for anything else (a bug)."""
    if records:
        first = records[0]
        what = f"a batch of {len(records)} from {first.topic}[{first.partition}]@{first.offset}"
    else:
        what = "what it was answering"
    named = isinstance(error, HeadraceError)
    log.critical(
        "giving up on %s: %s. Exiting (70) without committing it: a restarted worker "
        "answers it again%s",
        what,
        error if named else repr(error),
        "" if "hint: " in str(error) else f"; hint: {_fatal_hint(error)}",
        exc_info=None if named else error,
        extra=about(records=records),
    )
    logging.shutdown()
    os._exit(EXIT_BATCH_FAILED)


def _fatal_hint(error: BaseException) -> str:
    if isinstance(error, TransactionFenced):
        return (
            "another worker with this worker's transactional id (app_id.broker.instance_id) "
            "took over: give each worker its own broker.instance_id"
        )
    if isinstance(error, PublishError | TransactionFailed):
        return (
            "check that the brokers are up and that the output and dead-letter topics take "
            "these records; run workers under a supervisor that restarts them"
        )
    if isinstance(error, HeadraceError):
        return "the failure is named before this hint; run workers under a supervisor"
    return "a bug in headrace: please report it with its traceback"


def check_topics(config: HeadraceConfig) -> None:
    """Fail early, naming the topic, when an input or output topic does not exist;
    BrokerUnavailable when Kafka does not answer within `broker.connect_timeout_ms`."""
    existing = list_topics(config.broker.bootstrap_servers, config.broker.connect_timeout_s)
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
        wanted[spec.shadow_output_topic] = partitions
    return ensure_topics(config.broker.bootstrap_servers, wanted, config.broker.connect_timeout_s)


def serve_metrics(config: HeadraceConfig, health: Health) -> None:
    """Serve `/metrics` and the health endpoints on `metrics.port` (ConfigError, at
    once, when it is taken)."""
    try:
        metrics.serve_metrics(config.metrics.port, health.answer)
    except OSError as exc:
        raise ConfigError(
            f"metrics.port {config.metrics.port}: cannot serve /metrics ({exc.strerror}); "
            "hint: another process (a second worker on this host?) listens there: set "
            "metrics.port to a free port, or 0 for no endpoint"
        ) from exc


def follow_deployments(
    config: HeadraceConfig, wired: dict[str, Wired], resources: ExitStack
) -> None:
    """Serve what the control topic deploys (loaded before this returns, so a worker
    started after a deploy answers with the deployed version from its first batch), and
    follow its changes on a thread; a shadow scorer per pipeline."""
    ensure_control_topics(config)
    bootstrap, timeout_s = config.broker.bootstrap_servers, config.broker.connect_timeout_s
    shadows = {spec.shadow_output_topic: 1 for spec in config.pipelines}
    ensure_topics(bootstrap, shadows, timeout_s)
    switcher = ModelSwitcher()
    resources.callback(switcher.close)
    for parts in wired.values():
        switcher.add(parts.pipeline, parts.fields, parts.feature_refs)
        spec = parts.pipeline.config
        encoder = AnswerEncoder(parts.codec, spec.shadow_output_topic, spec.included_fields)
        parts.shadow = ShadowScorer(parts.pipeline, encoder,
                                    client_settings(bootstrap, "shadow", timeout_s))  # fmt: skip
        resources.callback(parts.shadow.close)
    follower = ControlFollower(config, wired, switcher.apply, switcher.reports, switcher.guard)
    follower.catch_up(timeout_s * 2)
    follower.start()
    resources.callback(follower.stop)


def _stop_while_starting(_signum, _frame) -> NoReturn:
    log.info("stopped while starting: nothing was consumed")
    raise SystemExit(0)


def use_event_loop(config: HeadraceConfig) -> None:
    """Install the config's event loop implementation; call before anything asks for a
    loop: Faust and the bare runtime both take the policy's."""
    if config.event_loop == "uvloop":
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def run_worker(config: HeadraceConfig, log_level: str = "info") -> None:
    """Run until SIGTERM or SIGINT; on a clean stop every answered input is committed."""
    if config.log_format == "json":
        use_json_logs()
    # Until a runtime installs its own handlers nothing was consumed: a stop is clean.
    signal.signal(signal.SIGTERM, _stop_while_starting)
    # What can be refused without loading anything, first: the port, then the broker.
    health = Health(config)
    serve_metrics(config, health)
    check_topics(config)
    use_event_loop(config)
    logging.getLogger().setLevel({"warn": "WARNING"}.get(log_level, log_level.upper()))
    with ExitStack() as resources:
        bootstrap = config.broker.bootstrap_servers
        # Sized by the limits of the topics it writes (read from Kafka: blocks briefly).
        written = [t for p in config.pipelines for t in (p.output_topic, p.dead_letter_topic)]
        settings = client_settings(bootstrap, "publisher", config.broker.connect_timeout_s)
        transactions = None
        if config.delivery == "exactly_once":
            # Aborts what a predecessor with this transactional id left open (blocks).
            publisher = transactions = TransactionalPublisher(
                config.broker, written, settings, transactional_id=transactional_id(config)
            )
        else:
            publisher = Publisher(config.broker, written, settings)
        publisher.start()
        resources.callback(publisher.stop)
        catalogue = open_catalogue(config.registry)
        wired = wire_pipelines(config, publisher, resources, catalogue)
        warm_paths(publisher, wired)
        health.warmed([parts.lookup for parts in wired.values() if parts.lookup is not None])
        follow_deployments(config, wired, resources)
        # Frozen past the group session, the worker marks its answers until reassigned.
        broker = config.broker
        freeze = FreezeWatch(broker.session_timeout_ms / 1000, broker.heartbeat_interval_ms / 1000)
        freeze.start()
        resources.callback(freeze.stop)
        health.on_join(freeze.assigned)
        health.on_revoke(freeze.revoked)
        log.info("headrace worker ready: %d pipeline(s), %s runtime", len(wired), config.runtime)

        def make_runner(
            name: str, in_flight: InFlight, ack: AckBatch, pause: PausePartition
        ) -> PipelineRunner:
            parts = wired[name]

            def acknowledge(handles: list) -> None:
                health.answered(name)
                ack(handles)

            return PipelineRunner(
                parts.pipeline, parts.decoder, in_flight, acknowledge, exit_on_fatal,
                concurrent_inference=parts.sessions, pause=pause,
                publish_ahead=BATCHES_AHEAD if transactions is not None else 0,
                shadow=parts.shadow, unsure=freeze.unsure,
            )  # fmt: skip

        if config.runtime == "bare":
            from streams.consumers.confluent import BareConsumer

            heap.settle_heap()
            asyncio.run(
                BareConsumer(
                    config, make_runner, health, transactions, exit_on_fatal,
                    answered_before=answered_before_check(config, catalogue),
                ).serve()
            )  # fmt: skip
            return
        from streams.consumers import faust

        # aiokafka logs each failed connection attempt of an outage (~1,200 lines in 15 s).
        quiet_repeats(["aiokafka", "faust", "mode"])
        heap.settle_heap()
        faust.serve(
            config,
            make_runner,
            health,
            log_level,
            answered_before_check(config, catalogue),
            freeze,
            faust.Transactions(transactions, exit_on_fatal) if transactions is not None else None,
        )
