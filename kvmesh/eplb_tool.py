"""`kvmesh eplb stats` and `kvmesh eplb plan`: record the expert load of live instances, and
turn it into an EPLB placement (kvmesh.engine.ep.eplb).

`stats` asks each instance's GetStats for its per-expert token counts (every MoE layer, top-k
and hash-routed alike, since it started; with --window S, the traffic of the next S seconds),
adds them up, prints each layer's balancedness at --ranks with experts in order, one replica
each, and writes the stats file; for an expert-parallel decode (`--ep N`) it also prints, per
layer, the balancedness of the placement in use measured on its live ranks next to what
`kvmesh.engine.ep.eplb.balancedness` predicts for that placement from the same counts.
`plan` reads such a file and prints each layer's balancedness before and after EPLB.

The stats file is JSON: {"layers": [[tokens routed to expert 0, 1, ...], ...]}, one row per MoE
layer.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

import numpy as np


def add_stats_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--instance", action="append", required=True, help="a prefill or decode HOST:PORT (repeatable)")
    p.add_argument("--ranks", type=int, default=4, help="EP ranks to report balancedness at (default 4)")
    p.add_argument("--window", type=float, default=0.0, help="seconds of traffic to count (0: since start)")
    p.add_argument("-o", "--output", default="", help="write the stats file here")


@dataclass(frozen=True)
class InstanceLoad:
    """What one instance's GetStats says of its MoE load."""

    expert_tokens: np.ndarray
    """[L, E] tokens routed to each expert."""
    ep_rank_tokens: np.ndarray | None = None
    """[L, R] rows each expert-parallel rank's experts computed (decode --ep only)."""
    ep_phy2log: np.ndarray | None = None
    """[L, P] the placement in use (decode --ep only)."""

    def __sub__(self, earlier: InstanceLoad) -> InstanceLoad:
        ranks = None if self.ep_rank_tokens is None else self.ep_rank_tokens - earlier.ep_rank_tokens
        return InstanceLoad(self.expert_tokens - earlier.expert_tokens, ranks, self.ep_phy2log)


async def _instance_load(address: str) -> InstanceLoad:
    """One instance's expert load from its GetStats (Decode or Prefill service)."""
    import grpc

    from kvmesh.engine.ep.eplb import counts_from_stats
    from kvmesh.protos.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stats = None
        for stub in (decode_pb2_grpc.DecodeStub(channel), prefill_pb2_grpc.PrefillStub(channel)):
            try:
                stats = await stub.GetStats(common_pb2.StatsRequest(), timeout=10)
                break
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise ValueError(f"{address}: GetStats failed: {exc.code().name} {exc.details()}") from None
    if stats is None or not stats.num_experts:
        raise ValueError(f"{address} serves no MoE model (no expert counts in its stats)")
    counts = counts_from_stats(stats.num_experts, stats.expert_tokens)
    if not stats.ep_ranks:
        return InstanceLoad(counts)
    ranks = np.asarray(list(stats.ep_rank_tokens), np.int64).reshape(-1, stats.ep_ranks)
    phy2log = np.asarray(list(stats.ep_phy2log), np.int64).reshape(-1, stats.ep_slots_per_layer)
    return InstanceLoad(counts, ranks, phy2log)


async def record_loads(addresses: list[str], window_s: float = 0.0) -> list[InstanceLoad]:
    """Each instance's expert load: since start, or over the next window_s seconds. Raises
    ValueError for an instance without expert counts, or instances of different layouts."""
    import asyncio

    async def snapshot() -> list[InstanceLoad]:
        loads = await asyncio.gather(*(_instance_load(a) for a in addresses))
        if len({x.expert_tokens.shape for x in loads}) != 1:
            raise ValueError(f"instances report different expert layouts: {[x.expert_tokens.shape for x in loads]}")
        return list(loads)

    start = await snapshot()
    if window_s <= 0:
        return start
    await asyncio.sleep(window_s)
    return [b - a for a, b in zip(start, await snapshot())]


async def record(addresses: list[str], window_s: float = 0.0) -> np.ndarray:
    """[L, E] tokens routed to each expert summed over `addresses`: since start, or over the next
    window_s seconds. Raises ValueError for an instance without expert counts or of another shape."""
    return np.sum([x.expert_tokens for x in await record_loads(addresses, window_s)], axis=0)


def run_stats(args: argparse.Namespace) -> int:
    import asyncio

    from kvmesh.engine.ep.eplb import balancedness, default_placement, mean_over_max, placement_of

    try:
        loads = asyncio.run(record_loads(args.instance, args.window))
        load = np.sum([x.expert_tokens for x in loads], axis=0)
        current = balancedness(load, default_placement(load.shape[0], load.shape[1], args.ranks))
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{load.shape[0]} MoE layers, {load.shape[1]} experts, {int(load[0].sum())} routings in layer 0")
    print(f"{'layer':>5}  {'balancedness at ' + str(args.ranks) + ' ranks':>26}  tokens per expert")
    for i, row in enumerate(load):
        print(f"{i:>5}  {current[i]:>26.3f}  {row.astype(int).tolist()}")
    for address, x in zip(args.instance, loads):
        if x.ep_rank_tokens is None or x.ep_phy2log is None:
            continue
        # an expert-parallel decode: its placement in use, measured on its live ranks, next to
        # what the planner predicts for that placement from the same traffic's counts
        R = x.ep_rank_tokens.shape[1]
        predicted = balancedness(x.expert_tokens, placement_of(x.ep_phy2log, load.shape[1], R))
        measured = mean_over_max(x.ep_rank_tokens)
        print(f"{address}: expert-parallel over {R} ranks, the placement in use")
        print(f"{'layer':>5}  {'measured':>9}  {'predicted':>9}  rows per rank")
        for i in range(len(measured)):
            print(f"{i:>5}  {measured[i]:>9.3f}  {predicted[i]:>9.3f}  {x.ep_rank_tokens[i].tolist()}")
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            json.dump({"layers": load.astype(int).tolist()}, f)
        print(f"wrote {args.output}")
    return 0


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
    from kvmesh.engine.ep.eplb import balancedness, default_placement, plan

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
