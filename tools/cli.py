"""The `headrace` command line.

Exit statuses (README, "Exit statuses"): 0 done; 1 a verdict that failed (`audit`: not
every committed input has exactly one outcome; `check`: problems found); 2 a usage or
configuration error (flags, config file, a model that does not fit its config or
metadata, a missing topic, the metrics port taken, a local service's `start` on other
ports than it runs on); 69 Kafka could not be reached or did not answer in time; 70 a
worker gave up on a batch it could not write (nothing of it committed); 75 `produce`:
not every event was delivered; a local service's `stop` could not end its process; 130
interrupted (`produce` first flushes what it sent and says how much).
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import click

from schemas.errors import HeadraceError

EXIT_USAGE = 2
EXIT_UNAVAILABLE = 69
EXIT_INTERRUPTED = 130

DEFAULT_CONFIG = Path("headrace.yaml")
DEFAULT_STATE = Path(".headrace")
config_option = click.option(
    "-c",
    "--config",
    "config_path",
    type=click.Path(path_type=Path),
    default=DEFAULT_CONFIG,
    show_default=True,
    help="Worker configuration (YAML).",
)


def _config(path: Path):
    from streams.config import load_config

    return load_config(path)


def _pipeline(config, name: str | None):
    if name is None:
        return config.pipelines[0]
    for spec in config.pipelines:
        if spec.name == name:
            return spec
    raise click.BadParameter(
        f"no pipeline {name!r}; configured: {[p.name for p in config.pipelines]}",
        param_hint="--pipeline",
    )


@click.group()
@click.option("-v", "--verbose", is_flag=True, help="Log at debug level.")
def cli(verbose: bool) -> None:
    """headrace: low-latency streaming ML inference on Apache Kafka."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # Feast logs every registry refresh at INFO.
    logging.getLogger("feast").setLevel(logging.WARNING)


def _service_group(name: str, help_text: str, make, ports: dict[str, int], where) -> None:
    """`headrace NAME start|stop` for a local service of `infra/` run in the background.

    `make(state_dir, **ports)` builds the service; `where(service)` says where it answers.
    """
    group = click.Group(name, help=help_text)
    state_dir_option = click.option(
        "--state-dir", type=click.Path(path_type=Path), default=DEFAULT_STATE / name
    )

    def start(state_dir: Path, **chosen: int) -> None:
        service = make(state_dir, **chosen)
        with _stop_first_hint(name, state_dir, DEFAULT_STATE / name):
            # Asked here too: not every service's start() checks its ports.
            if service.running_on(chosen):
                click.echo(
                    f"{name} already running at {where(service)} (pid {service.process.pid()}); "
                    f"state in {state_dir}"
                )
                return
            took = service.start()
        click.echo(f"{name} ready at {where(service)} ({took:.1f} s); state in {state_dir}")

    for port, default in ports.items():
        start = click.option(f"--{port.replace('_', '-')}", port, default=default,
                             show_default=True)(start)  # fmt: skip
    group.command("start", help=f"Start {name} in the background; wait until it answers.")(
        state_dir_option(start)
    )

    def stop(state_dir: Path) -> None:
        stopped = make(state_dir).stop()
        click.echo(f"{name} stopped" if stopped else f"{name} was not running")

    group.command("stop", help=f"Stop {name}.")(state_dir_option(stop))
    cli.add_command(group)


@contextlib.contextmanager
def _stop_first_hint(group: str, state_dir: Path, default_state: Path) -> Iterator[None]:
    """AlreadyRunning with the command that stops the running service in its hint."""
    from infra.process import AlreadyRunning

    try:
        yield
    except AlreadyRunning as exc:
        where = "" if state_dir == default_state else f" --state-dir {state_dir}"
        hint = f"stop it first (`headrace {group} stop{where}`)"
        raise AlreadyRunning(exc.name, exc.pid, exc.running, exc.asked, hint) from None


def _kafka(state_dir: Path, **ports: int):
    from infra.kafka import KafkaBroker

    return KafkaBroker(state_dir, **ports)


def _registry(state_dir: Path, **ports: int):
    from infra.registry import SchemaRegistryServer

    return SchemaRegistryServer(state_dir, **ports)


def _zipkin(state_dir: Path, **ports: int):
    from infra.zipkin import ZipkinServer

    return ZipkinServer(state_dir, **ports)


def _redis(state_dir: Path, **ports: int):
    from infra.redis import RedisServer

    return RedisServer(state_dir, **ports)


_service_group(
    "broker",
    "The local Kafka broker (KRaft, single node).",
    _kafka,
    {"port": 9092, "controller_port": 9093},
    lambda kafka: kafka.bootstrap_servers,
)
_service_group(
    "registry",
    "The local schema registry (Apicurio, Confluent-compatible API; Java 21+).",
    _registry,
    {"port": 8081, "management_port": 8091},
    lambda registry: registry.url,
)
_service_group(
    "zipkin",
    "A local Zipkin server (in-memory), where `tracing` sends spans (Java 17+).",
    _zipkin,
    {"port": 9411},
    lambda zipkin: zipkin.url,
)
_service_group(
    "redis",
    "A local Redis server for Feast's Redis online store.",
    _redis,
    {"port": 6379},
    lambda redis: redis.connection_string,
)


@cli.group()
def topics() -> None:
    """Topics of the configured pipelines."""


