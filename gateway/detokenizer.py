"""Incremental detokenization: text deltas that never split a multi-byte character.

Follows vLLM's `detokenize_incrementally` / transformers' TextStreamer: decode a short
window of recent tokens twice (with and without the new ones) and emit the difference,
holding back while the window ends in an incomplete UTF-8 sequence (U+FFFD).
"""

from __future__ import annotations


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas.

    `tokenizer` is a transformers tokenizer; special tokens (EOS) produce no text.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        # the window starts at prefix_offset; text up to read_offset was already emitted
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the newly completed text ('' while a character is incomplete)."""
        self.token_ids.extend(token_ids)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end: whatever is still held back (an incomplete character decodes to U+FFFD)."""
        rest = self._decode(self.token_ids[self.prefix_offset :])
        done = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        delta = rest[len(done) :]
        self.read_offset = len(self.token_ids)
        self.text += delta
        return delta


class StopStringMatcher:
    """Cuts the output before the first stop string, holding back only a tail that could
    still grow into one (the longest suffix that is a prefix of some stop string)."""

    def __init__(self, stop: list[str]) -> None:
        self.stop = [s for s in stop if s]
        self.longest = max((len(s) for s in self.stop), default=0)
        self.text = ""
        self.emitted = 0
        self.matched = ""
        """The stop string that was hit ("" until one is)."""

    def _held(self) -> int:
        """Length of the longest tail of the unemitted text that starts a stop string."""
        tail = self.text[self.emitted :]
        for n in range(min(len(tail), self.longest - 1), 0, -1):
            if any(s.startswith(tail[-n:]) for s in self.stop):
                return n
        return 0

    def feed(self, delta: str, final: bool = False) -> tuple[str, bool]:
        """Add decoded text; return (text safe to emit now, whether a stop string was hit)."""
        self.text += delta
        if self.stop:
            search_from = max(0, self.emitted - self.longest + 1)
            hits = [(i, s) for i, s in ((self.text.find(s, search_from), s) for s in self.stop) if i >= 0]
            if hits:
                at, self.matched = min(hits, key=lambda hit: hit[0])
                out = self.text[self.emitted : at]
                self.emitted = at
                return out, True
        end = len(self.text) if final else len(self.text) - self._held()
        out = self.text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return out, False


class TokenText:
    """Each token's own text and bytes, as OpenAI's logprobs show them (`token`, `bytes`).

    Byte-level BPE tokenizers (GPT-2's alphabet: SmolLM2, Llama 3, DeepSeek) give a token's
    exact bytes, a part of a multi-byte character included (its text then carries U+FFFD
    where the part stands, as vLLM shows it); others give the token decoded alone, encoded
    as UTF-8. Special tokens show as their content. Cached per id (a vocabulary's worth at most).
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_of: dict[str, int] | None = None
        if type(decoder).__name__ == "ByteLevel":
            from transformers.convert_slow_tokenizer import bytes_to_unicode

            self._byte_of = {c: b for b, c in bytes_to_unicode().items()}
        self._special = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
        self._cache: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token_id: int) -> tuple[str, bytes]:
        """(text, UTF-8 bytes) of one token id."""
        found = self._cache.get(token_id)
        if found is not None:
            return found
        if token_id in self._special:
            text = self._special[token_id]
            raw = text.encode("utf-8")
        elif self._byte_of is not None:
            piece = self.tokenizer.convert_ids_to_tokens(token_id) or ""
            if all(c in self._byte_of for c in piece):
                raw = bytes(self._byte_of[c] for c in piece)
            else:  # a token outside the byte alphabet (an added normal token): as it reads
                raw = piece.encode("utf-8")
            text = raw.decode("utf-8", "replace")
        else:
            text = self.tokenizer.decode([token_id], clean_up_tokenization_spaces=False)
            raw = text.encode("utf-8")
        self._cache[token_id] = (text, raw)
        return text, raw
