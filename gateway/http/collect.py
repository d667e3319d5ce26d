"""A one-choice answer from the request path, gathered whole: its text, its tokens' logprobs
and its Final message (what the Responses and Messages fronts answer when they do not stream)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from kvmesh.protos.v1 import common_pb2, gateway_pb2

Messages = AsyncGenerator[gateway_pb2.GenerateResponse, None]


@dataclass
class Whole:
    text: str
    final: gateway_pb2.Final
    logprobs: list[common_pb2.TokenLogprobs] = field(default_factory=list)


async def whole(messages: Messages) -> Whole:
    """The deltas of `messages` joined, until its final message (the generator is closed).
    Raises RequestFailed as the path does; AssertionError if the path ends without a final."""
    texts: list[str] = []
    logprobs: list[common_pb2.TokenLogprobs] = []
    async with contextlib.aclosing(messages):
        async for msg in messages:
            if msg.HasField("final"):
                return Whole("".join(texts), msg.final, logprobs)
            texts.append(msg.delta.text)
            logprobs.extend(msg.delta.logprobs)
    raise AssertionError("the request path ended without a final message")