@topics.command("create")
@config_option
@click.option("--partitions", default=3, show_default=True, help="For input and output topics.")
def topics_create(config_path: Path, partitions: int) -> None:
    """Create the missing input, output and dead-letter topics."""
    config = _config(config_path)
    _broker_topics(config)
    from streams.app import create_topics
    from streams.control import ensure_control_topics

    created = create_topics(config, partitions)
    # And the control plane's, so `models deploy` works before any worker ran.
    created += ensure_control_topics(config)
    click.echo(f"created: {', '.join(created) or 'nothing (all exist)'}")


@cli.group()
def features() -> None:
    """The Feast feature repo."""


@features.command("prepare")
@config_option
@click.option("--users", default=10_000, show_default=True)
@click.option("--merchants", default=1_000, show_default=True)
@click.option("--redis", "redis_at", metavar="HOST:PORT", help="Use Redis as the online store.")
def features_prepare(config_path: Path, users: int, merchants: int, redis_at: str | None) -> None:
    """Generate the sample statistics, register the views, materialize them online."""
    from features.sample_data import SampleWorld
    from features.store import prepare_sample_store

    repo = _config(config_path).features.repo_path
    prepare_sample_store(repo, SampleWorld(users, merchants), redis=redis_at)
    click.echo(f"features materialized in {repo}")


@cli.group()
def models() -> None:
    """Model artifacts."""


@models.command("train")
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    default=Path("models/artifacts/fraud-mlp.onnx"),
    show_default=True,
)
@click.option("--users", default=10_000, show_default=True)
@click.option("--merchants", default=1_000, show_default=True)
def models_train(out: Path, users: int, merchants: int) -> None:
    """Train the sample fraud model and its fallback, and the click-intent model, on the
    synthetic world; export them to ONNX (the others beside OUT, as fraud-lite.onnx and
    click-intent.onnx)."""
    from features.sample_data import SampleWorld
    from models.train import train
    from models.train_intent import intent_path, train_intent

    world = SampleWorld(users, merchants)
    report = train(out, world)
    for name in ("fraud-mlp", "fraud-lite"):
        model = report[name]
        click.echo(f"{name} written to {model['path']} (held-out AUC {model['auc']:.3f})")
    intent = train_intent(intent_path(out), world)
    click.echo(
        f"click-intent written to {intent['path']} (held-out accuracy {intent['accuracy']:.3f}, "
        f"log-loss {intent['log_loss']:.3f}); missing-product defaults {intent['defaults']}"
    )


@models.command("register")
@config_option
@click.option("--pipeline", "pipeline_name", help="Whose model registry (default: the first).")
@click.option("--alias", help="Also point this alias (e.g. champion) at the new version.")
@click.argument("name")
@click.argument("artifact", type=click.Path(path_type=Path, exists=True, dir_okay=False))
def models_register(
    config_path: Path, pipeline_name: str | None, alias: str | None, name: str, artifact: Path
) -> None:
    """Add ARTIFACT (.onnx) as the next version of NAME in the pipeline's model registry
    (its model's `registry`: a folder, or an MLflow server)."""
    from models.registry import open_registry

    registry = open_registry(_pipeline(_config(config_path), pipeline_name).model.registry)
    version = registry.register(name, artifact, {"source": str(artifact)})
    if alias:
        registry.set_alias(name, alias, version)
    click.echo(f"{name} version {version}" + (f" (@{alias})" if alias else ""))


@models.command("quantize")
@config_option
@click.option("--pipeline", "pipeline_name", help="Whose model (default: the first).")
@click.option(
    "--holdout",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    help="A CSV of held-out rows: the model's input columns and a `label` column "
    "(default: held-out events of the sample world, for the sample fraud model).",
)
@click.option(
    "--out",
    type=click.Path(path_type=Path, file_okay=False),
    default=Path("models/artifacts"),
    show_default=True,
    help="Folder for the int8 model and its report.",
)
def models_quantize(
    config_path: Path, pipeline_name: str | None, holdout: Path | None, out: Path
) -> None:
    """Write an int8 version of the pipeline's model (ONNX Runtime dynamic quantization)
    with a report beside it (the held-out metric of both models, batch latency at
    1/32/256 rows); a model from a registry gets it registered as its next version."""
    import json

    import pandas as pd

    from models.quantize import quantize, report
    from models.registry import model_name, open_registry, resolve_model

    model = _pipeline(_config(config_path), pipeline_name).model
    source = resolve_model(model)
    if holdout is not None:
        frame = pd.read_csv(holdout)
        labels = frame.pop("label").to_numpy()
    else:
        from features.sample_data import SampleWorld
        from models.train import held_out

        frame, labels = held_out(SampleWorld())
    stem = f"{model_name(model)}-{source.version or 'file'}.int8"
    int8 = quantize(source.path, out / f"{stem}.onnx")
    figures = report(source.path, int8, frame, labels)
    figures["quantized_from"] = str(source.path) if model.path else source.version
    version = None
    if model.path is None:  # from a registry: the int8 copy is its next version
        registry = open_registry(model.registry)
        meta = {"quantized_from": source.version, "report": json.dumps(figures)}
        version = figures["version"] = registry.register(model_name(model), int8, meta)
    (out / f"{stem}.report.json").write_text(json.dumps(figures, indent=2) + "\n")
    metric = figures["metric"]
    click.echo(f"{int8} ({metric} {figures[f'{metric}_float']} float, "
               f"{figures[f'{metric}_int8']} int8 on {figures['held_out_rows']} rows)")  # fmt: skip
    for role, sizes in figures["batch_latency_ms"].items():
        click.echo(f"  {role}: " + ", ".join(f"{ms} ms at {n}" for n, ms in sizes.items()))
    if version is not None:
        click.echo(f"registered as {model_name(model)} version {version}")


