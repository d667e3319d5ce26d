"""Turns on shared cores (runtime/cpu_share.py): a decode step and a prefill forward wait for
each other, alternate when both are busy, within their bounds; several instances of one side
take turns with each other too, in the order they asked; the prefill engine marks each forward.
CpuShare objects on one file stand for the processes: they map the same page, as prefill and
decode do."""

import functools
import os
import resource
import subprocess
import sys
import threading
import time

import pytest

from kvmesh.engine.forward import chunk_ends
from kvmesh.prefill_svc.engine import PrefillEngine
from kvmesh.runtime import cpu_share
from kvmesh.runtime.cpu_share import CpuShare, NoCpuShare, open_cpu_share
from kvmesh.runtime.turn_wakes import TurnWakes
from tests.unit.test_prefill_engine import ArgmaxRunner, _job


@pytest.fixture
def pair(tmp_path):
    path = str(tmp_path / "cpu-share")
    prefill, decode = CpuShare(path), CpuShare(path, max_wait_s=5.0)
    yield prefill, decode
    prefill.close()
    decode.close()


def _in_turn(turn, hold: threading.Event | None = None) -> tuple[threading.Thread, list[float]]:
    """Enter `turn` (a CpuShare side's context) on a thread and stay in it until `hold` is set
    (30 s at most; None: leave at once); the seconds it waited, once in."""
    waited: list[float] = []

    def run() -> None:
        with turn() as w:
            waited.append(w)
            if hold is not None:
                hold.wait(30)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, waited


def test_decode_does_not_wait_when_no_prefill_forward_runs(pair):
    _, decode = pair
    with decode.decode_step() as waited:
        assert waited < 0.5  # no poll loop: at once (bounded generously for a busy machine)
        assert decode.running()
    assert not decode.running()


def test_decode_waits_for_the_running_forward_to_end(pair):
    prefill, decode = pair
    with prefill.prefill_forward():
        thread, waited = _in_turn(decode.decode_step)
        thread.join(0.3)
        assert thread.is_alive()  # still waiting: the forward runs
    thread.join(5)
    assert not thread.is_alive() and waited[0] > 0


def test_prefill_waits_for_the_running_decode_step_to_end(pair):
    prefill, decode = pair
    with decode.decode_step():
        thread, waited = _in_turn(prefill.prefill_forward)
        thread.join(0.3)
        assert thread.is_alive()
    thread.join(5)
    assert not thread.is_alive() and waited[0] > 0


def test_with_both_busy_they_alternate_step_and_forward(pair):
    # a chunked prefill asks for its next forward at once: the decode step that asked while the
    # last chunk ran goes first, then the chunk; neither runs beside the other
    prefill, decode = pair
    order: list[str] = []
    hold = threading.Event()
    with prefill.prefill_forward():
        step, _ = _in_turn(decode.decode_step, hold)
        while not decode.asking():  # decode has asked
            time.sleep(0.001)
        order.append("forward 1 ends")
    while not decode.running():  # its step began
        time.sleep(0.001)

    def end_step_once_the_forward_asked() -> None:
        deadline = time.monotonic() + 30
        while not prefill.asking() and time.monotonic() < deadline:
            time.sleep(0.001)
        hold.set()

    threading.Thread(target=end_step_once_the_forward_asked, daemon=True).start()
    with prefill.prefill_forward():  # the next chunk: after the step
        order.append("forward 2 runs")
        assert not step.is_alive()
        assert not decode.running()
    step.join(5)
    assert order == ["forward 1 ends", "forward 2 runs"]


def test_the_side_that_asked_first_goes_first(pair):
    prefill, decode = pair
    hold = threading.Event()
    with decode.decode_step():  # both ask while a step runs: prefill first, then decode
        forward, _ = _in_turn(prefill.prefill_forward, hold)
        while not prefill.asking():
            time.sleep(0.001)
        step, _ = _in_turn(decode.decode_step)
        while not decode.asking():
            time.sleep(0.001)
    while not prefill.running():  # the forward began
        time.sleep(0.001)
    assert step.is_alive() and not decode.running()  # the step waits for it
    hold.set()
    forward.join(5)
    step.join(5)
    assert not step.is_alive()


