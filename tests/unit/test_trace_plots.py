"""`kvmesh bench --trace --plot`: the PNGs drawn from a replay's records and a simulation's."""

import numpy as np
import pytest

from kvmesh.bench.routing_sim import TraceRequest, router_chooser, simulate
from kvmesh.bench.trace import measured_prefill_rate, scale_trace
from kvmesh.bench.trace_plots import PLOT_FILES, MeasuredRequest, write_plots

# six requests, two prefixes of 3 shared blocks, one every 0.1 s
TRACE = [TraceRequest(0.1 * i, 0, (100 + i % 2, 200 + i % 2, 300 + i % 2, 1000 + i)) for i in range(6)]


def _simulated_as_measured(sim):
    # records shaped as the mesh gives them, from the simulation itself: the plots must draw both
    return [
        MeasuredRequest(
            r.arrival_s,
            r.finish_s - r.arrival_s,
            0.02 + 0.001 * i,
            r.prompt_tokens,
            r.prompt_tokens - r.computed_tokens,
            f"prefill-{r.instance}",
            r.finish_s - r.start_s,
        )
        for i, r in enumerate(sim.requests)
    ]


def test_plots_are_written_as_pngs(tmp_path):
    from matplotlib.image import imread

    prompts, scaled = scale_trace(TRACE, 8)
    assert [len(p) for p in prompts] == [32] * 6 and prompts[0][:24] == prompts[2][:24]
    sim = simulate(scaled, 2, 0, router_chooser("cache_aware", 8), 400.0, "cache_aware", 8)
    measured = _simulated_as_measured(sim)
    # the rate the simulated records imply is the rate they were simulated at
    assert measured_prefill_rate(measured) == pytest.approx(400.0)
    paths = write_plots(tmp_path / "plots", measured, sim.requests)
    assert [p.name for p in paths] == list(PLOT_FILES)
    for p in paths:
        img = imread(p)
        assert img.shape[:2] == (400, 600), (p.name, img.shape)
        # drawn on, not blank: more than a handful of distinct colours
        assert len(np.unique(img.reshape(-1, img.shape[-1]), axis=0)) > 10, p.name


def test_nothing_to_plot_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="no measured requests"):
        write_plots(tmp_path, [], [])


def test_a_batched_prefill_counts_its_time_once():
    # two requests prefilled together in one 1 s batch (each reports the batch's 1 s), and one
    # alone on the other instance: 300 tokens in 2 busy instance-seconds, not in 3
    both = [MeasuredRequest(0.0, 1.0, 0.0, 100, 0, "a", 1.0), MeasuredRequest(0.0, 1.0, 0.0, 100, 0, "a", 1.0)]
    alone = MeasuredRequest(0.5, 1.0, 0.0, 132, 32, "b", 1.0)
    assert measured_prefill_rate([*both, alone]) == pytest.approx(150.0)


def test_ttft_from_arrival_counts_the_wait_for_a_client_slot():
    # due at 1.0 s, sent at 3.0 s (all slots busy), first token 0.5 s after the send
    m = MeasuredRequest(3.0, 0.5, 0.0, 10, 0, "a", 0.2, arrival_s=1.0)
    assert m.ttft_from_arrival_s == pytest.approx(2.5)
    assert MeasuredRequest(3.0, 0.5, 0.0, 10, 0, "a").ttft_from_arrival_s == pytest.approx(0.5)