@models.command("deploy")
@config_option
@click.argument("pipeline")
@click.argument("version")
@click.option("--canary", type=float, help="Answer this percentage of keys with VERSION.")
@click.option(
    "--shadow", is_flag=True, help="Score with VERSION after serving, to the shadow topic."
)
@click.option(
    "--max-p99-increase-ms",
    type=float,
    help="Guardrail: roll the candidate back when its p99 run time exceeds the serving "
    "version's by more than this.",
)
@click.option(
    "--max-error-rate", type=float, help="Guardrail: ... when this share of its answers fail."
)
@click.option(
    "--max-score-drift",
    type=float,
    help="Guardrail: ... when its mean score moves this far from the serving version's.",
)
@click.option("--window-s", type=float, default=30.0, show_default=True, help="Its window.")
@click.option(
    "--wait",
    "wait_s",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="Seconds to wait for every live worker to apply it; exits 65 if one refused it, "
    "75 if one had not applied it by then (0: return once it is written).",
)
@click.option(
    "--min-answers",
    type=int,
    default=20,
    show_default=True,
    help="Answers each side needs in the window before the guardrail decides.",
)
def models_deploy(
    config_path: Path, pipeline: str, version: str, canary: float | None, shadow: bool,
    max_p99_increase_ms: float | None, max_error_rate: float | None,
    max_score_drift: float | None, window_s: float, wait_s: float, min_answers: int,
) -> None:  # fmt: skip
    """Make VERSION (or @ALIAS) of PIPELINE's model the serving one on every worker, or
    try it as a candidate (--canary PCT or --shadow) beside the serving one, optionally
    guarded: any --max-* limit broken over the window rolls the candidate back."""
    from streams.guardrail import Guardrail
    from tools import rollout

    if canary is not None and shadow:
        raise click.UsageError("--canary and --shadow exclude each other")
    config = _config(config_path)
    _broker_topics(config)
    mode = "canary" if canary is not None else "shadow" if shadow else None
    limits = (max_p99_increase_ms, max_error_rate, max_score_drift)
    guardrail = None
    if any(limit is not None for limit in limits):
        guardrail = Guardrail(window_s, *limits, min_answers=min_answers)
    spec = _pipeline(config, pipeline)
    desired = rollout.deploy(config, spec, version, mode, canary or 0.0, guardrail)
    click.echo(f"{pipeline}: {rollout.describe(desired)}")
    if wait_s:
        found = rollout.applied(config, spec, desired, wait_s)
        for report in found.reports:
            click.echo(f"  {rollout.report_line(report)}")
        rollout.check_applied(found, desired, wait_s)


@models.command("promote")
@config_option
@click.argument("pipeline")
def models_promote(config_path: Path, pipeline: str) -> None:
    """Make PIPELINE's candidate its serving version."""
    from tools import rollout

    config = _config(config_path)
    spec = _pipeline(config, pipeline)
    _broker_topics(config)
    desired = rollout.promote(config, spec)
    click.echo(f"{pipeline}: {rollout.describe(desired)}")


@models.command("rollback")
@config_option
@click.argument("pipeline")
def models_rollback(config_path: Path, pipeline: str) -> None:
    """Drop PIPELINE's candidate; without one, serve the previous version again."""
    from tools import rollout

    config = _config(config_path)
    spec = _pipeline(config, pipeline)
    _broker_topics(config)
    desired = rollout.rollback(config, spec)
    click.echo(f"{pipeline}: {rollout.describe(desired)}")


@models.command("status")
@config_option
@click.argument("pipeline", required=False)
def models_status(config_path: Path, pipeline: str | None) -> None:
    """What each pipeline should serve, and what each live worker serves."""
    from tools import rollout

    config = _config(config_path)
    specs = [_pipeline(config, pipeline)] if pipeline else config.pipelines
    _broker_topics(config)
    for spec in specs:
        click.echo("\n".join(rollout.status_lines(config, spec)))


@cli.command()
@config_option
def check(config_path: Path) -> None:
    """Load every pipeline's schema, feature service and models without Kafka; print the
    resolved column map and the answer schema; exit 1 listing every problem."""
    from contextlib import ExitStack

    from tools.answers import catalogue_of
    from tools.check import inspect_all, report

    config = _config(config_path)
    with ExitStack() as resources:
        found = inspect_all(config, resources)
    # Without a registry, the report shows the ids the local catalogue computes.
    catalogue = None if config.registry else catalogue_of(config)
    for inspection in found:
        click.echo("\n".join(report(inspection, catalogue)))
    problems = sum(len(inspection.problems) for inspection in found)
    if problems:
        raise click.ClickException(f"{problems} problem(s) in {config_path}")
    click.echo(f"{config_path}: {len(found)} pipeline(s), no problems")


@cli.group()
def schema() -> None:
    """A pipeline's schemas."""


