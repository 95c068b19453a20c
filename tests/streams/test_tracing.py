"""Traces through Kafka headers: a producer's trace continued by a worker's stage spans
and by the consumer of its answers, as a real Zipkin server holds it; and which span an
outcome's `traceparent` names when a batch mixes traces."""

from __future__ import annotations

import pytest
from confluent_kafka import Producer
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.exporter.zipkin.json import ZipkinExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, get_current_span
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from schemas.catalogue import LocalCatalogue
from schemas.codec import AvroEncoder
from streams.config import parse_config
from streams.records import InputRecord, Item, OutRecord
from streams.tracing import TRACEPARENT, Tracing
from tests.helpers import PATIENT_BUDGET_MS, read_messages, wait_until
from tools.loadgen import sample_events

STAGES = {"decode", "admit", "features", "infer", "encode", "publish"}
PROPAGATOR = TraceContextTextMapPropagator()


def provider_for(service: str, exporter) -> TracerProvider:
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider


def trace_headers() -> list[tuple[str, bytes]]:
    """The current span's context as Kafka headers."""
    carrier: dict[str, str] = {}
    PROPAGATOR.inject(carrier)
    return [(name, value.encode()) for name, value in carrier.items()]


def parent_of(headers) -> object:
    """The context a consumer continues from a record's headers."""
    return PROPAGATOR.extract({name: value.decode() for name, value in headers or []})


@pytest.mark.integration
@pytest.mark.parametrize("runtime", ["bare", "faust"])
def test_a_producers_trace_goes_on_through_each_stage_to_the_consumer(
    deploy, zipkin, sample_assets, runtime
):
    deployment = deploy(
        runtime=runtime,
        latency_budget_ms=PATIENT_BUDGET_MS,
        tracing={"enabled": True, "endpoint": zipkin.spans_endpoint},
    )
    spec = deployment.spec
    bootstrap = deployment.config.broker.bootstrap_servers
    exporter = ZipkinExporter(endpoint=zipkin.spans_endpoint, timeout=5)
    producing = provider_for("test-producer", exporter).get_tracer("test")
    consuming = provider_for("test-consumer", exporter).get_tracer("test")
    encoder = AvroEncoder(LocalCatalogue(), "transaction.avsc", f"{spec.input_topic}-value")
    events = sample_events(sample_assets.world, 7, "traced")
    with deployment.worker():
        producer = Producer({"bootstrap.servers": bootstrap})
        with producing.start_as_current_span(
            f"send {spec.input_topic}", kind=SpanKind.PRODUCER
        ) as sent:
            headers = trace_headers()
            for _ in range(3):
                event = next(events)
                producer.produce(spec.input_topic, encoder.encode(event), b"k", headers=headers)
            producer.produce(spec.input_topic, b"\x00not avro", b"k", headers=headers)
            assert producer.flush(30) == 0
        trace_id = f"{sent.get_span_context().trace_id:032x}"
        outcomes = read_messages(bootstrap, [spec.output_topic, spec.dead_letter_topic], 4, 90)
        assert len(outcomes) == 4, deployment.log_tail()
        for message in outcomes:
            parent = parent_of(message.headers())
            assert f"{get_current_span(parent).get_span_context().trace_id:032x}" == trace_id
            with consuming.start_as_current_span(
                f"receive {message.topic()}", context=parent, kind=SpanKind.CONSUMER
            ):
                pass

    def whole_trace() -> list[dict] | None:
        spans = zipkin.trace(trace_id)
        names = {span.get("name") for span in spans}
        consumers = [s for s in spans if s["localEndpoint"]["serviceName"] == "test-consumer"]
        return spans if names >= STAGES and len(consumers) == 4 else None

    spans = wait_until(whole_trace, 30)
    assert spans, f"Zipkin holds: {sorted({s.get('name') for s in zipkin.trace(trace_id)})}"
    by_id = {span["id"]: span for span in spans}
    service = deployment.config.app_id.lower()
    worker_spans = [s for s in spans if s["localEndpoint"]["serviceName"] == service]
    batches = [s for s in worker_spans if s["name"] == f"process {spec.input_topic}".lower()]
    assert batches, [s["name"] for s in worker_spans]
    for batch in batches:  # each batch continues the producer's span
        assert by_id[batch["parentId"]]["name"] == f"send {spec.input_topic}".lower()
    stages = [s for s in worker_spans if s["name"] in STAGES]
    assert {by_id[s["parentId"]]["name"] for s in stages} == {batches[0]["name"]}
    for span in spans:
        if span["localEndpoint"]["serviceName"] == "test-consumer":
            assert by_id[span["parentId"]] in batches  # the consumer continues a batch span
    print(f"\n{runtime}: the trace as Zipkin holds it\n{outline(spans)}")


