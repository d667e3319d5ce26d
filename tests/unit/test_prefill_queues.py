"""The gateway's fluid model of the prefill work it routed (kvmesh.gateway.prefill_queues): a
queue first come first served on cores of its own, instances of one core group computing their
jobs in the order they were routed, between their decode steps, first tokens setting the model
right. The expected finish times are worked out by hand from the rule in the module's
docstring."""

from __future__ import annotations

import pytest

from kvmesh.gateway.instance_load import InstanceLoad
from kvmesh.gateway.prefill_queues import PrefillQueues

FIT = (0.0, 0.0, 0.001, 0.0)  # 1 ms a token


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _prefill(address: str, group: str = "", forward_tokens: int = 0) -> InstanceLoad:
    return InstanceLoad(address, prefill_fit=FIT, core_group=group, max_forward_tokens=forward_tokens)


def test_on_cores_of_its_own_a_queue_is_first_come_first_served_and_drains_with_time():
    clock = Clock()
    a, b = _prefill("a"), _prefill("b")
    queues = PrefillQueues([a, b], [], clock)
    queues.add(a, 2.0)
    queues.add(a, 1.0)
    queues.add(b, 5.0)  # b's work does not slow a: each has its own cores
    assert queues.finish_s(a, 0.5) == pytest.approx((3.5, 1.0))
    clock.now += 2.5  # the first job is served out, half of the second
    assert queues.finish_s(a, 0.5) == pytest.approx((1.0, 1.0))
    clock.now += 10.0  # all served out: an idle instance
    assert queues.finish_s(a, 0.5) == pytest.approx((0.5, 1.0))


def test_instances_of_one_core_group_compute_their_jobs_in_the_order_they_were_routed():
    clock = Clock()
    a, b = _prefill("a", "host:/share"), _prefill("b", "host:/share")
    queues = PrefillQueues([a, b], [], clock)
    queues.add(a, 2.0)
    clock.now += 0.5  # a's job computes alone: 1.5 s left
    queues.add(b, 1.0)
    # b's job waits for a's (routed first) to end at 1.5 s, then computes: 2.5 s. Sharing the
    # cores a forward each in turn, it would end at 2 s (1 s at half speed) and a's at 2.5 s
    assert queues.finish_s(b, 0.0) == pytest.approx((2.5, 1.0))
    # a new job at a goes after b's, though a's queue is empty once its job ends: 3.5 s
    assert queues.finish_s(a, 1.0) == pytest.approx((3.5, 1.0))
    clock.now += 2.0  # a's job done at 1.5 s, b's computed 0.5 s since
    assert queues.finish_s(a, 1.0) == pytest.approx((1.5, 1.0))
    other = PrefillQueues([a, _prefill("b", "other:/share")], [], clock)
    other.add(a, 2.0)
    other.add(other.prefills[1], 1.0)
    assert other.finish_s(a, 1.0) == pytest.approx((3.0, 1.0))  # another host's cores: beside it
    assert other.finish_s(other.prefills[1], 1.0) == pytest.approx((2.0, 1.0))


def test_decode_steps_of_the_group_take_their_share_between_forwards():
    clock = Clock()
    a = _prefill("a", "host:/share", forward_tokens=256)  # a forward: 0.256 s
    busy = InstanceLoad("d1", decode_compute_fit=(0.05, 0.01, 0.0), core_group="host:/share", in_flight_requests=3)
    idle = InstanceLoad("d2", decode_compute_fit=(0.05, 0.01, 0.0), core_group="host:/share")
    elsewhere = InstanceLoad("d3", decode_compute_fit=(0.5, 0.0, 0.0), core_group="far:/share", in_flight_requests=2)
    queues = PrefillQueues([a], [busy, idle, elsewhere], clock)
    share = 0.256 / (0.256 + 0.05 + 0.03)  # d1's step (0.08 s) after each forward; d2 has no requests
    assert queues.finish_s(a, 1.0) == pytest.approx((1.0 / share, share))
    busy.in_flight_requests = 0  # decode idle: the forwards have the cores
    assert queues.finish_s(a, 1.0) == pytest.approx((1.0, 1.0))


