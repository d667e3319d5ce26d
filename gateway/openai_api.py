"""OpenAI's request and response bodies <-> the gateway's GenerateRequest and its answer.

Pure translation, no I/O: gateway/http_api.py serves it. Follows OpenAI's API reference
for Chat Completions (POST /v1/chat/completions, https://platform.openai.com/docs/api-reference/chat)
and Completions (POST /v1/completions, .../api-reference/completions). Only the shapes are
checked here (a wrong type is a BadField, HTTP 400, naming the field); every limit and range
(max_tokens, temperature, top_p, the context) is the request path's own check
(kvmesh.gateway.requests.PromptBuilder), so HTTP and gRPC refuse the same requests with the same
words. OpenAI's own fields that kvmesh does not implement yet (UNSUPPORTED) are refused with
HTTP 400 naming the field, unless they hold the value that turns them off, so a client never
gets something other than what it asked for; other unknown fields (another vendor's
extensions) are ignored, as OpenAI does. vLLM's extensions `top_k` and `ignore_eos` are
honoured. logprobs (chat: `logprobs` + `top_logprobs`; completions: `logprobs` 0..5, with
`echo` the prompt's too) come from where each token is sampled (kvmesh.engine.sampler.token_logprobs)
and are shaped here (`LogprobsShaper`) with kvmesh.gateway.detokenizer.TokenText's strings and bytes;
`n` choices and completions' `best_of` (`best_choices`), structured output
(`response_format`, vLLM's `structured_outputs` and `guided_*`: a GenerateOptions.grammar) and
tools (gateway/tools.py) are translated here too.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from kvmesh.engine.outcomes import FailureCause
from kvmesh.engine.sampling_params import MAX_CHOICES, MAX_LOGPROBS
from kvmesh.gateway.tools import ToolError, ToolRequest, call_schema, parse_tools, tool_calls, tool_schemas
from kvmesh.protos.v1 import common_pb2, gateway_pb2
from kvmesh.runtime.wire import FINISH_FROM_PB

CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
"""OpenAI's message roles -> the chat template's ("developer" is OpenAI's newer name for system)."""


def _off(*values: Any) -> Callable[[Any], bool]:
    """A field is off when it holds one of `values` (null always is)."""
    return lambda value: value is None or any(value == v and type(value) is type(v) for v in values)


UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "audio": _off(),
    "modalities": _off(["text"]),
    "prediction": _off(),
    "web_search_options": _off(),
    "frequency_penalty": _off(0, 0.0),
    "presence_penalty": _off(0, 0.0),
    "logit_bias": _off({}),
    "functions": _off([]),
    "function_call": _off("none"),
    "reasoning_effort": _off(),
    "verbosity": _off(),
    "store": _off(False),
    "service_tier": _off("auto", "default"),
    "suffix": _off(""),
    # vLLM's extensions of the same kinds: refused too, never silently dropped
    "guided_grammar": _off(),
    "prompt_logprobs": _off(),
    "min_tokens": _off(0),
    "repetition_penalty": _off(1, 1.0),
    "min_p": _off(0, 0.0),
}
"""OpenAI's request fields (and vLLM's extensions of them) that kvmesh does not implement yet,
each with the test for the value that turns it off: any other value is a 400 naming the field.
Accepted with no effect: `user`, `metadata`, `safety_identifier`, `prompt_cache_key`.
`tools`, `tool_choice` and `parallel_tool_calls` are gateway/tools.py's (chat only)."""

MAX_COMPLETION_LOGPROBS = 5
"""Most top alternatives /v1/completions' `logprobs` may ask for (OpenAI's bound)."""


class BadField(ValueError):
    """A field of the body has the wrong type or shape: HTTP 400, `param` names the field."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class OpenAIRequest:
    """One OpenAI request, translated."""

    request: gateway_pb2.GenerateRequest
    chat: bool
    """/v1/chat/completions (else /v1/completions)."""
    stream: bool
    include_usage: bool
    """stream_options.include_usage: a last chunk carries `usage`."""
    echo: bool = False
    """Completions' `echo`: the answer's text starts with the prompt's."""
    grammar_field: str = ""
    """The field that asked for structured output (GRAMMAR_FIELDS, or "tools"; "" for free
    text): the `param` of an error about the grammar."""
    tools: ToolRequest | None = None
    """The request's tools (chat), whose calls are parsed from the answer."""
    best_of: int = 0
    """Completions' best_of (> n; 0: none): that many choices are generated and the n whose
    tokens have the highest summed logprob are returned (`best_choices`)."""
    n: int = 1
    """Choices the client gets."""
    logprobs: bool = False
    """The client asked for logprobs (best_of asks for them itself, to score the choices)."""

    @property
    def response_id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.request.request_id


