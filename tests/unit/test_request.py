"""The one request type both engines use: counters, the finish rule, validation."""

from __future__ import annotations

import pytest

from kvmesh.engine.outcomes import FinishReason
from kvmesh.engine.request import Request, RequestStatus, finish_reason
from kvmesh.engine.sampling_params import SamplingParams


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


def test_a_decode_request_starts_after_prefills_token_and_keeps_a_step_up_to_its_finish():
    r = Request("r", num_prompt_tokens=3, max_tokens=5, status=RequestStatus.RESERVED)
    with pytest.raises(ValueError, match="prompt has 2 tokens, reserved 3"):
        r.start_decoding([5, 6], 9, SamplingParams(), frozenset({2}), lambda tokens, end, logprobs: None)
    r.start_decoding([5, 6, 7], 9, SamplingParams(), frozenset({2}), lambda tokens, end, logprobs: None)
    # the prompt's KV landed: 3 computed, the first token (9) still without KV
    assert (r.token_ids, r.num_computed_tokens, r.num_cached_tokens, r.finish) == ([5, 6, 7, 9], 3, 3, None)
    assert r.append_tokens([4, 1]) == [4, 1] and r.num_computed_tokens == 5 and r.finish is None
    # a speculative step kept 3 tokens; the stop id (2) ends the answer, what follows it is dropped
    assert r.append_tokens([8, 2, 3]) == [8, 2] and r.finish is FinishReason.STOP
    assert r.token_ids == [5, 6, 7, 9, 4, 1, 8, 2] and r.num_computed_tokens == 7
