"""Prometheus metrics of a MoE model's expert load, read from the runner at scrape time (no
cost per forward): the input EPLB plans from (kvmesh.engine.ep.eplb, `kvmesh eplb stats`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry


class ExpertLoadCollector(Collector):
    """`kvmesh_moe_expert_tokens_total{layer, expert}`: tokens routed to each expert since start;
    `kvmesh_moe_expert_balancedness{layer}`: mean over max of those counts (the balancedness
    with one expert a rank: 1.0 even, 1/E all on one expert).

    counts: returns [L, E] int64, or None for a dense model (then nothing is exported)."""

    def __init__(self, counts: Callable[[], np.ndarray | None]) -> None:
        self.counts = counts

    def collect(self) -> Iterator:
        counts = self.counts()
        if counts is None:
            return
        tokens = CounterMetricFamily(
            "kvmesh_moe_expert_tokens", "Tokens routed to each expert of each MoE layer", labels=["layer", "expert"]
        )
        balance = GaugeMetricFamily(
            "kvmesh_moe_expert_balancedness", "Mean over max tokens per expert, per MoE layer", labels=["layer"]
        )
        for layer, row in enumerate(counts):
            for expert, n in enumerate(row):
                tokens.add_metric([str(layer), str(expert)], float(n))
            top = row.max()
            balance.add_metric([str(layer)], float(row.mean() / top) if top else 1.0)
        yield tokens
        yield balance


_REGISTERED: dict[int, ExpertLoadCollector] = {}


def register_expert_load(registry: CollectorRegistry, counts: Callable[[], np.ndarray | None]) -> None:
    """Export the expert load of a runner (`runner.expert_token_counts`) on `registry`; a later
    call for the same registry replaces the earlier runner."""
    old = _REGISTERED.pop(id(registry), None)
    if old is not None:
        registry.unregister(old)
    _REGISTERED[id(registry)] = collector = ExpertLoadCollector(counts)
    registry.register(collector)
