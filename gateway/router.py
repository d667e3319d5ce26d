"""Choosing instances: prefill by cached prefix weighed against load, decode by least load.

The default prefill policy, `cache_aware`, scores each instance by the prefill tokens it
would compute for this request (prompt minus the prefix it holds, as the index says) plus
`load_weight` times its queue, and picks the lowest. The queue is the prefill tokens already
queued on it plus `request_cost_tokens` for each request in flight there (a request costs a
scheduling step and a KV push whatever its length, and this keeps a burst of short prompts
from piling up where a shared block is cached). A cached prefix counts only when it covers
at least `cache_threshold` of the prompt (SGLang's cache_threshold), so prompts that merely
share a system block do not steer routing. Ties go to the instance sent the fewest prefill
tokens so far.
For comparison (`kvmesh routesim`), the same router also offers `round_robin`, `random`,
`consistent_hash` (over the prompt's first `hash_blocks` block hashes, a ring with virtual
nodes) and `least_load` (fewest queued tokens, cache ignored).
What the gateway knows of each instance, `InstanceLoad`, is gateway/instance_load.py's
(importable from here too).
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import logging
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from kvmesh.gateway.instance_load import InstanceLoad, queued_tokens

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RouteDecision:
    """The chosen prefill instance and how many prompt tokens it holds (as the index says)."""

    address: str
    cached_tokens: int
    cost_tokens: float
    predicted_ttft_s: float | None = None
    """The TTFT predicted there (seconds from routing), when the request has a TTFT SLO."""
    meets_slo: bool = True
    """False when no instance was predicted to meet the SLO (this one was predicted fastest)."""


@dataclass(frozen=True)
class RouteAsk:
    """What a routing policy knows of one request."""

    num_prompt_tokens: int
    cached_blocks: Mapping[str, int]
    """instance_id -> leading prompt blocks it holds, from the index (empty when it is down)."""
    page_size: int
    block_hashes: Sequence[bytes]
    """The prompt's block hashes (only consistent_hash reads them)."""
    tiered_blocks: Mapping[str, int] = field(default_factory=dict)
    """instance_id -> leading prompt blocks it holds in its page pool or its second tier (>= its
    cached_blocks); empty when no instance has a tier."""
    tier_hit_weight: float = 0.5
    """What a block in a second tier saves, against one in the pool (1) and a miss (0)."""

    def cached_tokens(self, inst: InstanceLoad) -> int:
        """Tokens of this prompt `inst` would reuse from its page pool: whole cached blocks short
        of the last prompt token (whose logits prefill must compute), so the figure is what
        prefill will reuse."""
        return min(self.cached_blocks.get(inst.instance_id, 0), self._reusable_blocks) * self.page_size

    def tier_tokens(self, inst: InstanceLoad) -> int:
        """Tokens after cached_tokens that `inst` would load from its second tier instead of computing."""
        total = min(max(self.tiered_blocks.get(inst.instance_id, 0), 0), self._reusable_blocks) * self.page_size
        return max(0, total - self.cached_tokens(inst))

    @property
    def _reusable_blocks(self) -> int:
        return (self.num_prompt_tokens - 1) // self.page_size

    def decide(self, inst: InstanceLoad) -> RouteDecision:
        cached = self.cached_tokens(inst) + self.tier_tokens(inst)
        return RouteDecision(inst.address, cached, float(self.num_prompt_tokens - cached))


Policy = Callable[["PrefillRouter", Sequence[InstanceLoad], RouteAsk], RouteDecision]
"""(router, routable instances (at least one), request) -> the choice."""

POLICIES: dict[str, Policy] = {}
"""Routing policies by name; `--routing-policy` picks one."""


def policy(name: str) -> Callable[[Policy], Policy]:
    """Register a routing policy under `name`."""

    def register(fn: Policy) -> Policy:
        POLICIES[name] = fn
        return fn

    return register


def check_policy(name: str) -> None:
    """Raise ValueError naming the known policies when `name` is not one of them."""
    if name not in POLICIES:
        raise ValueError(f"routing policy must be one of {list(POLICIES)}, got {name!r}")


