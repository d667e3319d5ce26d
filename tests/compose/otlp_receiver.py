"""An OTLP/gRPC trace receiver for `make test-compose`, in the place of Jaeger (whose image no
registry here serves): it listens where the services export spans (4317, as Jaeger's
collector does) and prints one line per span received,
`span service=<service.name> name=<span name> trace=<trace id hex>`, so `compose logs jaeger`
shows what arrived. Runs in kvmesh's image (grpcio and opentelemetry-proto are its
dependencies)."""

from __future__ import annotations

import sys
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class Traces(trace_service_pb2_grpc.TraceServiceServicer):
    def Export(self, request, context):  # noqa: N802 (the service's method name)
        for resource_spans in request.resource_spans:
            attributes = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            service = attributes.get("service.name", "?")
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    print(f"span service={service} name={span.name} trace={span.trace_id.hex()}", flush=True)
        return trace_service_pb2.ExportTraceServiceResponse()


def main() -> None:
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 4317
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(), server)
    server.add_insecure_port(f"0.0.0.0:{port}")
    server.start()
    print(f"OTLP trace receiver listening on {port}", flush=True)
    server.wait_for_termination()


if __name__ == "__main__":
    main()