@pytest.mark.integration
def test_with_the_otlp_exporter_the_trace_reaches_an_otlp_backend(deploy, jaeger, sample_assets):
    """The OTLP exporter against a real OTLP receiver (Jaeger): the worker's batch span
    continues the producer's span, and each stage is a span of the worker's service."""
    deployment = deploy(
        runtime="bare",
        latency_budget_ms=PATIENT_BUDGET_MS,
        tracing={"enabled": True, "exporter": "otlp", "endpoint": jaeger.spans_endpoint},
    )
    spec = deployment.spec
    bootstrap = deployment.config.broker.bootstrap_servers
    exporter = OTLPSpanExporter(endpoint=jaeger.spans_endpoint, timeout=5)
    producing = provider_for("test-producer", exporter).get_tracer("test")
    encoder = AvroEncoder(LocalCatalogue(), "transaction.avsc", f"{spec.input_topic}-value")
    events = sample_events(sample_assets.world, 8, "otlp")
    with deployment.worker():
        producer = Producer({"bootstrap.servers": bootstrap})
        sending = f"send {spec.input_topic}"
        with producing.start_as_current_span(sending, kind=SpanKind.PRODUCER) as sent:
            headers = trace_headers()
            for _ in range(3):
                event = next(events)
                producer.produce(spec.input_topic, encoder.encode(event), b"k", headers=headers)
            assert producer.flush(30) == 0
        trace_id = f"{sent.get_span_context().trace_id:032x}"
        assert len(read_messages(bootstrap, [spec.output_topic], 3, 90)) == 3, deployment.log_tail()

        def whole_trace() -> list[dict] | None:
            spans = jaeger.trace(trace_id)
            return spans if {span["operationName"] for span in spans} >= STAGES else None

        spans = wait_until(whole_trace, 30)
    assert spans, f"Jaeger holds: {sorted({s['operationName'] for s in jaeger.trace(trace_id)})}"
    by_id = {span["spanID"]: span for span in spans}
    worker_spans = [s for s in spans if s["serviceName"] == deployment.config.app_id]
    batches = [s for s in worker_spans if s["operationName"] == f"process {spec.input_topic}"]
    assert batches, [s["operationName"] for s in worker_spans]

    def parent(span: dict) -> dict:
        # Jaeger shows the span a consumer's span continues as FOLLOWS_FROM (a span
        # linked to its parent's context too), a plain child as CHILD_OF.
        (reference,) = span["references"][:1]
        return by_id[reference["spanID"]]

    for batch in batches:
        assert parent(batch)["operationName"] == f"send {spec.input_topic}"
    stages = [s for s in worker_spans if s["operationName"] in STAGES]
    assert {parent(s)["spanID"] for s in stages} <= {b["spanID"] for b in batches}


def outline(spans: list[dict]) -> str:
    """Zipkin's spans as a tree: service, name, start after the root and duration."""
    children: dict[str | None, list[dict]] = {}
    for span in sorted(spans, key=lambda span: span["timestamp"]):
        children.setdefault(span.get("parentId"), []).append(span)
    start = min(span["timestamp"] for span in spans)
    lines = []

    def walk(parent: str | None, depth: int) -> None:
        for span in children.get(parent, []):
            after_ms = (span["timestamp"] - start) / 1000
            took_ms = span.get("duration", 0) / 1000
            service = span["localEndpoint"]["serviceName"]
            lines.append(
                f"{'  ' * depth}{service}: {span['name']} +{after_ms:.1f} ms, {took_ms:.2f} ms"
            )
            walk(span["id"], depth + 1)

    walk(None, 0)
    return "\n".join(lines)


def item(trace_parent: str | None, offset: int) -> Item:
    headers = [(TRACEPARENT, trace_parent.encode())] if trace_parent else []
    record = InputRecord("in", 0, offset, 0, b"k", b"v", headers)
    return Item(record, None, 0.0)


def test_a_batch_of_several_traces_links_each_and_answers_in_each_inputs_trace():
    spec = parse_config(
        {"pipelines": [{
            "name": "p", "input_topic": "in", "output_topic": "out", "dead_letter_topic": "dlq",
            "input": {"schema": "transaction.avsc"}, "model": {"path": "m.onnx"},
        }]},
        "test",
    ).pipelines[0]  # fmt: skip
    spans = InMemorySpanExporter()
    tracing = Tracing(provider_for("headrace", spans).get_tracer("test"), spec)
    a = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    b = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    items = [item(a, 0), item(b, 1), item(None, 2), item("garbage", 3)]
    tracing.read([i.record for i in items], items, 0.001)
    batch = tracing.batch(items)
    with batch.stage("encode"):
        records = [OutRecord("out", b"k", b"v", []) for _ in items]
        batch.mark(items, records)
    batch.end()

    finished = {span.name: span for span in spans.get_finished_spans() if span.name != "send out"}
    process = finished["process in"]
    assert process.parent is None  # two traces: a trace of its own...
    linked = {f"{link.context.trace_id:032x}" for link in process.links}
    assert linked == {a.split("-")[1], b.split("-")[1]}  # ...linked to each input's
    assert finished["decode"].parent.span_id == process.context.span_id
    assert finished["encode"].parent.span_id == process.context.span_id
    parents = [dict(record.headers)[TRACEPARENT].decode().split("-")[1] for record in records]
    own = f"{process.context.trace_id:032x}"
    # Traced inputs are answered in their own trace, the rest in the batch's.
    assert parents == [a.split("-")[1], b.split("-")[1], own, own]
    sends = [span for span in spans.get_finished_spans() if span.name == "send out"]
    assert len(sends) == 2
    assert all(send.links[0].context.span_id == process.context.span_id for send in sends)
