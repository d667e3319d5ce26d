"""`kvmesh eplb plan`: an EPLB placement (engine.eplb) from recorded per-expert token counts,
with each MoE layer's balancedness before (one replica per expert, experts in order on the
ranks) and after.

The stats file is JSON: {"layers": [[tokens routed to expert 0, 1, ...], ...]}, one row per MoE
layer (hash-routed layers included), as counted over a window of real traffic.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int, required=True, help="expert-parallel ranks")
    p.add_argument("--redundant", type=int, default=0, help="redundant expert slots in all (default 0)")
    p.add_argument("--groups", type=int, default=1, help="expert groups (group-limited routing; default 1)")
    p.add_argument("--nodes", type=int, default=1, help="nodes the ranks form (hierarchical when > 1)")
    p.add_argument("--json", action="store_true", help="print one JSON object: balancedness and placement")
    p.add_argument("stats_file", help='JSON {"layers": [[count per expert], ...]}')


def load_stats(path: str) -> np.ndarray:
    """[L, E] counts from a stats file; ValueError naming what is wrong."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    layers = data.get("layers") if isinstance(data, dict) else None
    if not isinstance(layers, list) or not layers or len({len(row) for row in layers}) != 1:
        raise ValueError(f'{path}: expected {{"layers": [[count per expert], ...]}} with one length per row')
    return np.array(layers, dtype=np.float64)


def run(args: argparse.Namespace) -> int:
    from engine.eplb import balancedness, default_placement, plan

    try:
        load = load_stats(args.stats_file)
        placement = plan(load, args.ranks, args.redundant, args.groups, args.nodes)
        before = balancedness(load, default_placement(load.shape[0], load.shape[1], args.ranks))
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    after = balancedness(load, placement)
    if args.json:
        print(
            json.dumps(
                {
                    "balancedness_before": before.tolist(),
                    "balancedness_after": after.tolist(),
                    "phy2log": placement.phy2log.tolist(),
                    "replicas": placement.replicas.tolist(),
                }
            )
        )
        return 0
    L, E = load.shape
    print(f"{L} MoE layers, {E} experts, {args.ranks} ranks, {args.redundant} redundant slots")
    print(f"{'layer':>5}  {'before':>8}  {'after':>8}  replicas of the hottest expert")
    for i in range(L):
        hot = int(np.argmax(load[i]))
        print(f"{i:>5}  {before[i]:>8.3f}  {after[i]:>8.3f}  expert {hot}: {placement.replicas[i, hot]}")
    print(f"{'mean':>5}  {before.mean():>8.3f}  {after.mean():>8.3f}")
    return 0
