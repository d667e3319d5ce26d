"""POST /v1/chat/completions and /v1/completions: one call object whose methods are the steps
of a request, in the order they run (the pattern of kvmesh.gateway.attempt).

Authenticate (before the body: no key, no parsing), read the body (bounded), translate it
(chat_completions.parse_chat or completions.parse_completion), send it down the request path,
then answer whole or as an event stream. A RequestFailed from the path answers with the HTTP
status of its gRPC status (errors.HTTP_STATUS) and OpenAI's error object, a 429 with
Retry-After (seconds). A streamed answer starts (status 200) once the first token is there, so
every failure before it has its own status; one after it ends the event stream with an error
event and `data: [DONE]` (openai_stream.py). A client that disconnects, mid-stream or while
waiting, cancels the request: the path aborts both legs (decode and prefill free the request's
pages).
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvmesh.engine.outcomes import FailureCause
from kvmesh.gateway.failure import RequestFailed
from kvmesh.gateway.http.body import read_json
from kvmesh.gateway.http.chat_completions import parse_chat
from kvmesh.gateway.http.completions import parse_completion
from kvmesh.gateway.http.errors import Refused, error_response, failure_response
from kvmesh.gateway.http.fields import BadField
from kvmesh.gateway.http.logprobs import LogprobsShaper
from kvmesh.gateway.http.openai_answer import best_choices, response
from kvmesh.gateway.http.openai_request import OpenAIRequest
from kvmesh.gateway.http.openai_stream import ChunkStream
from kvmesh.gateway.http.streaming import ClientGone, EventStream, cancel_on_disconnect
from kvmesh.gateway.request_path import SESSION_HEADER, RequestPath
from kvmesh.protos.v1 import gateway_pb2

logger = logging.getLogger(__name__)

Messages = AsyncGenerator[gateway_pb2.GenerateResponse, None]


def parse(body: Any, chat: bool, request_id: str = "", tool_parser: str = "json") -> OpenAIRequest:
    """Translate the JSON body of /v1/chat/completions (`chat`: chat_completions.parse_chat) or
    /v1/completions (completions.parse_completion). Raises BadField (HTTP 400) naming the field."""
    if chat:
        return parse_chat(body, request_id, tool_parser)
    return parse_completion(body, request_id)


@dataclass(frozen=True)
class OpenAIFront:
    """What every call of the OpenAI endpoints shares with the server."""

    path: RequestPath
    token_text: Callable[[int], tuple[str, bytes]]
    """A token's (text, bytes) for logprobs (kvmesh.gateway.detokenizer.TokenText)."""
    tool_parser: str = "json"
    """How calls are found in a free answer (kvmesh.gateway.tools.TOOL_PARSERS)."""
    session_from_user: bool = False
    """The `user` field names a request's session when no x-session-id header does."""


