"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API as a call object
whose methods are a request's steps, in the order they run.

Authenticate (the key as `x-api-key`, Anthropic's header, or as a bearer token), read the body
(messages_request.read_messages_body), translate it to a chat completion
(chat_completions.parse_chat: one request path), run it, answer whole or as Anthropic's events.
Every error is Anthropic's shape ({"type": "error", "error": {"type", "message"}}) with the HTTP
status the OpenAI front gives the same failure; a failure after the stream began is an `error`
event, so the client is never left waiting.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvmesh.gateway.failure import RequestFailed
from kvmesh.gateway.http.body import read_json
from kvmesh.gateway.http.chat_completions import parse_chat
from kvmesh.gateway.http.collect import Messages, whole
from kvmesh.gateway.http.errors import Refused, failure_response
from kvmesh.gateway.http.fields import BadField
from kvmesh.gateway.http.messages_answer import (
    MessageEvents,
    content_of,
    error,
    error_response,
    message,
    new_id,
    usage,
)
from kvmesh.gateway.http.messages_request import MessagesRequest, param_of_chat, read_messages_body
from kvmesh.gateway.http.openai_call import OpenAIFront
from kvmesh.gateway.http.openai_request import OpenAIRequest
from kvmesh.gateway.http.streaming import ClientGone, EventStream, cancel_on_disconnect
from kvmesh.gateway.requests import UnknownModelError
from kvmesh.protos.v1 import gateway_pb2

logger = logging.getLogger(__name__)


class MessagesCall:
    """One request to /v1/messages (`create`) or /v1/messages/count_tokens (`count_tokens`).
    max_body_bytes: the largest body read (a longer one is a 413)."""

    def __init__(self, front: OpenAIFront, request: Request, max_body_bytes: int) -> None:
        self.front = front
        self.request = request
        self.max_body_bytes = max_body_bytes
        key = request.headers.get("x-api-key")
        self.authorization = f"Bearer {key}" if key else request.headers.get("authorization")
        self.message_id = new_id("msg")

    async def create(self) -> Response:
        """POST /v1/messages: an error, the message, or its events."""
        try:
            self._authenticate()
            read, ask = self._parse(await read_json(self.request, self.max_body_bytes), count_only=False)
        except Refused as refused:
            return _anthropic(refused.response)
        messages = self.front.path.generate(ask.request, list(self.request.headers.items()), self.authorization)
        model = self.front.path.builder.model_name
        try:
            async with cancel_on_disconnect(self.request.receive):
                if read.stream:
                    first = await anext(messages)  # the first token decides the status
                    return EventStream(self._events(ask, model, first, messages))  # type: ignore[return-value]
                answer = await whole(messages)
        except RequestFailed as failure:
            return _anthropic(failure_response(failure))
        except ClientGone:
            logger.info("client disconnected before the answer; request cancelled")
            return Response(status_code=499)
        f = answer.final
        content = content_of(ask, answer.text, f)
        return JSONResponse(
            message(self.message_id, model, content, usage(f.prompt_tokens, f.cached_tokens, f.generated_tokens))
        )

    async def count_tokens(self) -> Response:
        """POST /v1/messages/count_tokens: {"input_tokens"}, the prompt's tokens as /v1/messages
        would send them (the chat template, the tools)."""
        try:
            self._authenticate()
            _, ask = self._parse(await read_json(self.request, self.max_body_bytes), count_only=True)
        except Refused as refused:
            return _anthropic(refused.response)
        builder = self.front.path.builder
        conversation = [(m.role, m.content) for m in ask.request.messages]
        try:
            builder.check_model(ask.request.model)
        except UnknownModelError as exc:
            return error_response(404, str(exc))
        try:
            ids = await asyncio.to_thread(builder.tokenize, b"", conversation, True, (), ask.tools)
        except ValueError as exc:
            return error_response(400, str(exc))
        return JSONResponse({"input_tokens": len(ids)})

    def _authenticate(self) -> None:
        try:
            self.front.path.authenticate(self.authorization)
        except RequestFailed as failure:
            raise Refused(failure_response(failure)) from None

    def _parse(self, body: Any, count_only: bool) -> tuple[MessagesRequest, OpenAIRequest]:
        """The body read and translated; Refused (400) naming the field at fault."""
        try:
            read = read_messages_body(body, count_only)
            request_id = self.request.headers.get("x-request-id", "") or self.message_id[4:]
            return read, parse_chat(read.chat, request_id, self.front.tool_parser)
        except BadField as exc:
            param = param_of_chat(exc.param)
            text = str(exc) if not param or str(exc).startswith(param) else f"{param}: {exc}"
            raise Refused(error_response(400, text)) from None

    async def _events(self, ask: OpenAIRequest, model: str, first: gateway_pb2.GenerateResponse, messages: Messages):
        """message_start (with the prompt's usage), ping, the content blocks (text as it comes,
        unless the answer may call tools and is held until whole), message_delta, message_stop;
        a failure after the start is an `error` event."""
        events = MessageEvents()
        start_usage = usage(first.delta.prompt_tokens, first.delta.cached_tokens, 0)
        yield events.event("message_start", message=message(self.message_id, model, None, start_usage))
        yield events.event("ping")
        hold = ask.tools is not None and ask.tools.may_call
        texts: list[str] = []
        msg = first
        try:
            if not hold:
                yield events.block_start(0, {"type": "text", "text": ""})
            while not msg.HasField("final"):
                texts.append(msg.delta.text)
                if not hold and msg.delta.text:
                    yield events.text_delta(0, msg.delta.text)
                msg = await anext(messages)
            f = msg.final
            content = content_of(ask, "".join(texts), f)
            if hold:
                for i, block in enumerate(content.blocks):
                    for event in events.whole_block(i, block):
                        yield event
            else:
                yield events.block_stop(0)
            for event in events.end(content, usage(f.prompt_tokens, f.cached_tokens, f.generated_tokens)):
                yield event
        except RequestFailed as failure:
            status = failure_response(failure).status_code
            yield events.event("error", error=error(status, str(failure))["error"])
        finally:
            await messages.aclose()


def _anthropic(response: JSONResponse) -> JSONResponse:
    """An OpenAI-shaped error answer of the shared steps (the key, the body's size, the path)
    in Anthropic's shape, with the same status and headers (Retry-After)."""
    body = json.loads(bytes(response.body))
    if body.get("type") == "error":
        return response
    headers = {k: v for k, v in response.headers.items() if k == "retry-after"}
    return error_response(response.status_code, body["error"]["message"], headers or None)
