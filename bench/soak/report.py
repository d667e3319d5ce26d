"""The soak's verdict: one JSON object and a plot over time.

Keys: `sent`, `finished` (answered, or cancelled by the client), `failed` (by status), `failed_by_fault`
(by the fault under way when the request ended, or within FAULT_SHADOW_S after it was undone;
"none" otherwise), `hung`, `wrong` (and `wrong_examples`), `crashed` (and `crashes`), `leaked_pages`
(by instance), `integrity_errors`, `near_ties` (a greedy answer that first parts from the
reference at a token within workload.NEAR_TIE_NATS of the reference's own: not wrong, counted), `rss_slope_mb_per_hour` (by service, over the last half of
the run, on its last life), `faults`, `by_fault_kind` (fault_table: what a client saw under each
kind of fault, and how long it waited), and `tier_corrupt_detected` (tier blocks that did not check
out and were recomputed, from the services' logs).
"""

from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np

from kvmesh.bench.soak.faults import Fault
from kvmesh.bench.soak.mesh import Crash
from kvmesh.bench.soak.workload import Outcome

FAULT_SHADOW_S = 10.0
"""A failure this long after a fault was undone is still put down to it (leases, reconnects)."""
TIER_REJECTED = "; recomputing it"
"""How a prefill logs a tier block that is unreadable, short or does not check out (kvstore/kv_tier.py)."""


def blame(o: Outcome, faults: list[Fault]) -> str:
    """The fault `o` is put down to: the one under way when it ended, else the last one undone
    at most FAULT_SHADOW_S before; "none" otherwise."""
    for f in faults:
        if f.at <= o.ended <= (f.ended or f.at):
            return f"{f.kind}:{f.target}"
    for f in reversed(faults):
        if (f.ended or f.at) <= o.ended <= (f.ended or f.at) + FAULT_SHADOW_S:
            return f"{f.kind}:{f.target}"
    return "none"


