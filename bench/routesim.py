"""`kvmesh routesim`: replay a Mooncake-format trace against the gateway's real router.

The simulated instances, their prefix caches and queues are in bench/routing_sim.py; with
--sglang, SGLang's own router decides too (bench/sglang_router.py).

Printed per policy:
- hit_rate: prompt blocks found in the chosen instance's cache / all prompt blocks;
- oracle_hit_rate: the same for one cache of num_instances x capacity_blocks blocks that
  sees every request (the best any routing can do with that much memory);
- balancedness: mean / max prefill tokens computed per instance (1.0 = perfectly even);
- queue_p50_s, queue_p90_s: time from arrival to the start of its prefill.
With --tier-blocks (each instance's second KV tier) or --pull-min-blocks (pull from a peer):
- tier, pulled: prompt blocks copied back from the chosen instance's tier / pulled from a peer;
- computed vs oracle: prompt tokens computed over what one cache of the mesh's whole size
  (pools and tiers) would compute (1.0 = as good as that cache).
Trace format: ../shared/traces/README.md (one block = 512 tokens, `hash_ids` per block).
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from kvmesh.bench.routing_sim import SimResult, fixed_chooser, load_trace, router_chooser, simulate
from kvmesh.gateway.router import POLICIES, PrefillRouter


def run(args: argparse.Namespace) -> int:
    """Raises ValueError for bad arguments or an empty or malformed trace, OSError for an unreadable file."""
    if args.instances < 1:
        raise ValueError(f"--instances must be >= 1, got {args.instances}")
    if args.capacity_blocks < 0:
        raise ValueError(f"--capacity-blocks must be >= 0 (0: unlimited), got {args.capacity_blocks}")
    if not (math.isfinite(args.tokens_per_s) and args.tokens_per_s > 0):
        raise ValueError(f"--tokens-per-s must be a finite number > 0, got {args.tokens_per_s}")
    if args.tier_blocks < 0 or args.pull_min_blocks < 0:
        raise ValueError("--tier-blocks and --pull-min-blocks must be >= 0")
    if args.limit < 0:
        raise ValueError(f"--limit must be >= 0 (0: the whole trace), got {args.limit}")
    trace = load_trace(args.trace)
    if args.limit:
        trace = trace[: args.limit]
    if not trace:
        raise ValueError(f"{args.trace} holds no requests")
    policies = args.policy or list(POLICIES)
    rows: list[SimResult] = []
    for p in policies:
        rows.append(
            simulate(
                trace,
                args.instances,
                args.capacity_blocks,
                router_chooser(p, cache_threshold=args.cache_threshold, load_weight=args.load_weight),
                args.tokens_per_s,
                policy=p,
                tier_blocks=args.tier_blocks,
                pull_min_blocks=args.pull_min_blocks,
            )
        )
    if args.sglang:
        from kvmesh.bench.sglang_router import sglang_assignments

        with open(args.trace) as f:  # the raw rows: the replay also holds requests for their output length
            raw = [{"output_length": 0, **json.loads(line)} for line in f if line.strip()][: len(trace)]
        for p in ("cache_aware", "prefix_hash"):
            rows.append(
                simulate(
                    trace,
                    args.instances,
                    args.capacity_blocks,
                    fixed_chooser(sglang_assignments(raw, args.instances, p)),
                    args.tokens_per_s,
                    policy=f"sglang:{p}",
                )
            )
    if args.json:
        for row in rows:
            print(
                json.dumps(
                    {
                        "policy": row.policy,
                        "hit_rate": row.hit_rate,
                        "oracle_hit_rate": row.oracle_hit_rate,
                        "balancedness": row.balancedness,
                        "queue_p50_s": row.queue_p50_s,
                        "queue_p90_s": row.queue_p90_s,
                        "tier_hit_rate": row.tier_hit_rate,
                        "pull_rate": row.pull_rate,
                        "computed_tokens": row.computed_tokens,
                        "oracle_computed_tokens": row.oracle_computed_tokens,
                    }
                )
            )
        return 0
    cap = "unlimited" if not args.capacity_blocks else f"{args.capacity_blocks} blocks"
    print(
        f"{len(trace)} requests, {args.instances} instances, capacity {cap} each, "
        f"{args.tokens_per_s:.0f} prefill tok/s per instance"
    )
    extra = bool(args.tier_blocks or args.pull_min_blocks)
    print(
        f"{'policy':<20}{'hit rate':>10}{'oracle':>9}{'vs oracle':>11}{'balanced':>10}{'queue p50':>11}{'p90':>9}"
        + (f"{'tier':>8}{'pulled':>8}{'computed vs oracle':>20}" if extra else "")
    )
    for row in rows:
        print(
            f"{row.policy:<20}{row.hit_rate:>10.4f}{row.oracle_hit_rate:>9.4f}"
            f"{row.hit_rate / max(row.oracle_hit_rate, 1e-9):>11.3f}{row.balancedness:>10.3f}"
            f"{row.queue_p50_s:>10.2f}s{row.queue_p90_s:>8.2f}s"
            + (
                f"{row.tier_hit_rate:>8.4f}{row.pull_rate:>8.4f}"
                f"{row.computed_tokens / max(row.oracle_computed_tokens, 1):>20.3f}"
                if extra
                else ""
            )
        )
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="Mooncake-format JSONL trace")
    p.add_argument("--instances", type=int, default=4)
    p.add_argument("--capacity-blocks", type=int, default=0, help="LRU blocks per instance (0: unlimited)")
    p.add_argument(
        "--policy", action="append", choices=POLICIES, help="policy to run (repeatable; default: every policy)"
    )
    p.add_argument("--tokens-per-s", type=float, default=10000.0, help="prefill tokens/s of one instance")
    p.add_argument(
        "--tier-blocks", type=int, default=0, help="each instance's second KV tier, blocks its cache evicted (0: none)"
    )
    p.add_argument(
        "--pull-min-blocks",
        type=int,
        default=0,
        help="pull a prefix from the peer holding at least this many blocks more than the chosen instance (0: never)",
    )
    p.add_argument("--cache-threshold", type=float, default=PrefillRouter.cache_threshold)
    p.add_argument("--load-weight", type=float, default=PrefillRouter.load_weight)
    p.add_argument("--sglang", action="store_true", help="also replay through sglang-router (cache_aware, prefix_hash)")
    p.add_argument("--limit", type=int, default=0, help="first N requests only")
    p.add_argument("--json", action="store_true", help="one JSON object per policy")


if __name__ == "__main__":
    from kvmesh.commands import Command

    sys.exit(Command(__doc__.splitlines()[0], add_arguments, run).main("kvmesh routesim"))