@schema.command("show")
@config_option
@click.option("--pipeline", "pipeline_name", help="Pipeline name (default: the first).")
@click.option("--input", "show_input", is_flag=True, help="The input (reader) schema instead.")
def schema_show(config_path: Path, pipeline_name: str | None, show_input: bool) -> None:
    """Print a pipeline's answer schema (Avro JSON; its local-catalogue id on stderr
    without a registry): what a consumer reads the output topic with."""
    from schemas.catalogue import LocalCatalogue
    from streams.app import answer_schema_of, input_schema
    from tools.answers import catalogue_of

    config = _config(config_path)
    spec = _pipeline(config, pipeline_name)
    catalogue = catalogue_of(config)
    subject = f"{spec.input_topic if show_input else spec.output_topic}-value"
    shown = input_schema(spec, catalogue) if show_input else answer_schema_of(spec, catalogue)
    click.echo(json.dumps(shown, indent=2))
    if isinstance(catalogue, LocalCatalogue):
        click.echo(f"schema id {catalogue.id_for(subject, shown)} (local catalogue)", err=True)


@cli.command()
@click.option("--name", required=True, help="Pipeline name (also names its topics).")
@click.option("--schema", "schema_path", required=True, type=click.Path(path_type=Path),
              help="The events' Avro schema (.avsc).")  # fmt: skip
@click.option("--model", "model_path", required=True, type=click.Path(path_type=Path),
              help="The ONNX model.")  # fmt: skip
@click.option("--feature-service", help="A Feast feature service of the repo.")
@click.option("--repo", type=click.Path(path_type=Path), default=Path("features/repo"),
              show_default=True, help="The Feast repo of the feature service.")  # fmt: skip
def init(
    name: str, schema_path: Path, model_path: Path, feature_service: str | None, repo: Path
) -> None:
    """Print a pipeline stanza for the `pipelines:` list of a config, from an event schema,
    a model and (optionally) a feature service. Check it with `headrace check`."""
    import yaml

    from tools.init import feature_service_columns, stanza

    refs, join_keys = [], []
    if feature_service:
        refs, join_keys = feature_service_columns(repo, feature_service)
    spec = stanza(name, schema_path, model_path, refs, feature_service, join_keys)
    click.echo(yaml.safe_dump([spec], sort_keys=False), nl=False)


@cli.command()
@config_option
@click.option("-l", "--log-level", default="info", type=click.Choice(["debug", "info", "warn"]))
def worker(config_path: Path, log_level: str) -> None:
    """Run a worker until SIGTERM or Ctrl-C."""
    # Importing the worker takes seconds (Feast, ONNX Runtime, Faust): a SIGTERM then
    # is a clean stop (nothing consumed), not the default death by signal (-15).
    signal.signal(signal.SIGTERM, lambda _signum, _frame: sys.exit(0))
    config = _config(config_path)
    _broker_topics(config)
    from streams.app import run_worker

    run_worker(config, log_level)


@cli.command()
@config_option
@click.option("--pipeline", "pipeline_name", help="Pipeline name (default: the first).")
@click.option(
    "--rate", type=click.FloatRange(0, min_open=True), default=100.0, show_default=True,
    help="Events per second.",
)  # fmt: skip
@click.option(
    "--duration", type=click.FloatRange(0, min_open=True), default=10.0, show_default=True,
    help="Seconds.",
)  # fmt: skip
@click.option("--seed", default=1, show_default=True)
@click.option("--priority", type=int, help="Send this priority in the pipeline's priority header.")
def produce(
    config_path: Path,
    pipeline_name: str | None,
    rate: float,
    duration: float,
    seed: int,
    priority: int | None,
) -> None:
    """Send synthetic events at a fixed rate to a sample pipeline's input topic (the
    example pipelines' events: transactions or clicks, chosen by the input schema).
    Exits 75 when Kafka did not acknowledge every event, saying how many it did. Ctrl-C
    stops it: what was sent is flushed (up to 5 s), one line says how many events were
    sent and delivered, and it exits 130."""
    config = _config(config_path)
    spec = _pipeline(config, pipeline_name)
    _require_topic(config, spec.input_topic)
    from confluent_kafka import Producer

    from features.sample_data import SampleWorld
    from infra.kafka_clients import client_settings
    from tools.answers import event_encoder
    from tools.loadgen import NotDelivered, SendInterrupted, encoded, events_for, send_at_rate

    encoder = event_encoder(config, spec)
    broker = config.broker
    producer = Producer(
        {
            **client_settings(broker.bootstrap_servers, "producer", broker.connect_timeout_s),
            "linger.ms": 1,
            "delivery.timeout.ms": _DELIVERY_TIMEOUT_MS,
        }
    )
    records = encoded(events_for(spec, SampleWorld(), seed), encoder)
    if priority is not None:
        if spec.priority.header is None:
            raise click.UsageError(f"pipeline {spec.name} reads no priority header")
        header = [(spec.priority.header, str(priority).encode())]
        records = ((key, value, header) for key, value in records)
    shown = []

    def progress(sent: int) -> None:
        shown.append(sent)
        click.echo(f"\rsent {sent}", nl=False, err=True)

    try:
        report = send_at_rate(
            producer,
            spec.input_topic,
            records,
            rate,
            duration,
            on_tick=progress,
            flush_timeout_s=_DELIVERY_TIMEOUT_MS / 1000 + 5,
            interrupted_flush_timeout_s=_INTERRUPTED_FLUSH_S,
        )
    except SendInterrupted as stopped:
        report = stopped.report
    if shown:
        click.echo(err=True)  # ends the progress line
    if report.interrupted:
        unconfirmed = report.sent - report.delivered - report.failed
        click.echo(
            f"headrace: interrupted after {report.elapsed_s:.1f} s: sent {report.sent} "
            f"events to {spec.input_topic}, {report.delivered} delivered ({report.failed} "
            f"failed, {unconfirmed} unconfirmed)",
            err=True,
        )
        sys.exit(EXIT_INTERRUPTED)
    if report.delivered < report.sent:
        unconfirmed = report.sent - report.delivered - report.failed
        raise NotDelivered(
            f"{report.delivered} of {report.sent} events delivered to {spec.input_topic} "
            f"({report.failed} failed: {report.first_error or 'none'}; {unconfirmed} "
            "unconfirmed); hint: is the broker up, and does it take records this size?"
        )
    click.echo(
        f"delivered {report.delivered} events to {spec.input_topic} in "
        f"{report.elapsed_s:.1f} s (worst schedule lag {report.max_lag_ms:.1f} ms)"
    )


