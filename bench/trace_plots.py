"""PNG plots of a trace replay (`kvmesh bench --trace ... --plot DIR`), measured next to simulated.

Four figures, each a file in DIR:
- ttft_cdf.png: CDF of TTFT (ms) from each request's arrival in the trace, the mesh's (the
  wait for a free client slot, then the gateway's `Final.ttft_s`) and the simulation's (queue
  + prefill at the prefill rate the mesh measured);
- itl_cdf.png: CDF of each request's mean inter-token latency (ms), the mesh's only (the
  simulation models no decode);
- computed_tokens.png: prompt tokens each prefill instance computed, cumulative over time
  (seconds from the replay's start), measured as solid lines and simulated as dashed ones;
- hit_rate.png: the cumulative prefix-cache hit rate (cached / prompt tokens) over time.
Drawn with matplotlib's object-oriented API (no pyplot state), so it is safe in any thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvmesh.bench.routing_sim import SimRequest

PLOT_FILES = ("ttft_cdf.png", "itl_cdf.png", "computed_tokens.png", "hit_rate.png")


@dataclass(frozen=True)
class MeasuredRequest:
    """One replayed request as the mesh answered it (seconds; tokens; the prefill instance's id)."""

    sent_s: float  # from the replay's start
    ttft_s: float  # the gateway's (Final.ttft_s), from the send
    itl_s: float  # 0 when only one token was generated
    prompt_tokens: int
    cached_tokens: int
    prefill_instance: str
    prefill_s: float = 0.0  # prefill compute (Final.prefill_s)
    arrival_s: float | None = None  # when the trace says it arrives (its send waits for a slot)

    @property
    def ttft_from_arrival_s(self) -> float:
        """TTFT counted from the trace's arrival: with waiting for a free client slot, as the
        simulation counts it (it has no bound on requests in flight)."""
        return self.first_token_s - (self.sent_s if self.arrival_s is None else self.arrival_s)

    @property
    def first_token_s(self) -> float:
        return self.sent_s + self.ttft_s


def _cdf(ax, values_ms: Sequence[float], label: str, style: str = "-") -> None:
    v = np.sort(np.asarray(values_ms, dtype=np.float64))
    if v.size:
        ax.step(v, np.arange(1, v.size + 1) / v.size, style, where="post", label=f"{label} (p50 {np.median(v):.0f} ms)")


def _cumulative(times: Sequence[float], amounts: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    order = np.argsort(np.asarray(times, dtype=np.float64), kind="stable")
    t = np.asarray(times, dtype=np.float64)[order]
    return t, np.cumsum(np.asarray(amounts, dtype=np.float64)[order])


def write_plots(out_dir: Path, measured: Sequence[MeasuredRequest], simulated: Sequence[SimRequest]) -> list[Path]:
    """Write the four PNGs (PLOT_FILES) into out_dir (created if missing) and return their paths.

    `simulated` times are seconds from the replay's start too (the bench divides the trace's
    arrivals by its speed-up before simulating). Raises ValueError when `measured` is empty.
    """
    from matplotlib.figure import Figure

    if not measured:
        raise ValueError("no measured requests to plot")
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []

    def save(fig, name: str) -> None:
        for ax in fig.axes:
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize="small")
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=100)
        paths.append(out_dir / name)

    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    _cdf(ax, [m.ttft_from_arrival_s * 1e3 for m in measured], "measured")
    _cdf(ax, [(s.finish_s - s.arrival_s) * 1e3 for s in simulated], "simulated", "--")
    ax.set(xlabel="TTFT (ms)", ylabel="fraction of requests", title="Time to first token")
    save(fig, "ttft_cdf.png")

    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    _cdf(ax, [m.itl_s * 1e3 for m in measured if m.itl_s > 0], "measured")
    ax.set(xlabel="mean ITL per request (ms)", ylabel="fraction of requests", title="Inter-token latency")
    save(fig, "itl_cdf.png")

    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    for k, name in enumerate(sorted({m.prefill_instance for m in measured})):
        rows = [m for m in measured if m.prefill_instance == name]
        t, c = _cumulative([m.first_token_s for m in rows], [m.prompt_tokens - m.cached_tokens for m in rows])
        ax.step(np.r_[0.0, t], np.r_[0.0, c], "-", where="post", color=f"C{k}", label=f"measured {name}")
    for k in sorted({s.instance for s in simulated}):
        rows_s = [s for s in simulated if s.instance == k]
        t, c = _cumulative([s.finish_s for s in rows_s], [s.computed_tokens for s in rows_s])
        ax.step(np.r_[0.0, t], np.r_[0.0, c], "--", where="post", color=f"C{k}", label=f"simulated {k}")
    ax.set(xlabel="seconds from the start", ylabel="prompt tokens computed", title="Prefill work per instance")
    save(fig, "computed_tokens.png")

    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    t, cached = _cumulative([m.first_token_s for m in measured], [m.cached_tokens for m in measured])
    _, prompt = _cumulative([m.first_token_s for m in measured], [m.prompt_tokens for m in measured])
    ax.plot(t, cached / np.maximum(prompt, 1), "-", label="measured")
    if simulated:
        t, computed = _cumulative([s.finish_s for s in simulated], [s.computed_tokens for s in simulated])
        _, prompt = _cumulative([s.finish_s for s in simulated], [s.prompt_tokens for s in simulated])
        ax.plot(t, 1.0 - computed / np.maximum(prompt, 1), "--", label="simulated")
    ax.set(xlabel="seconds from the start", ylabel="cached / prompt tokens", title="Prefix-cache hit rate (cumulative)")
    ax.set_ylim(0, 1)
    save(fig, "hit_rate.png")
    return paths
