"""The simulation behind `kvmesh routesim`: prefill instances with LRU prefix caches, routed by the gateway's router.

Each simulated prefill instance has an LRU prefix cache of `capacity_blocks` blocks (0: no
limit) and computes prefills one at a time, first come first served, at `tokens_per_s`
uncached prompt tokens a second (prefill cost is proportional to the uncached tokens). A
request arrives at its trace timestamp; the router (gateway/router.py, the code the gateway
runs) sees each instance's leading run of cached blocks, as the Redis index would, and the
prefill tokens queued on it, as the gateway's in-flight accounting would; the request then
hits the chosen instance's cached prefix and its blocks become that instance's most recent.
Trace format: ../shared/traces/README.md (one block = 512 tokens, `hash_ids` per block).
"""

from __future__ import annotations

import heapq
import statistics
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvmesh.gateway.router import InstanceLoad, PrefillRouter
from kvmesh.planner import workload

BLOCK_TOKENS = 512


@dataclass(frozen=True)
class TraceRequest:
    """One trace row: arrival (seconds from the trace's start), prompt tokens, block ids."""

    arrival_s: float
    input_tokens: int
    hash_ids: tuple[int, ...]


def load_trace(path: str) -> list[TraceRequest]:
    """Read a Mooncake-format JSONL trace (kvmesh.planner.workload.load_trace); ValueError names
    the first bad line."""
    return [TraceRequest(r.arrival_s, r.input_tokens, r.hash_ids) for r in workload.load_trace(path)]


