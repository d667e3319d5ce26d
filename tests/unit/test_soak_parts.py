"""The soak's parts that need no mesh (bench/soak/): the verdict's blame and RSS slopes, the
answer check, the seeded workload and fault order, the command's argument checks."""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal

import pytest

from kvmesh.bench.soak import report
from kvmesh.bench.soak.faults import FAULT_KINDS, Fault, FaultSchedule
from kvmesh.bench.soak.options import add_arguments
from kvmesh.bench.soak.run import Interrupted, bad, run, until_signal
from kvmesh.bench.soak.workload import KINDS, LOGPROB_TOLERANCE, Answer, Outcome, draw


def test_a_failure_is_blamed_on_the_fault_under_way_or_just_undone():
    faults = [Fault("kill9", "decode0", at=10.0, ended=20.0)]
    during = Outcome("chat", 0, 0, 9.0, 15.0, "UNAVAILABLE")
    shadow = Outcome("chat", 0, 0, 9.0, 20.0 + report.FAULT_SHADOW_S - 0.1, "UNAVAILABLE")
    later = Outcome("chat", 0, 0, 9.0, 20.0 + report.FAULT_SHADOW_S + 0.1, "UNAVAILABLE")
    assert [report.blame(o, faults) for o in (during, shadow, later)] == ["kill9:decode0", "kill9:decode0", "none"]
    # in the shadow of one fault and during the next: the one under way
    faults.append(Fault("cut", "gateway0", at=22.0, ended=25.0))
    assert report.blame(Outcome("chat", 0, 0, 21.0, 23.0, "connect_error"), faults) == "cut:gateway0"


def test_rss_slope_is_fitted_over_the_last_half_on_the_longest_life_after_its_warm_up():
    # decode0 grows 1 MiB a second in the last half (3600 MB/h); prefill0 restarted at t=52 and
    # t=80, each life climbing 10 MiB a second for its first 20 s (warm-up), then flat: 0, not a
    # leak; redis has too few samples
    def prefill(t):
        life = 80 if t >= 80 else 52
        return 500.0 + 10 * min(t - life, 20)

    samples = [
        {"t": float(t), "rss_mb": {"decode0": 100.0 + max(0, t - 50), "prefill0": prefill(t)}}
        for t in range(52, 201, 2)
    ]
    samples[-1]["rss_mb"]["redis"] = 5.0
    slopes = report.rss_slopes(samples, {"prefill0": [0.0, 52.0, 80.0]}, 0.0, 200.0)
    assert slopes["decode0"] == pytest.approx(3600.0, rel=1e-6)
    assert slopes["prefill0"] == 0.0 and "redis" not in slopes


def test_an_answer_differs_by_its_text_tool_calls_or_a_logprob_past_the_tolerance():
    ref = Answer(["Paris."], ["f({})"], [-0.5, -1.0])
    assert Answer(["Paris."], ["f({})"], [-0.5, -1.0 + LOGPROB_TOLERANCE / 2]).differs(ref) == ""
    assert "logprob" in Answer(["Paris."], ["f({})"], [-0.5, -1.0 + 2 * LOGPROB_TOLERANCE]).differs(ref)
    assert "text" in Answer(["Lyon."], ["f({})"], [-0.5, -1.0]).differs(ref)
    assert "tool calls" in Answer(["Paris."], [], [-0.5, -1.0]).differs(ref)
    assert "logprobs" in Answer(["Paris."], ["f({})"], [-0.5]).differs(ref)


def test_the_workload_and_the_fault_order_are_seeded_and_every_kind_comes_before_a_repeat():
    a = [draw(random.Random(7), 2, 2) for _ in range(50)]
    assert a == [draw(random.Random(7), 2, 2) for _ in range(50)]
    rng = random.Random(7)
    specs = [draw(rng, 2, 2) for _ in range(400)]
    assert {s.kind for s in specs} == set(KINDS) and {s.gateway for s in specs} == {0, 1}
    schedule = FaultSchedule(mesh=None, rng=random.Random(3), gap_s=(1, 2), stop_after=0)  # type: ignore[arg-type]
    order = [schedule._next_kind() for _ in range(2 * len(FAULT_KINDS))]
    assert sorted(order[: len(FAULT_KINDS)]) == sorted(FAULT_KINDS) == sorted(order[len(FAULT_KINDS) :])
    with pytest.raises(ValueError, match="unknown fault kinds"):
        FaultSchedule(mesh=None, rng=random.Random(3), gap_s=(1, 2), stop_after=0, kinds=["meteor"])  # type: ignore[arg-type]


def test_a_run_is_bad_for_anything_hung_wrong_crashed_or_leaked():
    good = {"hung": 0, "wrong": 0, "crashed": 0, "leaked_pages": {"decode0": 0}, "integrity_errors": []}
    assert bad(good) == []
    assert bad({**good, "hung": 1}) == ["hung: 1"]
    assert bad({**good, "leaked_pages": {"decode0": 3}}) == ["leaked pages: {'decode0': 3}"]
    assert bad({**good, "integrity_errors": ["decode0: x"]}) == ["integrity errors: ['decode0: x']"]


