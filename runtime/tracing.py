"""OpenTelemetry tracing for every kvmesh service: one trace per request, exported over OTLP.

Configured by the standard variables only: OTEL_EXPORTER_OTLP_ENDPOINT (or
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) turns export on, OTEL_SERVICE_NAME names the service,
OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG pick the sampler (the SDK reads them). Without an
endpoint no SDK is installed: spans come from the API's no-op tracer and cost nothing
measurable. The W3C `traceparent` rides gRPC metadata between services (`inject` / `extract`).

Spans are started and ended explicitly (never attached as "current"): a request's work hops
between an async generator, the event loop and engine threads, where attach/detach pairs
would not match up.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

logger = logging.getLogger(__name__)

_provider = None


def setup_tracing(default_service_name: str) -> bool:
    """Install the SDK with an OTLP gRPC exporter when an endpoint is configured; True if so."""
    global _provider
    if not (os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")):
        return False
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    name = os.environ.get("OTEL_SERVICE_NAME") or default_service_name
    _provider = TracerProvider(resource=Resource.create({"service.name": name}))
    _provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(_provider)
    logger.info(
        "tracing to %s as %s",
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"],
        name,
    )
    return True


def shutdown_tracing() -> None:
    """Flush and stop the exporter (at the end of a service's life)."""
    if _provider is not None:
        _provider.shutdown()


def tracer() -> trace.Tracer:
    return trace.get_tracer("kvmesh")


def extract(metadata: Sequence[tuple[str, str | bytes]] | None) -> otel_context.Context:
    """The caller's trace context from gRPC invocation metadata (empty when none came)."""
    carrier = {k: v for k, v in (metadata or ()) if isinstance(v, str)}
    return propagate.extract(carrier)


def inject(span: trace.Span) -> list[tuple[str, str]]:
    """gRPC metadata carrying `span` as the parent of the callee's spans."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return list(carrier.items())


def traceparent(span: trace.Span) -> str:
    """W3C traceparent of `span` ('' when not sampled / tracing off)."""
    return dict(inject(span)).get("traceparent", "")


def trace_id(span: trace.Span) -> str:
    """32-hex trace id of `span`, '' when tracing is off."""
    ctx = span.get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else ""


def child(
    parent: trace.Span, name: str, start_ns: int | None = None, attributes: Mapping[str, object] | None = None
) -> trace.Span:
    """Start a child span of `parent` (optionally back-dated to start_ns, epoch ns)."""
    return tracer().start_span(
        name,
        context=trace.set_span_in_context(parent),
        start_time=start_ns,
        attributes=dict(attributes or {}),  # type: ignore[arg-type]
    )


def record(
    parent: trace.Span, name: str, start_ns: int, end_ns: int, attributes: Mapping[str, object] | None = None
) -> None:
    """A finished child span for work timed elsewhere (e.g. on an engine thread)."""
    span = child(parent, name, start_ns, attributes)
    span.end(end_time=end_ns)


def now_ns() -> int:
    return time.time_ns()


@contextmanager
def server_span(name: str, context, request_id: str, instance: str) -> Iterator[trace.Span]:
    """The span of one RPC a service serves: child of the caller's traceparent (gRPC metadata),
    tagged with the request id and instance, marked ERROR when the handler raises, always ended.

    Also points `kvmesh.runtime.logs.request_context` at this request, so its log lines carry both ids.
    """
    from kvmesh.runtime.logs import request_context
    from kvmesh.runtime.wire import check_request_id

    try:
        check_request_id(request_id)
    except ValueError:
        request_id = "<invalid request_id>"  # the handler refuses it; the log shows no caller text
    span = tracer().start_span(
        name,
        kind=trace.SpanKind.SERVER,
        context=extract(context.invocation_metadata()),
        attributes={"kvmesh.request_id": request_id, "kvmesh.instance": instance},
    )
    request_context.set((request_id, trace_id(span)))
    try:
        yield span
    except BaseException as exc:
        span.set_status(trace.Status(trace.StatusCode.ERROR, type(exc).__name__))
        raise
    finally:
        span.end()