def fault_table(outcomes: list[Outcome], faults: list[Fault]) -> dict[str, dict]:
    """By fault kind: how many faults, the requests that ended under one (blame), how many
    finished, the failures by status, the seconds a failed request waited for its status
    (p50, max) and the finished ones' end-to-end seconds (p50, p99). Kinds that never ran are
    left out."""
    kind_of = {f"{f.kind}:{f.target}": f.kind for f in faults}
    rows: dict[str, dict] = {}
    for kind in sorted({f.kind for f in faults}):
        rows[kind] = {"faults": sum(f.kind == kind for f in faults), "requests": 0, "finished": 0, "failed": Counter()}
    waits: dict[str, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    for o in outcomes:
        kind = kind_of.get(blame(o, faults))
        if kind is None:
            continue
        row = rows[kind]
        row["requests"] += 1
        done = o.status in ("ok", "cancelled")
        row["finished"] += done
        if not done:
            row["failed"][o.status] += 1
        waits[kind][done].append(o.ended - o.sent)
    for kind, row in rows.items():
        failed_s, finished_s = waits[kind]
        row["failed"] = dict(sorted(row["failed"].items()))
        row["failed_wait_s"] = _percentiles(failed_s, (50, 100))
        row["finished_s"] = _percentiles(finished_s, (50, 99))
    return rows


def _percentiles(values: list[float], qs: tuple[int, ...]) -> dict[str, float]:
    """{"p50": ..., "max": ...} of values, rounded to 0.1 s; {} when there are none."""
    if not values:
        return {}
    return {("max" if q == 100 else f"p{q}"): round(float(np.percentile(values, q)), 1) for q in qs}


def markdown_table(verdict: dict) -> str:
    """The verdict's `by_fault_kind` as a markdown table (docs/operations.md)."""
    lines = [
        "| fault | faults | requests under it | finished | failed, by status | a failure's wait (s), p50 / max | finished (s), p50 / p99 |",
        "|---|---|---|---|---|---|---|",
    ]
    for kind, row in verdict["by_fault_kind"].items():
        failed = ", ".join(f"{n} {status}" for status, n in row["failed"].items()) or "none"
        wait = " / ".join(str(v) for v in row["failed_wait_s"].values()) or "-"
        took = " / ".join(str(v) for v in row["finished_s"].values()) or "-"
        lines.append(
            f"| `{kind}` | {row['faults']} | {row['requests']} | {row['finished']} | {failed} | {wait} | {took} |"
        )
    return "\n".join(lines)


WARMUP_S = 30.0
"""A service's RSS grows as it warms up (pages touched, caches filled): its first seconds of a
life are left out of its slope."""


def rss_slopes(samples: list[dict], starts: dict[str, list[float]], start: float, end: float) -> dict[str, float]:
    """Each service's RSS slope (MB/hour, least squares) over the last half of [start, end], on its
    longest life there (`starts`: each life's start, in order) less that life's first WARMUP_S; a
    service with fewer than 5 such samples is left out. A service restarted by the faults starts
    low and climbs to its working set: fitted across lives, that climb would read as a leak."""
    half = start + (end - start) / 2
    segments: dict[str, dict[float, list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
    for s in samples:
        if s["t"] < half:
            continue
        for name, mb in s["rss_mb"].items():
            life = max((t for t in starts.get(name, [float("-inf")]) if t <= s["t"]), default=float("-inf"))
            if s["t"] >= life + WARMUP_S:
                segments[name][life].append((s["t"], mb))
    slopes = {}
    for name, lives in sorted(segments.items()):
        points = max(lives.values(), key=lambda pts: pts[-1][0] - pts[0][0])
        if len(points) >= 5:
            t, mb = np.array(points).T
            if np.ptp(t) > 0:
                slopes[name] = round(float(np.polyfit(t, mb, 1)[0]) * 3600, 1)
    return slopes


def summarize(
    outcomes: list[Outcome],
    faults: list[Fault],
    crashes: list[Crash],
    leaked: dict[str, int],
    integrity: list[str],
    slopes: dict[str, float],
    logs: str,
    duration_s: float,
    seed: int,
) -> dict:
    failed = Counter(o.status for o in outcomes if o.status not in ("ok", "cancelled", "hung"))
    by_fault: dict[str, Counter] = defaultdict(Counter)
    for o in outcomes:
        if o.status not in ("ok", "cancelled"):
            by_fault[blame(o, faults)][o.status] += 1
    wrong = [o for o in outcomes if o.wrong]
    ties = [o for o in outcomes if o.near_tie]
    return {
        "seed": seed,
        "duration_s": round(duration_s, 1),
        "sent": len(outcomes),
        "finished": sum(o.status in ("ok", "cancelled") for o in outcomes),
        "failed": dict(sorted(failed.items())),
        "failed_by_fault": {k: dict(v) for k, v in sorted(by_fault.items())},
        "hung": sum(o.status == "hung" for o in outcomes),
        "wrong": len(wrong),
        "wrong_examples": [f"{o.kind} at {o.ended:.1f} s: {o.wrong} ({o.detail})" for o in wrong[:10]],
        "near_ties": len(ties),
        "near_tie_examples": [f"{o.kind} at {o.ended:.1f} s: {o.near_tie}" for o in ties[:10]],
        "checked": sum(o.status == "ok" and o.kind not in ("n2", "cancel") for o in outcomes),
        "crashed": len(crashes),
        "crashes": [c.json() for c in crashes],
        "leaked_pages": leaked,
        "integrity_errors": integrity,
        "rss_slope_mb_per_hour": slopes,
        "faults": [f.json() for f in faults],
        "by_fault_kind": fault_table(outcomes, faults),
        "tier_corrupt_detected": logs.count(TIER_REJECTED),
    }


def plot(path: str, outcomes: list[Outcome], samples: list[dict], faults: list[Fault], bin_s: float = 10.0) -> None:
    """Requests/s (finished, failed), p99 TTFT, pages used per instance and RSS per service over
    time, the faults as shaded spans; a PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(11, 11), sharex=True)
    end = max([o.ended for o in outcomes] + [s["t"] for s in samples] + [1.0])
    edges = np.arange(0.0, end + bin_s, bin_s)
    mids = edges[:-1] + bin_s / 2
    ok = np.histogram([o.ended for o in outcomes if o.status in ("ok", "cancelled")], edges)[0] / bin_s
    bad = np.histogram([o.ended for o in outcomes if o.status not in ("ok", "cancelled")], edges)[0] / bin_s
    axes[0].plot(mids, ok, label="finished")
    axes[0].plot(mids, bad, label="failed", color="tab:red")
    axes[0].set_ylabel("requests/s")
    p99 = []
    for lo in edges[:-1]:
        ttfts = [o.ttft_s for o in outcomes if o.ttft_s is not None and lo <= o.ended < lo + bin_s]
        p99.append(np.percentile(ttfts, 99) if ttfts else np.nan)
    axes[1].plot(mids, p99)
    axes[1].set_ylabel("p99 TTFT (s)")
    for key, ax, label in (("pages_used", axes[2], "pages used"), ("rss_mb", axes[3], "RSS (MiB)")):
        names = sorted({n for s in samples for n in s[key]})
        for name in names:
            pts = [(s["t"], s[key][name]) for s in samples if name in s[key]]
            ax.plot(*zip(*pts, strict=True), label=name)
        ax.set_ylabel(label)
        ax.legend(fontsize=7, ncol=4)
    axes[0].legend(fontsize=7)
    for f in faults:
        for ax in axes:
            ax.axvspan(f.at, f.ended or f.at, color="tab:orange", alpha=0.2)
        axes[0].annotate(f.kind, (f.at, 0), rotation=90, fontsize=6, va="bottom")
    axes[-1].set_xlabel("seconds into the run")
    fig.suptitle("kvmesh soak: requests, TTFT, pages and RSS under faults (shaded)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
