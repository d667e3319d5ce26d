# L=MoE layers, E=logical (routed) experts, P=physical expert slots (E + redundant), R=ranks,
# N=nodes, G=expert groups
"""EPLB, the expert-parallel load balancer: turn per-expert token counts into a placement of
expert replicas on ranks whose loads are as even as the counts allow.

The algorithm is DeepSeek's published one (DeepSeek-V3 technical report, arXiv:2412.19437,
section 3.4, and the EPLB repository, github.com/deepseek-ai/EPLB, `rebalance_experts`), written
here from its description:

1. redundant experts: the P - E extra slots go one at a time to the expert whose load per
   replica is highest (its load split evenly over its replicas);
2. balanced packing: the P replicas go onto the R ranks, P / R each, heaviest first, each to the
   least loaded rank that still has a free slot;
3. hierarchical, when the ranks form N nodes and the experts G groups with G % N == 0 (DeepSeek's
   group-limited routing): whole groups are first packed onto nodes the same way (so a token's
   experts sit on few nodes), then steps 1 and 2 run inside each node with its share of the
   slots and ranks. Otherwise the policy is global (one node, one group).

Ties go to the lower index everywhere (stable sorts, first minimum), so a plan is a function of
the counts alone. Balancedness is mean rank load over max rank load (1.0: perfectly even), where
a replica's load is its expert's load over the expert's replica count (tokens are split evenly
among replicas, as the EP dispatch does).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Placement:
    """Where each layer's expert replicas live.

    phy2log [L, P] int64: the logical expert in physical slot p; slots p in
        [r * P/R, (r+1) * P/R) are rank r's.
    replicas [L, E] int64: replicas of each logical expert (>= 1; sums to P per layer).
    num_ranks: R.
    """

    phy2log: np.ndarray
    replicas: np.ndarray
    num_ranks: int

    @property
    def slots_per_rank(self) -> int:
        return self.phy2log.shape[1] // self.num_ranks


def expert_stats(counts: np.ndarray | None) -> dict[str, int | list[int]]:
    """InstanceStats fields of a runner's expert_token_counts(): num_experts (E) and
    expert_tokens ([L * E], layer-major); {} for a dense model."""
    if counts is None:
        return {}
    return {"num_experts": int(counts.shape[1]), "expert_tokens": [int(x) for x in counts.reshape(-1)]}


def ep_stats(rank_tokens: np.ndarray, phy2log: np.ndarray) -> dict[str, int | list[int]]:
    """InstanceStats fields of an expert-parallel decode: rank_tokens [L, R] rows each rank's
    experts computed, phy2log [L, P] the placement in use (flattened layer-major)."""
    return {
        "ep_ranks": int(rank_tokens.shape[1]),
        "ep_rank_tokens": [int(x) for x in rank_tokens.reshape(-1)],
        "ep_slots_per_layer": int(phy2log.shape[1]),
        "ep_phy2log": [int(x) for x in phy2log.reshape(-1)],
    }


def runner_ep_stats(runner) -> dict[str, int | list[int]]:
    """ep_stats of an expert-parallel runner's measured rank loads and placement in use; {} for
    a runner that is not expert-parallel."""
    loads, placement = getattr(runner, "loads", None), getattr(runner, "placement", None)
    if loads is None or placement is None:
        return {}
    return ep_stats(loads.rank_tokens.copy(), np.asarray(placement.phy2log))


def counts_from_stats(num_experts: int, expert_tokens) -> np.ndarray:
    """[L, E] counts back from InstanceStats' flat fields. Raises ValueError when they disagree."""
    flat = np.asarray(list(expert_tokens), np.int64)
    if num_experts < 1 or flat.size % num_experts:
        raise ValueError(f"{flat.size} expert token counts do not split into rows of {num_experts} experts")
    return flat.reshape(-1, num_experts)


def default_placement(num_layers: int, num_experts: int, num_ranks: int) -> Placement:
    """No EPLB: expert e on rank e // (E / R), one replica each. Raises ValueError unless
    R divides E."""
    if num_ranks < 1 or num_experts % num_ranks:
        raise ValueError(f"{num_ranks} ranks must divide {num_experts} experts")
    phy2log = np.tile(np.arange(num_experts, dtype=np.int64), (num_layers, 1))
    return Placement(phy2log, np.ones((num_layers, num_experts), np.int64), num_ranks)


def rank_loads(load: np.ndarray, placement: Placement) -> np.ndarray:
    """[L, R] float64 tokens each rank computes under `placement`, from load [L, E] (tokens routed
    to each expert): a replica takes its expert's load over the expert's replica count."""
    load = np.asarray(load, np.float64)
    per_replica = load / placement.replicas  # [L, E]
    slot_load = np.take_along_axis(per_replica, placement.phy2log, axis=1)  # [L, P]
    return slot_load.reshape(load.shape[0], placement.num_ranks, -1).sum(axis=2)


def mean_over_max(rank_loads: np.ndarray) -> np.ndarray:
    """[L] balancedness of per-rank loads [L, R], measured or predicted: each layer's mean rank
    load over its max (1.0 for a layer with no tokens)."""
    top = rank_loads.max(axis=1).astype(np.float64)
    return np.where(top > 0, rank_loads.mean(axis=1) / np.where(top > 0, top, 1.0), 1.0)


