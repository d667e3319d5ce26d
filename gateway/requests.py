"""Turning a client request into token ids and checked sampling settings.

Every error here is one the caller can fix, raised as ValueError with a message that
says what to change; the servicer maps it to INVALID_ARGUMENT.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from engine.sampler import SamplingParams


CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})


@dataclass(frozen=True)
class GenerateInput:
    """A validated request: prompt token ids and how to generate."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    seed: int
    max_tokens: int
    stop: tuple[str, ...]
    ignore_eos: bool


class PromptBuilder:
    """Tokenizes prompts (optionally through the chat template) and checks the limits."""

    def __init__(self, tokenizer, model_name: str, max_context: int, default_max_tokens: int,
                 max_tokens_limit: int) -> None:
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

    def check_model(self, model: str) -> None:
        if model and model.lower() != self.model_name.lower():
            raise ValueError(f"unknown model {model!r}: this gateway serves {self.model_name!r} (or leave model empty)")

    def tokenize(self, prompt: bytes, messages: Sequence[tuple[str, str]], chat: bool,
                 token_ids: Sequence[int] = ()) -> list[int]:
        """Token ids of the prompt; messages (role, content) or chat=True use the chat template;
        token_ids, when given, are the prompt as it is (each checked against the vocabulary)."""
        if token_ids:
            if prompt or messages or chat:
                raise ValueError("send prompt_token_ids alone: without prompt, messages or chat")
            vocab = len(self.tokenizer)
            bad = next((t for t in token_ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise ValueError(f"prompt_token_ids must be in [0, {vocab}), got {bad}")
            return list(token_ids)
        if prompt and messages:
            raise ValueError("send either prompt or messages, not both")
        size = len(prompt) + sum(len(c.encode("utf-8", "surrogatepass")) for _, c in messages)
        if size > self.max_prompt_bytes:
            raise ValueError(f"prompt is {size} bytes, more than the context of {self.max_context} tokens can "
                             f"hold (at most {self.max_prompt_bytes} bytes); shorten the prompt")
        bad_roles = sorted({r for r, _ in messages} - CHAT_ROLES)
        if bad_roles:
            raise ValueError(f"message roles must be one of {sorted(CHAT_ROLES)}, got {bad_roles}")
        try:
            text = prompt.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"prompt is not valid UTF-8 (bad byte at offset {exc.start}); send UTF-8 text") from None
        if messages:
            conversation = [{"role": r, "content": c} for r, c in messages]
        elif not text.strip():
            raise ValueError("prompt is empty; send some text")
        else:
            conversation = [{"role": "user", "content": text}] if chat else None
        if conversation is not None:
            if not self.tokenizer.chat_template:
                raise ValueError(f"model {self.model_name!r} has no chat template; send a plain prompt without chat")
            ids = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return list(ids)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def build(self, request_id: str, prompt_token_ids: list[int], temperature: float, top_p: float | None,
              top_k: int, max_tokens: int | None, seed: int | None, stop: Sequence[str],
              ignore_eos: bool) -> GenerateInput:
        """Check sampling settings and lengths; raises ValueError naming what to change."""
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
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt is empty after tokenization; send some text")
        if n >= self.max_context:
            raise ValueError(f"prompt has {n} tokens but the context holds {self.max_context}; shorten the prompt")
        if n + max_tokens > self.max_context:
            raise ValueError(f"prompt ({n} tokens) + max_tokens ({max_tokens}) exceeds the context of "
                             f"{self.max_context} tokens; lower max_tokens to {self.max_context - n} or less")
        sampling = SamplingParams(temperature=temperature, top_p=1.0 if top_p is None else top_p, top_k=top_k,
                                  seed=seed)
        return GenerateInput(request_id=request_id, prompt_token_ids=tuple(prompt_token_ids), sampling=sampling,
                             seed=seed if seed is not None else random.getrandbits(63), max_tokens=max_tokens,
                             stop=tuple(s for s in stop if s), ignore_eos=ignore_eos)
