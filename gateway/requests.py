"""Turning a client request into token ids and checked sampling settings.

Every error here is one the caller can fix, raised as ValueError with a message that
says what to change; the servicer maps it to INVALID_ARGUMENT.

Text from a request is data: a special-token string such as "<|im_end|>" typed into a
prompt or a message is encoded as ordinary text, never as the control token. Only the
chat template's own markers become control tokens; `prompt_token_ids` is the way to send
exact ids.
"""

from __future__ import annotations

import json
import random
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.engine.sampling_params import MAX_CHOICES, MAX_LOGPROBS, GrammarSpec, SamplingParams
from kvmesh.gateway.tools import ToolRequest, system_text, tool_schemas, with_tools

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})

# an ordinary conversation rendered once at start: the template must show each content exactly
# once and the split tokenization must give apply_chat_template's ids for it
_PROBE_CONVERSATION = (
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Spain?"},
)


class UnknownModelError(ValueError):
    """The request names a model this gateway does not serve (NOT_FOUND, HTTP 404)."""


@dataclass(frozen=True)
class GenerateInput:
    """A validated request: prompt token ids and how to generate."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    """With its seed always set (a random one when the client left it unset)."""
    max_tokens: int
    stop: tuple[str, ...]
    ignore_eos: bool


class PromptBuilder:
    """Tokenizes prompts (optionally through the chat template) and checks the limits."""

    def __init__(
        self, tokenizer, model_name: str, max_context: int, default_max_tokens: int, max_tokens_limit: int
    ) -> None:
        """Raises ValueError when the tokenizer has a chat template whose output cannot be split
        into the template's own text and each message's content (see `_chat_token_ids`)."""
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_context = max_context
        self.default_max_tokens = default_max_tokens
        self.max_tokens_limit = max_tokens_limit
        # no prompt that fits the context can be longer than context x the longest token
        # (x4: a token's characters are at most 4 UTF-8 bytes each); longer ones are
        # refused before tokenizing, which would cost seconds and gigabytes on huge input
        longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
        self.max_prompt_bytes = max_context * longest * 4
        # message i's content renders as f"{mark}{i}z": letters and digits, which templates
        # pass through unchanged; random, so no template's own text contains it
        self._content_mark = "kvmesh" + secrets.token_hex(8)
        self._content_mark_re = re.compile(re.escape(self._content_mark) + r"(\d+)z")
        # the special added tokens, matched as the tokenizer matches them (longest first,
        # single_word ones only between non-word characters)
        self._markers = {t.content: (i, t) for i, t in sorted(tokenizer.added_tokens_decoder.items()) if t.special}
        alternatives = [
            rf"(?<!\w){re.escape(content)}(?!\w)" if t.single_word else re.escape(content)
            for content, (_, t) in sorted(self._markers.items(), key=lambda kv: -len(kv[0]))
        ]
        self._marker_re = re.compile("(" + "|".join(alternatives) + ")") if alternatives else None
        if tokenizer.chat_template:
            self._check_chat_template()

    def check_model(self, model: str) -> None:
        """Raises UnknownModelError unless `model` is empty or the served model's name (any case)."""
        if model and model.lower() != self.model_name.lower():
            raise UnknownModelError(
                f"unknown model {model[:64]!r}{'...' if len(model) > 64 else ''}: this gateway serves "
                f"{self.model_name!r} (or leave model empty)"
            )

    def tokenize(
        self,
        prompt: bytes,
        messages: Sequence[tuple[str, str]],
        chat: bool,
        token_ids: Sequence[int] = (),
        tools: ToolRequest | None = None,
    ) -> list[int]:
        """Token ids of the prompt; messages (role, content) or chat=True use the chat template;
        token_ids, when given, are the prompt as it is (each checked against the vocabulary).

        A special-token string typed in the prompt or in a message's content is encoded as
        ordinary tokens; only the chat template's own markers are control tokens. Raises
        ValueError naming what to change: bad ids, prompt and messages both, too many bytes,
        unknown roles, invalid UTF-8, an empty prompt, chat without a chat template, or a
        template that does not show each message's content once and in order. `tools` (chat
        only) are rendered by the chat template when it renders tools (refused, ValueError, when
        their text holds a special token: the template's text becomes control tokens where it
        holds one), else described in the system message (content: data whatever it holds).
        """
        if tools is not None and not (messages or chat):
            raise ValueError("tools need a chat: send messages")
        if token_ids:
            if prompt or messages or chat:
                raise ValueError("send prompt_token_ids alone: without prompt, messages or chat")
            vocab = len(self.tokenizer)
            if min(token_ids) < 0 or max(token_ids) >= vocab:  # builtins: ~20x a Python loop's speed
                bad = next(t for t in token_ids if not 0 <= t < vocab)
                raise ValueError(f"prompt_token_ids must be in [0, {vocab}), got {bad}")
            return list(token_ids)
        if prompt and messages:
            raise ValueError("send either prompt or messages, not both")
        size = len(prompt) + sum(len(c.encode("utf-8", "surrogatepass")) for _, c in messages)
        if tools is not None:
            size += len(system_text(tools).encode("utf-8", "surrogatepass"))
        if size > self.max_prompt_bytes:
            raise ValueError(
                f"prompt is {size} bytes, more than the context of {self.max_context} tokens can "
                f"hold (at most {self.max_prompt_bytes} bytes); shorten the prompt"
            )
        bad_roles = sorted({r for r, _ in messages} - CHAT_ROLES)
        if bad_roles:
            raise ValueError(f"message roles must be one of {sorted(CHAT_ROLES)}, got {bad_roles}")
        try:
            text = prompt.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"prompt is not valid UTF-8 (bad byte at offset {exc.start}); send UTF-8 text") from None
        conversation: list[dict[str, str]] | None
        if messages:
            conversation = [{"role": r, "content": c} for r, c in messages]
        elif not text.strip():
            raise ValueError("prompt is empty; send some text")
        else:
            conversation = [{"role": "user", "content": text}] if chat else None
        if conversation is not None:
            if not self.tokenizer.chat_template:
                raise ValueError(f"model {self.model_name!r} has no chat template; send a plain prompt without chat")
            if tools is None:
                return self._chat_token_ids(conversation)
            if not self.renders_tools:  # the tools described in the system message, as content
                shown = with_tools([(m["role"], m["content"]) for m in conversation], tools)
                return self._chat_token_ids([{"role": r, "content": c} for r, c in shown])
            self._check_tools_text(tools)
            return self._chat_token_ids(conversation, tool_schemas(tools))
        return self._text_token_ids(text)

    def _text_token_ids(self, text: str) -> list[int]:
        """Ids of text from a request; a special-token string in it becomes ordinary tokens."""
        if not text:
            return []
        return list(self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))

    @property
    def renders_tools(self) -> bool:
        """The chat template renders a `tools` list (it names the variable)."""
        return "tools" in (self.tokenizer.chat_template or "")

    def _check_tools_text(self, tools: ToolRequest) -> None:
        """ValueError when a tool's text holds a special token's text: the template renders tools
        as its own text, where such a string would become the control token."""
        if self._marker_re is None:
            return
        found = self._marker_re.search(json.dumps(tool_schemas(tools), ensure_ascii=False))
        if found:
            raise ValueError(f"tools must not hold the special token {found.group(0)!r}: remove it from the tool")

    def _chat_token_ids(self, conversation: Sequence[dict[str, str]], tools: list[dict] | None = None) -> list[int]:
        """Ids of the conversation through the chat template, where only the template's own
        markers are control tokens: a special-token string inside a message's content is text.

        The template renders with each content replaced by a stand-in; the rendered text is cut
        at the stand-ins and at the template's special tokens, and each run of text between two
        special tokens (template text and content together) is encoded with special tokens
        left unparsed. apply_chat_template encodes the same runs, since the tokenizer splits at
        special tokens before anything else, so ordinary content gets the same ids it gives
        (checked at start on a probe conversation). Raises ValueError when the template does not
        show each content exactly once and in order for this conversation.
        """
        stand_ins = [{**m, "content": f"{self._content_mark}{i}z"} for i, m in enumerate(conversation)]
        rendered = self.tokenizer.apply_chat_template(
            stand_ins, add_generation_prompt=True, tokenize=False, **({"tools": tools} if tools else {})
        )
        pieces = self._content_mark_re.split(rendered)  # [template, i, template, j, ..., template]
        if [int(i) for i in pieces[1::2]] != list(range(len(conversation))):
            raise ValueError(
                f"the chat template of model {self.model_name!r} does not show each message's "
                f"content exactly once and in order for roles {[m['role'] for m in conversation]}; "
                f"send a plain prompt or prompt_token_ids"
            )
        ids: list[int] = []
        run: list[str] = []  # text since the last marker
        strip_next = False  # the last marker has rstrip: it takes the whitespace after it
        for k, piece in enumerate(pieces):
            if k % 2:
                run.append(conversation[int(piece)]["content"])
                continue
            parts = self._marker_re.split(piece) if self._marker_re else [piece]
            for j, part in enumerate(parts):
                if not j % 2:
                    run.append(part)
                    continue
                marker_id, marker = self._markers[part]
                text = "".join(run)
                text = text.rstrip() if marker.lstrip else text
                ids += self._text_token_ids(text.lstrip() if strip_next else text)
                ids.append(marker_id)
                run, strip_next = [], marker.rstrip
        text = "".join(run)
        return ids + self._text_token_ids(text.lstrip() if strip_next else text)

    def _template_token_ids(self, conversation: Sequence[dict[str, str]]) -> list[int]:
        """apply_chat_template's own ids, special-token strings in content parsed as control tokens."""
        ids = self.tokenizer.apply_chat_template(
            list(conversation), add_generation_prompt=True, tokenize=True, return_dict=False
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def _check_chat_template(self) -> None:
        """Raises ValueError when the chat template drops, repeats, reorders or rewrites message
        content, or when splitting its output at the content changes the ids of an ordinary
        conversation: a bad template fails at start rather than on every chat request."""
        try:
            split_ids = self._chat_token_ids(_PROBE_CONVERSATION)
        except ValueError:
            raise ValueError(
                f"the chat template of model {self.model_name!r} does not show each message's content "
                f"exactly once and in order, so content cannot be kept apart from control tokens; "
                f"use a template that renders message['content'] as it is"
            ) from None
        template_ids = self._template_token_ids(_PROBE_CONVERSATION)
        if split_ids != template_ids:
            raise ValueError(
                f"tokenizing the chat template of model {self.model_name!r} piece by piece gives "
                f"{split_ids}, not apply_chat_template's {template_ids}, for an ordinary conversation; "
                f"this tokenizer cannot keep message content apart from control tokens"
            )

    def build(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        temperature: float,
        top_p: float | None,
        top_k: int,
        max_tokens: int | None,
        seed: int | None,
        stop: Sequence[str],
        ignore_eos: bool,
        logprobs: int | None = None,
        n: int = 1,
        grammar: tuple[str, str] | None = None,
        prompt_logprobs: int | None = None,
    ) -> GenerateInput:
        """Check sampling settings and lengths; raises ValueError naming what to change.
        logprobs: report each token's logprob and this many top alternatives (None: none);
        n: choices to generate from the prompt; grammar: (kind, spec) the answer must follow
        (kvmesh.engine.sampling_params.GrammarSpec; its compile is the instances' check);
        prompt_logprobs: each prompt token's logprob and this many top alternatives (None: none)."""
        if max_tokens is None:
            max_tokens = self.default_max_tokens
        if not 1 <= max_tokens <= self.max_tokens_limit:
            raise ValueError(f"max_tokens must be in [1, {self.max_tokens_limit}], got {max_tokens}")
        if top_p is not None and not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
        if not 1 <= n <= MAX_CHOICES:
            raise ValueError(f"n must be in [1, {MAX_CHOICES}], got {n}")
        if prompt_logprobs is not None and not 0 <= prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {prompt_logprobs}")
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}] (top alternatives per token), got {logprobs}")
        try:
            spec = GrammarSpec(*grammar) if grammar is not None else None
        except ValueError as exc:
            raise ValueError(f"grammar: {exc}") from None
        num_prompt = len(prompt_token_ids)
        if num_prompt == 0:
            raise ValueError("prompt is empty after tokenization; send some text")
        if num_prompt >= self.max_context:
            raise ValueError(
                f"prompt has {num_prompt} tokens but the context holds {self.max_context}; shorten the prompt"
            )
        if num_prompt + max_tokens > self.max_context:
            raise ValueError(
                f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) exceeds the context of "
                f"{self.max_context} tokens; lower max_tokens to {self.max_context - num_prompt} or less"
            )
        sampling = SamplingParams(
            temperature=temperature,
            top_p=1.0 if top_p is None else top_p,
            top_k=top_k,
            seed=seed if seed is not None else random.getrandbits(63),
            logprobs=logprobs,
            n=n,
            grammar=spec,
            prompt_logprobs=prompt_logprobs,
        )
        return GenerateInput(
            request_id=request_id,
            prompt_token_ids=tuple(prompt_token_ids),
            sampling=sampling,
            max_tokens=max_tokens,
            stop=tuple(s for s in stop if s),
            ignore_eos=ignore_eos,
        )
