"""The gateway's HTTP server: Starlette on uvicorn, in the gateway's own process and event loop,
a thin adapter over kvmesh.gateway.request_path.RequestPath.

    POST /v1/chat/completions   OpenAI Chat Completions (stream: server-sent events)
    POST /v1/completions        OpenAI Completions
    GET  /v1/models             the served model (GET /v1/models/{id} too)
    POST /v1/responses          OpenAI Responses (stored: GET / DELETE /v1/responses/{id}, .../input_items)
    POST /v1/messages           Anthropic Messages (and /v1/messages/count_tokens)
    GET  /health                200 while the gateway serves, 503 otherwise (no key needed)

Each route is its API's module's (openai_call.py, responses_call.py, messages_call.py,
models.py); this one binds the socket, serves, and stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import socket
import time

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvmesh.gateway.detokenizer import TokenText
from kvmesh.gateway.http.messages_call import MessagesCall
from kvmesh.gateway.http.models import ModelList
from kvmesh.gateway.http.openai_call import OpenAICall, OpenAIFront
from kvmesh.gateway.http.responses_call import ResponsesCall
from kvmesh.gateway.request_path import RequestPath
from kvmesh.gateway.response_store import MemoryResponseStore, ResponseStore
from kvmesh.runtime.service import MAX_MESSAGE_BYTES

MAX_BODY_BYTES = MAX_MESSAGE_BYTES
"""Largest request body read (bytes), the gRPC front's message limit: a longer one is a 413
before it is parsed (no prompt that fits a context comes near it)."""


class HttpFront:
    """The HTTP server: binds `host:port` at once (OSError when taken), serves from `start()`
    to `stop()`; TLS when `tls_cert` and `tls_key` (PEM files) are given. tool_parser: how
    calls are found in a free answer (kvmesh.gateway.tools.TOOL_PARSERS); session_from_user: the
    `user` field names a request's session when no x-session-id header does; responses: where
    /v1/responses keeps stored responses (None: this process's memory, for a day).

    Raises OSError when the port is taken, ValueError when the certificate or key cannot be
    loaded."""

    def __init__(
        self,
        path: RequestPath,
        host: str,
        port: int,
        tls_cert: str = "",
        tls_key: str = "",
        grace_s: float = 25.0,
        tool_parser: str = "json",
        session_from_user: bool = False,
        responses: ResponseStore | None = None,
    ) -> None:
        self.path = path
        self.responses = responses if responses is not None else MemoryResponseStore(24 * 3600.0)
        self._token_texts: TokenText | None = None  # made on first use: logprobs are rare
        self.openai = OpenAIFront(path, self._token_text, tool_parser, session_from_user)
        self.serving = False
        self.grace_s = grace_s
        self.created = int(time.time())
        self.app = self._routes(ModelList(path, self.created))
        self._sock = _listen(host, port)
        self.port = self._sock.getsockname()[1]
        self.address = f"{'https' if tls_cert else 'http'}://{host}:{self.port}"
        self.server = uvicorn.Server(self._uvicorn_config(tls_cert, tls_key))
        self._task: asyncio.Task | None = None

    def _routes(self, models: ModelList) -> Starlette:
        return Starlette(
            routes=[
                Route("/health", self.health, methods=["GET"]),
                Route("/v1/models", models.models, methods=["GET"]),
                Route("/v1/models/{model:path}", models.model, methods=["GET"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/responses", self.responses_create, methods=["POST"]),
                Route("/v1/responses/{response_id}", self.responses_get, methods=["GET"]),
                Route("/v1/responses/{response_id}", self.responses_delete, methods=["DELETE"]),
                Route("/v1/responses/{response_id}/input_items", self.responses_input_items, methods=["GET"]),
                Route("/v1/messages", self.messages, methods=["POST"]),
                Route("/v1/messages/count_tokens", self.messages_count_tokens, methods=["POST"]),
            ]
        )

    def _uvicorn_config(self, tls_cert: str, tls_key: str) -> uvicorn.Config:
        """uvicorn's settings, loaded (the TLS files read now: ValueError when they cannot be)."""
        config = uvicorn.Config(
            self.app,
            lifespan="off",
            log_config=None,  # the gateway's own logging stays as it is
            access_log=False,  # request lines would add nothing the gateway's own lines lack
            ws="none",
            ssl_certfile=tls_cert or None,
            ssl_keyfile=tls_key or None,
            timeout_graceful_shutdown=max(1, math.ceil(self.grace_s)),
        )
        try:
            config.load()
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            self._sock.close()
            raise ValueError(f"could not load the TLS certificate/key for HTTP: {exc}") from None
        return config

    async def start(self) -> None:
        """Serve (in a task on the running loop) once the server has started."""
        self._task = asyncio.ensure_future(self.server.serve(sockets=[self._sock]))
        while not self.server.started:
            if self._task.done():
                try:
                    self._task.result()
                except SystemExit:  # uvicorn exits on a failed start-up
                    pass
                raise RuntimeError(f"the HTTP server on {self.address} did not start")
            await asyncio.sleep(0.01)
        self.serving = True

    async def stop(self) -> None:
        """Stop admitting, let open requests run on for the grace period, then close."""
        self.serving = False
        self.server.should_exit = True
        if self._task is not None:
            with contextlib.suppress(TimeoutError, SystemExit):
                await asyncio.wait_for(self._task, self.grace_s + 5)
        self._sock.close()
        await self.responses.close()

    async def health(self, request: Request) -> Response:
        """GET /health: 200 {"status": "ok"} from start() to stop(), else 503; no key needed."""
        if self.serving:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "not serving"}, status_code=503)

    async def chat_completions(self, request: Request) -> Response:
        """POST /v1/chat/completions (OpenAI Chat Completions; messages through the chat template)."""
        return await OpenAICall(self.openai, request, True, MAX_BODY_BYTES).answer()

    async def completions(self, request: Request) -> Response:
        """POST /v1/completions (OpenAI Completions; the prompt as it is, text or token ids)."""
        return await OpenAICall(self.openai, request, False, MAX_BODY_BYTES).answer()

    async def responses_create(self, request: Request) -> Response:
        """POST /v1/responses (OpenAI Responses; `previous_response_id` continues a stored one)."""
        return await ResponsesCall(self.openai, self.responses, request, MAX_BODY_BYTES).create()

    async def responses_get(self, request: Request) -> Response:
        """GET /v1/responses/{response_id}: a response this key stored."""
        return await ResponsesCall(self.openai, self.responses, request, MAX_BODY_BYTES).get()

    async def responses_delete(self, request: Request) -> Response:
        """DELETE /v1/responses/{response_id}."""
        return await ResponsesCall(self.openai, self.responses, request, MAX_BODY_BYTES).delete()

    async def responses_input_items(self, request: Request) -> Response:
        """GET /v1/responses/{response_id}/input_items."""
        return await ResponsesCall(self.openai, self.responses, request, MAX_BODY_BYTES).input_items()

    async def messages(self, request: Request) -> Response:
        """POST /v1/messages (Anthropic Messages)."""
        return await MessagesCall(self.openai, request, MAX_BODY_BYTES).create()

    async def messages_count_tokens(self, request: Request) -> Response:
        """POST /v1/messages/count_tokens."""
        return await MessagesCall(self.openai, request, MAX_BODY_BYTES).count_tokens()

    def _token_text(self, token_id: int) -> tuple[str, bytes]:
        """A token's (text, bytes) for logprobs (kvmesh.gateway.detokenizer.TokenText)."""
        if self._token_texts is None:
            self._token_texts = TokenText(self.path.builder.tokenizer)
        return self._token_texts(token_id)


def _listen(host: str, port: int) -> socket.socket:
    """A non-blocking socket listening on host:port; OSError saying so when the port is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"could not bind HTTP {host}:{port} ({exc.strerror}): pick another --http-port") from None
    sock.listen(1024)
    sock.setblocking(False)
    return sock
