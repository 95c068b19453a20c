"""OpenTelemetry tracing of the data path, chosen once when a worker is wired.

With `tracing.enabled`, a pipeline's `Tracing`:
- reads each input's W3C `traceparent` / `tracestate` headers as it is decoded;
- makes one span per batch, `process <input topic>` (kind CONSUMER), with a link to
  each traced input's context (the OpenTelemetry messaging conventions for batch
  processing) and a child span per stage: decode, admit, features, infer, encode,
  publish. When every traced input of a batch belongs to one trace (one traced input,
  or a producer that sent them under one span) the batch span is a child in that
  trace, so the producer's trace shows the stages; otherwise the batch starts a trace
  of its own, linked to each input's;
- writes a `traceparent` on every answer and dead letter: the batch span's context
  when its input belongs to the batch's trace (or carried none), else the context of
  a `send <output topic>` span (kind PRODUCER) made for that input, a child of the
  input's context linked to the batch span. A consumer continuing the header is in
  the producer's trace either way.

Off (the default), `NO_TRACING` stands in: no header is read or written and no span
is made; the stages make a few no-op calls per batch and none per event.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

    from streams.config import PipelineConfig, TracingConfig
    from streams.records import InputRecord, Item, OutRecord

log = logging.getLogger(__name__)

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
DEFAULT_ENDPOINTS = {
    "zipkin": "http://127.0.0.1:9411/api/v2/spans",
    "otlp": "http://127.0.0.1:4318/v1/traces",
}
# Spans wait at most this long in the worker before they are sent.
EXPORT_DELAY_MS = 1_000


class InputTrace(NamedTuple):
    """What tracing keeps of one input (`Item.trace`)."""

    context: Any
    """Its producer's SpanContext, or None when it carried no valid `traceparent`."""
    decode_start_ns: int
    decode_end_ns: int

    @property
    def trace_id(self) -> str | None:
        return None if self.context is None else f"{self.context.trace_id:032x}"


class NoBatchTrace:
    """A batch's trace with tracing off: every call does nothing."""

    trace_id = None

    def stage(self, name: str) -> AbstractContextManager:
        return _NO_SPAN

    def mark(self, items: Sequence[Item], records: Sequence[OutRecord]) -> None:
        pass

    def trace_id_of(self, item: Item) -> str | None:
        return None

    def end(self) -> None:
        pass


class NoTracing:
    """A pipeline's tracing when it is off."""

    def read(self, records: Sequence[InputRecord], items: Sequence[Item], seconds: float) -> None:
        pass

    def batch(self, items: Sequence[Item]) -> NoBatchTrace:
        return NO_BATCH


_NO_SPAN = nullcontext()
NO_BATCH = NoBatchTrace()
NO_TRACING = NoTracing()


def open_provider(config: TracingConfig, service_name: str) -> TracerProvider | None:
    """The span pipeline (sampler, background exporter), or None with tracing off.
    Call `shutdown()` on it at stop: it sends what is left (up to the export timeout)."""
    if not config.enabled:
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    endpoint = config.endpoint or DEFAULT_ENDPOINTS[config.exporter]
    timeout_s = config.export_timeout_ms / 1000
    if config.exporter == "zipkin":
        from opentelemetry.exporter.zipkin.json import ZipkinExporter

        exporter = ZipkinExporter(endpoint=endpoint, timeout=timeout_s)
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=endpoint, timeout=timeout_s)
    provider = TracerProvider(
        sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)),
        resource=Resource.create({"service.name": config.service_name or service_name}),
    )
    provider.add_span_processor(
        BatchSpanProcessor(
            exporter,
            schedule_delay_millis=EXPORT_DELAY_MS,
            export_timeout_millis=config.export_timeout_ms,
        )
    )
    log.info("tracing: %s spans to %s, sampling %.3g", config.exporter, endpoint,
             config.sample_ratio)  # fmt: skip
    return provider


def tracing_for(provider: TracerProvider | None, spec: PipelineConfig) -> Tracing | NoTracing:
    """A pipeline's tracing: `NO_TRACING` without a provider."""
    if provider is None:
        return NO_TRACING
    return Tracing(provider.get_tracer("headrace"), spec)