@pytest.mark.parametrize(
    "flags", [["--fault-gap", "5"], ["--fault-gap", "9:3"], ["--duration", "0"], ["--concurrency", "0"]]
)
def test_bad_flags_get_one_line_and_exit_1(flags, capsys, monkeypatch):
    monkeypatch.setattr("kvmesh.bench.soak.run.unavailable", lambda: None)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert run(parser.parse_args(flags)) == 1
    assert "kvmesh soak:" in capsys.readouterr().out


def test_a_greedy_answer_that_parts_at_a_near_tied_token_is_a_near_tie_not_wrong():
    from kvmesh.bench.soak.workload import NEAR_TIE_NATS

    ref = Answer(
        ["Bees make honey."],
        tokens=["Bees", " make", " honey"],
        tops=[{"Bees": -0.1}, {" make": -0.50, " produce": -0.50 - NEAR_TIE_NATS / 2}, {" honey": -0.2}],
    )
    tie = Answer(["Bees produce honey."], tokens=["Bees", " produce", " honey"])
    far = Answer(["Bees produce honey."], tokens=["Bees", " produce", " honey"])
    ref_far = Answer(ref.text, tokens=ref.tokens, tops=[ref.tops[0], {" make": -0.5, " produce": -3.0}, ref.tops[2]])
    unseen = Answer(["Bees eat honey."], tokens=["Bees", " eat", " honey"])
    assert "token 1" in tie.near_tie(ref) and tie.differs(ref).startswith("text")
    assert far.near_tie(ref_far) == "" and unseen.near_tie(ref) == ""
    assert Answer(["Bees produce honey."]).near_tie(ref) == ""  # no token logprobs: cannot tell


def test_the_fault_table_counts_what_clients_saw_under_each_kind_and_how_long_they_waited():
    faults = [
        Fault("kill9", "decode0", at=10.0, ended=20.0),
        Fault("cut", "gateway0", at=40.0, ended=45.0),
        Fault("kill9", "prefill1", at=70.0, ended=75.0),
    ]
    outcomes = [
        Outcome("chat", 0, 0, 12.0, 13.0, "UNAVAILABLE"),  # kill9, waited 1 s
        Outcome("chat", 0, 0, 11.0, 14.0, "ok"),  # kill9, 3 s
        Outcome("chat", 0, 0, 70.0, 73.0, "UNAVAILABLE"),  # kill9, waited 3 s
        Outcome("chat", 0, 0, 41.0, 41.5, "connect_error"),  # cut
        Outcome("chat", 0, 0, 60.0, 61.0, "ok"),  # no fault: left out
    ]
    table = report.fault_table(outcomes, faults)
    assert table["kill9"] == {
        "faults": 2,
        "requests": 3,
        "finished": 1,
        "failed": {"UNAVAILABLE": 2},
        "failed_wait_s": {"p50": 2.0, "max": 3.0},
        "finished_s": {"p50": 3.0, "p99": 3.0},
    }
    assert table["cut"]["failed"] == {"connect_error": 1} and table["cut"]["finished_s"] == {}
    md = report.markdown_table({"by_fault_kind": table})
    assert "| `kill9` | 2 | 3 | 1 | 2 UNAVAILABLE | 2.0 / 3.0 | 3.0 / 3.0 |" in md
    assert "| `cut` | 1 | 1 | 0 | 1 connect_error | 0.5 / 0.5 | - |" in md


def test_a_fault_gap_past_the_run_s_end_ends_with_the_run():
    # `--fault-gap 100000:100000`: a run without faults; the schedule must not sleep past its end
    class Clock:
        def __init__(self) -> None:
            self.t0 = asyncio.get_running_loop().time()

        def now(self) -> float:
            return asyncio.get_running_loop().time() - self.t0

    async def scenario():
        schedule = FaultSchedule(mesh=Clock(), rng=random.Random(3), gap_s=(1e5, 1e5), stop_after=0.05)  # type: ignore[arg-type]
        return await asyncio.wait_for(schedule.run(), 10)

    assert asyncio.run(scenario()) == []


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_cancels_the_soak_so_its_mesh_is_closed_even_where_the_signal_was_ignored(signum):
    # before: SIGTERM killed `kvmesh soak` on the spot and left its seven services running, and a
    # soak started in a script's background ignored SIGINT while its services drained on it
    closed = []

    async def soak() -> dict:
        try:
            os.kill(os.getpid(), signum)
            await asyncio.Event().wait()  # the load: forever, but for the signal
            return {}
        finally:
            closed.append(True)  # where the real soak closes its mesh

    before = signal.signal(signum, signal.SIG_IGN)
    try:
        with pytest.raises(Interrupted) as info:
            asyncio.run(until_signal(soak()))
    finally:
        signal.signal(signum, before)
    assert info.value.signum == signum and closed == [True]
    assert signal.Signals(signum).name in str(info.value)