# How long `produce` waits for Kafka to acknowledge an event before counting it failed.
_DELIVERY_TIMEOUT_MS = 30_000
# How long an interrupted `produce` waits for what it sent (a second Ctrl-C ends it sooner).
_INTERRUPTED_FLUSH_S = 5.0


def _broker_topics(config) -> dict:
    """The cluster's topics; BrokerUnavailable (exit 69) when Kafka does not answer within
    `broker.connect_timeout_ms`. Commands ask before their heavy imports (Feast, ONNX
    Runtime: seconds), so an unreachable broker is named at once."""
    from infra.kafka_clients import list_topics

    return list_topics(config.broker.bootstrap_servers, config.broker.connect_timeout_s)


def _require_topic(config, topic: str) -> None:
    """As `_broker_topics`; and ConfigError for a topic Kafka does not have (a producer
    would wait for it until every event timed out)."""
    from streams.errors import ConfigError

    if topic not in _broker_topics(config):
        raise ConfigError(
            f"topic {topic!r} does not exist; hint: `headrace topics create -c CONFIG`"
        )


@cli.command()
@config_option
@click.option("--pipeline", "pipeline_name", help="Pipeline name (default: the first).")
@click.option("--max", "max_records", default=0, help="Stop after this many (0: never).")
@click.option("--from-beginning", is_flag=True)
def consume(
    config_path: Path, pipeline_name: str | None, max_records: int, from_beginning: bool
) -> None:
    """Print a pipeline's answers as JSON lines (a SHED answer's NaN as null)."""
    config = _config(config_path)
    spec = _pipeline(config, pipeline_name)
    _require_topic(config, spec.output_topic)
    import uuid

    from confluent_kafka import Consumer

    from infra.kafka_clients import client_settings
    from tools.answers import answer_decoder

    decoder = answer_decoder(config)
    broker = config.broker
    consumer = Consumer(
        {
            **client_settings(broker.bootstrap_servers, "consumer", broker.connect_timeout_s),
            "group.id": f"headrace-consume-{uuid.uuid4().hex[:8]}",
            "auto.offset.reset": "earliest" if from_beginning else "latest",
            "enable.auto.commit": False,
        }
    )
    consumer.subscribe([spec.output_topic])
    seen = skipped = 0
    try:
        while not max_records or seen < max_records:
            message = consumer.poll(1.0)
            if message is None or message.error():
                continue
            line = _answer_line(message, decoder)
            if line is None:
                skipped += 1
                continue
            click.echo(line)
            seen += 1
    except KeyboardInterrupt:
        pass
    finally:
        consumer.close()
        if skipped:
            click.echo(f"headrace: skipped {skipped} record(s) that did not decode", err=True)


def _answer_line(message, decoder) -> str | None:
    """One answer as a JSON line; None, after a line on stderr naming the record and why,
    for a record that is not an answer (a tombstone, other bytes): one bad record must not
    end the read, or `--from-beginning` could never get past it."""
    from schemas.errors import DecodeError
    from tools.answers import json_safe

    where = f"{message.topic()}[{message.partition()}]@{message.offset()}"
    if message.value() is None:
        click.echo(f"headrace: {where}: skipped, a tombstone (no value)", err=True)
        return None
    try:
        answer = decoder.decode(message.value())
    except DecodeError as exc:
        click.echo(f"headrace: {where}: skipped, not an answer ({exc})", err=True)
        return None
    return json.dumps(json_safe(answer), default=_json_value)


def _json_value(value):
    """What fastavro returns for logical types and bytes (an included input field), as
    JSON text: ISO dates and times, base64 bytes, UUID and Decimal as their strings."""
    import base64
    import datetime
    import decimal
    import uuid

    if isinstance(value, datetime.date | datetime.time):  # datetime is a date
        return value.isoformat()
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, uuid.UUID | decimal.Decimal):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