class LRUBlocks:
    """A prefix cache of block ids with LRU eviction; capacity 0 means unlimited."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0 blocks, got {capacity}")
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def prefix_hits(self, hash_ids: Sequence[int]) -> int:
        """Leading blocks of hash_ids held (a prefix cache reuses only a leading run)."""
        n = 0
        for h in hash_ids:
            if h not in self._blocks:
                break
            n += 1
        return n

    def __contains__(self, h: int) -> bool:
        return h in self._blocks

    def touch(self, hash_ids: Sequence[int]) -> list[int]:
        """Insert or refresh the blocks, then evict least recently used ones over capacity;
        returns the evicted ids (oldest first), which a second tier keeps."""
        for h in hash_ids:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        evicted = []
        while self.capacity and len(self._blocks) > self.capacity:
            evicted.append(self._blocks.popitem(last=False)[0])
        return evicted


@dataclass(frozen=True)
class SimRequest:
    """One simulated request: where it went and when its prefill ran (seconds from the trace's start)."""

    arrival_s: float
    instance: int
    prompt_tokens: int
    hit_blocks: int
    computed_tokens: int
    start_s: float
    finish_s: float
    tier_blocks: int = 0
    """Blocks after hit_blocks found in the instance's second tier (copied back, not computed)."""
    pulled_blocks: int = 0
    """Blocks after those pulled from a peer that held them (not computed)."""


@dataclass(frozen=True)
class SimResult:
    """One policy's figures over a whole trace (see bench/routesim.py for what each means)."""

    policy: str
    hit_rate: float
    oracle_hit_rate: float
    balancedness: float
    queue_p50_s: float
    queue_p90_s: float
    tokens_per_instance: tuple[int, ...]
    # per request, in trace order
    requests: tuple[SimRequest, ...] = ()
    tier_hit_rate: float = 0.0
    """Prompt blocks found in the chosen instance's second tier / all prompt blocks."""
    pull_rate: float = 0.0
    """Prompt blocks pulled from a peer / all prompt blocks."""
    computed_tokens: int = 0
    oracle_computed_tokens: int = 0
    """Prompt tokens one cache of the mesh's whole size (pools and tiers) would compute."""


def _block_key(h: int) -> bytes:
    return h.to_bytes(8, "big", signed=False)


def oracle_hit_rate(trace: Sequence[TraceRequest], capacity_blocks: int) -> float:
    """Hit rate of one LRU cache of capacity_blocks blocks (0: unlimited) seeing every request."""
    return _oracle(trace, capacity_blocks, BLOCK_TOKENS)[0]


def _oracle(trace: Sequence[TraceRequest], capacity_blocks: int, block_tokens: int) -> tuple[float, int]:
    """(hit rate, prompt tokens computed) of one LRU cache of capacity_blocks blocks (0:
    unlimited) seeing every request; the last prompt token is always computed."""
    cache, hits, total, computed = LRUBlocks(capacity_blocks), 0, 0, 0
    for r in trace:
        hit = cache.prefix_hits(r.hash_ids)
        hits += hit
        total += len(r.hash_ids)
        computed += max(1, r.input_tokens - hit * block_tokens)
        cache.touch(r.hash_ids)
    return hits / max(total, 1), computed


def simulate(
    trace: Sequence[TraceRequest],
    num_instances: int,
    capacity_blocks: int,
    choose: Callable[[TraceRequest, list[InstanceLoad], list[LRUBlocks]], int],
    tokens_per_s: float,
    policy: str = "",
    block_tokens: int = BLOCK_TOKENS,
    tier_blocks: int = 0,
    pull_min_blocks: int = 0,
    pull_cost: float = 0.05,
) -> SimResult:
    """Replay `trace` with `choose(request, loads, caches) -> instance index`; see the module docstring.

    `block_tokens` is the tokens each hash id stands for (512 in Mooncake traces; fewer when a
    benchmark scales the trace down), so a hit of h blocks saves h x block_tokens prompt tokens.
    tier_blocks: each instance's second tier (kvmesh.kvstore.kv_tier), an LRU of the blocks its cache
    evicts (0: none); a block found there after the cache's run is not computed. `choose` is
    then called with the tiers too (choose(request, loads, caches, tiers)).
    pull_min_blocks: when another instance's cache holds at least this many blocks more than
    the chosen one's run (0: no pulls), the chosen one pulls them (prefill_svc/kv_pull.py),
    which costs `pull_cost` of computing them.
    """
    caches = [LRUBlocks(capacity_blocks) for _ in range(num_instances)]
    tiers = [LRUBlocks(tier_blocks) for _ in range(num_instances)] if tier_blocks else None
    loads = [InstanceLoad(address=f"sim-{k}", instance_id=f"sim-{k}") for k in range(num_instances)]
    free_at = [0.0] * num_instances
    running: list[list[tuple[float, int]]] = [[] for _ in range(num_instances)]  # heaps of (finish, tokens)
    computed = [0] * num_instances
    hits = total = tier_hits = pulled_hits = 0
    delays = []
    records = []
    for r in trace:
        for k in range(num_instances):  # prefills finished by now leave the queue
            while running[k] and running[k][0][0] <= r.arrival_s:
                loads[k].in_flight_tokens -= heapq.heappop(running[k])[1]
                loads[k].in_flight_requests -= 1
        k = choose(r, loads, caches, tiers) if tiers is not None else choose(r, loads, caches)
        hit = caches[k].prefix_hits(r.hash_ids)
        in_tier = 0
        if tiers is not None:
            while hit + in_tier < len(r.hash_ids) and r.hash_ids[hit + in_tier] in tiers[k]:
                in_tier += 1
        pulled = 0
        if pull_min_blocks:
            peer = max(c.prefix_hits(r.hash_ids) for j, c in enumerate(caches) if j != k) if num_instances > 1 else 0
            if peer >= hit + pull_min_blocks:
                pulled = max(0, peer - hit - in_tier)
        evicted = caches[k].touch(r.hash_ids)
        if tiers is not None:
            tiers[k].touch(evicted)
        hits += hit
        tier_hits += in_tier
        pulled_hits += pulled
        total += len(r.hash_ids)
        # the last token is always computed
        uncached = max(1, r.input_tokens - (hit + in_tier + pulled) * block_tokens)
        start = max(r.arrival_s, free_at[k])
        free_at[k] = start + (uncached + pull_cost * pulled * block_tokens) / tokens_per_s
        delays.append(start - r.arrival_s)
        records.append(SimRequest(r.arrival_s, k, r.input_tokens, hit, uncached, start, free_at[k], in_tier, pulled))
        heapq.heappush(running[k], (free_at[k], uncached))
        loads[k].in_flight_tokens += uncached
        loads[k].in_flight_requests += 1
        loads[k].total_routed_tokens += uncached
        computed[k] += uncached
    q = statistics.quantiles(delays, n=10) if len(delays) > 1 else [delays[0]] * 9
    whole = (capacity_blocks + tier_blocks) * num_instances if capacity_blocks else 0
    oracle_rate, oracle_computed = _oracle(trace, whole, block_tokens)
    return SimResult(
        policy,
        hits / max(total, 1),
        oracle_rate,
        statistics.mean(computed) / max(max(computed), 1),
        statistics.median(delays),
        q[8],
        tuple(computed),
        tuple(records),
        tier_hits / max(total, 1),
        pulled_hits / max(total, 1),
        sum(computed),
        oracle_computed,
    )


def router_chooser(policy: str, block_tokens: int = BLOCK_TOKENS, **router_args) -> Callable:
    """A `choose` that asks kvmesh.gateway.router.PrefillRouter, fed what the index and gateway would know."""
    router: PrefillRouter | None = None

    def choose(r: TraceRequest, loads: list[InstanceLoad], caches: list[LRUBlocks], tiers=None) -> int:
        nonlocal router
        if router is None:
            router = PrefillRouter(loads, policy=policy, **router_args)
        cached = {inst.instance_id: c.prefix_hits(r.hash_ids) for inst, c in zip(loads, caches)}
        tiered = {}
        if tiers is not None:  # the index's tiered answer: the run in the pool or the tier
            for inst, c, t in zip(loads, caches, tiers):
                n = cached[inst.instance_id]
                while n < len(r.hash_ids) and (r.hash_ids[n] in c or r.hash_ids[n] in t):
                    n += 1
                tiered[inst.instance_id] = n
        d = router.choose(
            r.input_tokens, cached, block_tokens, [_block_key(h) for h in r.hash_ids], tiered_blocks=tiered
        )
        return next(k for k, inst in enumerate(loads) if inst.address == d.address)

    return choose


def fixed_chooser(assignments: Sequence[int]) -> Callable:
    """A `choose` that replays another router's recorded assignments, request by request."""
    it = iter(assignments)
    return lambda r, loads, caches, tiers=None: next(it)