def test_a_first_token_ends_its_job_and_those_ahead_and_a_late_one_gives_service_back():
    clock = Clock()
    a = _prefill("a")
    queues = PrefillQueues([a], [], clock)
    first, second, third = queues.add(a, 2.0), queues.add(a, 2.0), queues.add(a, 2.0)
    clock.now += 1.0
    queues.done(a, second)  # sooner than the model: the first and the second are done
    assert queues.finish_s(a, 0.0) == pytest.approx((2.0, 1.0))  # the third, whole (its turn starts now)
    clock.now += 1.5
    fourth = queues.add(a, 2.0)
    clock.now += 1.5  # the model served the third out at 103.0, and the fourth 1 s since
    queues.done(a, third, push_s=0.6)  # its compute ended at 103.4: 0.4 s later than the model's
    assert queues.finish_s(a, 0.0) == pytest.approx((1.4, 1.0))  # the fourth gets 0.4 s back
    queues.done(a, first)  # long gone: nothing changes
    assert queues.finish_s(a, 0.0) == pytest.approx((1.4, 1.0))
    clock.now += 1.4
    queues.done(a, fourth)
    assert queues.finish_s(a, 1.0) == pytest.approx((1.0, 1.0))


def test_a_short_job_behind_a_waiting_one_shares_its_forward_while_the_forward_has_room():
    # forwards of 256 tokens: a computes j1 (the head); j2 (100 tokens) waits, so j3 (100) would
    # be taken with it into one batch (kvmesh.prefill_svc.pending.take) and pay no forward, j4
    # (100 more) would not fit that forward; behind the head alone nothing waits to join
    clock = Clock()
    a = _prefill("a", forward_tokens=256)
    queues = PrefillQueues([a], [], clock)
    queues.add(a, 1.0, 100)
    assert not queues.joins_batch(a, 100)  # the head's batch computes already
    queues.add(a, 1.0, 100)
    assert queues.joins_batch(a, 100)
    assert not queues.joins_batch(a, 200)  # 300 tokens: past the forward
    queues.add(a, 0.1, 100, joined=True)
    assert not queues.joins_batch(a, 100)  # 100 + 100 + 100 in the waiting batch: full
    clock.now += 1.5  # j1 served out, j2 and j3's batch computes now
    assert not queues.joins_batch(a, 10)
    unbounded = _prefill("b")
    queues = PrefillQueues([unbounded], [], clock)
    queues.add(unbounded, 1.0, 10)
    queues.add(unbounded, 1.0, 10)
    assert not queues.joins_batch(unbounded, 10)  # the batch bound is not known: never


def test_a_prompt_s_compute_counts_its_forwards_and_none_when_it_joins_a_waiting_batch():
    from kvmesh.gateway.predictor import LatencyPredictor

    fit = (0.05, 0.01, 0.001, 0.0)  # 50 ms a forward, 10 ms a request, 1 ms a token
    clock = Clock()
    a = InstanceLoad("a", prefill_fit=fit, max_forward_tokens=256)
    predictor = LatencyPredictor(16, [a], [])
    predictor.queues = PrefillQueues([a], [], clock)
    long = predictor.ttft(a, 600, 0)  # 3 forwards of at most 256 tokens
    assert long is not None and long.compute_s == pytest.approx(3 * 0.05 + 0.01 + 0.6)
    predictor.commit(a, long)
    waiting = predictor.ttft(a, 64, 0)
    assert waiting is not None and not waiting.joins_batch
    assert waiting.compute_s == pytest.approx(0.05 + 0.01 + 0.064)
    predictor.commit(a, waiting)
    joining = predictor.ttft(a, 64, 0)
    assert joining is not None and joining.joins_batch
    assert joining.compute_s == pytest.approx(0.01 + 0.064)  # the waiting batch's forward
    assert joining.queue_s == pytest.approx(long.compute_s + waiting.compute_s)