@policy("cache_aware")
def _cache_aware(router: PrefillRouter, healthy: Sequence[InstanceLoad], ask: RouteAsk) -> RouteDecision:
    best: tuple[float, int, int] | None = None
    choice: RouteDecision | None = None
    rr = router.next_turn()
    for pos, inst in enumerate(healthy):
        # a second tier's blocks save less than the pool's (a copy back), more than a miss
        device, tier = ask.cached_tokens(inst), ask.tier_tokens(inst)
        cached = device + tier
        worth = device + ask.tier_hit_weight * tier
        counted = worth if cached >= router.cache_threshold * ask.num_prompt_tokens and cached > 0 else 0
        load = queued_tokens(inst) + router.request_cost_tokens * max(
            inst.in_flight_requests, inst.reported_active_requests
        )
        cost = (ask.num_prompt_tokens - counted) + router.load_weight * load
        key = (cost, inst.total_routed_tokens, (pos - rr) % len(healthy))
        if best is None or key < best:
            best, choice = key, RouteDecision(inst.address, cached, cost)
    assert choice is not None
    return choice


@policy("round_robin")
def _round_robin(router: PrefillRouter, healthy: Sequence[InstanceLoad], ask: RouteAsk) -> RouteDecision:
    return ask.decide(healthy[router.next_turn() % len(healthy)])


@policy("random")
def _random(router: PrefillRouter, healthy: Sequence[InstanceLoad], ask: RouteAsk) -> RouteDecision:
    return ask.decide(router.rng.choice(healthy))


@policy("consistent_hash")
def _consistent_hash(router: PrefillRouter, healthy: Sequence[InstanceLoad], ask: RouteAsk) -> RouteDecision:
    return ask.decide(_ring_choice(healthy, b"".join(ask.block_hashes[: router.hash_blocks])))


@policy("least_load")
def _least_load(router: PrefillRouter, healthy: Sequence[InstanceLoad], ask: RouteAsk) -> RouteDecision:
    rr, n = router.next_turn(), len(healthy)
    return ask.decide(min(enumerate(healthy), key=lambda p: (queued_tokens(p[1]), (p[0] - rr) % n))[1])


@dataclass
class PrefillRouter:
    """Prefill choice by a named policy (see the module docstring)."""

    instances: list[InstanceLoad]
    cache_threshold: float = 0.3
    load_weight: float = 0.02
    """Weight of queued prefill tokens against this request's uncached tokens. Small: a
    conversation's next turn stays where its prefix is unless that queue is long, which saves
    the whole mesh work; `kvmesh routesim` on the Mooncake conversation trace (4 instances)
    measured 0.987 of the oracle hit rate at 0.99 balancedness with 0.02 (threshold 0.3),
    0.82 with 1.0."""
    request_cost_tokens: int = 256
    """Queue tokens each in-flight request adds on top of its prompt tokens."""
    policy: str = "cache_aware"
    """A name in POLICIES."""
    tier_hit_weight: float = 0.5
    """What a prompt token held in an instance's second tier saves against one in its pool (1):
    its copy back into the pool costs more than a pool hit and far less than a recompute."""
    hash_blocks: int = 2
    seed: int = 0
    _rr: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if not (math.isfinite(self.load_weight) and self.load_weight >= 0):
            raise ValueError(f"load_weight must be a finite number >= 0, got {self.load_weight}")
        check_policy(self.policy)
        if self.request_cost_tokens < 0:
            raise ValueError(f"request_cost_tokens must be >= 0, got {self.request_cost_tokens}")
        if not 0.0 <= self.tier_hit_weight <= 1.0:
            raise ValueError(f"tier_hit_weight must be in [0, 1], got {self.tier_hit_weight}")
        if self.hash_blocks < 1:
            raise ValueError(f"hash_blocks must be >= 1, got {self.hash_blocks}")
        self.rng = random.Random(self.seed)
        self._choose = POLICIES[self.policy]

    def next_turn(self) -> int:
        """A counter that rotates ties between equal instances (and round_robin's pick)."""
        self._rr += 1
        return self._rr

    def choose(
        self,
        num_prompt_tokens: int,
        cached_blocks: Mapping[str, int],
        page_size: int,
        block_hashes: Sequence[bytes] = (),
        exclude: frozenset[str] = frozenset(),
        tiered_blocks: Mapping[str, int] | None = None,
        slo_ttft_s: float = 0.0,
        predict: Callable[[InstanceLoad, int], float | None] | None = None,
    ) -> RouteDecision:
        """Pick a routable prefill instance (not one whose address is in `exclude`).

        cached_blocks maps instance_id -> leading prompt blocks it holds in its page pool (from
        the index; empty when the index is down), tiered_blocks -> those it holds in its pool
        or its second tier; block_hashes are the prompt's block hashes (only consistent_hash
        reads them). With a TTFT SLO (`slo_ttft_s` > 0) and `predict` (instance, its cached
        tokens -> predicted TTFT, seconds; None: no profile yet), `within_slo` chooses instead
        of the policy once every instance has a prediction. Raises LookupError when no instance
        is routable.
        """
        healthy = [i for i in self.instances if i.routable and i.address not in exclude]
        if not healthy:
            raise LookupError("no healthy prefill instance")
        ask = RouteAsk(
            num_prompt_tokens, cached_blocks, page_size, block_hashes, tiered_blocks or {}, self.tier_hit_weight
        )
        if slo_ttft_s > 0 and predict is not None:
            chosen = within_slo(healthy, ask, slo_ttft_s, predict)
            if chosen is not None:
                return chosen
        return self._choose(self, healthy, ask)


