"""Latency-aware routing's parts: the latency fit an instance publishes, the gateway's TTFT and
ITL predictions from it, the choice within an SLO (most prefix reuse among the instances
predicted to meet it), shedding what none can meet, and the SLO a request carries."""

from __future__ import annotations

import asyncio
import json
import math
import time

import pytest

from kvmesh.engine.outcomes import FailureCause
from kvmesh.gateway.auth import ApiKeys
from kvmesh.gateway.failure import RequestFailed
from kvmesh.gateway.instance_load import InstanceLoad
from kvmesh.gateway.pool import InstancePool
from kvmesh.gateway.prediction_log import PredictionLog
from kvmesh.gateway.predictor import LatencyPredictor
from kvmesh.gateway.request_path import RequestPath
from kvmesh.gateway.router import PrefillRouter
from kvmesh.gateway.slo import Slo, slo_of
from kvmesh.gateway.slo_watch import SloWatch
from kvmesh.protos.v1 import gateway_pb2
from kvmesh.runtime.latency_fit import MAX_LOG_RATIO, LinearFit, RatioFit

PREFILL_FIT = (0.0, 0.01, 0.001, 0.0)  # 10 ms a request + 1 ms a token, no attention term
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


def test_a_relative_fit_keeps_short_samples_close_where_the_absolute_fit_lets_long_ones_decide():
    lengths = (64, 256, 768, 1536) * 4
    absolute, relative = LinearFit(2), LinearFit(2, relative=True)
    for tokens in lengths:  # a cost the features cannot follow exactly: super-linear in tokens
        for fit in (absolute, relative):
            fit.add((1, tokens), 1e-3 * tokens**1.3)

    def worst(fit):
        return max(abs(fit.predict((1, t)) - 1e-3 * t**1.3) / (1e-3 * t**1.3) for t in lengths)

    assert worst(relative) < 0.7 * worst(absolute)
    assert relative.predict((1, 64)) == pytest.approx(1e-3 * 64**1.3, rel=0.5)
    exact = LinearFit(2, relative=True)  # a cost it can follow: recovered as the absolute fit does
    for tokens in lengths:
        exact.add((1, tokens), 0.05 + 0.001 * tokens)
    assert exact.coefficients() == pytest.approx([0.05, 0.001], rel=1e-6)


def test_a_ratio_fit_corrects_a_prediction_by_the_measured_relative_error():
    fit = RatioFit(2, window=16, min_samples=4)
    assert fit.correct((1.0, 0.0), 2.0) is None  # nothing measured yet
    # measured = predicted x 0.8 x 1.1^rows: the log of the ratio is linear in [1, rows]
    for predicted, rows in ((1.0, 0), (0.2, 3), (5.0, 6), (2.0, 1), (0.5, 9)):
        fit.add((1.0, rows), predicted, predicted * 0.8 * 1.1**rows)
    assert fit.correct((1.0, 4), 3.0) == pytest.approx(3.0 * 0.8 * 1.1**4)
    # symmetric: 2x over and 2x under cancel, whatever the seconds (a burst's 30 s weigh as 0.3 s)
    even = RatioFit(1, min_samples=2)
    even.add((1.0,), 30.0, 15.0)
    even.add((1.0,), 0.3, 0.6)
    assert even.correct((1.0,), 1.0) == pytest.approx(1.0)
    # held within what was measured: rows of 0-9 say nothing of 30
    assert fit.correct((1.0, 30), 3.0) == pytest.approx(3.0 * 0.8 * 1.1**9)
    # bounded: a correction never moves a prediction more than MAX_LOG_RATIO either way
    wild = RatioFit(1, min_samples=1)
    wild.add((1.0,), 1e-6, 100.0)
    assert wild.correct((1.0,), 1.0) == pytest.approx(math.exp(MAX_LOG_RATIO))


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


def test_a_reported_queue_counts_only_when_polled_after_the_last_first_token_from_it():
    predictor = LatencyPredictor(page_size=16)
    busy = _prefill("b", queued=2000, requests=2)
    busy.polled_at = time.monotonic()
    assert predictor.ttft(busy, 320, 160).queue_s == pytest.approx(2 * 0.01 + 2.0)  # other gateways' work, say
    p = predictor.ttft(busy, 64, 0)
    predictor.observe(busy, p, 0.1, predictor.commit(busy, p))
    # that report was polled before this first token: it may count work now done
    assert predictor.ttft(busy, 320, 160).queue_s == pytest.approx(0.0, abs=1e-6)
    busy.polled_at = predictor.queues.done_at(busy) + 1e-3  # a fresher one counts again
    assert predictor.ttft(busy, 320, 160).queue_s == pytest.approx(2 * 0.01 + 2.0)


