"""The OpenAI-compatible HTTP front of the gateway: Starlette on uvicorn, in the gateway's
own process and event loop, a thin adapter over kvmesh.gateway.request_path.RequestPath.

    POST /v1/chat/completions   OpenAI Chat Completions (stream: server-sent events)
    POST /v1/completions        OpenAI Completions
    GET  /v1/models             the served model (GET /v1/models/{id} too)
    GET  /health                200 while the gateway serves, 503 otherwise (no key needed)

Bodies are translated by gateway/openai_api.py; a RequestFailed from the path answers with
the HTTP status of its gRPC status (openai_api.HTTP_STATUS) and OpenAI's error object, and
a 429 carries Retry-After (seconds). Streaming answers start (status 200) once the first
token is there, so every failure before it has its own status; one after it ends the event
stream with an error event and `data: [DONE]`. A client that disconnects, mid-stream or
while waiting, cancels the request: the path aborts both legs (decode and prefill free the
request's pages).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import socket
import time
from collections.abc import AsyncGenerator

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvmesh.engine.outcomes import FailureCause
from kvmesh.gateway import openai_api
from kvmesh.gateway.detokenizer import TokenText
from kvmesh.gateway.failure import RequestFailed
from kvmesh.gateway.http_stream import ClientGone, EventStream, cancel_on_disconnect
from kvmesh.gateway.openai_api import BadField, LogprobsShaper, OpenAIRequest
from kvmesh.gateway.request_path import RequestPath
from kvmesh.protos.v1 import gateway_pb2
from kvmesh.runtime.service import MAX_MESSAGE_BYTES
from kvmesh.runtime.wire import status_of

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = MAX_MESSAGE_BYTES
"""Largest request body read (bytes), the gRPC front's message limit: a longer one is a 413
before it is parsed (no prompt that fits a context comes near it)."""


def error_response(
    status: int, message: str, cause: FailureCause | None, param: str | None = None, retry_after_s: float | None = None
) -> JSONResponse:
    """OpenAI's error object with `status` (and Retry-After, whole seconds, when given)."""
    headers = {"retry-after": str(max(1, math.ceil(retry_after_s)))} if retry_after_s is not None else None
    return JSONResponse(openai_api.error(status, message, cause, param), status_code=status, headers=headers)


def failure_response(failure: RequestFailed, param: str | None = None) -> JSONResponse:
    """The HTTP answer to a RequestFailed: the status of its cause's gRPC status; `param`
    names the field at fault (an unknown model's is `model`)."""
    retry = failure.retry_after_s
    if failure.cause == FailureCause.OVERLOADED and retry is None:
        retry = 1.0
    if failure.cause == FailureCause.UNKNOWN_MODEL:
        param = "model"
    return error_response(openai_api.http_status(status_of(failure.cause)), str(failure), failure.cause, param, retry)


_FIELD_AT_FAULT = re.compile(
    r"^(?:\[[^\]]*\] )?(max_tokens|temperature|top_p|top_k|seed|logprobs|prompt_logprobs|n|message roles|"
    r"the session id|prompt|tools)\b"
)
_PARAM_OF_WORDS = {"message roles": "messages", "the session id": "x-session-id", "prompt": "prompt"}


def _param_of(failure: RequestFailed, ask: OpenAIRequest) -> str | None:
    """The request field a refused request names (OpenAI's error `param`): the failure's own,
    the field that asked for a grammar the instances refused, or the field the message starts
    with (the request path's checks say what to change, field first)."""
    if failure.cause != FailureCause.BAD_REQUEST:
        return failure.param
    if failure.param == "n" and ask.best_of:
        return "best_of"
    if failure.param:
        return failure.param
    text = str(failure)
    if "grammar: " in text:
        return ask.grammar_field or None
    found = _FIELD_AT_FAULT.match(text)
    if found is None:
        return None
    return _PARAM_OF_WORDS.get(found.group(1), found.group(1))