@cli.command()
@config_option
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--timeout", default=120.0, show_default=True, help="Seconds to read the topics.")
def audit(config_path: Path, as_json: bool, timeout: float) -> None:
    """Check that every committed input has exactly one outcome (exit status 1 if not;
    69 if Kafka cannot be reached or the topics are not read in time)."""
    config = _config(config_path)
    _broker_topics(config)
    from tools.audit import audit as run_audit
    from tools.audit import format_report

    audits = run_audit(config, timeout)
    if as_json:
        click.echo(json.dumps([found.as_dict() for found in audits], indent=2))
    else:
        click.echo(format_report(audits))
    if not all(found.exact for found in audits):
        sys.exit(1)


@cli.command()
@click.option("--rate", default=200.0, show_default=True, help="Events per second.")
@click.option("--duration", default=20.0, show_default=True, help="Seconds of measured load.")
@click.option("--partitions", default=3, show_default=True)
@click.option("--runtime", type=click.Choice(["faust", "bare"]), default="faust", show_default=True)
@click.option("--state-dir", type=click.Path(path_type=Path), default=DEFAULT_STATE / "demo")
@click.option(
    "--pipeline",
    type=click.Choice(["fraud", "clicks"]),
    default="fraud",
    show_default=True,
    help="The example pipeline the events go to (the worker serves both).",
)
def demo(
    rate: float, duration: float, partitions: int, runtime: str, state_dir: Path, pipeline: str
) -> None:
    """End to end on the embedded defaults: broker, features, model, worker, load, summary."""
    from tools.demo import run_demo

    run_demo(state_dir, rate, duration, partitions, runtime, pipeline)


@cli.command()
@click.option("--rates", help="Comma-separated offered rates (events/s); default: a sweep.")
@click.option("--sweep-start", default=100.0, show_default=True)
@click.option("--sweep-max", default=25_600.0, show_default=True)
@click.option(
    "--refine-steps",
    default=3,
    show_default=True,
    help="Bisections between each system's highest passing and lowest failing rate.",
)
@click.option(
    "--repeats", default=2, show_default=True, help="Runs of each refining rate (all must pass)."
)
@click.option(
    "--passes",
    type=click.IntRange(1, 4),
    default=1,
    show_default=True,
    help="Sweeps of every system, each pass in the opposite order to the one before.",
)
@click.option("--no-profile", is_flag=True, help="No py-spy flame graphs of the workers.")
@click.option(
    "--idle-s",
    default=5.0,
    show_default=True,
    help="Seconds over which an idle worker's CPU is measured (0: not measured).",
)
@click.option("--warmup", default=2.0, show_default=True, help="Seconds per step, not counted.")
@click.option("--measure", default=5.0, show_default=True, help="Measured seconds per step.")
@click.option(
    "--budget-ms",
    type=float,
    help="The workers' latency budget and the p99 bound of the verdicts "
    "[default: 50 for the sweep, 250 for the overload scenario].",
)
@click.option(
    "--partitions",
    type=click.IntRange(1, 64),
    help="Partitions of each topic [default: 12 for the scaleout scenario, else 3].",
)
@click.option("--max-batch-size", default=64, show_default=True)
@click.option("--max-wait-ms", default=5.0, show_default=True)
@click.option(
    "--fetch-min-bytes",
    type=click.IntRange(min=1),
    help="The workers' and the relay's broker.fetch_min_bytes [default: each runtime's: "
    "bare and the relay 1, Faust 16384].",
)
@click.option(
    "--fetch-max-wait-ms",
    type=click.IntRange(0, 1000),
    help="Their broker.fetch_max_wait_ms [default: bare and the relay 500, Faust 5]; 500 "
    "with --fetch-min-bytes 1 answers every fetch on its first byte (latency first).",
)
@click.option(
    "--commit-interval-ms",
    type=click.IntRange(0, 60_000),
    help="The workers' broker.commit_interval_ms [default: 100]; 0 commits each batch's "
    "offsets as soon as it is acknowledged.",
)
@click.option(
    "--no-baselines",
    is_flag=True,
    help="Only headrace's runtimes among the systems (no naive, Kafka, relay, ONNX, MLServer).",
)
@click.option(
    "--system",
    "systems",
    multiple=True,
    type=click.Choice(["kafka", "relay", "headrace", "bare", "naive", "mlserver"]),
    help="Systems the sweep runs (repeatable; default all: headrace is the Faust runtime; "
    "relay is a plain confluent-kafka consume-and-produce loop, the Kafka floor of a "
    "worker; mlserver builds its own environment on first use, skipped if it cannot).",
)
@click.option(
    "--scenario",
    type=click.Choice(["sweep", "overload", "capacity", "scaleout", "swap", "devices"]),
    default="sweep",
    show_default=True,
    help="sweep: headrace and baselines over rising rates; overload: 0.5x to 4x capacity; "
    "capacity: one worker's sustainable rate and the workers, partitions and KEDA lag "
    "threshold a target rate needs; scaleout: 1, 2 and 3 workers of one group; "
    "swap: p99 across a model swap, and the sustainable rate with a shadow candidate; "
    "devices: ONNX Runtime on CPU and CUDA (no Kafka; reports CUDA unavailable on CPU-only).",
)
@click.option(
    "--runtime",
    "runtimes",
    multiple=True,
    type=click.Choice(["bare", "faust"]),
    help="Runtimes of the overload, capacity, scaleout and swap scenarios (repeatable; default "
    "both, bare only for scaleout).",
)
@click.option(
    "--target-rate",
    type=click.FloatRange(min=0, min_open=True),
    help="Input rate (events/s) the capacity scenario plans for [default: 1, 2, 5 and 10 "
    "times one worker's rate].",
)
@click.option(
    "--headroom",
    type=click.FloatRange(0, 1, min_open=True),
    default=0.5,
    show_default=True,
    help="Share of a worker's sustainable rate the capacity plan uses.",
)
@click.option(
    "--overload-model",
    type=click.Choice(["heavy", "sample"]),
    default="heavy",
    show_default=True,
    help="Overload scenario's model: heavy (model-bound capacity) or the sample MLP.",
)
@click.option(
    "--delivery",
    type=click.Choice(["at_least_once", "exactly_once"]),
    default="at_least_once",
    show_default=True,
    help="The workers' delivery: exactly_once commits each batch and its offsets in a transaction.",
)
@click.option(
    "--tracing",
    is_flag=True,
    help="Workers trace every event (100% sampling, to a private Zipkin): what tracing costs.",
)
@click.option("--bootstrap", help="Use this running broker instead of a private one.")
@click.option(
    "--out", type=click.Path(path_type=Path), default=Path("bench-results"), show_default=True
)
def bench(
    rates: str | None,
    sweep_start: float,
    sweep_max: float,
    refine_steps: int,
    repeats: int,
    passes: int,
    no_profile: bool,
    idle_s: float,
    warmup: float,
    measure: float,
    budget_ms: float | None,
    partitions: int | None,
    max_batch_size: int,
    max_wait_ms: float,
    fetch_min_bytes: int | None,
    fetch_max_wait_ms: int | None,
    commit_interval_ms: int | None,
    no_baselines: bool,
    systems: tuple[str, ...],
    scenario: str,
    runtimes: tuple[str, ...],
    target_rate: float | None,
    headroom: float,
    overload_model: str,
    delivery: str,
    tracing: bool,
    bootstrap: str | None,
    out: Path,
) -> None:
    """Open-loop benchmark of headrace against raw Kafka, raw ONNX and a naive loop."""
    import time

    from tools.bench.harness import Bench, BenchSettings
    from tools.bench.report import write_reports

    if scenario == "devices":
        _bench_devices(out / f"devices-{time.strftime('%Y%m%d-%H%M%S')}")
        return
    settings = BenchSettings(
        rates=tuple(float(r) for r in rates.split(",")) if rates else (),
        sweep_start_per_s=sweep_start,
        sweep_max_per_s=sweep_max,
        refine_steps=refine_steps,
        repeats=repeats,
        passes=passes,
        profile=not no_profile,
        idle_s=idle_s,
        warmup_s=warmup,
        measure_s=measure,
        budget_ms=budget_ms or (250.0 if scenario == "overload" else 50.0),
        partitions=partitions or (12 if scenario == "scaleout" else 3),
        max_batch_size=max_batch_size,
        max_wait_ms=max_wait_ms,
        fetch_min_bytes=fetch_min_bytes,
        fetch_max_wait_ms=fetch_max_wait_ms,
        commit_interval_ms=commit_interval_ms,
        baselines=not no_baselines,
        systems=systems or BenchSettings.model_fields["systems"].default,
        scenario=scenario,
        runtimes=runtimes or (("bare",) if scenario == "scaleout" else ("bare", "faust")),
        target_per_s=target_rate,
        headroom=headroom,
        overload_model=overload_model,
        delivery=delivery,
        tracing=tracing,
        bootstrap_servers=bootstrap,
        state_dir=DEFAULT_STATE / "bench",
    )
    results = Bench(settings).run()
    paths = write_reports(results, out / time.strftime("%Y%m%d-%H%M%S"))
    click.echo(paths["markdown"].read_text())
    click.echo(f"reports: {', '.join(str(p) for p in paths.values())}")