class Tracing:
    """A pipeline's tracing when it is on (see the module's docstring)."""

    def __init__(self, tracer: Any, spec: PipelineConfig) -> None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._tracer = tracer
        self._extract = TraceContextTextMapPropagator().extract
        self._process_name = f"process {spec.input_topic}"
        self._send_name = f"send {spec.output_topic}"
        self._attributes = {
            "messaging.system": "kafka",
            "messaging.operation.type": "process",
            "messaging.destination.name": spec.input_topic,
            "headrace.pipeline": spec.name,
        }

    def read(self, records: Sequence[InputRecord], items: Sequence[Item], seconds: float) -> None:
        """Keep each input's trace context and its chunk's decode window on its item."""
        from opentelemetry.trace import get_current_span

        end_ns = time.time_ns()
        start_ns = end_ns - int(seconds * 1e9)
        for record, item in zip(records, items, strict=True):
            carrier = None
            for name, value in record.headers:
                if name in (TRACEPARENT, TRACESTATE) and value:
                    carrier = carrier or {}
                    carrier.setdefault(name, value.decode("ascii", "replace"))
            context = None
            if carrier is not None and TRACEPARENT in carrier:
                found = get_current_span(self._extract(carrier)).get_span_context()
                context = found if found.is_valid else None
            item.trace = InputTrace(context, start_ns, end_ns)

    def batch(self, items: Sequence[Item]) -> BatchTrace:
        """Start a released batch's span (back-dated to its first decode) and its decode
        span; the caller ends it with `end()` once its outcomes are written."""
        from opentelemetry.context import Context
        from opentelemetry.trace import Link, NonRecordingSpan, SpanKind, set_span_in_context

        traces = [item.trace for item in items if item.trace is not None]
        linked = list({(c.trace_id, c.span_id): c for t in traces if (c := t.context)}.values())
        parent = Context()
        if linked and len({context.trace_id for context in linked}) == 1:
            parent = set_span_in_context(NonRecordingSpan(linked[0]))
        start_ns = min((t.decode_start_ns for t in traces), default=None)
        root = self._tracer.start_span(
            self._process_name, context=parent, kind=SpanKind.CONSUMER,
            links=[Link(context) for context in linked], start_time=start_ns,
            attributes={**self._attributes, "messaging.batch.message_count": len(items)},
        )  # fmt: skip
        batch = BatchTrace(self._tracer, root, start_ns, self._send_name)
        if traces:
            decode = self._tracer.start_span("decode", context=batch.context, start_time=start_ns)
            decode.end(end_time=max(t.decode_end_ns for t in traces))
        return batch


class BatchTrace:
    """One batch's span and its stages' spans."""

    def __init__(self, tracer: Any, root: Any, start_ns: int | None, send_name: str) -> None:
        from opentelemetry.trace import set_span_in_context

        self._tracer = tracer
        self._root = root
        self._start_ns = start_ns
        self._send_name = send_name
        self._sends: list[Any] = []
        self.context = set_span_in_context(root)
        span_context = root.get_span_context()
        self._trace_id = span_context.trace_id
        self.trace_id = f"{span_context.trace_id:032x}"

    def stage(self, name: str) -> AbstractContextManager:
        """A span for one stage of the batch, as a context manager (an exception that
        leaves it is recorded on it)."""
        return self._tracer.start_as_current_span(name, context=self.context)

    def trace_id_of(self, item: Item) -> str:
        """The trace an input's outcome continues: its own, else the batch's."""
        trace = item.trace
        own = trace.trace_id if trace is not None else None
        return own or self.trace_id

    def mark(self, items: Sequence[Item], records: Sequence[OutRecord]) -> None:
        """Add a `traceparent` (and `tracestate`) header to each outcome record."""
        from opentelemetry.trace import Link, NonRecordingSpan, SpanKind, set_span_in_context

        batch_headers = _headers(self._root.get_span_context())
        for item, record in zip(items, records, strict=True):
            context = item.trace.context if item.trace is not None else None
            if context is None or context.trace_id == self._trace_id:
                record.headers.extend(batch_headers)
                continue
            send = self._tracer.start_span(
                self._send_name, context=set_span_in_context(NonRecordingSpan(context)),
                kind=SpanKind.PRODUCER, links=[Link(self._root.get_span_context())],
                start_time=self._start_ns,
            )  # fmt: skip
            self._sends.append(send)
            record.headers.extend(_headers(send.get_span_context()))

    def end(self) -> None:
        end_ns = time.time_ns()
        for send in self._sends:
            send.end(end_time=end_ns)
        self._root.end(end_time=end_ns)


def _headers(context: Any) -> list[tuple[str, bytes]]:
    flags = int(context.trace_flags)
    headers = [
        (TRACEPARENT, f"00-{context.trace_id:032x}-{context.span_id:016x}-{flags:02x}".encode())
    ]
    state = context.trace_state.to_header() if context.trace_state else ""
    if state:
        headers.append((TRACESTATE, state.encode()))
    return headers
