"""Latency-aware routing's parts: the latency fit an instance publishes, the gateway's TTFT and
ITL predictions from it, the choice within an SLO (most prefix reuse among the instances
predicted to meet it), shedding what none can meet, and the SLO a request carries."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvmesh.engine.outcomes import FailureCause
from kvmesh.gateway.auth import ApiKeys
from kvmesh.gateway.failure import RequestFailed
from kvmesh.gateway.instance_load import InstanceLoad
from kvmesh.gateway.pool import InstancePool
from kvmesh.gateway.predictor import LatencyPredictor
from kvmesh.gateway.request_path import RequestPath
from kvmesh.gateway.router import PrefillRouter
from kvmesh.gateway.slo import Slo, slo_of
from kvmesh.gateway.slo_watch import SloWatch
from kvmesh.protos.v1 import gateway_pb2
from kvmesh.runtime.latency_fit import LinearFit

PREFILL_FIT = (0.01, 0.001, 0.0)  # 10 ms a request + 1 ms a token, no attention term
PUSH_FIT = (0.002, 0.0005)


def test_the_fit_recovers_known_costs_and_keeps_them_non_negative():
    fit = LinearFit(3, window=64)
    assert fit.coefficients() is None  # too few samples
    for requests in (1, 2, 3):
        for tokens in (100, 400, 900, 1600):
            fit.add(
                (requests, tokens, tokens * tokens / 2), 0.02 * requests + 0.001 * tokens + 1e-7 * tokens * tokens / 2
            )
    assert fit.coefficients() == pytest.approx([0.02, 0.001, 1e-7], rel=1e-6)
    assert fit.predict((1, 1000, 500_000)) == pytest.approx(0.02 + 1.0 + 0.05)
    # a feature that only ever lowers the time is dropped, not given a negative cost
    falling = LinearFit(2)
    for x in range(1, 9):
        falling.add((1, x), 1.0 - 0.01 * x)
    assert min(falling.coefficients()) >= 0
    # the window forgets: a machine that got twice as slow is followed
    slow = LinearFit(1, window=8)
    for _ in range(8):
        slow.add((1,), 1.0)
    for _ in range(8):
        slow.add((1,), 2.0)
    assert slow.predict((1,)) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        slow.add((1, 2), 1.0)


def test_a_relative_fit_weighs_each_sample_by_its_own_size():
    # one feature, two samples: 1 s at x = 1, 30 s at x = 10. Least squares minimizes the absolute
    # error (the 30 s sample decides); the relative fit minimizes each error over its own size
    samples = [((1.0,), 1.0), ((10.0,), 30.0)]
    absolute, relative = LinearFit(1, window=8, min_samples=2), LinearFit(1, window=8, min_samples=2, relative=True)
    for features, seconds in samples:
        absolute.add(features, seconds)
        relative.add(features, seconds)
    x, y = [f[0] for f, _ in samples], [s for _, s in samples]
    assert absolute.coefficients()[0] == pytest.approx(sum(a * b for a, b in zip(x, y)) / sum(a * a for a in x))
    ratios = [a / b for a, b in zip(x, y)]  # minimize sum((c x / y - 1)^2): c = sum(x / y) / sum((x / y)^2)
    assert relative.coefficients()[0] == pytest.approx(sum(ratios) / sum(r * r for r in ratios))
    short = 1.0
    assert abs(relative.predict((1.0,)) - short) < abs(absolute.predict((1.0,)) - short)


def _prefill(address: str, queued: int = 0, requests: int = 0) -> InstanceLoad:
    inst = InstanceLoad(address, instance_id=address, prefill_fit=PREFILL_FIT, push_fit=PUSH_FIT)
    inst.reported_queued_tokens, inst.reported_active_requests = queued, requests
    return inst


def test_ttft_is_the_queue_the_uncached_compute_and_the_push():
    predictor = LatencyPredictor(page_size=16)
    idle, busy = _prefill("a"), _prefill("b", queued=2000, requests=2)
    p = predictor.ttft(idle, 320, 160)  # 160 tokens to compute, 20 pages to push
    assert (p.queue_s, p.compute_s, p.push_s) == pytest.approx((0.0, 0.01 + 0.16, 0.002 + 0.01))
    assert p.seconds == pytest.approx(p.raw_s)  # nothing measured yet: no calibration
    q = predictor.ttft(busy, 320, 160)
    assert q.queue_s == pytest.approx(2 * 0.01 + 2.0)  # two queued requests, 2000 tokens
    assert predictor.ttft(InstanceLoad("c"), 320, 0) is None  # no profile published yet
    # decode: its step time with one more row and this prompt's context
    decode = InstanceLoad("d", decode_fit=(0.005, 0.002, 1e-6), context_tokens=1000, reported_active_requests=3)
    assert predictor.itl(decode, 500) == pytest.approx(0.005 + 0.002 * 4 + 1e-6 * 1500)


def test_calibration_learns_what_the_profile_misses():
    predictor = LatencyPredictor(page_size=16)
    inst = _prefill("a")
    for n in (100, 200, 400, 800, 1600, 300, 500, 700, 900, 1100):
        p = predictor.ttft(inst, n, 0)
        committed = predictor.commit(inst, p)
        predictor.observe(inst, p, 0.05 + 2 * p.compute_s + p.push_s, committed)  # hops, and a slower machine
    p = predictor.ttft(inst, 1000, 0)
    assert p.seconds == pytest.approx(0.05 + 2 * p.compute_s + p.push_s, rel=0.05)


def test_within_the_slo_the_instance_with_the_most_reuse_wins_else_the_fastest():
    a, b = _prefill("a"), _prefill("b", queued=3000, requests=3)
    router = PrefillRouter([a, b])
    predictor = LatencyPredictor(16, [a, b])

    def predict(inst, cached):
        return predictor.ttft(inst, 1024, cached).seconds

    # b holds 960 of the 1024 tokens: its queue (3 s) still fits a 5 s SLO, and it reuses most
    decision = router.choose(1024, {"b": 60}, 16, slo_ttft_s=5.0, predict=predict)
    assert decision.address == "b" and decision.meets_slo and decision.cached_tokens == 960
    # a 2 s SLO: only the idle instance meets it, though it computes the whole prompt
    decision = router.choose(1024, {"b": 60}, 16, slo_ttft_s=2.0, predict=predict)
    assert decision.address == "a" and decision.meets_slo
    # nothing meets 10 ms: the fastest, marked as missing it
    decision = router.choose(1024, {"b": 60}, 16, slo_ttft_s=0.01, predict=predict)
    assert decision.address == "a" and not decision.meets_slo
    # an instance without a profile: the policy decides (prefix and load), as without an SLO
    c = InstanceLoad("c", instance_id="c")
    assert PrefillRouter([a, c]).choose(1024, {"c": 60}, 16, slo_ttft_s=2.0, predict=lambda i, k: None).address == "c"


def test_shed_refuses_what_no_instance_is_predicted_to_serve_in_time():
    async def scenario():
        pool = InstancePool(["p1:1", "p2:1"], ["d1:1"], 16, None, 0.3, 0.02, rpc_timeout_s=1.0)
        for inst, queued in zip(pool.prefills, (4000, 6000)):
            inst.instance_id, inst.prefill_fit, inst.push_fit = inst.address, PREFILL_FIT, PUSH_FIT
            inst.reported_queued_tokens, inst.reported_active_requests = queued, 2
        watch = SloWatch(pool, Slo(ttft_s=1.0), "r1", 256, time.perf_counter())
        with pytest.raises(RequestFailed) as caught:
            watch.check({}, frozenset())
        assert caught.value.cause is FailureCause.OVERLOADED and caught.value.retry_after_s >= 3
        assert "TTFT" in str(caught.value)
        # a generous SLO passes, and so does an ITL SLO while no decode has a profile
        SloWatch(pool, Slo(ttft_s=30.0, itl_s=0.001), "r2", 256, time.perf_counter()).check({}, frozenset())
        # the prediction goes into Final, from the request's arrival
        watch = SloWatch(pool, Slo(), "r3", 256, time.perf_counter())
        decision = pool.pick_prefill(256, {}, [])[1]
        watch.routed(pool.prefills[0], decision, pool.decodes[0], 0)
        final = gateway_pb2.Final(ttft_s=4.0)
        watch.final(final)
        assert final.predicted_ttft_s >= 4.0 and final.predicted_itl_s == 0.0  # decode has no profile
        await pool.close()

    asyncio.run(scenario())


def test_a_request_s_slo_comes_from_its_fields_then_its_headers_then_the_gateway():
    default = Slo(ttft_s=2.0, itl_s=0.1)
    assert slo_of((0, 0), [], default) == default
    assert slo_of((0, 0), [("X-SLO-TTFT-MS", "500"), ("x-slo-tpot-ms", b"50")], default) == Slo(0.5, 0.05)
    assert slo_of((250, 0), [("x-slo-ttft-ms", "500")], default) == Slo(0.25, 0.1)
    for bad in ("fast", "-5", "nan", "inf"):
        with pytest.raises(ValueError, match="x-slo-ttft-ms"):
            slo_of((0, 0), [("x-slo-ttft-ms", bad)], default)
    with pytest.raises(ValueError, match="slo_itl_ms"):
        slo_of((0, -1), [], default)


def test_a_key_s_band_slo_comes_before_the_gateway_s_field_by_field():
    path = RequestPath.__new__(RequestPath)  # only its keys and its SLO are read
    path.keys = ApiKeys(["sk-a", "sk-b"], slos={"sk-a": (500.0, 0.0)})
    path.slo = Slo(2.0, 0.1)
    assert path._band_slo("key-1") == Slo(0.5, 0.1)
    assert path._band_slo("key-2") == path._band_slo("") == Slo(2.0, 0.1)