def test_two_prefill_instances_take_turns_with_each_other(tmp_path):
    # two prefills of one mesh on the same cores: one forward at a time, as with a decode
    path = str(tmp_path / "cpu-share")
    first, second = CpuShare(path), CpuShare(path, max_wait_s=5.0)
    assert first.record != second.record
    with first.prefill_forward():
        thread, waited = _in_turn(second.prefill_forward)
        thread.join(0.3)
        assert thread.is_alive() and not second.running()  # waits while the first forward runs
    thread.join(5)
    assert not thread.is_alive() and waited[0] > 0


def _take(order: list[str], turn, name: str) -> threading.Thread:
    """On a new thread: enter `turn` (a CpuShare side's context), append `name` to `order` once in."""

    def run() -> None:
        with turn():
            order.append(name)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _order_after(running_turn, first_turn, second_turn, first: CpuShare, second: CpuShare) -> list[str]:
    """While `running_turn` runs, `first_turn` asks, then `second_turn`: the order the two ran in."""
    order: list[str] = []
    take = functools.partial(_take, order)

    with running_turn():
        threads = [take(first_turn, "first")]
        while not first.asking():
            time.sleep(0.001)
        threads.append(take(second_turn, "second"))
        while not second.asking():
            time.sleep(0.001)
    for thread in threads:
        thread.join(10)
    return order


def test_every_instance_goes_in_the_order_it_asked(tmp_path):
    # a decode step runs; a prefill asks, then another decode: the forward goes first
    path = str(tmp_path / "cpu-share")
    decode, prefill, other_decode = CpuShare(path), CpuShare(path, max_wait_s=5.0), CpuShare(path, max_wait_s=5.0)
    order = _order_after(decode.decode_step, prefill.prefill_forward, other_decode.decode_step, prefill, other_decode)
    assert order == ["first", "second"]


def test_a_decode_step_goes_between_two_forwards(tmp_path):
    # a forward of one prefill runs; another prefill asks, then a decode: the step goes before the
    # second forward, so a stream waits for one forward a token however many prefills are busy
    path = str(tmp_path / "cpu-share")
    running, later, decode = CpuShare(path), CpuShare(path, max_wait_s=5.0), CpuShare(path, max_wait_s=5.0)
    order = _order_after(running.prefill_forward, later.prefill_forward, decode.decode_step, later, decode)
    assert order == ["second", "first"]


def test_prefill_forwards_go_by_their_oldest_request_not_by_when_they_asked(tmp_path):
    # a forward runs; a prefill asks for a batch that arrived just now, then another for one that
    # arrived a second ago: the older batch goes first (the prompts of the prefill instances on
    # these cores first come first served, as one engine's queue)
    path = str(tmp_path / "cpu-share")
    running, newer, older = CpuShare(path), CpuShare(path, max_wait_s=5.0), CpuShare(path, max_wait_s=5.0)
    a_second_ago = time.monotonic_ns() - 10**9
    order = _order_after(
        running.prefill_forward,
        lambda: newer.prefill_forward(time.monotonic_ns()),
        lambda: older.prefill_forward(a_second_ago),
        newer,
        older,
    )
    assert order == ["second", "first"]


def test_each_decode_steps_once_between_forwards_taken_oldest_first(tmp_path):
    # a forward ran, then both decodes stepped; while one steps again, a prefill asks for a new
    # batch, then another for an older one. After the step: the older batch's forward, then the
    # other decode (due again after a forward), then the newer batch's forward. Every side has
    # one place in one order, so no two ever wait for each other
    path = str(tmp_path / "cpu-share")
    newer, older = CpuShare(path, max_wait_s=5.0), CpuShare(path, max_wait_s=5.0)
    decode, other_decode = CpuShare(path, max_wait_s=5.0), CpuShare(path, max_wait_s=5.0)
    with older.prefill_forward():
        pass
    with other_decode.decode_step():
        pass
    order: list[str] = []
    take = functools.partial(_take, order)
    a_second_ago = time.monotonic_ns() - 10**9
    with decode.decode_step():
        threads = [take(lambda: newer.prefill_forward(time.monotonic_ns()), "newer")]
        _until(newer.asking)
        threads.append(take(lambda: older.prefill_forward(a_second_ago), "older"))
        _until(older.asking)
        threads.append(take(other_decode.decode_step, "other decode"))
        _until(other_decode.asking)
    for thread in threads:
        thread.join(10)
    assert order == ["older", "other decode", "newer"]


