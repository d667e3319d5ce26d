"""kvmesh.bench.predictor_log: where the TTFT predictor misses, from records worked out by hand."""

from kvmesh.bench.predictor_log import summary


def _record(queue, compute, push, predicted, measured, m_queue, m_compute, m_push):
    return {
        "queue_s": queue,
        "compute_s": compute,
        "push_s": push,
        "raw_s": queue + compute + push,
        "predicted_s": predicted,
        "measured_s": measured,
        "measured_queue_s": m_queue,
        "measured_compute_s": m_compute,
        "measured_push_s": m_push,
    }


def test_each_miss_is_put_on_the_part_whose_seconds_are_most_off():
    records = [
        # within 25%: not a miss
        _record(0.5, 1.0, 0.1, 1.6, 1.7, 0.5, 1.1, 0.1),
        # prefill waited 4 s, not 1: a miss by the queue and compute (3 s off)
        _record(1.0, 1.0, 0.1, 2.1, 5.2, 4.0, 1.0, 0.1),
        # the push took 2 s, not 0.1: a miss by the push (1.9 s off)
        _record(0.0, 1.0, 0.1, 1.1, 3.1, 0.0, 1.0, 2.0),
        # prefill's parts as predicted, 2 s more on the way: a miss by the hops
        _record(0.0, 1.0, 0.1, 1.1, 3.1, 0.0, 1.0, 0.1),
    ]
    got = summary(records)
    assert (got["requests"], got["within 25%"], got["missed"]) == (4, "0.25", 3)
    assert got["the part most off"] == "prefill 1, push 1, hops 1"
    # prefill measured / predicted over the misses: 2.5, 1.0, 1.0
    assert got["prefill: measured / predicted (median)"] == "1.00"
    assert got["push: measured / predicted (median)"] == "1.00"  # 1.0, 20, 1.0
    assert got["hops: measured s (median)"] == "0.100"  # 0.1, 0.1, 2.0


def test_an_empty_log_says_so():
    assert summary([]) == {"requests": 0}
