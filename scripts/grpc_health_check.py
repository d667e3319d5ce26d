"""Exit 0 only when a kvmesh service's grpc.health.v1 reports SERVING.

Usage: python scripts/grpc_health_check.py HOST:PORT [SERVICE] [--timeout SECONDS]

SERVICE is a fully-qualified gRPC service name ("kvmesh.v1.Decode"); empty (the default)
asks for the server as a whole. Every kvmesh service reports NOT_SERVING until its model
is warm (readiness, not liveness), so this is what container healthchecks run (compose.yaml)
in place of the grpc_health_probe binary.

Exit status: 0 SERVING; 1 NOT_SERVING, unknown service or no answer within the timeout
(default 3 s); 2 bad usage. The reason goes to stderr.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(address: str, service: str = "", timeout_s: float = 3.0) -> tuple[bool, str]:
    """One Health.Check call: (serving, what was seen), never raising for a dead or absent server."""
    with grpc.insecure_channel(address) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s, wait_for_ready=False
            )
        except grpc.RpcError as exc:
            return False, f"{exc.code().name}: {exc.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    return resp.status == health_pb2.HealthCheckResponse.SERVING, status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="exit 0 when HOST:PORT's grpc.health.v1 reports SERVING")
    parser.add_argument("address", metavar="HOST:PORT")
    parser.add_argument("service", nargs="?", default="", help="service name (default: the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer (default 3)")
    args = parser.parse_args(argv)
    serving, seen = check(args.address, args.service, args.timeout)
    if not serving:
        print(f"{args.address} {args.service or '(server)'}: {seen}", file=sys.stderr)
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
