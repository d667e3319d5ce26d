"""POST /v1/responses and GET / DELETE /v1/responses/{id} (and its input_items): the Responses
API as a call object whose methods are a request's steps, in the order they run.

Create: authenticate (no key, no parsing), read the body (responses_request.read_responses), load
the previous response (`previous_response_id`: its conversation, 404 when the key has none of
that id), translate to a chat completion (chat_completions.parse_chat: one request path), run it
on the path as a session named by the chain's first response (its turns go back to the
instances that hold their prefix), answer whole or as typed events, and store the response
(`store`, the default) once it is whole. Nothing is stored for a request that fails.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvmesh.engine.outcomes import FailureCause
from kvmesh.gateway.failure import RequestFailed
from kvmesh.gateway.http.body import read_json
from kvmesh.gateway.http.chat_completions import parse_chat
from kvmesh.gateway.http.collect import Messages, whole
from kvmesh.gateway.http.errors import Refused, error_response, failure_error, failure_response
from kvmesh.gateway.http.fields import BadField
from kvmesh.gateway.http.logprobs import LogprobsShaper
from kvmesh.gateway.http.openai_call import OpenAIFront, param_of
from kvmesh.gateway.http.openai_request import OpenAIRequest
from kvmesh.gateway.http.responses_answer import ResponseEvents, envelope, failed, finished, output_of
from kvmesh.gateway.http.responses_request import (
    ResponsesRequest,
    check_tool_outputs,
    new_id,
    param_of_chat,
    read_responses,
)
from kvmesh.gateway.http.streaming import ClientGone, EventStream, cancel_on_disconnect
from kvmesh.gateway.request_path import SESSION_HEADER
from kvmesh.gateway.response_store import ResponseStore, ResponseStoreError
from kvmesh.protos.v1 import gateway_pb2

logger = logging.getLogger(__name__)


class ResponsesCall:
    """One request to /v1/responses or /v1/responses/{id}; `create`, `get`, `delete`,
    `input_items` answer it. max_body_bytes: the largest body read (a longer one is a 413)."""

    def __init__(self, front: OpenAIFront, store: ResponseStore, request: Request, max_body_bytes: int) -> None:
        self.front = front
        self.store = store
        self.request = request
        self.max_body_bytes = max_body_bytes
        self.authorization = request.headers.get("authorization")
        self.owner = ""
        self.response_id = new_id("resp")
        self.session = self.response_id  # a chain's session is named by its first response
        self.history: list[dict] = []
        self.base: dict = {}

    async def create(self) -> Response:
        """POST /v1/responses: an error before the path, the path's failure, the Response, or its events."""
        try:
            self._authenticate()
            read = self._read(await read_json(self.request, self.max_body_bytes))
            await self._load_previous(read)
            ask = await self._ask(read)
        except Refused as refused:
            return refused.response
        messages = self.front.path.generate(ask.request, self._metadata(), self.authorization)
        model, created = self.front.path.builder.model_name, int(time.time())
        self.base = envelope(self.response_id, read, model, created, read.previous_response_id)
        try:
            async with cancel_on_disconnect(self.request.receive):
                if read.stream:
                    first = await anext(messages)  # the first token decides the status
                    return EventStream(self._events(read, ask, first, messages))  # type: ignore[return-value]
                return JSONResponse(await self._whole(read, ask, messages))
        except RequestFailed as failure:
            return failure_response(failure, param_of_chat(param_of(failure, ask)))
        except ClientGone:
            logger.info("client disconnected before the answer; request cancelled")
            return Response(status_code=499)

    async def get(self) -> Response:
        """GET /v1/responses/{response_id}: the stored Response (404 when this key has none of that id)."""
        try:
            self._authenticate()
            return JSONResponse((await self._record(self.request.path_params["response_id"]))["response"])
        except Refused as refused:
            return refused.response

    async def delete(self) -> Response:
        """DELETE /v1/responses/{response_id}: {"id", "object": "response", "deleted": true}, or 404."""
        response_id = self.request.path_params["response_id"]
        try:
            self._authenticate()
            deleted = await self._stored(self.store.delete(self.owner, response_id))
        except Refused as refused:
            return refused.response
        if not deleted:
            return _not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    async def input_items(self) -> Response:
        """GET /v1/responses/{response_id}/input_items: this response's input items as a list,
        paged by `limit` (1-100, 20), `order` (desc, the default, or asc) and `after` (an item id)."""
        try:
            self._authenticate()
            items = (await self._record(self.request.path_params["response_id"]))["input_items"]
            page, has_more = _page(items, self.request.query_params)
        except Refused as refused:
            return refused.response
        first, last = (page[0]["id"], page[-1]["id"]) if page else (None, None)
        return JSONResponse({"object": "list", "data": page, "first_id": first, "last_id": last, "has_more": has_more})

    def _authenticate(self) -> None:
        """The caller's key, checked before the body is read; it owns what it stores."""
        try:
            self.owner = self.front.path.keys.owner_of(self.front.path.authenticate(self.authorization))
        except RequestFailed as failure:
            raise Refused(failure_response(failure)) from None

    def _read(self, body: Any) -> ResponsesRequest:
        try:
            return read_responses(body)
        except BadField as exc:
            raise Refused(error_response(400, str(exc), FailureCause.BAD_REQUEST, exc.param)) from None

    async def _load_previous(self, read: ResponsesRequest) -> None:
        """The previous response's conversation and session (404 when this key stored none of that id)."""
        if read.previous_response_id is None:
            return
        try:
            record = await self._record(read.previous_response_id)
        except Refused as refused:
            if refused.response.status_code != 404:
                raise
            message = f"Previous response with id '{read.previous_response_id[:100]}' not found."
            raise Refused(error_response(404, message, FailureCause.BAD_REQUEST, "previous_response_id")) from None
        self.history, self.session = record["messages"], record["session"]

    async def _ask(self, read: ResponsesRequest) -> OpenAIRequest:
        """The turn as a chat completion (the conversation through this input), its tools'
        outputs checked against the calls made; with truncation "auto", cut to fit the context."""
        try:
            check_tool_outputs(self.history + read.messages)
            ask = parse_chat(read.chat_body(self.history), self.response_id[5:], self.front.tool_parser)
        except BadField as exc:
            raise Refused(error_response(400, str(exc), FailureCause.BAD_REQUEST, param_of_chat(exc.param))) from None
        if read.truncation == "auto":
            await asyncio.to_thread(truncate_to_context, self.front, ask)
        return ask

    def _metadata(self) -> list[tuple[str, str]]:
        """The headers, with the chain's session unless the client names its own."""
        metadata = list(self.request.headers.items())
        if SESSION_HEADER not in self.request.headers:
            metadata.append((SESSION_HEADER, self.session))
        return metadata

    async def _whole(self, read: ResponsesRequest, ask: OpenAIRequest, messages: Messages) -> dict:
        answer = await whole(messages)
        shaped = LogprobsShaper(ask, self.front.token_text).shape(answer.logprobs)
        output = output_of(ask, answer.text, shaped["content"] if shaped else None)
        response = finished(self.base, output, answer.final)
        return await self._keep(read, response, output.message)

    async def _events(
        self, read: ResponsesRequest, ask: OpenAIRequest, first: gateway_pb2.GenerateResponse, messages: Messages
    ):
        """The typed events: created, in_progress, the output's items (text as it comes, unless
        the answer may call tools and is held until whole), completed; a failure after the
        start is an `error` event and response.failed."""
        events = ResponseEvents()
        yield events.event("response.created", response=self.base)
        yield events.event("response.in_progress", response=self.base)
        hold = ask.tools is not None and ask.tools.may_call
        shaper = LogprobsShaper(ask, self.front.token_text)
        item_id, texts, pending, logprobs = new_id("msg"), [], [], []
        msg = first
        try:
            if not hold:
                for event in events.text_start(0, item_id):
                    yield event
            while not msg.HasField("final"):
                texts.append(msg.delta.text)
                pending.extend(msg.delta.logprobs)
                logprobs.extend(msg.delta.logprobs)
                if not hold and msg.delta.text:  # logprobs of tokens whose text is held go with the next text
                    shaped = shaper.shape(pending)
                    yield events.text_delta(0, item_id, msg.delta.text, shaped["content"] if shaped else None)
                    pending = []
                msg = await anext(messages)
            shaped = shaper.shape(logprobs)
            output = output_of(ask, "".join(texts), shaped["content"] if shaped else None, item_id)
            if hold:
                for i, item in enumerate(output.items):
                    for event in events.whole_item(i, item):
                        yield event
            else:
                if pending:
                    tail = shaper.shape(pending)
                    yield events.text_delta(0, item_id, "", tail["content"] if tail else None)
                for event in events.text_end(0, output.items[0]):
                    yield event
            response = await self._keep(read, finished(self.base, output, msg.final), output.message)
            yield events.event("response.completed", response=response)
        except RequestFailed as failure:
            error = failure_error(failure)["error"]
            yield events.event("error", code=error["code"], message=error["message"], param=None)
            yield events.event("response.failed", response=failed(self.base, error["code"], error["message"]))
        finally:
            await messages.aclose()

    async def _keep(self, read: ResponsesRequest, response: dict, message: dict) -> dict:
        """Store the whole response (when asked to) with its input and the conversation it ends;
        a store that cannot be reached leaves it unstored, and the answer says so (store false)."""
        if not read.store:
            return response
        record = {
            "response": response,
            "input_items": read.items,
            "messages": self.history + read.messages + [message],
            "session": self.session,
        }
        try:
            await self.store.put(self.owner, self.response_id, record)
        except ResponseStoreError as exc:
            logger.warning("response %s not stored: %s", self.response_id, exc)
            return {**response, "store": False}
        return response

    async def _record(self, response_id: str) -> dict:
        """The record this key stored under `response_id`; Refused with 404 when there is none."""
        record = await self._stored(self.store.get(self.owner, response_id))
        if record is None:
            raise Refused(_not_found(response_id))
        return record

    async def _stored(self, call):
        """A store call's result; Refused with 503 when the store cannot be reached."""
        try:
            return await call
        except ResponseStoreError as exc:
            raise Refused(error_response(503, f"{exc}; retry", FailureCause.NO_INSTANCE)) from None


