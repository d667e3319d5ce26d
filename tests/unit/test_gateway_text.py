"""Incremental detokenization and stop strings, on the real tokenizer."""

from __future__ import annotations

import pytest

from kvmesh.engine.checkpoint import load_tokenizer
from kvmesh.engine.loader import resolve_model
from kvmesh.gateway.detokenizer import IncrementalDetokenizer, StopStringMatcher, TokenText


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model(None))


@pytest.mark.parametrize(
    "text", ["Paris is the capital of France.", "naïve café — 東京タワー 🎉🎉 ok", "emoji 👩‍👩‍👧 and math ∑ x²"]
)
def test_one_token_at_a_time_rebuilds_the_text_without_broken_characters(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add([i]) for i in ids] + [detok.flush()]
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    # no delta ever carries a replacement character from a split multi-byte sequence
    assert all("\ufffd" not in d for d in deltas)
    # multi-byte characters span several byte-level tokens: some steps emit nothing
    if any(ord(c) > 127 for c in text):
        assert "" in deltas[:-1]


def test_eos_adds_no_text(tokenizer):
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.add(tokenizer.encode("Hi", add_special_tokens=False)) == "Hi"
    assert detok.add([tokenizer.convert_tokens_to_ids("<|im_end|>")]) == ""


def test_stop_string_cuts_before_it_and_holds_back_partial_matches():
    m = StopStringMatcher(["STOP"])
    assert m.feed("Hello ST") == ("Hello ", False)  # "ST" might start STOP: held back
    assert m.feed("O") == ("", False)
    assert m.feed("P and more") == ("", True)  # cut right before STOP
    m = StopStringMatcher(["STOP"])
    assert m.feed("a ST") == ("a ", False)
    assert m.feed("AR") == ("STAR", False)  # not a stop string after all: released
    m = StopStringMatcher(["\n\n", "END"])
    assert m.feed("a\n") == ("a", False)
    assert m.feed("b", final=True) == ("\nb", False)  # at the end everything held is released


def test_no_stop_strings_streams_everything():
    m = StopStringMatcher([])
    assert m.feed("abc") == ("abc", False)


def test_prompt_token_ids_pass_through_checked(tokenizer):
    from kvmesh.gateway.requests import PromptBuilder

    b = PromptBuilder(tokenizer, "m", 2048, 16, 64)
    ids = tokenizer.encode("Paris is the capital of France.", add_special_tokens=False)
    # a pre-tokenized prompt is the same tokens the text gives
    assert b.tokenize(b"", [], False, ids) == b.tokenize(b"Paris is the capital of France.", [], False)
    with pytest.raises(ValueError, match=r"prompt_token_ids must be in \[0, 49152\), got 49152"):
        b.tokenize(b"", [], False, [5, len(tokenizer)])
    with pytest.raises(ValueError, match="alone"):
        b.tokenize(b"hi", [], False, [5])
    with pytest.raises(ValueError, match="alone"):
        b.tokenize(b"", [], True, [5])


def test_each_token_s_bytes_put_together_are_the_text_even_split_characters(tokenizer):
    # OpenAI's logprobs `bytes`: a character split over tokens (CJK, emoji) is rebuilt from them
    text = "Grüße, 日本語 and 🙂!\n"
    ids = tokenizer.encode(text, add_special_tokens=False)
    token_text = TokenText(tokenizer)
    pieces = [token_text(i) for i in ids]
    assert b"".join(raw for _, raw in pieces).decode() == text
    assert any("\ufffd" in t for t, _ in pieces)  # a token holding part of a character shows U+FFFD
    assert all(t == raw.decode() for t, raw in pieces if "\ufffd" not in t)
    eos = tokenizer.eos_token_id
    assert token_text(eos) == (tokenizer.eos_token, tokenizer.eos_token.encode())


def test_n_choices_end_on_their_own_and_a_stop_string_ends_one_while_decode_goes_on(tokenizer):
    from kvmesh.engine.sampling_params import SamplingParams
    from kvmesh.gateway.answer import Answer
    from kvmesh.gateway.requests import GenerateInput
    from kvmesh.protos.v1 import common_pb2, decode_pb2, prefill_pb2

    ids = {w: tokenizer.encode(w, add_special_tokens=False) for w in (" red", " green", " blue", " sky")}
    inp = GenerateInput("r", (1, 2, 3), SamplingParams(n=2, seed=1), 10, (" blue",), False)
    answer = Answer(tokenizer, inp, frozenset({2}), arrived=0.0, waited=0.0, retries=0)
    first = answer.first(
        prefill_pb2.PrefillResponse(first_token=ids[" red"][0], choice_first_tokens=[ids[" red"][0], ids[" green"][0]])
    )
    assert [(d.delta.index, d.delta.text) for d in first] == [(0, " red"), (1, " green")]
    # choice 0 reaches the stop string: it ends here, the text before it
    hit = answer.add(decode_pb2.DecodeResponse(token_ids=ids[" blue"], index=0))
    assert hit is not None and hit.delta.text == "" and answer.finish is None
    # decode, which matches no text, goes on with choice 0: those tokens are dropped
    assert answer.add(decode_pb2.DecodeResponse(token_ids=ids[" sky"], index=0)) is None
    more = answer.add(
        decode_pb2.DecodeResponse(token_ids=ids[" sky"], index=1, finish_reason=common_pb2.FINISH_REASON_LENGTH)
    )
    assert more.delta.index == 1 and more.delta.text == " sky" and answer.finish is not None
    final = answer.final(prefill_pb2.PrefillResponse(), decode_pb2.ReserveResponse()).final
    assert list(final.choice_finish) == [common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH]
    assert final.finish_reason == "stop" and list(final.choice_generated_tokens) == [
        1 + len(ids[" blue"]),
        1 + len(ids[" sky"]),
    ]