def _bench_devices(out: Path) -> None:
    import json

    from features.sample_data import SampleWorld
    from tools.bench import devices
    from tools.deploy import prepare_sample_assets

    _repo, model = prepare_sample_assets((DEFAULT_STATE / "bench").resolve(), SampleWorld())
    result = devices.run(model)
    out.mkdir(parents=True, exist_ok=True)
    (out / "devices.json").write_text(json.dumps(result, indent=2))
    (out / "devices.md").write_text(devices.markdown(result))
    click.echo(devices.markdown(result))
    click.echo(f"reports: {out / 'devices.md'}, {out / 'devices.json'}")


def _metrics_targets(targets: tuple[str, ...], config_path: Path) -> list[str]:
    """The given host:port targets, else the config's metrics endpoint on this host."""
    if targets:
        return list(targets)
    if not config_path.exists():
        raise click.UsageError(
            f"no --target given and no config at {config_path}; hint: --target HOST:PORT "
            "(a worker's metrics.port), or -c CONFIG"
        )
    port = _config(config_path).metrics.port
    if not port:
        raise click.UsageError(f"{config_path}: metrics.port is 0 (no /metrics endpoint)")
    return [f"127.0.0.1:{port}"]


target_option = click.option(
    "--target",
    "targets",
    multiple=True,
    metavar="HOST:PORT",
    help="A worker's /metrics endpoint (repeatable; default: the config's metrics.port here).",
)


slo_option = click.option(
    "--slo",
    default=0.999,
    show_default=True,
    type=click.FloatRange(0, 1, min_open=True, max_open=True),
    help="The SLO: the share of inputs to answer OK within the latency budget.",
)