def _not_found(response_id: str) -> JSONResponse:
    return error_response(404, f"No response found with id '{response_id[:100]}'.", FailureCause.BAD_REQUEST)


def _page(items: list[dict], query) -> tuple[list[dict], bool]:
    """(the page of `items` the query asks for, whether more follow). Raises Refused (400) for a
    bad limit or order."""
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        limit = 0
    order = query.get("order", "desc")
    if not 1 <= limit <= 100 or order not in ("asc", "desc"):
        raise Refused(
            error_response(400, "limit must be in [1, 100] and order 'asc' or 'desc'", FailureCause.BAD_REQUEST)
        )
    ordered = items if order == "asc" else items[::-1]
    after = query.get("after")
    if after is not None:
        ids = [item["id"] for item in ordered]
        ordered = ordered[ids.index(after) + 1 :] if after in ids else []
    return ordered[:limit], len(ordered) > limit


def truncate_to_context(front: OpenAIFront, ask: OpenAIRequest) -> None:
    """Truncation "auto": drop the conversation's oldest turns (after its leading system
    messages) until its prompt and max_tokens fit the context, keeping at least the last
    message; the turn left first is a user's where one can be. The cut is found by bisection
    over the places a kept conversation may start: at most ~log2(messages) tokenizations, and a
    conversation over the builder's byte bound is refused before it is tokenized."""
    builder = front.path.builder
    messages = ask.request.messages
    budget = builder.max_context - (ask.request.sampling.max_tokens or builder.default_max_tokens)
    lead = next((k for k, m in enumerate(messages) if m.role != "system"), len(messages))
    rest = list(messages[lead:])
    if len(rest) < 2:
        return
    # where the kept conversation may start: the first message, each later user turn, the last message
    cuts = sorted({0, len(rest) - 1, *(k for k, m in enumerate(rest) if m.role == "user")})

    def fits(cut: int) -> bool:
        conversation = [(m.role, m.content) for m in (*messages[:lead], *rest[cut:])]
        try:
            return len(builder.tokenize(b"", conversation, True, tools=ask.tools)) <= budget
        except ValueError:  # too many bytes to tokenize at all: does not fit
            return False

    lo, hi = 0, len(cuts) - 1  # the first cut that fits is in cuts[lo:hi + 1] (the last one if none does)
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(cuts[mid]):
            hi = mid
        else:
            lo = mid + 1
    del messages[lead : lead + cuts[lo]]
