"""A small client of the Gateway service (used by `kvmesh generate`, the demo and the tests)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from kvmesh.protos.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from kvmesh.runtime.service import GRPC_OPTIONS


@dataclass
class Completion:
    """A whole answer: text, token ids (with their logprobs when asked for) and the gateway's
    Final message; with n > 1, `choices` holds every choice's (this one's fields are choice 0's)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[common_pb2.TokenLogprobs] = field(default_factory=list)
    final: gateway_pb2.Final | None = None
    choices: list[Completion] = field(default_factory=list)
    prompt_logprobs: list[common_pb2.TokenLogprobs] = field(default_factory=list)
    """With prompt_logprobs asked for: each prompt token's (the first one's logprob NaN)."""


def make_request(
    prompt: str | bytes = b"",
    *,
    messages: list[tuple[str, str]] | None = None,
    chat: bool = False,
    max_tokens: int | None = None,
    temperature: float = 0.0,
    top_p: float | None = None,
    top_k: int = 0,
    seed: int | None = None,
    stop: list[str] | None = None,
    ignore_eos: bool = False,
    model: str = "",
    request_id: str = "",
    prompt_token_ids: list[int] | None = None,
    logprobs: int | None = None,
    n: int = 1,
    grammar: tuple[str, str] | None = None,
    prompt_logprobs: int | None = None,
    tools: list[dict] | None = None,
) -> gateway_pb2.GenerateRequest:
    """Build a GenerateRequest; `prompt` may be bytes to send exactly those bytes, or token ids.
    logprobs: each answer token's logprob and this many top alternatives (None: none);
    n: choices to generate; grammar: (kind, spec) the answer must follow (structured output:
    "json_object", "json_schema" with the schema's JSON, "regex", "choice" with a JSON list);
    prompt_logprobs: each prompt token's logprob and this many top alternatives; tools: OpenAI's
    function tools the chat's model may call (GenerateRequest.tools)."""
    sampling = gateway_pb2.GenerateOptions(temperature=temperature, top_k=top_k, stop=stop or [], ignore_eos=ignore_eos)
    if top_p is not None:
        sampling.top_p = top_p
    if max_tokens is not None:
        sampling.max_tokens = max_tokens
    if seed is not None:
        sampling.seed = seed
    if logprobs is not None:
        sampling.logprobs = logprobs
    if n != 1:
        sampling.n = n
    if grammar is not None:
        sampling.grammar.kind, sampling.grammar.spec = grammar
    if prompt_logprobs is not None:
        sampling.prompt_logprobs = prompt_logprobs
    return gateway_pb2.GenerateRequest(
        request_id=request_id,
        model=model,
        prompt=prompt.encode() if isinstance(prompt, str) else prompt,
        messages=[gateway_pb2.ChatMessage(role=r, content=c) for r, c in (messages or [])],
        chat=chat,
        sampling=sampling,
        prompt_token_ids=prompt_token_ids or [],
        tools=json.dumps(tools) if tools else "",
    )


class GatewayClient:
    """Async client; use as `async with GatewayClient(addr) as c: ...`."""

    def __init__(self, address: str, api_key: str = "", root_certificates: bytes | None = None) -> None:
        """api_key: sent as `authorization: Bearer <key>` on every call (a gateway started with
        --api-key-file or KVMESH_API_KEYS needs one). root_certificates: PEM certificates to trust
        for a gateway serving TLS (--tls-cert); None: plain TCP."""
        self.address = address
        if root_certificates is not None:
            creds = grpc.ssl_channel_credentials(root_certificates)
            self.channel = grpc.aio.secure_channel(address, creds, options=GRPC_OPTIONS)
        else:
            self.channel = grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)
        self.metadata = [("authorization", f"Bearer {api_key}")] if api_key else None
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)

    async def __aenter__(self) -> GatewayClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.channel.close()

    async def list_models(self, timeout_s: float = 10.0) -> gateway_pb2.ListModelsResponse:
        return await self.stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=timeout_s, metadata=self.metadata)

    async def stream(
        self, request: gateway_pb2.GenerateRequest, timeout_s: float | None = None
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        """Yield the gateway's messages as they arrive; raises grpc.aio.AioRpcError on failure."""
        async for msg in self.stub.Generate(request, timeout=timeout_s, metadata=self.metadata):
            yield msg

    async def complete(self, request: gateway_pb2.GenerateRequest, timeout_s: float | None = None) -> Completion:
        """The whole answer at once (every choice's)."""
        choices = [Completion() for _ in range(max(1, request.sampling.n))]
        final = None
        async for msg in self.stream(request, timeout_s):
            if msg.HasField("delta"):
                choice = choices[msg.delta.index]
                choice.text += msg.delta.text
                choice.token_ids.extend(msg.delta.token_ids)
                choice.logprobs.extend(msg.delta.logprobs)
                choices[0].prompt_logprobs.extend(msg.delta.prompt_logprobs)
            else:
                final = msg.final
        out = choices[0]
        out.final = final
        out.choices = choices
        return out