def test_calibration_learns_what_the_profile_misses():
    inst = _prefill("a")
    inst.core_group = "host:/dev/shm/share"
    decode = InstanceLoad("d", core_group=inst.core_group)  # streams requests from the same cores
    predictor = LatencyPredictor(16, [inst], [decode])
    for n, rows in ((100, 0), (200, 4), (400, 1), (800, 8), (1600, 2), (300, 6), (500, 3), (700, 0), (900, 5)):
        decode.in_flight_requests = rows
        p = predictor.ttft(inst, n, 0)
        assert p.rows == rows
        job = predictor.commit(inst, p)
        predictor.observe(inst, p, p.raw_s * 1.5 * 1.1**rows, job)  # a slower machine, slower as decode streams
    decode.in_flight_requests = 7
    p = predictor.ttft(inst, 1000, 0)
    assert p.seconds == pytest.approx(p.raw_s * 1.5 * 1.1**7)


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
        # passed before its decode was reserved (p1: ~4.3 s of a 5 s SLO), then the queues grew:
        # refused at routing too, never routed against its prediction
        late = SloWatch(pool, Slo(ttft_s=5.0), "r4", 256, time.perf_counter())
        late.check({}, frozenset())
        for inst in pool.prefills:
            inst.reported_queued_tokens += 2000
        decision = pool.pick_prefill(256, {}, [], slo_ttft_s=late.ttft_budget_s)[1]
        with pytest.raises(RequestFailed) as caught:
            late.check_route(decision)
        assert caught.value.cause is FailureCause.OVERLOADED and caught.value.retry_after_s >= 1
        generous = SloWatch(pool, Slo(ttft_s=30.0), "r5", 256, time.perf_counter())
        generous.check_route(pool.pick_prefill(256, {}, [], slo_ttft_s=generous.ttft_budget_s)[1])
        # the prediction goes into Final, from the request's arrival
        watch = SloWatch(pool, Slo(), "r3", 256, time.perf_counter())
        decision = pool.pick_prefill(256, {}, [])[1]
        watch.routed(pool.prefills[0], decision, pool.decodes[0], 0)
        final = gateway_pb2.Final(ttft_s=4.0)
        watch.final(final)
        assert final.predicted_ttft_s >= 4.0 and final.predicted_itl_s == 0.0  # decode has no profile
        await pool.close()

    asyncio.run(scenario())


def test_the_predictor_log_holds_each_prediction_its_inputs_and_the_ttft_measured(tmp_path):
    slow_fit = (0.0, 100.0, 0.001, 0.0)  # 100 s a request: the first is still queued in the model when the second comes

    async def scenario():
        pool = InstancePool(["p1:1"], ["d1:1"], 16, None, 0.3, 0.02, rpc_timeout_s=1.0)
        inst = pool.prefills[0]
        inst.instance_id, inst.prefill_fit, inst.push_fit = inst.address, slow_fit, PUSH_FIT
        pool.predictor.log = PredictionLog(str(tmp_path / "predictions.jsonl"))
        ids = ['r1\n{"forged": true}', "r2"]  # a client's request id stays data on one line
        watches = [SloWatch(pool, Slo(), request_id, 320, time.perf_counter()) for request_id in ids]
        for watch, cached in zip(watches, (0, 160)):
            watch.routed(inst, pool.pick_prefill(320, {inst.address: cached // 16}, [])[1], pool.decodes[0], 0)
        for watch in watches:
            watch.first_token()
            watch.first_token()  # once a try
        # the line is written at the request's end, with what prefill measured (Final)
        transfer = gateway_pb2.KVTransfer(exposed_seconds=0.02)
        for watch, cached in zip(watches, (0, 160)):
            final = gateway_pb2.Final(
                queue_s=0.5, prefill_s=1.5, pull_s=0.25, cached_tokens=cached, kv_transfer=transfer
            )
            watch.final(final)
            watch.final(final)  # once a request
        pool.predictor.log.close()
        await pool.close()

    asyncio.run(scenario())
    lines = (tmp_path / "predictions.jsonl").read_text().splitlines()
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)
    assert first["request_id"] == 'r1\n{"forged": true}' and "forged" not in second
    assert first["prompt_tokens"] == 320 and first["cached_tokens"] == 0 and second["cached_tokens"] == 160
    assert first["compute_s"] == pytest.approx(100.32) and second["compute_s"] == pytest.approx(100.16)
    # the second was routed behind the first: one job ahead, its instance busy, its queue the first's compute
    assert (first["jobs_ahead"], first["prefills_busy"], second["jobs_ahead"], second["prefills_busy"]) == (0, 0, 1, 1)
    assert second["queue_s"] == pytest.approx(100.32, rel=1e-3)
    for record in (first, second):
        assert record["raw_s"] == pytest.approx(record["queue_s"] + record["compute_s"] + record["push_s"])
        assert 0 < record["measured_s"] < 100 and record["prefill"] == "p1:1" and record["predicted_s"] > 0
        assert record["routed_at"] <= record["at"]
        assert (record["measured_queue_s"], record["measured_compute_s"], record["pull_s"]) == (0.5, 1.5, 0.25)
        assert record["measured_push_s"] == pytest.approx(0.02)
    assert (first["measured_cached_tokens"], second["measured_cached_tokens"]) == (0, 160)


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