class OpenAICall:
    """One request to /v1/chat/completions (`chat`) or /v1/completions; `answer()` runs it.
    max_body_bytes: the largest body read (a longer one is a 413)."""

    def __init__(self, front: OpenAIFront, request: Request, chat: bool, max_body_bytes: int) -> None:
        self.front = front
        self.request = request
        self.chat = chat
        self.max_body_bytes = max_body_bytes
        self.authorization = request.headers.get("authorization")
        self.model, self.created = "", 0  # the answer's model name and creation time (s): _prepare
        self.echoed = ""
        self.shapers: list[LogprobsShaper] = []  # one per choice generated

    async def answer(self) -> Response:
        """The HTTP answer: an error before the path, the path's failure, a JSON body, or an event stream."""
        try:
            self._authenticate()
            body = await read_json(self.request, self.max_body_bytes)
            ask = self._parse(body)
        except Refused as refused:
            return refused.response
        messages = self.front.path.generate(ask.request, self._metadata(body), self.authorization)
        self._prepare(ask)
        try:
            async with cancel_on_disconnect(self.request.receive):
                if ask.stream:
                    return await self._stream(ask, messages)
                return await self._whole(ask, messages)
        except RequestFailed as failure:
            return failure_response(failure, param_of(failure, ask))
        except ClientGone:
            logger.info("client disconnected before the answer; request cancelled")
            return Response(status_code=499)

    def _authenticate(self) -> None:
        """Check the API key before the body is read: no key, no parsing."""
        try:
            self.front.path.authenticate(self.authorization)
        except RequestFailed as failure:
            raise Refused(failure_response(failure)) from None

    def _parse(self, body: Any) -> OpenAIRequest:
        """The body translated, named by the X-Request-Id header when there is one."""
        try:
            return parse(body, self.chat, self.request.headers.get("x-request-id", ""), self.front.tool_parser)
        except BadField as exc:
            raise Refused(error_response(400, str(exc), FailureCause.BAD_REQUEST, exc.param)) from None

    def _metadata(self, body: dict) -> list[tuple[str, str]]:
        """The headers, as the path's metadata; with session_from_user, `user` names the session
        when no header does (the operator's choice)."""
        metadata = list(self.request.headers.items())
        user = body.get("user")
        if (
            self.front.session_from_user
            and isinstance(user, str)
            and user
            and SESSION_HEADER not in self.request.headers
        ):
            metadata.append((SESSION_HEADER, user))
        return metadata

    def _prepare(self, ask: OpenAIRequest) -> None:
        """What every shape of the answer needs: the model's name, the time, the echoed prompt
        and one logprobs shaper per choice generated."""
        self.model, self.created = self.front.path.builder.model_name, int(time.time())
        self.echoed = self._echoed(ask)
        # with prompt logprobs the echoed prompt's own tokens are shaped, from offset 0
        start = 0 if ask.request.sampling.HasField("prompt_logprobs") else len(self.echoed)
        self.shapers = [LogprobsShaper(ask, self.front.token_text, start) for _ in range(ask.request.sampling.n or 1)]

    def _echoed(self, ask: OpenAIRequest) -> str:
        """The prompt's text when a completion asks for `echo` ('' otherwise)."""
        if not ask.echo:
            return ""
        if ask.request.prompt_token_ids:
            tokenizer = self.front.path.builder.tokenizer
            return tokenizer.decode(ask.request.prompt_token_ids, clean_up_tokenization_spaces=False)
        return ask.request.prompt.decode("utf-8", "replace")

    async def _stream(self, ask: OpenAIRequest, messages: Messages) -> Response:
        """The answer as an event stream, once its first message is there."""
        # the first token decides the status: every failure before it has its own
        first = await anext(messages)
        events = ChunkStream(ask, self.model, self.created, self.shapers, self.echoed).events(first, messages)
        return EventStream(events)  # type: ignore[return-value]

    async def _whole(self, ask: OpenAIRequest, messages: Messages) -> Response:
        """The whole answer as one JSON body: each choice's deltas joined, its logprobs shaped."""
        n = len(self.shapers)
        texts: list[list[str]] = [[self.echoed] for _ in range(n)]
        logprobs: list[list] = [[] for _ in range(n)]
        prompt: list = []  # the echoed prompt's logprobs, each choice's text starts with
        async with contextlib.aclosing(messages):
            async for msg in messages:
                if msg.HasField("final"):
                    shaped = [shaper.shape(prompt + lp) for shaper, lp in zip(self.shapers, logprobs)]
                    order = best_choices(ask, logprobs)
                    whole = response(
                        ask, self.model, self.created, ["".join(t) for t in texts], msg.final, shaped, order
                    )
                    return JSONResponse(whole)
                texts[msg.delta.index].append(msg.delta.text)
                logprobs[msg.delta.index].extend(msg.delta.logprobs)
                prompt.extend(msg.delta.prompt_logprobs)
        raise AssertionError("the request path ended without a final message")


_FIELD_AT_FAULT = re.compile(
    r"^(?:\[[^\]]*\] )?(max_tokens|temperature|top_p|top_k|seed|logprobs|prompt_logprobs|n|message roles|"
    r"the session id|prompt|tools)\b"
)
_PARAM_OF_WORDS = {"message roles": "messages", "the session id": "x-session-id", "prompt": "prompt"}


def param_of(failure: RequestFailed, ask: OpenAIRequest) -> str | None:
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
