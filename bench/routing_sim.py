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
import json
import math
import statistics
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gateway.router import InstanceLoad, PrefillRouter

BLOCK_TOKENS = 512


@dataclass(frozen=True)
class TraceRequest:
    """One trace row: arrival (seconds from the trace's start), prompt tokens, block ids."""

    arrival_s: float
    input_tokens: int
    hash_ids: tuple[int, ...]


def load_trace(path: str) -> list[TraceRequest]:
    """Read a Mooncake-format JSONL trace; ValueError names the first bad line."""
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                arrival, tokens, ids = float(row["timestamp"]) / 1000.0, row["input_length"], row["hash_ids"]
                if not (math.isfinite(arrival) and arrival >= 0):
                    raise ValueError(f"timestamp must be a finite number of ms >= 0, got {row['timestamp']}")
                if not isinstance(tokens, int) or tokens < 1:
                    raise ValueError(f"input_length must be an integer >= 1, got {tokens!r}")
                if not isinstance(ids, list) or not all(isinstance(h, int) and 0 <= h < 2**63 for h in ids):
                    raise ValueError("hash_ids must be a list of integers in [0, 2**63)")
                out.append(TraceRequest(arrival, tokens, tuple(ids)))
            except (ValueError, KeyError, TypeError, OverflowError) as exc:
                raise ValueError(f"{path}:{n}: not a Mooncake trace row ({exc})") from exc
    return out


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

    def touch(self, hash_ids: Sequence[int]) -> None:
        """Insert or refresh the blocks, then evict least recently used ones over capacity."""
        for h in hash_ids:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while self.capacity and len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)


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


def _block_key(h: int) -> bytes:
    return h.to_bytes(8, "big", signed=False)


def oracle_hit_rate(trace: Sequence[TraceRequest], capacity_blocks: int) -> float:
    """Hit rate of one LRU cache of capacity_blocks blocks (0: unlimited) seeing every request."""
    cache, hits, total = LRUBlocks(capacity_blocks), 0, 0
    for r in trace:
        hits += cache.prefix_hits(r.hash_ids)
        total += len(r.hash_ids)
        cache.touch(r.hash_ids)
    return hits / max(total, 1)


def simulate(
    trace: Sequence[TraceRequest],
    num_instances: int,
    capacity_blocks: int,
    choose: Callable[[TraceRequest, list[InstanceLoad], list[LRUBlocks]], int],
    tokens_per_s: float,
    policy: str = "",
    block_tokens: int = BLOCK_TOKENS,
) -> SimResult:
    """Replay `trace` with `choose(request, loads, caches) -> instance index`; see the module docstring.

    `block_tokens` is the tokens each hash id stands for (512 in Mooncake traces; fewer when a
    benchmark scales the trace down), so a hit of h blocks saves h x block_tokens prompt tokens.
    """
    caches = [LRUBlocks(capacity_blocks) for _ in range(num_instances)]
    loads = [InstanceLoad(address=f"sim-{k}", instance_id=f"sim-{k}") for k in range(num_instances)]
    free_at = [0.0] * num_instances
    running: list[list[tuple[float, int]]] = [[] for _ in range(num_instances)]  # heaps of (finish, tokens)
    computed = [0] * num_instances
    hits = total = 0
    delays = []
    records = []
    for r in trace:
        for k in range(num_instances):  # prefills finished by now leave the queue
            while running[k] and running[k][0][0] <= r.arrival_s:
                loads[k].in_flight_tokens -= heapq.heappop(running[k])[1]
                loads[k].in_flight_requests -= 1
        k = choose(r, loads, caches)
        hit = caches[k].prefix_hits(r.hash_ids)
        caches[k].touch(r.hash_ids)
        hits += hit
        total += len(r.hash_ids)
        uncached = max(1, r.input_tokens - hit * block_tokens)  # the last token is always computed
        start = max(r.arrival_s, free_at[k])
        free_at[k] = start + uncached / tokens_per_s
        delays.append(start - r.arrival_s)
        records.append(SimRequest(r.arrival_s, k, r.input_tokens, hit, uncached, start, free_at[k]))
        heapq.heappush(running[k], (free_at[k], uncached))
        loads[k].in_flight_tokens += uncached
        loads[k].in_flight_requests += 1
        loads[k].total_routed_tokens += uncached
        computed[k] += uncached
    q = statistics.quantiles(delays, n=10) if len(delays) > 1 else [delays[0]] * 9
    return SimResult(
        policy,
        hits / max(total, 1),
        oracle_hit_rate(trace, capacity_blocks * num_instances),
        statistics.mean(computed) / max(max(computed), 1),
        statistics.median(delays),
        q[8],
        tuple(computed),
        tuple(records),
    )


def router_chooser(policy: str, block_tokens: int = BLOCK_TOKENS, **router_args) -> Callable:
    """A `choose` that asks gateway.router.PrefillRouter, fed what the index and gateway would know."""
    router: PrefillRouter | None = None

    def choose(r: TraceRequest, loads: list[InstanceLoad], caches: list[LRUBlocks]) -> int:
        nonlocal router
        if router is None:
            router = PrefillRouter(loads, policy=policy, **router_args)
        cached = {inst.instance_id: c.prefix_hits(r.hash_ids) for inst, c in zip(loads, caches)}
        d = router.choose(r.input_tokens, cached, block_tokens, [_block_key(h) for h in r.hash_ids])
        return next(k for k, inst in enumerate(loads) if inst.address == d.address)

    return choose


def fixed_chooser(assignments: Sequence[int]) -> Callable:
    """A `choose` that replays another router's recorded assignments, request by request."""
    it = iter(assignments)
    return lambda r, loads, caches: next(it)