def balancedness(load: np.ndarray, placement: Placement) -> np.ndarray:
    """[L] mean rank load over max rank load per layer under `placement`, predicted from load
    [L, E] (1.0 for a layer with no tokens)."""
    return mean_over_max(rank_loads(load, placement))


def placement_of(phy2log: np.ndarray, num_experts: int, num_ranks: int) -> Placement:
    """The placement whose slots hold phy2log [L, P] (logical expert of each physical slot),
    its replica counts [L, E] counted from it."""
    phy2log = np.asarray(phy2log, np.int64)
    replicas = np.stack([np.bincount(row, minlength=num_experts) for row in phy2log]).astype(np.int64)
    return Placement(phy2log, replicas, num_ranks)


def replicate(weights: np.ndarray, num_slots: int) -> tuple[np.ndarray, np.ndarray]:
    """Step 1 for one layer: weights [n] -> (slot2item [num_slots], replicas [n]). Item i takes
    slot i; each further slot goes to the item with the highest weight per replica."""
    n = len(weights)
    if num_slots < n:
        raise ValueError(f"{num_slots} slots cannot hold {n} experts")
    replicas = np.ones(n, np.int64)
    slots = list(range(n))
    for _ in range(num_slots - n):
        item = int(np.argmax(weights / replicas))  # first maximum: ties to the lower index
        replicas[item] += 1
        slots.append(item)
    return np.array(slots, np.int64), replicas


def balanced_packing(weights: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Step 2 for one layer: weights [n] -> (pack [n], position in pack [n]); every pack takes
    n / num_packs items; heaviest first, each to the lightest pack with room. Raises ValueError
    unless num_packs divides n."""
    n = len(weights)
    if num_packs < 1 or n % num_packs:
        raise ValueError(f"{num_packs} packs must divide {n} items")
    cap = n // num_packs
    pack = np.empty(n, np.int64)
    position = np.empty(n, np.int64)
    loads = np.zeros(num_packs)
    counts = np.zeros(num_packs, np.int64)
    for item in np.argsort(-np.asarray(weights, np.float64), kind="stable"):
        open_packs = np.flatnonzero(counts < cap)
        p = int(open_packs[np.argmin(loads[open_packs])])
        pack[item], position[item] = p, counts[p]
        loads[p] += weights[item]
        counts[p] += 1
    return pack, position


def _plan_layer(load: np.ndarray, num_slots: int, num_ranks: int, num_groups: int, num_nodes: int) -> np.ndarray:
    """phy2log [P] of one layer (hierarchical; the global policy is num_groups = num_nodes = 1)."""
    E = len(load)
    group_size = E // num_groups
    group_node, _ = balanced_packing(load.reshape(num_groups, group_size).sum(axis=1), num_nodes)
    slots_per_node, ranks_per_node = num_slots // num_nodes, num_ranks // num_nodes
    slots_per_rank = num_slots // num_ranks
    phy2log = np.empty(num_slots, np.int64)
    for node in range(num_nodes):
        groups = np.flatnonzero(group_node == node)  # in group order
        experts = (groups[:, None] * group_size + np.arange(group_size)).reshape(-1)  # logical ids
        slot2expert, replicas = replicate(load[experts], slots_per_node)
        replica_load = load[experts][slot2expert] / replicas[slot2expert]
        rank, position = balanced_packing(replica_load, ranks_per_node)
        for s, local in enumerate(slot2expert):
            global_rank = node * ranks_per_node + rank[s]
            phy2log[global_rank * slots_per_rank + position[s]] = experts[local]
    return phy2log


def plan(load: np.ndarray, num_ranks: int, num_redundant: int, num_groups: int = 1, num_nodes: int = 1) -> Placement:
    """EPLB placement of E experts plus `num_redundant` replicas on `num_ranks` ranks, per layer.

    load [L, E] tokens routed to each expert over a window of traffic (any non-negative
    numbers). Hierarchical when num_groups % num_nodes == 0 and num_nodes > 1, else global.
    Raises ValueError when R does not divide E + num_redundant, the nodes do not divide the
    ranks, the groups do not divide E, or a count is negative.
    """
    load = np.asarray(load, np.float64)
    if load.ndim != 2 or (load < 0).any() or not np.isfinite(load).all():
        raise ValueError(f"load must be [layers, experts] of finite counts >= 0, got shape {load.shape}")
    L, E = load.shape
    P = E + num_redundant
    if num_redundant < 0 or num_ranks < 1 or P % num_ranks:
        raise ValueError(f"{num_ranks} ranks must divide {E} experts + {num_redundant} redundant")
    if num_nodes < 1 or num_ranks % num_nodes or num_groups < 1 or E % num_groups:
        raise ValueError(f"{num_nodes} nodes must divide {num_ranks} ranks and {num_groups} groups {E} experts")
    if num_groups % num_nodes or num_nodes == 1:
        num_groups = num_nodes = 1  # the global policy
    phy2log = np.stack([_plan_layer(load[i], P, num_ranks, num_groups, num_nodes) for i in range(L)])
    return placement_of(phy2log, E, num_ranks)