def _until(state, timeout_s: float = 30.0) -> None:
    """Wait for `state()` to be true (at most timeout_s)."""
    deadline = time.monotonic() + timeout_s
    while not state():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def test_a_side_waiting_longer_than_the_bound_keeps_its_place(tmp_path):
    # `waiting` waits behind a long forward (its bound is 30 s); `late`, whose bound is 0.3 s,
    # asks for a newer batch once `waiting` has waited past 0.3 s. `late` takes the forward's mark
    # as stale, but not `waiting`'s ask, which it re-stamps as it waits: `late` goes after it
    path = str(tmp_path / "cpu-share")
    running, waiting = CpuShare(path), CpuShare(path, max_wait_s=30.0)
    late = CpuShare(path, max_wait_s=0.3)
    order: list[str] = []

    def take(share: CpuShare, since_ns: int, name: str) -> threading.Thread:
        return _take(order, lambda: share.prefill_forward(since_ns), name)

    with running.prefill_forward():
        threads = [take(waiting, time.monotonic_ns(), "waiting")]
        _until(waiting.asking)
        asked_ns = waiting._read(cpu_share._HEADER + waiting.record * cpu_share._FIELDS + cpu_share._ORDER)
        _until(lambda: time.monotonic_ns() - asked_ns > 0.5e9)  # past late's bound
        threads.append(take(late, time.monotonic_ns(), "late"))
        _until(lambda: late.asking() or bool(order))
        time.sleep(0.05)  # ample heartbeats for late to run, were it not held back
        assert order == []
    for thread in threads:
        thread.join(10)
    assert order == ["waiting", "late"]


def test_records_are_given_back_and_taken_over_from_dead_processes(tmp_path):
    path = str(tmp_path / "cpu-share")
    held = [CpuShare(path) for _ in range(cpu_share.MAX_PARTIES)]
    assert sorted(share.record for share in held) == list(range(cpu_share.MAX_PARTIES))
    extra = CpuShare(path, max_wait_s=5.0)
    assert extra.record is None  # all held: it runs without turns
    with held[0].prefill_forward(), extra.prefill_forward() as waited:
        assert waited == 0.0
    extra.close()
    held[3].close()  # given back: the next instance takes it
    again = CpuShare(path)
    assert again.record == 3
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(30)
    held[5]._set(cpu_share._PID, gone.pid)  # its process exited without closing
    assert CpuShare(path).record == 5
    assert CpuShare(path).record is None


def _count_sleeps(monkeypatch) -> list[int]:
    """Counts (in a one-item list) the times a wait for a turn goes to sleep."""
    sleeps = [0]
    sleep = TurnWakes.sleep

    def counted(self: TurnWakes) -> None:
        sleeps[0] += 1
        sleep(self)

    monkeypatch.setattr(TurnWakes, "sleep", counted)
    return sleeps


def test_a_forward_that_never_ends_holds_decode_back_only_max_wait_s(tmp_path, monkeypatch):
    # a prefill that hangs (SIGSTOP) or died with its mark set
    path = str(tmp_path / "cpu-share")
    prefill, decode = CpuShare(path), CpuShare(path, max_wait_s=0.3)
    with prefill.prefill_forward():
        began_ns = time.monotonic_ns()
        ended_ns: list[int] = []

        def step() -> None:
            with decode.decode_step():
                ended_ns.append(time.monotonic_ns())

        thread = threading.Thread(target=step)
        thread.start()
        thread.join(30)
        # it waited max_wait_s, then stepped
        assert not thread.is_alive() and ended_ns[0] - began_ns >= 0.3e9
        sleeps = _count_sleeps(monkeypatch)
        with decode.decode_step():
            pass
        assert sleeps == [0]  # the mark is older than the bound: stale, no more waits


def test_a_side_that_died_asking_holds_the_other_back_only_max_wait_s(tmp_path, monkeypatch):
    path = str(tmp_path / "cpu-share")
    prefill, decode = CpuShare(path, max_wait_s=0.3), CpuShare(path)
    decode._set(cpu_share._ASK, time.monotonic_ns() - 10**9)  # asked a second ago, then died
    sleeps = _count_sleeps(monkeypatch)
    with prefill.prefill_forward():
        pass
    assert sleeps == [0]