def within_slo(
    healthy: Sequence[InstanceLoad],
    ask: RouteAsk,
    slo_ttft_s: float,
    predict: Callable[[InstanceLoad, int], float | None],
) -> RouteDecision | None:
    """Latency-aware routing: among the instances predicted to meet the TTFT SLO, the one that
    reuses the most of the prompt (then the fastest); when none is, the fastest, marked as
    missing it (llm-d's SLO headroom routing, prefix reuse first as SGLang's and Dynamo's KV
    routers weigh it). None while an instance has no prediction (its profile is not measured
    yet): the policy decides meanwhile."""
    scored = []
    for inst in healthy:
        decision = ask.decide(inst)
        predicted = predict(inst, decision.cached_tokens)
        if predicted is None:
            return None
        scored.append((decision, predicted))
    meeting = [(d, p) for d, p in scored if p <= slo_ttft_s]
    if meeting:
        decision, predicted = max(meeting, key=lambda dp: (dp[0].cached_tokens, -dp[1]))
        return RouteDecision(decision.address, decision.cached_tokens, decision.cost_tokens, predicted, True)
    decision, predicted = min(scored, key=lambda dp: dp[1])
    return RouteDecision(decision.address, decision.cached_tokens, decision.cost_tokens, predicted, False)


def _point(key: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big")


@functools.lru_cache(maxsize=64)
def _ring(names: tuple[str, ...], vnodes: int = 64) -> list[tuple[int, int]]:
    """The hash ring of these instances: (point, index into names), sorted; built once per set."""
    return sorted((_point(f"{name}#{v}".encode()), k) for k, name in enumerate(names) for v in range(vnodes))


def _ring_choice(healthy: Sequence[InstanceLoad], key: bytes) -> InstanceLoad:
    """Consistent hashing (Karger et al. 1997): the first instance clockwise of key's point,
    each instance placed at 64 points, so removing one moves only its own keys."""
    ring = _ring(tuple(inst.instance_id or inst.address for inst in healthy))
    i = bisect.bisect(ring, (_point(key), len(healthy)))
    return healthy[ring[i % len(ring)][1]]


def pick_decode(
    instances: Sequence[InstanceLoad],
    rr: int,
    exclude: frozenset[str] = frozenset(),
    cached_blocks: Mapping[str, int] | None = None,
    slack: int = 0,
) -> InstanceLoad:
    """A routable decode instance with a free slot, not in `exclude`: among those with at most
    `slack` active requests more than the least loaded, the one holding the most leading blocks
    of the prompt (`cached_blocks`: instance_id -> blocks, from the prefix index; its pages are
    not pushed again), then the least loaded; ties rotate with rr.

    Decode step time barely depends on context length here, so request count is the load; the
    slack bounds what a conversation's stickiness may cost the balance (SGLang's decode radix
    cache and Dynamo's KV router weigh the same two). Raises LookupError when none is routable.
    """
    healthy = [i for i in instances if i.routable and i.address not in exclude]
    if not healthy:
        raise LookupError("no healthy decode instance")
    healthy = [i for i in healthy if i.has_free_slot] or healthy
    n = len(healthy)
    cached_blocks = cached_blocks or {}

    def load(inst: InstanceLoad) -> int:
        return max(inst.in_flight_requests, inst.reported_active_requests)

    least = min(load(i) for i in healthy)
    return min(
        ((k, i) for k, i in enumerate(healthy) if load(i) <= least + slack),
        key=lambda p: (-cached_blocks.get(p[1].instance_id, 0), load(p[1]), (p[0] - rr) % n),
    )[1]
