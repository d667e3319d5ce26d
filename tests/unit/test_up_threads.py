"""`kvmesh up --prefill-threads / --decode-threads` reach each instance as --torch-threads, and
`--dtype` as its --dtype."""

from __future__ import annotations

import signal

import pytest

from kvmesh import cli, launcher, up


@pytest.fixture(autouse=True)
def keep_signal_handlers():
    """run_up installs SIGINT / SIGTERM handlers; give pytest its own back."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def test_thread_flags_become_each_instances_torch_threads(monkeypatch):
    seen = {}

    def fake_start_mesh(num_prefill, num_decode, model, port, **kwargs):
        seen.update(kwargs, num_prefill=num_prefill, num_decode=num_decode, port=port)
        raise KeyboardInterrupt  # as Ctrl-C during start-up: run_up returns 130

    monkeypatch.setattr(launcher, "start_mesh", fake_start_mesh)
    assert cli.main(["up", "--port", "50999", "--prefill-threads", "1", "--decode-threads", "2"]) == 130
    # --dtype from KVMESH_DTYPE (the suite's float32, tests/conftest.py) reaches both roles
    assert seen["extra_prefill_args"] == ["--dtype", "float32", "--torch-threads", "1"]
    assert seen["extra_decode_args"] == ["--dtype", "float32", "--torch-threads", "2"]
    assert (seen["num_prefill"], seen["num_decode"], seen["port"]) == (1, 1, 50999)
    seen.clear()
    assert cli.main(["up", "--port", "50999"]) == 130  # the default: every core, no flag passed
    assert seen["extra_prefill_args"] == seen["extra_decode_args"] == ["--dtype", "float32"]
    assert seen["http_port"] == 8000  # the OpenAI-compatible HTTP API is on by default
    seen.clear()
    assert cli.main(["up", "--port", "50999", "--http-port", "off"]) == 130
    assert seen["http_port"] == 0
    seen.clear()
    assert cli.main(["up", "--port", "50999", "--speculative", "ngram", "--num-draft-tokens", "3"]) == 130
    assert seen["extra_decode_args"] == ["--dtype", "float32", "--speculative", "ngram", "--num-draft-tokens", "3"]
    seen.clear()
    assert cli.main(["up", "--port", "50999", "--dtype", "bf16"]) == 130
    assert seen["extra_prefill_args"] == seen["extra_decode_args"] == ["--dtype", "bf16"]
    assert cli.main(["up", "--port", "50999", "--dtype", "float16"]) == 1  # refused before anything starts


def test_negative_thread_counts_are_refused():
    with pytest.raises(ValueError, match="thread counts must be >= 0"):
        up.run_up(1, 1, None, 50999, prefill_threads=-1)


def test_autoscale_flags_reach_the_gateway_and_bounds_are_checked_before_anything_starts(monkeypatch, capsys):
    seen = {}

    def fake_start_mesh(num_prefill, num_decode, model, port, **kwargs):
        seen.update(kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(launcher, "start_mesh", fake_start_mesh)
    argv = ["up", "--port", "50999", "--autoscale", "--slo-ttft-ms", "3000", "--slo-itl-ms", "600"]
    assert cli.main(argv) == 130
    gateway = seen["extra_gateway_args"]
    assert gateway[gateway.index("--slo-ttft-ms") + 1] == "3000.0" and "--metrics-port" in gateway
    assert seen["keep_cpu_share"] is True  # instances started later open the same CPU-share file
    for bad, message in (
        (["up", "--autoscale"], "give --slo-ttft-ms"),
        (["up", "--max-prefill", "2"], "add --autoscale"),
        ([*argv, "--prefill", "3", "--max-prefill", "2"], "at least the starting count"),
        (["up", "--slo-ttft-ms", "-1"], "SLO targets must be >= 0"),
    ):
        seen.clear()
        assert cli.main(bad) == 1
        assert message in capsys.readouterr().err and not seen