def test_the_prefill_engine_marks_each_forward(pair):
    prefill, decode = pair
    seen = []

    class Runner(ArgmaxRunner):
        def forward(self, items):
            seen.append(prefill.running())
            return super().forward(items)

    engine = PrefillEngine(Runner(), 4, 16, enable_prefix_caching=False, cpu_share=prefill, chunked_prefill_size=4)
    try:
        result = engine.submit(_job("a", list(range(10, 22)))).result(timeout=10)
        assert result.first_token == 22
        assert seen == [True, True, True]  # 12 tokens in 3 chunks of 4, each marked
        assert not prefill.running()  # and unmarked after
        assert engine.stats()["num_forwards"] == 3 and engine.stats()["forward_seconds"] > 0
    finally:
        engine.shutdown()


def test_decode_counts_as_busy_while_it_steps_and_just_after(pair):
    prefill, decode = pair
    assert not prefill.decode_busy()  # never stepped
    with decode.decode_step():
        assert prefill.decode_busy()
    assert prefill.decode_busy()  # a step just ended: the next one comes within ~1 ms
    window_ns = int(cpu_share.BUSY_WINDOW_S * 1e9)
    decode._write(cpu_share._DECODE_DONE, time.monotonic_ns() - 2 * window_ns)  # its last step, long ago
    assert not prefill.decode_busy()
    decode._set(cpu_share._ASK, time.monotonic_ns())  # asking for its next one
    assert prefill.decode_busy()


def test_prefill_forwards_shrink_to_their_budget_while_decode_steps(pair):
    prefill, decode = pair
    sizes: list[int] = []

    class Runner(ArgmaxRunner):
        def forward(self, items):
            sizes.append(sum(len(it.token_ids) for it in items))
            return super().forward(items)

    engine = PrefillEngine(
        Runner(), 4, 64, enable_prefix_caching=False, cpu_share=prefill, forward_tokens_beside_decode=8
    )
    try:
        decode._write(cpu_share._DECODE_DONE, time.monotonic_ns() + 10**12)  # decode stepping all along
        busy = engine.submit(_job("a", list(range(10, 34)))).result(timeout=10)
        assert busy.first_token == 34
        assert sum(sizes) == 24 and max(sizes) <= 8 and len(sizes) == 3  # 8 tokens a forward at most
        decode._write(cpu_share._DECODE_DONE, 0)  # decode idle: the prompt in one forward
        sizes.clear()
        idle = engine.submit(_job("b", list(range(40, 64)))).result(timeout=10)
        assert idle.first_token == 64 and sizes == [24]
    finally:
        engine.shutdown()


def test_a_budget_that_does_not_bind_keeps_the_prompts_own_chunks(pair):
    prefill, decode = pair
    sizes: list[int] = []

    class Runner(ArgmaxRunner):
        def forward(self, items):
            sizes.append(sum(len(it.token_ids) for it in items))
            return super().forward(items)

    engine = PrefillEngine(
        Runner(),
        4,
        64,
        enable_prefix_caching=False,
        cpu_share=prefill,
        chunked_prefill_size=16,
        forward_tokens_beside_decode=8,
    )
    try:
        decode._write(cpu_share._DECODE_DONE, 0)  # decode idle all along: the budget never binds
        assert engine.submit(_job("a", list(range(10, 50)))).result(timeout=10).first_token == 50
        ends = chunk_ends(0, 40, 16, 4)  # the plan with no budget at all, its short last chunk kept
        assert sizes == [b - a for a, b in zip([0, *ends], ends)]
    finally:
        engine.shutdown()


def test_no_path_means_no_sharing():
    alone = open_cpu_share("", 2.0)
    assert isinstance(alone, NoCpuShare) and not alone.shared and not alone.decode_busy()
    with alone.prefill_forward() as waited_forward, alone.decode_step() as waited_step:
        assert waited_forward == waited_step == 0.0
    with pytest.raises(ValueError):
        CpuShare("/nonexistent", max_wait_s=-1)


