"""Structured output's grammar layer (engine/grammar.py) on the default model's real tokenizer,
checked against xgrammar's own matcher stepping token by token."""

from __future__ import annotations

import json

import pytest
import torch

from kvmesh.engine.checkpoint import load_tokenizer
from kvmesh.engine.grammar import Grammars, GrammarState, fill_draft_masks
from kvmesh.engine.loader import load_config, resolve_model
from kvmesh.engine.sampling_params import GrammarSpec

SCHEMA = {
    "type": "object",
    "properties": {"colour": {"enum": ["red", "green"]}, "bright": {"type": "boolean"}},
    "required": ["colour", "bright"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def grammars():
    files = resolve_model(None)
    config = load_config(files)
    return Grammars(load_tokenizer(files), config.vocab_size, sorted(config.eos_token_ids)), load_tokenizer(files)


def _allowed(grammars: Grammars, state: GrammarState) -> set[int]:
    mask = grammars.new_bitmask(1)
    state.fill(mask, 0)
    logits = torch.zeros(1, grammars.vocab_size)
    grammars.apply(logits, mask, [0])
    return set(torch.nonzero(logits[0] > float("-inf")).flatten().tolist())


def test_a_schema_s_mask_allows_only_its_text_and_then_only_the_stop_token(grammars):
    g, tok = grammars
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    state = GrammarState(g, g.matcher(spec))
    first = _allowed(g, state)
    assert first and all(tok.decode([t]).startswith("{") for t in first)
    text = '{"colour": "red", "bright": true}'
    ids = tok.encode(text, add_special_tokens=False)
    # the schema's own text is accepted token by token (xgrammar's matcher is the reference)
    for t in ids:
        assert t in _allowed(g, state)
        assert state.accept([t])
    assert _allowed(g, state) == set(g.stop_token_ids)  # complete: only the stop token is left
    assert state.accept(g.stop_token_ids[:1]) and state.matcher.is_terminated()
    # a token outside the grammar is refused
    fresh = GrammarState(g, g.matcher(spec))
    assert not fresh.accept(tok.encode("Hello", add_special_tokens=False))


def test_draft_rows_get_the_mask_after_the_drafts_before_them_and_the_matcher_stays(grammars):
    g, tok = grammars
    spec = GrammarSpec("choice", json.dumps(["yes indeed", "no"]))
    state = GrammarState(g, g.matcher(spec))
    drafts = tok.encode("yes indeed", add_special_tokens=False)
    masks = g.new_bitmask(len(drafts) + 1)
    fill_draft_masks(state.matcher, drafts, masks, 0)
    # row j is the mask of a matcher that accepted drafts[:j]: stepping a fresh one gives the same
    stepper = g.matcher(spec)
    for j in range(len(drafts) + 1):
        want = g.new_bitmask(1)
        stepper.fill_next_token_bitmask(want, 0)
        assert torch.equal(masks[j], want[0]), j
        if j < len(drafts):
            assert stepper.accept_token(drafts[j])
    assert torch.equal(masks[-1], _stop_mask(g))  # after the whole choice: the stop token only
    # the matcher was rolled back: it still starts the answer
    assert state.accept(drafts[:1])
    # a refused draft repeats its row's mask for the rows after it
    bad = [drafts[0], tok.encode("xyz", add_special_tokens=False)[0], drafts[-1]]
    fresh = g.matcher(spec)
    masks = g.new_bitmask(4)
    fill_draft_masks(fresh, bad, masks, 0)
    assert torch.equal(masks[2], masks[1]) and torch.equal(masks[3], masks[1])
    # a drafted stop token ends the run: no mask is asked of a finished matcher, and the step's
    # tokens are cut after it (GrammarState.advance)
    eos = g.stop_token_ids[0]
    through_stop = [*drafts, eos, drafts[0]]
    masks = g.new_bitmask(len(through_stop) + 1)
    fill_draft_masks(g.matcher(spec), through_stop, masks, 0)
    assert torch.equal(masks[-1], masks[len(drafts)])
    kept, ended = GrammarState(g, g.matcher(spec)).advance(through_stop)
    assert kept == [*drafts, eos] and ended
    kept, ended = GrammarState(g, g.matcher(spec)).advance([drafts[0], bad[1]])
    assert kept == [drafts[0]] and ended


def _stop_mask(g: Grammars) -> torch.Tensor:
    mask = torch.zeros_like(g.new_bitmask(1)[0])
    for t in g.stop_token_ids:
        mask[t // 32] |= 1 << (t % 32)
    return mask


@pytest.mark.parametrize(
    "kind,spec,message",
    [
        ("json_schema", "{not json", "not JSON"),
        ("json_schema", json.dumps({"type": "nonsense"}), "does not compile"),
        ("regex", "a(", "does not compile"),
        ("regex", "[^\\s\\S]", "matches no text"),
        ("choice", json.dumps([]), "non-empty list of strings"),
    ],
)
def test_bad_grammars_say_what_is_wrong(grammars, kind, spec, message):
    g, _ = grammars
    with pytest.raises(ValueError, match=message):
        g.check(GrammarSpec(kind, spec))


def test_a_dead_end_allows_the_stop_tokens_so_the_answer_ends():
    # a mask that allows nothing would leave nothing to sample from
    g = Grammars.__new__(Grammars)
    g.stop_token_ids, g.vocab_size = [3], 40
    import xgrammar as xgr

    g._xgr = xgr
    logits = torch.zeros(2, 40)
    mask = torch.zeros(1, 2, dtype=torch.int32)
    g.apply(logits, mask, [1])
    assert torch.isinf(logits[1]).sum() == 39 and logits[1, 3] == 0 and not torch.isinf(logits[0]).any()
    with pytest.raises(ValueError, match="grammar kind"):
        GrammarSpec("yaml")


@pytest.mark.parametrize(
    "schema,words",
    [
        ({"type": "array", "contains": {"const": 42}}, "'contains'"),
        ({"not": {"type": "string"}}, "'not'"),
        ({"if": {"type": "string"}, "then": {"maxLength": 3}}, "'if'"),
        ({"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}, "'uniqueItems' at schema.properties.a"),
        ({"$ref": "https://example.com/schema.json"}, "local \\$refs"),
        ({"anyOf": [{"type": "string"}, {"oneOf": []}]}, "'oneOf'"),
    ],
)  # fmt: skip
def test_a_json_schema_keyword_the_grammar_would_not_enforce_is_refused(schema, words):
    with pytest.raises(ValueError, match=words):
        GrammarSpec("json_schema", json.dumps(schema))
    nested: dict = {"type": "string"}
    for _ in range(70):
        nested = {"type": "array", "items": nested}
    with pytest.raises(ValueError, match="nests more than"):
        GrammarSpec("json_schema", json.dumps(nested))
    with pytest.raises(ValueError, match="takes no spec"):
        GrammarSpec("json_object", "{}")


def test_json_object_is_any_object_never_another_json_value(grammars):
    g, tok = grammars
    state = GrammarState(g, g.matcher(GrammarSpec("json_object")))
    first = _allowed(g, state)
    assert first and all(tok.decode([t]).lstrip().startswith("{") for t in first)
    assert not (first & set(tok.encode("[", add_special_tokens=False)))
