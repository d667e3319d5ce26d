"""The soak's clients (bench/soak/send.py sends through them): the openai and anthropic clients
over the gateways' HTTP API and kvmesh's GatewayClient over gRPC, one per (gateway, key), and the
status a client's error names in an outcome (bench/soak/workload.py Outcome).
"""

from __future__ import annotations

import anthropic
import grpc
import openai

from kvmesh.bench.soak.workload import DEADLINE_S, HANG_SLACK_S
from kvmesh.client import GatewayClient


class Clients:
    """An openai client, an anthropic client and a GatewayClient per (gateway, key): `http_urls` the gateways' /v1 URLs,
    `grpc_addresses` their gRPC addresses, `keys` the API keys."""

    def __init__(self, http_urls: list[str], grpc_addresses: list[str], keys: list[str]) -> None:
        self.http = [
            [openai.AsyncOpenAI(base_url=u, api_key=k, timeout=DEADLINE_S + HANG_SLACK_S, max_retries=0) for k in keys]
            for u in http_urls
        ]
        self.grpc = [[GatewayClient(a, api_key=k) for k in keys] for a in grpc_addresses]
        self.anthropic = [
            [
                anthropic.AsyncAnthropic(
                    base_url=u.removesuffix("/v1"), api_key=k, timeout=DEADLINE_S + HANG_SLACK_S, max_retries=0
                )
                for k in keys
            ]
            for u in http_urls
        ]

    async def __aenter__(self) -> Clients:
        for row in self.grpc:
            for c in row:
                await c.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        for row in self.grpc:
            for c in row:
                await c.__aexit__(None, None, None)
        for row in [*self.http, *self.anthropic]:
            for c in row:
                await c.close()


def status_of(exc: BaseException) -> str:
    """The status a client error names (see Outcome)."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code().name
    if isinstance(exc, TimeoutError):
        return "hung"
    for api in (openai, anthropic):  # the two HTTP clients' errors have the same shape
        if isinstance(exc, api.APITimeoutError):
            return "hung"
        if isinstance(exc, api.APIStatusError):
            return f"http_{exc.status_code}"
        if isinstance(exc, api.APIConnectionError):
            return "connect_error"
        if isinstance(exc, api.APIError):
            return "stream_error"
    return type(exc).__name__
