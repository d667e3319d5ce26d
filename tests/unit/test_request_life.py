"""The gateway's request life pieces, each alone: circuit breaker, admission queue, one
attempt's accounting and release (the pool and decode stubs are test doubles here)."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.engine.outcomes import FailureCause
from kvmesh.gateway.accounting import Stage
from kvmesh.gateway.admission import AdmissionQueue, OverloadedError
from kvmesh.gateway.attempt import Attempt
from kvmesh.gateway.breaker import BreakerState, CircuitBreaker
from kvmesh.gateway.failure import RequestFailed
from kvmesh.gateway.router import InstanceLoad, pick_decode


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_breaker_opens_after_three_failures_then_lets_one_probe_through():
    clock = Clock()
    b = CircuitBreaker(failure_threshold=3, cooldown_s=5.0, clock=clock)
    b.record_failure()
    b.record_failure()
    assert b.allows() and b.state == BreakerState.CLOSED
    b.record_failure()
    assert b.state == BreakerState.OPEN and not b.allows()
    clock.t += 4.9
    assert not b.allows()
    clock.t += 0.2  # cool-down over: exactly one probe may go
    assert b.allows()
    b.on_routed()
    assert b.state == BreakerState.HALF_OPEN and not b.allows()
    b.record_failure()  # the probe failed: open again, for twice as long
    assert b.state == BreakerState.OPEN
    clock.t += 5.1
    assert not b.allows()
    clock.t += 5.0
    b.on_routed()
    b.record_success()
    assert b.state == BreakerState.CLOSED and b.allows() and b.consecutive_failures == 0


def test_breaker_probe_that_ends_for_no_fault_of_the_instance_frees_the_probe():
    clock = Clock()
    b = CircuitBreaker(failure_threshold=1, cooldown_s=1.0, clock=clock)
    b.record_failure()
    clock.t += 1.5
    b.on_routed()
    assert not b.allows()
    b.record_neutral()  # the client cancelled the probe
    assert b.allows() and b.state == BreakerState.HALF_OPEN


def test_a_success_resets_the_count_of_failures_in_a_row():
    b = CircuitBreaker(failure_threshold=3)
    b.record_failure()
    b.record_failure()
    b.record_success()
    b.record_failure()
    b.record_failure()
    assert b.state == BreakerState.CLOSED


def test_pick_decode_skips_open_circuits_and_full_instances():
    full, open_, free = (
        InstanceLoad("full", max_requests=2, in_flight_requests=2),
        InstanceLoad("open"),
        InstanceLoad("free", in_flight_requests=1, max_requests=8),
    )
    for _ in range(3):
        open_.breaker.record_failure()
    assert pick_decode([full, open_, free], 0).address == "free"
    with pytest.raises(LookupError):
        pick_decode([open_], 0)


def test_admission_is_first_come_first_served_and_bounded():
    async def scenario():
        capacity = [2]
        q = AdmissionQueue(lambda: capacity[0], max_queued_requests=3, max_queued_tokens=100, max_queue_time_s=30)
        assert await q.admit(10) == 0.0 and await q.admit(10) == 0.0  # two slots: in at once
        order = []

        async def wait(name, tokens):
            await q.admit(tokens)
            order.append(name)

        waiters = [asyncio.ensure_future(wait(n, 30)) for n in "abc"]
        await asyncio.sleep(0)
        assert q.num_queued == 3 and q.queued_tokens == 90
        with pytest.raises(OverloadedError, match="queue is full") as err:
            await q.admit(1)  # a fourth waiter is past the request bound
        assert err.value.retry_after_s >= 1
        q.done()  # a slot frees: the first in line gets it, not a later arrival
        await asyncio.sleep(0.05)
        assert order == ["a"]
        capacity[0] = 4  # an instance appeared: pump hands out the new room in order
        q.pump()
        await asyncio.gather(*waiters)
        assert order == ["a", "b", "c"] and q.num_admitted == 4 and q.queued_tokens == 0

    asyncio.run(scenario())


def test_admission_refuses_past_the_token_bound_and_the_queue_time():
    async def scenario():
        q = AdmissionQueue(lambda: 0, max_queued_requests=10, max_queued_tokens=50, max_queue_time_s=0.2)
        with pytest.raises(OverloadedError, match="prompt tokens"):
            await q.admit(60)
        with pytest.raises(OverloadedError, match="waited"):
            await q.admit(10)
        assert q.num_queued == 0 and q.queued_tokens == 0 and q.num_admitted == 0

    asyncio.run(scenario())


def test_a_cancelled_waiter_leaves_the_queue_and_takes_no_slot():
    async def scenario():
        capacity = [1]
        q = AdmissionQueue(lambda: capacity[0], max_queued_requests=10, max_queued_tokens=100, max_queue_time_s=30)
        await q.admit(5)
        waiter = asyncio.ensure_future(q.admit(5))
        await asyncio.sleep(0)
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        assert q.num_queued == 0 and q.queued_tokens == 0
        q.done()
        assert q.num_admitted == 0

    asyncio.run(scenario())


class FakePool:
    def __init__(self) -> None:
        self.released = []

    def spawn(self, coro):
        return asyncio.ensure_future(coro)

    async def release(self, decode, request_id, transfer_id):
        self.released.append((decode.address, request_id, transfer_id))


class FakeCall:
    def __init__(self) -> None:
        self.cancelled = False

    def done(self) -> bool:
        return self.cancelled

    def cancel(self) -> None:
        self.cancelled = True


def test_an_aborted_attempt_undoes_its_accounting_and_releases_the_reservation_once():
    async def scenario():
        pool, p, d = FakePool(), InstanceLoad("p"), InstanceLoad("d")
        life = Attempt(pool, "r1", p, d, queued_tokens=100)
        assert (p.in_flight_requests, p.in_flight_tokens, p.total_routed_tokens, d.in_flight_requests) == (
            1,
            100,
            100,
            1,
        )
        life.reserved(7)
        failure = RequestFailed(FailureCause.INSTANCE_LOST, "prefill p: lost", instance=p)
        life.abort(failure)
        life.abort(failure)  # a second abort changes nothing
        await asyncio.sleep(0)
        assert pool.released == [("d", "r1", 7)]
        assert (p.in_flight_requests, p.in_flight_tokens, p.total_routed_tokens, d.in_flight_requests) == (0, 0, 0, 0)
        assert p.breaker.consecutive_failures == 1 and d.breaker.consecutive_failures == 0
        assert life.stage == Stage.ABORTED

    asyncio.run(scenario())


def test_a_finished_attempt_keeps_its_routed_tokens_and_a_cancel_mid_stream_cancels_decode():
    async def scenario():
        pool, p, d = FakePool(), InstanceLoad("p"), InstanceLoad("d")
        done = Attempt(pool, "r1", p, d, queued_tokens=40)
        done.reserved(1)
        done.prefilled()
        assert p.in_flight_requests == 0 and d.in_flight_requests == 1
        done.decoding(FakeCall())
        done.finish()
        assert p.total_routed_tokens == 40 and d.in_flight_requests == 0

        streaming = Attempt(pool, "r2", p, d, queued_tokens=60)
        streaming.reserved(2)
        streaming.prefilled()
        call = FakeCall()
        streaming.decoding(call)
        streaming.abort(None)  # the client went away mid-stream
        await asyncio.sleep(0)
        # decode frees the pages when it sees the cancel; a Release goes too, in case the cancel
        # never reaches it (decode answers a second release with released=False)
        assert call.cancelled and pool.released == [("d", "r2", 2)]
        assert p.total_routed_tokens == 40 and d.in_flight_requests == 0
        assert p.breaker.consecutive_failures == 0 and d.breaker.consecutive_failures == 0

        # the client left while the gateway awaited decode's first message: grpc.aio cancelled
        # the call with the task, so it is done when the attempt aborts, and maybe before
        # Generate went out (decode never hears of it): the Release still goes
        early = Attempt(pool, "r3", p, d, queued_tokens=10)
        early.reserved(3)
        early.prefilled()
        gone = FakeCall()
        gone.cancel()
        early.decoding(gone)
        early.abort(None)
        await asyncio.sleep(0)
        assert pool.released == [("d", "r2", 2), ("d", "r3", 3)]
        assert d.in_flight_requests == 0

    asyncio.run(scenario())


def test_instances_that_disagree_on_page_size_or_model_are_not_routed_to():
    from kvmesh.gateway.pool import InstancePool, MismatchError
    from kvmesh.protos.v1 import common_pb2

    async def scenario():
        pool = InstancePool(
            ["p1:1", "p2:1"],
            ["d1:1"],
            page_size=16,
            index=None,
            cache_threshold=0.3,
            load_weight=0.02,
            rpc_timeout_s=1.0,
            model_fingerprint="abc",
        )
        try:
            p1, p2 = pool.prefills
            assert (
                pool._mismatch(p1, common_pb2.InstanceStats(instance_id="p1", page_size=16, model_fingerprint="abc"))
                == ""
            )
            p2.mismatch = pool._mismatch(
                p2, common_pb2.InstanceStats(instance_id="p2", page_size=32, model_fingerprint="abc")
            )
            assert p2.mismatch == "p2 has page_size 32, the gateway 16"
            pool.check_usable()  # one prefill still agrees
            for k in range(4):
                prefill, _, _ = await pool.route(list(range(40 + k)), [])
                assert prefill is p1
            d1 = pool.decodes[0]
            d1.mismatch = pool._mismatch(
                d1, common_pb2.InstanceStats(instance_id="d1", page_size=16, model_fingerprint="xyz")
            )
            with pytest.raises(MismatchError, match="d1 serves model xyz, the gateway abc"):
                pool.check_usable()
        finally:
            await pool.close()

    asyncio.run(scenario())


def test_an_attempt_ended_while_reserve_is_in_flight_releases_the_late_reservation():
    class Reserved:
        transfer_id = 99

    async def scenario():
        pool, p, d = FakePool(), InstanceLoad("p"), InstanceLoad("d")
        life = Attempt(pool, "r3", p, d, queued_tokens=10)
        reserve_call = asyncio.get_running_loop().create_future()
        life.reserving(reserve_call)
        life.abort(None)  # the client left before decode answered
        assert pool.released == []
        reserve_call.set_result(Reserved())  # decode reserved all the same
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert pool.released == [("d", "r3", 99)]
        # the answer came as the client left, before the attempt read it: released all the same
        late = Attempt(pool, "r4", p, d, queued_tokens=10)
        answered = asyncio.get_running_loop().create_future()
        answered.set_result(Reserved())
        late.reserving(answered)
        late.abort(None)
        for _ in range(3):
            await asyncio.sleep(0)
        assert pool.released[-1] == ("d", "r4", 99)

    asyncio.run(scenario())
