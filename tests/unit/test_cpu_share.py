"""Prefill first on shared cores (runtime/cpu_share.py): decode's wait between steps, its bounds,
and the prefill engine marking each forward. Two CpuShare objects on one file stand for the two
processes: they map the same page, as prefill and decode do."""

import threading
import time

import pytest

from prefill_svc.engine import PrefillEngine
from runtime import cpu_share
from runtime.cpu_share import CpuShare, open_cpu_share
from tests.unit.test_prefill_engine import ArgmaxRunner, _job


@pytest.fixture
def pair(tmp_path):
    path = str(tmp_path / "cpu-share")
    prefill, decode = CpuShare(path), CpuShare(path, max_wait_s=5.0)
    yield prefill, decode
    prefill.close()
    decode.close()


def _waiter(share: CpuShare) -> tuple[threading.Thread, list[float]]:
    waited: list[float] = []
    thread = threading.Thread(target=lambda: waited.append(share.wait_for_prefill()), daemon=True)
    thread.start()
    return thread, waited


def test_decode_does_not_wait_when_no_prefill_forward_runs(pair):
    _, decode = pair
    assert decode.wait_for_prefill() == 0.0


def test_decode_waits_for_the_running_forward_to_end(pair):
    prefill, decode = pair
    with prefill.prefill_forward():
        thread, waited = _waiter(decode)
        thread.join(0.3)
        assert thread.is_alive()  # still waiting: the forward runs
    thread.join(5)
    assert not thread.is_alive() and waited[0] > 0


def test_decode_waits_through_one_forward_only(pair):
    # chunked prefill starts its next chunk at once: decode, which waited through the chunk it
    # found, takes a step rather than waiting for the whole prompt
    prefill, decode = pair
    with prefill.prefill_forward():
        thread, _ = _waiter(decode)
        thread.join(0.2)
        assert thread.is_alive()
        time.sleep(0.001)  # the next forward's mark differs from this one's
        with prefill.prefill_forward():
            thread.join(5)
            assert not thread.is_alive()


class _CountingClock:
    """runtime.cpu_share's `time`, counting the polls a wait sleeps through."""

    def __init__(self) -> None:
        self.sleeps = 0

    def __getattr__(self, name: str):
        return getattr(time, name)

    def sleep(self, seconds: float) -> None:
        self.sleeps += 1
        time.sleep(seconds)


def test_a_forward_that_never_ends_holds_decode_back_only_max_wait_s(tmp_path, monkeypatch):
    # a prefill that hangs (SIGSTOP) or died with its mark set
    path = str(tmp_path / "cpu-share")
    prefill, decode = CpuShare(path), CpuShare(path, max_wait_s=0.3)
    with prefill.prefill_forward():
        began_ns = decode._read()
        ended_ns: list[int] = []
        thread = threading.Thread(target=lambda: (decode.wait_for_prefill(), ended_ns.append(time.monotonic_ns())))
        thread.start()
        thread.join(30)
        # it waited until max_wait_s after the forward began (measured from the mark, so a
        # waiter that a busy machine starts late waits less, never past the bound)
        assert not thread.is_alive() and ended_ns[0] - began_ns >= 0.3e9
        clock = _CountingClock()
        monkeypatch.setattr(cpu_share, "time", clock)
        decode.wait_for_prefill()
        assert clock.sleeps == 0  # past its bound: no more waits


def test_the_prefill_engine_marks_each_forward(pair):
    prefill, decode = pair
    seen = []

    class Runner(ArgmaxRunner):
        def forward(self, items):
            seen.append(decode._read() != 0)
            return super().forward(items)

    engine = PrefillEngine(Runner(), 4, 16, enable_prefix_caching=False, cpu_share=prefill, chunked_prefill_size=4)
    try:
        result = engine.submit(_job("a", list(range(10, 22)))).result(timeout=10)
        assert result.first_token == 22
        assert seen == [True, True, True]  # 12 tokens in 3 chunks of 4, each marked
        assert decode._read() == 0  # and unmarked after
    finally:
        engine.shutdown()


def test_no_path_means_no_sharing():
    assert open_cpu_share("", 2.0) is None
    with pytest.raises(ValueError):
        CpuShare("/nonexistent", max_wait_s=-1)