def _get(body: dict, name: str, kinds: tuple[type, ...], what: str) -> Any:
    """body[name] when it is one of `kinds` (None when absent or null); BadField otherwise."""
    value = body.get(name)
    if value is None:
        return None
    # bool is an int to Python, never to JSON Schema: true is not a number
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise BadField(f"{name} must be {what}, got {json.dumps(value)[:40]}", name)
    if isinstance(value, float) and not math.isfinite(value):
        raise BadField(f"{name} must be a finite number", name)
    return value


def _text(content: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts ({"type": "text", "text": ...})."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadField(f"{where}[{i}] must be a text part {{'type': 'text', 'text': '...'}}", where)
            texts.append(part["text"])
        return "".join(texts)
    raise BadField(f"{where} must be a string or a list of text parts", where)


def _content(m: dict, where: str) -> str:
    """A message's text; an assistant's earlier tool calls are shown as the JSON array the tool
    prompt asks for (kvmesh.gateway.tools), so the model sees what it called."""
    text = _text(m.get("content"), f"{where}.content")
    calls = m.get("tool_calls")
    if m.get("role") == "assistant" and calls:
        if not isinstance(calls, list) or not all(
            isinstance(c, dict) and isinstance(c.get("function"), dict) for c in calls
        ):
            raise BadField(f"{where}.tool_calls must be a list of function calls", f"{where}.tool_calls")
        shown = []
        for c in calls:
            fn = c["function"]
            try:
                arguments = json.loads(fn.get("arguments") or "{}")
            except (TypeError, ValueError):
                raise BadField(f"{where}.tool_calls: arguments must be JSON text", f"{where}.tool_calls") from None
            shown.append({"name": fn.get("name"), "arguments": arguments})
        text = (text + "\n" if text else "") + json.dumps(shown, ensure_ascii=False)
    return text


def _messages(body: dict) -> list[gateway_pb2.ChatMessage]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadField("messages must be a non-empty list of {'role', 'content'} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadField(f"{where} must be an object with a string role", where)
        role = CHAT_ROLES.get(m["role"], m["role"])  # an unknown role: the request path names the allowed ones
        out.append(gateway_pb2.ChatMessage(role=role, content=_content(m, where)))
    return out


def _prompt(body: dict) -> tuple[str, list[int]]:
    """The completion prompt: a string or token ids, alone or as a batch of one."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return prompt, []
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(-(2**31) <= t < 2**31 for t in prompt):
            raise BadField("prompt token ids must be 32-bit integers", "prompt")
        return "", prompt
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str | list) for p in prompt):
        raise BadField("send one prompt per request (this gateway answers no batch of prompts)", "prompt")
    raise BadField("prompt must be a string or a non-empty list of token ids", "prompt")


def _refuse_unsupported(body: dict) -> None:
    """BadField naming the first UNSUPPORTED field that is not off."""
    for name, is_off in UNSUPPORTED.items():
        if name in body and not is_off(body[name]):
            raise BadField(
                f"{name} is not supported by this server yet; leave it out (or send the value that turns it off)",
                name,
            )


GRAMMAR_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice")
"""Where a request may ask for structured output: OpenAI's response_format, vLLM's
structured_outputs ({"json" | "regex" | "choice": ...}) and its older guided_* fields."""


def _grammar(body: dict) -> tuple[str, tuple[str, str] | None]:
    """The structured output a request asks for: (the field that asked, (kind, spec)), or
    ("", None) for free text. Raises BadField for a malformed one or for two at once."""
    found: list[tuple[str, tuple[str, str]]] = []
    response_format = _get(body, "response_format", (dict,), "an object")
    if response_format is not None:
        kind = response_format.get("type")
        if kind == "json_object":
            found.append(("response_format", ("json_object", "")))
        elif kind == "json_schema":
            inner = response_format.get("json_schema")
            if not isinstance(inner, dict) or not isinstance(inner.get("schema", {}), dict | bool):
                raise BadField(
                    "response_format.json_schema must be an object with a 'name' and a 'schema'", "response_format"
                )
            found.append(("response_format", ("json_schema", json.dumps(inner.get("schema", {})))))
        elif kind != "text":
            raise BadField(
                f"response_format.type must be 'text', 'json_object' or 'json_schema', got {json.dumps(kind)[:40]}",
                "response_format",
            )
    outputs = _get(body, "structured_outputs", (dict,), "an object")
    legacy = {
        key: body[f"guided_{key}"] for key in ("json", "regex", "choice") if body.get(f"guided_{key}") is not None
    }
    for field, given in (("structured_outputs", outputs or {}), *((f"guided_{k}", {k: v}) for k, v in legacy.items())):
        for key, value in given.items():
            if value is None:
                continue
            if key == "json":
                if not isinstance(value, dict | str | bool):
                    raise BadField(f"{field}: json must be a JSON Schema (an object or its text)", field)
                found.append((field, ("json_schema", value if isinstance(value, str) else json.dumps(value))))
            elif key == "regex":
                if not isinstance(value, str):
                    raise BadField(f"{field}: regex must be a string", field)
                found.append((field, ("regex", value)))
            elif key == "choice":
                if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
                    raise BadField(f"{field}: choice must be a non-empty list of strings", field)
                found.append((field, ("choice", json.dumps(value))))
            else:
                raise BadField(f"{field}.{key} is not supported (json, regex or choice are)", field)
    if len(found) > 1:
        raise BadField(
            f"ask for one structured output, got {len(found)} ({', '.join(f for f, _ in found)})", found[1][0]
        )
    return found[0] if found else ("", None)


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many top alternatives each token's logprobs list (None: no logprobs): chat's
    `logprobs` (a boolean) with `top_logprobs` (0..20), or completions' `logprobs` (0..5)."""
    if chat:
        wanted = _get(body, "logprobs", (bool,), "a boolean")
        top = _get(body, "top_logprobs", (int,), "an integer")
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise BadField(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top}", "top_logprobs")
        if top is not None and not wanted:
            raise BadField("top_logprobs needs logprobs set to true", "top_logprobs")
        return (top or 0) if wanted else None
    wanted = _get(body, "logprobs", (int,), "an integer")
    if wanted is not None and not 0 <= wanted <= MAX_COMPLETION_LOGPROBS:
        raise BadField(f"logprobs must be in [0, {MAX_COMPLETION_LOGPROBS}], got {wanted}", "logprobs")
    return wanted


def parse(body: Any, chat: bool, request_id: str = "", tool_parser: str = "json") -> OpenAIRequest:
    """Translate the JSON body of /v1/chat/completions (`chat`) or /v1/completions.

    Chat messages go through the model's chat template; a completion prompt is sent as it is.
    `request_id` (from an X-Request-Id header) names the request; empty: a new uuid.
    Chat `tools` are described in the system message and, for tool_choice required or a named
    function, enforced by a grammar (gateway/tools.py); `tool_parser` finds calls in the answer.
    Raises BadField for a body that is not an object, a missing or mistyped field, n outside
    [1, 128], a batch of prompts, or an UNSUPPORTED field that is not off.
    """
    if not isinstance(body, dict):
        raise BadField("the body must be a JSON object", None)
    _refuse_unsupported(body)
    model = _get(body, "model", (str,), "a string") or ""
    n = _get(body, "n", (int,), "an integer")
    if n is not None and not 1 <= n <= MAX_CHOICES:
        raise BadField(f"n must be in [1, {MAX_CHOICES}], got {n}", "n")
    max_tokens = _get(body, "max_tokens", (int,), "an integer")
    max_completion_tokens = _get(body, "max_completion_tokens", (int,), "an integer")
    if max_completion_tokens is not None:
        max_tokens = max_completion_tokens  # the newer name wins, as OpenAI documents
    temperature = _get(body, "temperature", (int, float), "a number")
    top_p = _get(body, "top_p", (int, float), "a number")
    top_k = _get(body, "top_k", (int,), "an integer")
    seed = _get(body, "seed", (int,), "an integer")
    if seed is not None and not 0 <= seed < 2**64:
        raise BadField(f"seed must be in [0, 2**64), got {seed}", "seed")
    stop = _get(body, "stop", (str, list), "a string or a list of strings")
    if isinstance(stop, list) and not all(isinstance(s, str) for s in stop):
        raise BadField("stop must be a string or a list of strings", "stop")
    stream = _get(body, "stream", (bool,), "a boolean") or False
    options = _get(body, "stream_options", (dict,), "an object") or {}
    include_usage = _get(options, "include_usage", (bool,), "a boolean") or False
    ignore_eos = _get(body, "ignore_eos", (bool,), "a boolean") or False
    _get(body, "user", (str,), "a string")  # accepted and unused, as OpenAI's abuse-tracking field
    logprobs = _logprobs(body, chat)
    for name, off, endpoint in (("echo", False, "completions"), ("best_of", 1, "completions")):
        if chat and body.get(name) not in (None, off):
            raise BadField(f"{name} is for /v1/{endpoint}", name)
    if not chat and body.get("tool_choice") not in (None, "none"):
        raise BadField("tool_choice is for /v1/chat/completions", "tool_choice")
    echo = False if chat else _get(body, "echo", (bool,), "a boolean") or False
    best_of = None if chat else _get(body, "best_of", (int,), "an integer")
    if best_of is not None:
        if not (n or 1) <= best_of <= MAX_CHOICES:
            raise BadField(f"best_of must be in [n, {MAX_CHOICES}] (n = {n or 1}), got {best_of}", "best_of")
        if stream and best_of > (n or 1):
            raise BadField("best_of cannot be streamed (the best choices are known only at the end)", "best_of")
        if best_of == (n or 1):
            best_of = None  # nothing to pick from
    sampling = gateway_pb2.GenerateOptions(
        temperature=float(temperature) if temperature is not None else 1.0,  # OpenAI's default
        top_k=top_k or 0,
        stop=[stop] if isinstance(stop, str) else (stop or []),
        ignore_eos=ignore_eos,
    )
    if top_p is not None:
        sampling.top_p = float(top_p)
    if max_tokens is not None:
        if not -(2**31) <= max_tokens < 2**31:
            raise BadField(f"max_tokens must be a 32-bit integer, got {max_tokens}", "max_tokens")
        sampling.max_tokens = max_tokens
    if seed is not None:
        sampling.seed = seed
    if logprobs is not None:
        sampling.logprobs = logprobs
        if echo:  # the echoed prompt's tokens get their logprobs too
            sampling.prompt_logprobs = logprobs
    if best_of is not None:
        # best_of choices, each scored by its tokens' logprobs (asked for if the client did not)
        sampling.n = best_of
        if logprobs is None:
            sampling.logprobs = 0
    elif n is not None and n > 1:
        sampling.n = n
    grammar_field, grammar = _grammar(body)
    tools = None
    if chat:
        try:
            tools = parse_tools(body, tool_parser)
        except ToolError as exc:
            raise BadField(str(exc), exc.param) from None
    elif body.get("tools"):
        raise BadField("tools are for /v1/chat/completions", "tools")
    schema = call_schema(tools) if tools is not None else None
    if schema is not None:
        if grammar is not None:
            raise BadField(f"this tool_choice constrains the answer: send no {grammar_field} with it", grammar_field)
        grammar_field, grammar = "tools", ("json_schema", schema)
    if grammar is not None:
        sampling.grammar.kind, sampling.grammar.spec = grammar
    request = gateway_pb2.GenerateRequest(
        request_id=request_id or uuid.uuid4().hex, model=model, sampling=sampling, chat=False
    )
    if chat:
        request.messages.extend(_messages(body))
        if tools is not None:  # rendered by the gateway's prompt builder (chat template or system message)
            request.tools = json.dumps(tool_schemas(tools), ensure_ascii=False)
    else:
        text, ids = _prompt(body)
        if ids:
            request.prompt_token_ids.extend(ids)
        else:
            request.prompt = text.encode("utf-8", "surrogatepass")
    return OpenAIRequest(
        request=request,
        chat=chat,
        stream=stream,
        include_usage=include_usage,
        echo=echo,
        grammar_field=grammar_field,
        tools=tools,
        best_of=best_of or 0,
        n=n or 1,
        logprobs=logprobs is not None,
    )


LOGPROB_FLOOR = -9999.0
"""What a logprob of -inf (a token a grammar's mask or top-k ruled out) reads as in JSON, which
has no infinity: OpenAI's and vLLM's value for it."""


def _finite(value: float) -> float | None:
    """A logprob as JSON can hold it: -inf as LOGPROB_FLOOR, NaN (nothing predicts the token) None."""
    if math.isnan(value):
        return None
    return max(value, LOGPROB_FLOOR)


class LogprobsShaper:
    """OpenAI's `logprobs` objects from the answer's TokenLogprobs messages, chunk by chunk.

    Chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
    "bytes"}]}], "refusal": null}. Completions: {"tokens", "token_logprobs", "top_logprobs"
    (a {token: logprob} map of the top alternatives and the sampled token, as the legacy API
    sends up to logprobs + 1), "text_offset" (each token's character offset in the choice's
    text, counted over the tokens' own texts)}; with echo, the prompt's tokens come first (the
    very first with null logprobs: nothing predicts it). token_text: id -> (text, bytes)
    (kvmesh.gateway.detokenizer.TokenText); offset: where the first token's text starts (the echoed
    prompt's length, when its tokens are not shaped too).
    """

    def __init__(self, ask: OpenAIRequest, token_text: Callable[[int], tuple[str, bytes]], offset: int = 0) -> None:
        self.chat = ask.chat
        self.wanted = ask.logprobs
        self.token_text = token_text
        self.offset = offset

    def shape(self, entries: Sequence[common_pb2.TokenLogprobs]) -> dict | None:
        """The logprobs object of these tokens (None when the request did not ask for them)."""
        if not self.wanted:
            return None
        if self.chat:
            return {"content": [self._chat_entry(e) for e in entries], "refusal": None}
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            text = self.token_text(e.token_id)[0]
            logprob = _finite(e.logprob)
            top: dict | None = None
            if logprob is not None:  # None: an echoed prompt's first token, which nothing predicts
                top = {self.token_text(t)[0]: _finite(lp) for t, lp in zip(e.top_token_ids, e.top_logprobs)}
                top.setdefault(text, logprob)
            out["tokens"].append(text)
            out["token_logprobs"].append(logprob)
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out

    def _chat_entry(self, e: common_pb2.TokenLogprobs) -> dict:
        text, raw = self.token_text(e.token_id)
        return {
            "token": text,
            "logprob": _finite(e.logprob),
            "bytes": list(raw),
            "top_logprobs": [
                {"token": t_text, "logprob": _finite(lp), "bytes": list(t_raw)}
                for (t_text, t_raw), lp in ((self.token_text(t), lp) for t, lp in zip(e.top_token_ids, e.top_logprobs))
            ],
        }


def usage(final: gateway_pb2.Final) -> dict:
    """OpenAI's `usage` object (tokens) from the gateway's Final message."""
    return {
        "prompt_tokens": final.prompt_tokens,
        "completion_tokens": final.generated_tokens,
        "total_tokens": final.prompt_tokens + final.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": final.cached_tokens},
    }


def finish_reasons(final: gateway_pb2.Final) -> list[str]:
    """Each choice's finish reason ("stop" or "length"), in choice order."""
    if not final.choice_finish:
        return [final.finish_reason]
    return [FINISH_FROM_PB[f].value for f in final.choice_finish]


def best_choices(ask: OpenAIRequest, logprobs: Sequence[Sequence[common_pb2.TokenLogprobs]]) -> list[int]:
    """The choices the client gets, in order: all of them, or with best_of the n whose tokens'
    logprobs sum highest (ties: the lower index), best first (OpenAI's best_of; vLLM ranked
    by the same cumulative logprob)."""
    if not ask.best_of:
        return list(range(len(logprobs)))
    scores = [sum(lp.logprob for lp in entries) for entries in logprobs]
    return sorted(range(len(scores)), key=lambda i: (-scores[i], i))[: ask.n]


def response(
    ask: OpenAIRequest,
    model: str,
    created: int,
    texts: Sequence[str],
    final: gateway_pb2.Final,
    logprobs: Sequence[dict | None] = (),
    order: Sequence[int] | None = None,
) -> dict:
    """The whole (non-streaming) answer: a chat.completion or a text_completion object with a
    choice per text (choice i's text, and LogprobsShaper's object of its tokens when asked for);
    order: which choices, in what order (best_choices; None: all). usage counts every choice's
    tokens, the ones not returned too (OpenAI bills best_of so)."""
    finishes = finish_reasons(final)
    choices = []
    for i, k in enumerate(range(len(texts)) if order is None else order):
        text, finish = texts[k], finishes[k]
        lp = logprobs[k] if k < len(logprobs) else None
        if ask.chat:
            message: dict = {"role": "assistant", "content": text}
            if ask.tools is not None:
                content, calls = tool_calls(ask.tools, text)
                if calls:
                    message, finish = {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"
            choice = {"index": i, "message": message, "logprobs": lp, "finish_reason": finish}
        else:
            choice = {"index": i, "text": text, "logprobs": lp, "finish_reason": finish}
        choices.append(choice)
    return {
        "id": ask.response_id,
        "object": "chat.completion" if ask.chat else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage(final),
    }


def chunk(
    ask: OpenAIRequest,
    model: str,
    created: int,
    text: str | None,
    finish_reason: str | None = None,
    first: bool = False,
    logprobs: dict | None = None,
    index: int = 0,
) -> dict:
    """One streamed chunk (chat.completion.chunk or text_completion) of choice `index`: `text`
    (None: no text, as in the chunk that carries the finish reason); a choice's first chat
    chunk names the role; logprobs: LogprobsShaper's object of the chunk's tokens."""
    if ask.chat:
        delta: dict = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice: dict = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
    out: dict[str, Any] = {
        "id": ask.response_id,
        "object": "chat.completion.chunk" if ask.chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }
    if ask.include_usage:
        out["usage"] = None  # every chunk but the last, as OpenAI sends them
    return out


def tool_chunks(ask: OpenAIRequest, model: str, created: int, index: int, text: str, finish: str) -> list[dict]:
    """The end of a streamed chat choice whose text was held back for tool calls: its calls as
    one tool_calls delta each (id, name and whole arguments: deltas the openai client
    assembles) or its text, then the finish reason ("tool_calls" when there are calls)."""
    assert ask.tools is not None
    content, calls = tool_calls(ask.tools, text)
    out = []
    if calls:
        for k, call in enumerate(calls):
            part = chunk(ask, model, created, None, index=index)
            part["choices"][0]["delta"]["tool_calls"] = [{"index": k, **call}]
            out.append(part)
        finish = "tool_calls"
    if content:
        out.append(chunk(ask, model, created, content, index=index))
    out.append(chunk(ask, model, created, None, finish, index=index))
    return out


def usage_chunk(ask: OpenAIRequest, model: str, created: int, final: gateway_pb2.Final) -> dict:
    """The last chunk when stream_options.include_usage is set: no choices, the usage."""
    return {
        "id": ask.response_id,
        "object": "chat.completion.chunk" if ask.chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage(final),
    }


def sse(data: dict | str) -> bytes:
    """One server-sent event: `data: <json>` and a blank line (`data: [DONE]` for the string)."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
"""The HTTP status of each gRPC status the request path produces; any other is a 500 (a mesh
set up wrong, FAILED_PRECONDITION, is the server's fault, not the caller's)."""

_ERROR_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    429: "rate_limit_error",
}
_ERROR_CODE = {
    FailureCause.UNAUTHENTICATED: "invalid_api_key",
    FailureCause.UNKNOWN_MODEL: "model_not_found",
    FailureCause.OVERLOADED: "rate_limit_exceeded",
}


def http_status(code: grpc.StatusCode) -> int:
    """The HTTP status for a gRPC status (see HTTP_STATUS)."""
    return HTTP_STATUS.get(code, 500)


def error(status: int, message: str, cause: FailureCause | None = None, param: str | None = None) -> dict:
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
    code = _ERROR_CODE.get(cause, cause.value.lower()) if cause is not None else None
    return {
        "error": {
            "message": message,
            "type": _ERROR_TYPE.get(status, "server_error" if status >= 500 else "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }
