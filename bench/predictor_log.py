"""Where the TTFT predictor misses, from its log (a gateway's --predictor-log).

    python -P -m kvmesh.bench.predictor_log PATH [PATH ...]

Per file: the requests, the share whose prediction (calibrated, and raw: before the gateway's
calibration) was within 25% of the TTFT measured, and, over the requests it missed, the
median of measured over predicted for each part of TTFT (kvmesh.gateway.prediction_log):

    prefill    the wait at prefill and its compute: measured_queue_s + measured_compute_s
               against queue_s + compute_s (the compute's turns on shared cores are in the
               predicted queue, so the two compare as a sum)
    push       measured_push_s against push_s
    hops       what the TTFT measured holds beyond prefill's parts (the gateway's calls, the
               first token's way back), against none (raw_s is the sum of the predicted parts)

and how many of the misses each part explains most (the part whose error, in seconds, is the
largest). Lines without the measured parts (an older gateway's) count only in the first figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter

WITHIN = 0.25


def summary(records: list[dict]) -> dict:
    """The figures above for one log's records."""
    if not records:
        return {"requests": 0}

    def within(key: str) -> float:
        return sum(abs(r[key] / r["measured_s"] - 1) <= WITHIN for r in records) / len(records)

    missed = [r for r in records if abs(r["predicted_s"] / r["measured_s"] - 1) > WITHIN and "measured_queue_s" in r]
    parts = {name: [_part(r, name) for r in missed] for name in ("prefill", "push", "hops")}
    worst = Counter(max(parts, key=lambda name: abs(parts[name][i][1] - parts[name][i][0])) for i in range(len(missed)))
    return {
        "requests": len(records),
        "within 25%": f"{within('predicted_s'):.2f}",
        "raw within 25%": f"{within('raw_s'):.2f}",
        "missed": len(missed),
        **{
            f"{name}: measured / predicted (median)": _median_ratio(pairs)
            for name, pairs in parts.items()
            if name != "hops"
        },
        "hops: measured s (median)": f"{statistics.median(m for _, m in parts['hops']):.3f}" if missed else "-",
        "the part most off": ", ".join(f"{name} {worst[name]}" for name in parts),
    }


def _part(r: dict, name: str) -> tuple[float, float]:
    """(predicted, measured) seconds of one part of a record's TTFT."""
    if name == "prefill":
        return r["queue_s"] + r["compute_s"], r["measured_queue_s"] + r["measured_compute_s"]
    if name == "push":
        return r["push_s"], r["measured_push_s"]
    measured_parts = r["measured_queue_s"] + r["measured_compute_s"] + r["measured_push_s"]
    return 0.0, max(r["measured_s"] - measured_parts, 0.0)  # raw_s is the sum of the parts: none left for hops


def _median_ratio(pairs: list[tuple[float, float]]) -> str:
    ratios = [m / p for p, m in pairs if p > 0]
    return f"{statistics.median(ratios):.2f}" if ratios else "-"


def read(path: str) -> list[dict]:
    """The records of one log (blank lines skipped)."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", metavar="PATH")
    args = parser.parse_args(argv)
    for path in args.paths:
        print_summary(path)
    return 0


def print_summary(path: str, title: str = "") -> None:
    """Print the figures of the log at `path`, under its name (and `title`)."""
    print(f"{path} {title}".rstrip())
    for key, value in summary(read(path)).items():
        print(f"  {key:<40} {value}")


if __name__ == "__main__":
    sys.exit(main())
