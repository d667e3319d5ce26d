# B=rows of a step, V=vocab, W=ceil(V / 32) words of a token bitmask
"""Structured output: a grammar the answer must follow, as a mask on each sampled token.

xgrammar (the grammar engine vLLM and SGLang use; Dong et al. 2024, "XGrammar: Flexible and
Efficient Structured Generation Engine") compiles a JSON schema, the JSON grammar, a regex or
an EBNF grammar against the model's tokenizer; a `GrammarMatcher` follows the tokens of one
answer and fills, before each token, the bitmask of the tokens that keep the answer inside the
grammar. The mask is applied to the logits before sampling wherever a token is sampled: the
first token on prefill, the rest on decode (whose matcher is rebuilt from the prompt's grammar
and the first token), and each speculative verification row with the drafts before it
accepted (`fill_draft_masks`). Once the grammar is complete only the stop tokens are allowed,
so the answer ends there.

`kvmesh.engine.sampling_params.GrammarSpec` is plain data (it rides in SamplingParams); `Grammars`
compiles specs for one tokenizer, with a cache, and checks them (prefill refuses a spec that
does not compile or that no text can match before it queues the request); a request carries
its matcher as a `GrammarState`.
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvmesh.engine.sampling_params import GrammarSpec


class Grammars:
    """Compiles GrammarSpecs against one tokenizer (xgrammar), cached, and makes matchers.

    tokenizer: a transformers tokenizer; vocab_size: the model's logits width (>= the
    tokenizer's ids); stop_token_ids: the tokens that end an answer once the grammar is
    complete (the model's EOS ids). Thread-safe.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=self.stop_token_ids)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._lock = threading.Lock()

    @functools.lru_cache(maxsize=256)  # noqa: B019 (one Grammars per process, alive as long)
    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar (xgrammar.CompiledGrammar). Raises ValueError naming what is
        wrong: a schema that is not JSON or not a schema xgrammar supports, a regex that does
        not parse, choices that are not a non-empty list of strings."""
        try:
            with self._lock:
                if spec.kind == "json_object":  # any object (not any JSON value), additional keys allowed
                    return self._compiler.compile_json_schema(
                        '{"type": "object"}', any_whitespace=False, strict_mode=False
                    )
                if spec.kind == "json_schema":  # JSON, with keywords it enforces: GrammarSpec checked it
                    return self._compiler.compile_json_schema(spec.spec, any_whitespace=False, strict_mode=True)
                if spec.kind == "regex":
                    return self._compiler.compile_regex(spec.spec)
                try:
                    choices = json.loads(spec.spec)
                except ValueError:
                    choices = None
                if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
                    raise ValueError("choice must be a non-empty list of strings")
                return self._compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in choices))
        except ValueError:
            raise
        except Exception as exc:  # xgrammar reports bad input as RuntimeError
            raise ValueError(f"the {spec.kind} does not compile: {_reason(exc)}") from None

    def matcher(self, spec: GrammarSpec) -> Any:
        """A fresh xgrammar.GrammarMatcher at the answer's start (rollback without a bound, for
        speculative drafts). Raises ValueError as `compile`."""
        return self._xgr.GrammarMatcher(self.compile(spec), max_rollback_tokens=-1)

    def check(self, spec: GrammarSpec) -> None:
        """Raises ValueError when the spec does not compile or allows no first token (a regex
        that matches nothing)."""
        mask = self.new_bitmask(1)
        self.matcher(spec).fill_next_token_bitmask(mask, 0)
        if not bool((mask != 0).any()):
            raise ValueError(f"the {spec.kind} matches no text: no token can start the answer")

    def new_bitmask(self, rows: int) -> torch.Tensor:
        """A bitmask for `rows` rows: [rows, W] int32 on the CPU, every token allowed."""
        return self._xgr.allocate_token_bitmask(rows, self.vocab_size)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        """Set the disallowed tokens' logits of `rows` to -inf, in place. logits [B, V] fp32 on
        any device; bitmask [len(rows), W] int32 on the CPU, row i for logits row rows[i].
        A row whose mask allows nothing (a grammar at a dead end) allows the stop tokens, so
        the answer ends instead of sampling from nothing."""
        for i in range(bitmask.shape[0]):
            if not bool((bitmask[i] != 0).any()):
                for t in self.stop_token_ids:
                    bitmask[i, t // 32] |= 1 << (t % 32)
        if logits.device.type == "cpu":  # numpy, one thread: no OpenMP team woken on shared cores
            V = logits.shape[-1]
            words = bitmask.numpy().view(np.uint8)  # little-endian int32 words: bit t of the row is token t
            allowed = np.unpackbits(words, axis=-1, bitorder="little")[:, :V].astype(bool)  # [rows, V]
            values = logits.detach().numpy()
            for i, row in enumerate(rows):
                values[row, ~allowed[i]] = -np.inf
            return
        with torch.inference_mode():  # the step's logits are inference tensors
            device_mask = bitmask.to(logits.device, non_blocking=True)
            index = list(rows)
            view = logits[index]
            self._xgr.apply_token_bitmask_inplace(view, device_mask, vocab_size=logits.shape[-1])
            logits[index] = view


@dataclass
class GrammarState:
    """One answer's place in its grammar: the matcher following its tokens, and the Grammars
    that made it (its vocabulary and stop tokens)."""

    grammars: Grammars
    matcher: Any

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """The next token's mask into bitmask row `row`."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, tokens: Sequence[int]) -> bool:
        """Advance over the answer's new tokens; False when the grammar refuses one (the rest
        are not taken)."""
        return all(self.matcher.accept_token(t) for t in tokens)

    def advance(self, tokens: list[int]) -> tuple[list[int], bool]:
        """Advance over a step's kept tokens: (the ones the answer keeps, whether it ends). It
        ends at a token the grammar refuses (not kept) or at its stop token (kept): a step
        with speculative drafts may have sampled past either."""
        for i, t in enumerate(tokens):
            if not self.matcher.accept_token(t):
                return tokens[:i], True
            if self.matcher.is_terminated():
                return tokens[: i + 1], True
        return tokens, False


def fill_draft_masks(matcher: Any, drafts: Sequence[int], bitmask: torch.Tensor, first_row: int) -> None:
    """The masks of one sequence's verification rows (first_row .. first_row + len(drafts)):
    row j's is the mask after drafts[:j] are accepted, since verification reads row j only when
    those drafts were kept. The matcher ends where it began (tentative drafts rolled back). A
    draft the grammar refuses ends the run: the later rows repeat its row's mask (verification
    stops at that draft, which the mask excludes)."""
    accepted = 0
    for j in range(len(drafts) + 1):
        matcher.fill_next_token_bitmask(bitmask, first_row + j)
        if j == len(drafts):
            break
        if not matcher.accept_token(drafts[j]):
            for later in range(j + 1, len(drafts) + 1):
                bitmask[first_row + later] = bitmask[first_row + j]
            break
        accepted += 1
        if matcher.is_terminated():  # a drafted stop token: nothing follows it (the answer ends there)
            for later in range(j + 1, len(drafts) + 1):
                bitmask[first_row + later] = bitmask[first_row + j]
            break
    if accepted:
        matcher.rollback(accepted)


def _reason(exc: Exception) -> str:
    """xgrammar's message without its C++ source location."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "] " in text and text.startswith("["):
        text = text.split("] ", 1)[1]
    if ": " in text and ".cc:" in text.split(": ", 1)[0]:
        text = text.split(": ", 1)[1]
    return text[:300]
