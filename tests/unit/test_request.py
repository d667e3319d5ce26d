"""The one request type both engines use: counters, the finish rule, validation."""

from __future__ import annotations

import pytest

from engine.outcomes import FinishReason
from engine.request import Request, RequestStatus, finish_reason
from engine.sampling_params import SamplingParams


def test_counters_start_from_the_prompt():
    r = Request("r", [5, 6, 7], SamplingParams(seed=3), max_tokens=4)
    assert r.token_ids == [5, 6, 7] and r.num_prompt_tokens == 3 and r.num_tokens == 3
    assert r.num_generated == 0 and r.num_computed_tokens == 0 and r.status is RequestStatus.WAITING
    assert r.sampling.seed == 3
    r.token_ids.append(9)  # the first token: prefill's
    r.num_computed_tokens = 3  # its KV is not computed yet: the gap of one decode always has
    assert (r.num_generated, r.num_tokens, r.last_token) == (1, 4, 9)
    r.token_ids.append(1)  # appending never touches the prompt
    assert r.prompt_token_ids == [5, 6, 7]


def test_a_decode_reservation_knows_its_prompts_length_before_its_tokens():
    r = Request("r", num_prompt_tokens=10, max_tokens=7, status=RequestStatus.RESERVED)
    assert r.num_prompt_tokens == 10 and r.token_ids == [] and r.status is RequestStatus.RESERVED


def test_bad_counts_are_refused_with_what_to_change():
    with pytest.raises(ValueError, match=r"\[r\] the prompt's tokens and max_tokens must be >= 1, got 0, 1"):
        Request("r")
    with pytest.raises(ValueError, match="got 2, 0"):
        Request("r", [1, 2], max_tokens=0)


def test_the_finish_rule_counts_the_first_token_and_lets_a_stop_id_win():
    assert finish_reason(2, 1, 4, {2}) is FinishReason.STOP
    assert finish_reason(2, 4, 4, {2}) is FinishReason.STOP  # the last allowed token is EOS: stopped
    assert finish_reason(3, 4, 4, {2}) is FinishReason.LENGTH
    assert finish_reason(3, 3, 4, {2}) is None
    r = Request("r", [1], max_tokens=3, stop_token_ids=frozenset({0}))
    r.token_ids.append(10)  # 1 generated
    assert r.finish_reason_after(10) is None  # the last appended token
    assert r.finish_reason_after(11, 1) is None and r.finish_reason_after(12, 2) is FinishReason.LENGTH
    assert r.finish_reason_after(0, 1) is FinishReason.STOP


def test_done_means_finished_or_aborted():
    r = Request("r", [1])
    done = {s for s in RequestStatus if Request("x", [1], status=s).is_done}
    assert done == {RequestStatus.FINISHED, RequestStatus.ABORTED} and not r.is_done