class HttpFront:
    """The HTTP server: binds `host:port` at once (OSError when taken), serves from `start()`
    to `stop()`; TLS when `tls_cert` and `tls_key` (PEM files) are given. tool_parser: how
    calls are found in a free answer (kvmesh.gateway.tools.TOOL_PARSERS); session_from_user: the
    `user` field names a request's session when no x-session-id header does.

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
    ) -> None:
        self.path = path
        self.tool_parser = tool_parser
        self.session_from_user = session_from_user
        self._token_texts: TokenText | None = None  # made on first use: logprobs are rare
        self.serving = False
        self.grace_s = grace_s
        self.created = int(time.time())
        self.app = Starlette(
            routes=[
                Route("/health", self.health, methods=["GET"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/models/{model:path}", self.model, methods=["GET"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
            ]
        )
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
        except OSError as exc:
            self._sock.close()
            raise OSError(f"could not bind HTTP {host}:{port} ({exc.strerror}): pick another --http-port") from None
        self._sock.listen(1024)
        self._sock.setblocking(False)
        self.port = self._sock.getsockname()[1]
        self.address = f"{'https' if tls_cert else 'http'}://{host}:{self.port}"
        config = uvicorn.Config(
            self.app,
            lifespan="off",
            log_config=None,  # the gateway's own logging stays as it is
            access_log=False,  # request lines would add nothing the gateway's own lines lack
            ws="none",
            ssl_certfile=tls_cert or None,
            ssl_keyfile=tls_key or None,
            timeout_graceful_shutdown=max(1, math.ceil(grace_s)),
        )
        try:
            config.load()
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            self._sock.close()
            raise ValueError(f"could not load the TLS certificate/key for HTTP: {exc}") from None
        self.server = uvicorn.Server(config)
        self._task: asyncio.Task | None = None

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

    async def health(self, request: Request) -> Response:
        """GET /health: 200 {"status": "ok"} from start() to stop(), else 503; no key needed."""
        if self.serving:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "not serving"}, status_code=503)

    def _model_list(self, request: Request) -> list[dict]:
        info = self.path.models(request.headers.get("authorization"))
        return [
            {
                "id": m,
                "object": "model",
                "created": self.created,
                "owned_by": "kvmesh",
                "max_model_len": info.max_context_tokens,
            }
            for m in info.models
        ]

    async def models(self, request: Request) -> Response:
        """GET /v1/models: OpenAI's model list (one model: the served one)."""
        try:
            return JSONResponse({"object": "list", "data": self._model_list(request)})
        except RequestFailed as failure:
            return failure_response(failure)

    async def model(self, request: Request) -> Response:
        """GET /v1/models/{id}: the served model, or 404."""
        try:
            models = self._model_list(request)
        except RequestFailed as failure:
            return failure_response(failure)
        wanted = request.path_params["model"]
        for m in models:
            if m["id"].lower() == wanted.lower():
                return JSONResponse(m)
        return error_response(404, f"unknown model {wanted[:64]!r}", FailureCause.UNKNOWN_MODEL, "model")

    async def chat_completions(self, request: Request) -> Response:
        """POST /v1/chat/completions (OpenAI Chat Completions; messages through the chat template)."""
        return await self._complete(request, chat=True)

    async def completions(self, request: Request) -> Response:
        """POST /v1/completions (OpenAI Completions; the prompt as it is, text or token ids)."""
        return await self._complete(request, chat=False)

    async def _complete(self, request: Request, chat: bool) -> Response:
        authorization = request.headers.get("authorization")
        try:
            self.path.authenticate(authorization)  # before the body: no key, no parsing
        except RequestFailed as failure:
            return failure_response(failure)
        raw = bytearray()
        async for part in request.stream():
            raw += part
            if len(raw) > MAX_BODY_BYTES:
                return error_response(
                    413, f"the body is over {MAX_BODY_BYTES >> 20} MiB; send a shorter prompt", FailureCause.BAD_REQUEST
                )
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return error_response(400, "the body is not valid JSON", FailureCause.BAD_REQUEST)
        except RecursionError:
            return error_response(400, "the body nests too deeply", FailureCause.BAD_REQUEST)
        try:
            ask = openai_api.parse(body, chat, request.headers.get("x-request-id", ""), self.tool_parser)
        except BadField as exc:
            return error_response(400, str(exc), FailureCause.BAD_REQUEST, exc.param)
        metadata = list(request.headers.items())
        user = body.get("user")
        if self.session_from_user and isinstance(user, str) and user and "x-session-id" not in request.headers:
            metadata.append(("x-session-id", user))  # the operator's choice: `user` names the session
        messages = self.path.generate(ask.request, metadata, authorization)
        model, created = self.path.builder.model_name, int(time.time())
        echoed = self._echoed(ask)
        n = ask.request.sampling.n or 1
        # with prompt logprobs the echoed prompt's own tokens are shaped, from offset 0
        start = 0 if ask.request.sampling.HasField("prompt_logprobs") else len(echoed)
        shapers = [LogprobsShaper(ask, self._token_text, start) for _ in range(n)]
        try:
            async with cancel_on_disconnect(request.receive):
                if ask.stream:
                    # the first token decides the status: every failure before it has its own
                    first = await anext(messages)
                    events = self._events(ask, model, created, first, messages, shapers, echoed)
                    return EventStream(events)  # type: ignore[return-value]
                texts: list[list[str]] = [[echoed] for _ in range(n)]
                logprobs: list[list] = [[] for _ in range(n)]
                prompt: list = []  # the echoed prompt's logprobs, each choice's text starts with
                async with contextlib.aclosing(messages):
                    async for msg in messages:
                        if msg.HasField("final"):
                            whole = openai_api.response(
                                ask,
                                model,
                                created,
                                ["".join(t) for t in texts],
                                msg.final,
                                [shaper.shape(prompt + lp) for shaper, lp in zip(shapers, logprobs)],
                                openai_api.best_choices(ask, logprobs),
                            )
                            return JSONResponse(whole)
                        texts[msg.delta.index].append(msg.delta.text)
                        logprobs[msg.delta.index].extend(msg.delta.logprobs)
                        prompt.extend(msg.delta.prompt_logprobs)
        except RequestFailed as failure:
            return failure_response(failure, _param_of(failure, ask))
        except ClientGone:
            logger.info("client disconnected before the answer; request cancelled")
            return Response(status_code=499)
        raise AssertionError("the request path ended without a final message")

    def _token_text(self, token_id: int) -> tuple[str, bytes]:
        """A token's (text, bytes) for logprobs (kvmesh.gateway.detokenizer.TokenText)."""
        if self._token_texts is None:
            self._token_texts = TokenText(self.path.builder.tokenizer)
        return self._token_texts(token_id)

    def _echoed(self, ask: OpenAIRequest) -> str:
        """The prompt's text when a completion asks for `echo` ('' otherwise)."""
        if not ask.echo:
            return ""
        if ask.request.prompt_token_ids:
            return self.path.builder.tokenizer.decode(ask.request.prompt_token_ids, clean_up_tokenization_spaces=False)
        return ask.request.prompt.decode("utf-8", "replace")

    async def _events(
        self,
        ask: OpenAIRequest,
        model: str,
        created: int,
        first: gateway_pb2.GenerateResponse,
        messages: AsyncGenerator[gateway_pb2.GenerateResponse, None],
        shapers: list[LogprobsShaper],
        echoed: str = "",
    ) -> AsyncGenerator[bytes, None]:
        """The answer as server-sent events: text chunks of each choice (with their tokens'
        logprobs when asked for), each choice's finish reason, usage when asked for,
        `data: [DONE]`; a failure mid-stream is an error event before [DONE]. Tokens whose text
        is held back (a character not yet whole) have their logprobs sent with the choice's next
        chunk that has text, or with its finish reason."""
        msg = first
        is_first = [True] * len(shapers)
        pending: list[list] = [[] for _ in shapers]  # each choice's logprobs not sent yet
        # a chat answer that may call tools is held back, each choice's, until it is whole: only
        # then can its text be told from its calls
        hold = ask.tools is not None and ask.tools.may_call
        held = ["" for _ in shapers]
        prompt = list(first.delta.prompt_logprobs)  # echo with logprobs: each choice's first chunk
        primed = [False] * len(shapers)
        try:
            while True:
                if msg.HasField("final"):
                    for i, finish in enumerate(openai_api.finish_reasons(msg.final)):
                        if hold:
                            for part in openai_api.tool_chunks(ask, model, created, i, held[i], finish):
                                yield openai_api.sse(part)
                            continue
                        tail = shapers[i].shape(pending[i])
                        yield openai_api.sse(
                            openai_api.chunk(ask, model, created, None, finish, logprobs=tail, index=i)
                        )
                    if ask.include_usage:
                        yield openai_api.sse(openai_api.usage_chunk(ask, model, created, msg.final))
                    break
                i = msg.delta.index
                if hold:
                    held[i] += msg.delta.text
                    if is_first[i]:  # the role at once; the rest once the answer is whole
                        yield openai_api.sse(openai_api.chunk(ask, model, created, None, first=True, index=i))
                        is_first[i] = False
                    msg = await anext(messages)
                    continue
                if not primed[i]:
                    pending[i].extend(prompt)
                    primed[i] = True
                pending[i].extend(msg.delta.logprobs)
                text = (echoed + msg.delta.text) if is_first[i] else msg.delta.text
                if text or (is_first[i] and ask.chat):
                    part = openai_api.chunk(
                        ask, model, created, text, first=is_first[i], logprobs=shapers[i].shape(pending[i]), index=i
                    )
                    yield openai_api.sse(part)
                    is_first[i], pending[i] = False, []
                msg = await anext(messages)
        except RequestFailed as failure:
            status = openai_api.http_status(status_of(failure.cause))
            yield openai_api.sse(openai_api.error(status, str(failure), failure.cause))
        finally:
            await messages.aclose()
        yield openai_api.sse("[DONE]")
