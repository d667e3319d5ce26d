"""Streaming answers over ASGI, whatever they carry: a client's disconnect cancels the work
awaited on its behalf (`cancel_on_disconnect`), and `EventStream` sends server-sent events as
they come. gateway/http/openai_call.py uses both for the OpenAI front.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator

from starlette.types import Receive, Scope, Send

logger = logging.getLogger(__name__)


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was complete."""


@contextlib.asynccontextmanager
async def cancel_on_disconnect(receive: Receive):
    """Within the block, a client disconnect (ASGI `http.disconnect`) cancels the current task
    at the await it is in, and the block raises ClientGone: whatever it awaited (the request
    path's generator) sees the cancel and cleans up. Use only after the body has been read."""
    task = asyncio.current_task()
    assert task is not None
    state = {"inside": True, "gone": False}

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if state["inside"]:  # checked at the moment of cancelling: the cancel lands in the block
            state["gone"] = True
            task.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        yield
    except asyncio.CancelledError:
        if not state["gone"]:
            raise
        task.uncancel()
        raise ClientGone() from None
    finally:
        state["inside"] = False
        watcher.cancel()


class EventStream:
    """An ASGI response streaming server-sent events (bytes from `events`); a disconnect
    stops it and closes `events`."""

    def __init__(self, events: AsyncGenerator[bytes, None]) -> None:
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream; charset=utf-8"),
                    (b"cache-control", b"no-cache"),
                    (b"x-accel-buffering", b"no"),  # proxies pass each event on at once
                ],
            }
        )
        try:
            async with cancel_on_disconnect(receive):
                async for event in self.events:
                    await send({"type": "http.response.body", "body": event, "more_body": True})
        except ClientGone:
            logger.info("client disconnected mid-stream; request cancelled")
            return
        finally:
            await self.events.aclose()
        await send({"type": "http.response.body", "body": b"", "more_body": False})