@cli.group()
def monitor() -> None:
    """A local Prometheus with headrace's SLO and alert rules (Debian's `prometheus`)."""


@monitor.command("start")
@config_option
@target_option
@slo_option
@click.option("--port", default=9090, show_default=True, help="Prometheus's web port (loopback).")
@click.option("--scrape-interval", default=5.0, show_default=True, help="Seconds.")
@click.option("--state-dir", type=click.Path(path_type=Path), default=DEFAULT_STATE / "monitor")
@click.option("--foreground", is_flag=True, help="Stay until Ctrl-C, then stop Prometheus.")
def monitor_start(
    config_path: Path,
    targets: tuple[str, ...],
    slo: float,
    port: int,
    scrape_interval: float,
    state_dir: Path,
    foreground: bool,
) -> None:
    """Run Prometheus in the background on the workers' /metrics, with the SLO's
    burn-rate rules for --slo and the alerts; its data stays in the state folder.
    Started again, it reloads the new targets and rules. Stop it with `monitor stop`."""
    import time

    from tools import monitor as local

    scraped = _metrics_targets(targets, config_path)
    with _stop_first_hint("monitor", state_dir, DEFAULT_STATE / "monitor"):
        server, took = local.start(state_dir, scraped, port, slo, scrape_interval)
    how = "already running, config reloaded" if took is None else f"{took:.1f} s"
    click.echo(
        f"prometheus at {server.url} ({how}), scraping {', '.join(scraped)}, SLO "
        f"{100 * slo:g}%; alerts at {server.url}/alerts; state in {state_dir}"
    )
    if not foreground:
        return
    try:
        while server.running():
            time.sleep(0.5)
        click.echo(f"prometheus ended; log {server.process.log_file}", err=True)
    except KeyboardInterrupt:
        server.stop()
        click.echo("prometheus stopped")


@monitor.command("stop")
@click.option("--state-dir", type=click.Path(path_type=Path), default=DEFAULT_STATE / "monitor")
def monitor_stop(state_dir: Path) -> None:
    """Stop the local Prometheus."""
    from infra.monitoring import PrometheusServer

    stopped = PrometheusServer(state_dir).stop()
    click.echo("prometheus stopped" if stopped else "prometheus was not running")


@monitor.command("rules")
@slo_option
@click.option("--out", type=click.Path(path_type=Path), help="Write here instead of stdout.")
def monitor_rules(slo: float, out: Path | None) -> None:
    """Print the SLO's multi-window, multi-burn-rate rules for a target (a Prometheus
    rule file; infra/prometheus/rules/slo.yml is the one for 99.9%)."""
    from tools.monitor import slo_rules

    rules = slo_rules(slo)
    if out is None:
        click.echo(rules, nl=False)
    else:
        out.write_text(rules)
        click.echo(f"rules for an SLO of {100 * slo:g}% written to {out}")


@cli.command()
@config_option
@target_option
@click.option("--interval", default=2.0, show_default=True, help="Seconds between frames.")
@click.option("--once", is_flag=True, help="Print one frame (over one interval) and exit.")
def top(config_path: Path, targets: tuple[str, ...], interval: float, once: bool) -> None:
    """A live view of the workers, from their /metrics: outcomes/s by status, p50/p99
    against the budget, lag, batch size, in flight, feature cache hit rates."""
    from tools.top import NoWorkerAnswered, frames, metrics_url, render

    urls = [metrics_url(target) for target in _metrics_targets(targets, config_path)]
    live = sys.stdout.isatty() and not once
    try:
        for frame in frames(urls, interval):
            text = render(frame, urls)
            click.echo(f"\x1b[H\x1b[2J{text}" if live else text)
            if once:
                if not frame.workers:  # a script must not read "no workers" as fine
                    raise NoWorkerAnswered(
                        f"no worker's /metrics answered ({', '.join(urls)}); hint: is a "
                        "worker running, and is metrics.port its port? (--target HOST:PORT)"
                    )
                return
            if not live:
                click.echo()
    except KeyboardInterrupt:
        pass


@cli.command("bench-features")
@click.option("--seconds", default=1.0, show_default=True, help="Measured seconds per cell.")
@click.option(
    "--out", type=click.Path(path_type=Path), default=Path("bench-results"), show_default=True
)
def bench_features(seconds: float, out: Path) -> None:
    """Feature-stage cost: get_online_features, the direct read and the cache, SQLite and Redis."""
    import time

    from tools.bench.features import run, write_report

    results = run((DEFAULT_STATE / "bench-features").resolve(), seconds)
    path = write_report(results, out / f"features-{time.strftime('%Y%m%d-%H%M%S')}")
    click.echo(path.read_text())


def main() -> None:
    """Run the command; an error ends it with one line (naming the problem, with a hint)
    and its exit status, never a traceback."""
    from confluent_kafka import KafkaException

    try:
        cli(standalone_mode=False)
    except click.exceptions.Abort:
        sys.exit(EXIT_INTERRUPTED)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except HeadraceError as exc:
        click.echo(f"headrace: {exc}", err=True)
        sys.exit(getattr(exc, "exit_status", EXIT_USAGE))
    except KafkaException as exc:  # one a command did not wrap: still Kafka's failure
        click.echo(f"headrace: Kafka failed: {exc.args[0].str()}", err=True)
        sys.exit(EXIT_UNAVAILABLE)


if __name__ == "__main__":
    main()