@pytest.fixture
def sleepy(tmp_path, monkeypatch):
    """A prefill and a decode side whose waits look at the file by themselves once a minute:
    sooner only when woken."""
    monkeypatch.setattr(cpu_share, "HEARTBEAT_S", 60.0)
    path = str(tmp_path / "cpu-share")
    prefill, decode = CpuShare(path, max_wait_s=300.0), CpuShare(path, max_wait_s=300.0)
    yield prefill, decode
    prefill.close()
    decode.close()


def _waiting_forward(prefill: CpuShare) -> tuple[threading.Thread, list[int]]:
    """A forward of `prefill` asking for its turn on a thread, once it has looked at the file;
    the list grows by one each time its wait wakes (`while_waiting`)."""
    looks: list[int] = []
    forward, _ = _in_turn(functools.partial(prefill.prefill_forward, while_waiting=lambda: looks.append(1)))
    _until(lambda: looks)
    return forward, looks


def test_a_prefill_engine_waiting_for_its_turn_still_runs_the_calls_made_on_its_worker(sleepy):
    # an older prompt's forward runs at another prefill; the engine's batch waits for its turn,
    # and a call on its worker (a pull's allocation, a hold, the stats) wakes it and runs
    # meanwhile (its heartbeat is a minute away)
    share, other = sleepy
    engine = PrefillEngine(ArgmaxRunner(), 4, 16, enable_prefix_caching=False, cpu_share=share, chunked_prefill_size=4)
    try:
        with other.prefill_forward(time.monotonic_ns() - 10**9):
            result = engine.submit(_job("a", list(range(10, 22))))
            _until(share.asking)
            assert engine.call(lambda: "ran").result(timeout=30) == "ran"
            assert share.asking() and not result.done()  # the call ran while the batch waited
        assert result.result(timeout=30).first_token == 22
    finally:
        engine.shutdown()


def test_a_waiting_side_sleeps_until_the_turn_before_it_ends(sleepy):
    # no polls: the waiting forward looks at the file once, then sleeps until the step ends and
    # wakes it (its heartbeat is a minute away). Polling every 0.2 ms cost the side that runs
    # 30% of its speed (runtime/cpu_share.py)
    prefill, decode = sleepy
    with decode.decode_step():
        forward, looks = _waiting_forward(prefill)
        forward.join(0.3)
        assert forward.is_alive() and len(looks) == 1  # asleep: a poll loop looks ~1,000 times
    forward.join(30)
    assert not forward.is_alive() and len(looks) == 1  # woken by the step's end


def test_wake_runs_a_waiting_forward_s_calls_at_once(sleepy):
    # the prefill engine's worker calls: queued from another thread, run by the forward that
    # waits for its turn, once `wake` wakes it
    prefill, decode = sleepy
    with decode.decode_step():
        forward, looks = _waiting_forward(prefill)
        prefill.wake()
        _until(lambda: len(looks) == 2)
        assert forward.is_alive() and not prefill.running()  # still waiting: the step runs
    forward.join(30)
    assert not forward.is_alive()


def test_a_side_no_wake_reaches_looks_again_at_its_heartbeat(tmp_path):
    # a peer that cannot wake it (another network namespace, a socket that could not be bound)
    path = str(tmp_path / "cpu-share")
    prefill, decode = CpuShare(path), CpuShare(path)
    prefill._wakes.wakeable = False
    try:
        with decode.decode_step():
            forward, waited = _in_turn(prefill.prefill_forward)
            _until(prefill.asking)
        forward.join(30)
        assert not forward.is_alive() and waited[0] > 0
    finally:
        prefill.close()
        decode.close()


def test_a_wait_sleeps_on_a_socket_numbered_past_1024(tmp_path):
    # a service holds many sockets (gRPC, UCX): select.select refuses descriptors past 1,023
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(max(soft, 2048), hard), hard))
    spare = [os.open(os.devnull, os.O_RDONLY) for _ in range(max(0, 1100 - len(os.listdir("/proc/self/fd"))))]
    path = str(tmp_path / "cpu-share")
    try:
        prefill, decode = CpuShare(path), CpuShare(path)
        assert prefill._wakes._socket.fileno() > 1024
        with decode.decode_step():
            forward, waited = _in_turn(prefill.prefill_forward)
            _until(prefill.asking)
        forward.join(30)
        assert not forward.is_alive() and waited[0] > 0
        prefill.close()
        decode.close()
    finally:
        for fd in spare:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
