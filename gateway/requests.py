"""Turning a client request into token ids and checked sampling settings.

Every error here is one the caller can fix, raised as ValueError with a message that
says what to change; the servicer maps it to INVALID_ARGUMENT.

Text from a request is data: a special-token string such as "<|im_end|>" typed into a
prompt or a message is encoded as ordinary text, never as the control token. Only the
chat template's own markers become control tokens (kvmesh.gateway.chat_template);
`prompt_token_ids` is the way to send exact ids.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.engine.sampling_params import MAX_CHOICES, MAX_LOGPROBS, GrammarSpec, SamplingParams
from kvmesh.gateway.chat_template import ChatTemplate, text_token_ids
from kvmesh.gateway.tools import ToolRequest, system_text, tool_schemas, with_tools

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})


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
        into the template's own text and each message's content (ChatTemplate.check)."""
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
        self.template = ChatTemplate(tokenizer, model_name)
        if tokenizer.chat_template:
            self.template.check()

    def check_model(self, model: str) -> None:
        """Raises UnknownModelError unless `model` is empty or the served model's name (any case)."""
        if model and model.lower() != self.model_name.lower():
            raise UnknownModelError(
                f"unknown model {model[:64]!r}{'...' if len(model) > 64 else ''}: this gateway serves "
                f"{self.model_name!r} (or leave model empty)"
            )

    @property
    def renders_tools(self) -> bool:
        """The chat template renders a `tools` list (it names the variable)."""
        return self.template.renders_tools

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
            return self._checked_ids(prompt, messages, chat, token_ids)
        if prompt and messages:
            raise ValueError("send either prompt or messages, not both")
        self._check_size(prompt, messages, tools)
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
        if conversation is None:
            return text_token_ids(self.tokenizer, text)
        return self._chat_ids(conversation, tools)

    def _checked_ids(
        self, prompt: bytes, messages: Sequence[tuple[str, str]], chat: bool, token_ids: Sequence[int]
    ) -> list[int]:
        """prompt_token_ids, sent alone and each in the vocabulary."""
        if prompt or messages or chat:
            raise ValueError("send prompt_token_ids alone: without prompt, messages or chat")
        vocab = len(self.tokenizer)
        if min(token_ids) < 0 or max(token_ids) >= vocab:  # builtins: ~20x a Python loop's speed
            bad = next(t for t in token_ids if not 0 <= t < vocab)
            raise ValueError(f"prompt_token_ids must be in [0, {vocab}), got {bad}")
        return list(token_ids)

    def _check_size(self, prompt: bytes, messages: Sequence[tuple[str, str]], tools: ToolRequest | None) -> None:
        """ValueError for more bytes of text (prompt, contents, the tools' description) than
        max_prompt_bytes, before any of it is tokenized."""
        size = len(prompt) + sum(len(c.encode("utf-8", "surrogatepass")) for _, c in messages)
        if tools is not None:
            size += len(system_text(tools).encode("utf-8", "surrogatepass"))
        if size > self.max_prompt_bytes:
            raise ValueError(
                f"prompt is {size} bytes, more than the context of {self.max_context} tokens can "
                f"hold (at most {self.max_prompt_bytes} bytes); shorten the prompt"
            )

    def _chat_ids(self, conversation: list[dict[str, str]], tools: ToolRequest | None) -> list[int]:
        """Ids of the conversation through the chat template, with the tools rendered by the
        template when it renders tools, else described in the system message."""
        if not self.tokenizer.chat_template:
            raise ValueError(f"model {self.model_name!r} has no chat template; send a plain prompt without chat")
        if tools is None:
            return self.template.token_ids(conversation)
        if not self.renders_tools:  # the tools described in the system message, as content
            shown = with_tools([(m["role"], m["content"]) for m in conversation], tools)
            return self.template.token_ids([{"role": r, "content": c} for r, c in shown])
        self.template.check_tools_text(tools)
        return self.template.token_ids(conversation, tool_schemas(tools))

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
        _check_ranges(temperature, top_p, top_k, n, logprobs, prompt_logprobs)
        try:
            spec = GrammarSpec(*grammar) if grammar is not None else None
        except ValueError as exc:
            raise ValueError(f"grammar: {exc}") from None
        self._check_lengths(len(prompt_token_ids), max_tokens)
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

    def _check_lengths(self, num_prompt: int, max_tokens: int) -> None:
        """ValueError unless the prompt (tokens) and max_tokens fit the context together."""
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


def _check_ranges(
    temperature: float, top_p: float | None, top_k: int, n: int, logprobs: int | None, prompt_logprobs: int | None
) -> None:
    """ValueError naming the first sampling setting out of its range, and the range."""
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
