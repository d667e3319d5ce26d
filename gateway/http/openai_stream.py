"""An OpenAI answer as server-sent events: text chunks of each choice (with their tokens'
logprobs when asked for), each choice's finish reason, usage when asked for, `data: [DONE]`;
a failure mid-stream is an error event before [DONE], so the client is never left waiting."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterator

from kvmesh.gateway.failure import RequestFailed
from kvmesh.gateway.http.errors import failure_error
from kvmesh.gateway.http.logprobs import LogprobsShaper
from kvmesh.gateway.http.openai_answer import chunk, finish_reasons, tool_chunks, usage_chunk
from kvmesh.gateway.http.openai_request import OpenAIRequest
from kvmesh.gateway.http.sse import DONE, sse
from kvmesh.protos.v1 import gateway_pb2


class ChunkStream:
    """The events of one streamed answer, each choice's state kept apart.

    Tokens whose text is held back (a character not yet whole) have their logprobs sent with
    the choice's next chunk that has text, or with its finish reason. A chat answer that may
    call tools is held back, each choice's, until it is whole: only then can its text be told
    from its calls (its role goes out at once). echoed: the prompt's text, which a completion
    with `echo` starts each choice's text with."""

    def __init__(
        self, ask: OpenAIRequest, model: str, created: int, shapers: list[LogprobsShaper], echoed: str = ""
    ) -> None:
        self.ask, self.model, self.created = ask, model, created
        self.shapers = shapers
        self.echoed = echoed
        self.is_first = [True] * len(shapers)
        self.pending: list[list] = [[] for _ in shapers]  # each choice's logprobs not sent yet
        self.hold = ask.tools is not None and ask.tools.may_call
        self.held = ["" for _ in shapers]
        self.prompt: list = []  # echo with logprobs: the prompt's, which each choice's first chunk carries
        self.primed = [False] * len(shapers)

    async def events(
        self, first: gateway_pb2.GenerateResponse, messages: AsyncGenerator[gateway_pb2.GenerateResponse, None]
    ) -> AsyncGenerator[bytes, None]:
        """The events of `first` and the path's `messages` after it, to [DONE]; closes `messages`."""
        msg = first
        self.prompt = list(first.delta.prompt_logprobs)
        try:
            while not msg.HasField("final"):
                for event in self._delta(msg.delta):
                    yield event
                msg = await anext(messages)
            for event in self._end(msg.final):
                yield event
        except RequestFailed as failure:
            yield sse(failure_error(failure))
        finally:
            await messages.aclose()
        yield sse(DONE)

    def _delta(self, delta: gateway_pb2.TextDelta) -> Iterator[bytes]:
        """The chunk of one delta of choice delta.index (none while its text is held back)."""
        i = delta.index
        if self.hold:
            yield from self._hold(i, delta.text)
            return
        if not self.primed[i]:
            self.pending[i].extend(self.prompt)
            self.primed[i] = True
        self.pending[i].extend(delta.logprobs)
        text = (self.echoed + delta.text) if self.is_first[i] else delta.text
        if text or (self.is_first[i] and self.ask.chat):
            logprobs = self.shapers[i].shape(self.pending[i])
            yield sse(self._chunk(text, first=self.is_first[i], logprobs=logprobs, index=i))
            self.is_first[i], self.pending[i] = False, []

    def _hold(self, i: int, text: str) -> Iterator[bytes]:
        """Keep choice i's text for the end; the role at once, the rest once the answer is whole."""
        self.held[i] += text
        if self.is_first[i]:
            yield sse(self._chunk(None, first=True, index=i))
            self.is_first[i] = False

    def _end(self, final: gateway_pb2.Final) -> Iterator[bytes]:
        """Each choice's last chunk (its held text or tool calls, its last logprobs) with its
        finish reason, then usage when asked for."""
        for i, finish in enumerate(finish_reasons(final)):
            if self.hold:
                for part in tool_chunks(self.ask, self.model, self.created, i, self.held[i], finish):
                    yield sse(part)
                continue
            tail = self.shapers[i].shape(self.pending[i])
            yield sse(self._chunk(None, finish, logprobs=tail, index=i))
        if self.ask.include_usage:
            yield sse(usage_chunk(self.ask, self.model, self.created, final))

    def _chunk(
        self,
        text: str | None,
        finish: str | None = None,
        first: bool = False,
        logprobs: dict | None = None,
        index: int = 0,
    ) -> dict:
        """openai_answer.chunk of this answer."""
        return chunk(self.ask, self.model, self.created, text, finish, first, logprobs, index)
