"""The gateway's view of the mesh for routing: `InstancePool`, the instances
(gateway/instances.py: channels, membership, stats polls), the prefix index
(gateway/prefix_lookup.py) and the routing calls over them.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvmesh.gateway import metrics
from kvmesh.gateway.instance_load import InstanceLoad, queued_tokens
from kvmesh.gateway.instances import InstanceSet
from kvmesh.gateway.predictor import LatencyPredictor
from kvmesh.gateway.router import PrefillRouter, RouteDecision, pick_decode
from kvmesh.kvstore.redis_index import AsyncRedisKVIndexReader

# Requests a decode instance is assumed to take before its first stats report says.
DEFAULT_DECODE_SLOTS = 64


class InstancePool(InstanceSet):
    """Stubs, load and health of the prefill and decode instances, and the routing calls.

    Args (InstanceSet's, and the routing knobs):
        cache_threshold, load_weight, routing_policy, tier_hit_weight: the prefill router's
            (kvmesh.gateway.router.PrefillRouter).
        decode_hit_slack: active requests a decode instance may carry beyond the least loaded
            and still be picked for holding more of the prompt (`pick_decode`).
        decode_reuse_min_blocks: leading prompt blocks decode must hold for a Reserve before
            Prefill (`decode_reuse`).
        pull_min_blocks: blocks a peer prefill must hold beyond the chosen one's to be named
            as the place to pull them from (`pull_source`; 0: never).
    """

    def __init__(
        self,
        prefill_addresses,
        decode_addresses,
        page_size: int,
        index: AsyncRedisKVIndexReader | None,
        cache_threshold: float,
        load_weight: float,
        rpc_timeout_s: float,
        routing_policy: str = "cache_aware",
        model_fingerprint: str = "",
        decode_hit_slack: int = 0,
        decode_reuse_min_blocks: int = 1,
        pull_min_blocks: int = 0,
        tier_hit_weight: float = 0.5,
    ) -> None:
        super().__init__(prefill_addresses, decode_addresses, page_size, index, rpc_timeout_s, model_fingerprint)
        self.pull_min_blocks = pull_min_blocks
        self.decode_hit_slack = decode_hit_slack
        self.decode_reuse_min_blocks = decode_reuse_min_blocks
        self.router = PrefillRouter(
            self.prefills,
            cache_threshold=cache_threshold,
            load_weight=load_weight,
            policy=routing_policy,
            tier_hit_weight=tier_hit_weight,
        )
        self.predictor = LatencyPredictor(page_size, self.prefills, self.decodes)
        self._rr = 0

    def decode_capacity(self) -> int:
        """Requests the routable decode instances take at once (their reported slots)."""
        return sum(d.max_requests or DEFAULT_DECODE_SLOTS for d in self.decodes if d.routable)

    def max_decode_batch(self) -> int:
        """The largest batch a routable decode instance reported (sequences at once); 0 while
        none has reported one."""
        return max((d.max_requests for d in self.decodes if d.routable), default=0)

    def check_usable(self) -> None:
        """Raises MismatchError when every prefill or every decode instance disagrees with
        this gateway (page size, model), LookupError when none of one kind is routable."""
        for kind, insts in (("prefill", self.prefills), ("decode", self.decodes)):
            if insts and all(i.mismatch for i in insts):
                raise MismatchError("; ".join(i.mismatch for i in insts))
            if not any(i.routable for i in insts):
                why = self._why_down(insts) or "none listed, none registered in Redis yet"
                raise LookupError(f"no healthy {kind} instance ({why})")

    @staticmethod
    def _why_down(insts: list[InstanceLoad]) -> str:
        return ", ".join(
            f"{i.address}: "
            + (
                "unreachable"
                if not i.reachable
                else i.mismatch or f"circuit {i.breaker.state.value} after {i.breaker.consecutive_failures} failures"
            )
            for i in insts
        )

    async def route(
        self, prompt_token_ids, block_hashes, exclude: frozenset[str] = frozenset()
    ) -> tuple[InstanceLoad, InstanceLoad, int]:
        """(prefill, decode, cached tokens the index reports on that prefill), skipping the
        addresses in `exclude`. LookupError if none is routable.

        The gateway's own requests call the parts apart (`pick_decode`, then `lookup_prefix`
        and `pick_prefill` while decode's Reserve is in flight); this is them in one call."""
        cached_blocks = await self.lookup_prefix(block_hashes)
        prefill, decision = self.pick_prefill(len(prompt_token_ids), cached_blocks, block_hashes, exclude)
        return prefill, self.pick_decode(exclude, cached_blocks), decision.cached_tokens

    def pick_decode(
        self,
        exclude: frozenset[str] = frozenset(),
        cached_blocks: Mapping[str, int] | None = None,
        slo_itl_s: float = 0.0,
        num_prompt_tokens: int = 0,
    ) -> InstanceLoad:
        """The decode instance to reserve on (router.pick_decode: the fewest active requests, or
        within decode_hit_slack of them the one holding the most of the prompt by
        `cached_blocks`, lookup_prefix's answer), not one in `exclude`; with an ITL SLO
        (`slo_itl_s` > 0), among those predicted to meet it when any is. Raises LookupError
        when none is routable, or when no prefill instance is (a reservation would be wasted)."""
        if not any(i.routable and i.address not in exclude for i in self.prefills):
            raise LookupError("no healthy prefill instance")
        self._rr += 1
        decodes = self.decodes
        if slo_itl_s > 0:
            meeting = [
                d for d in decodes if (itl := self.predictor.itl(d, num_prompt_tokens)) is None or itl <= slo_itl_s
            ]
            if any(d.routable and d.address not in exclude for d in meeting):
                decodes = meeting  # else the least loaded, as without an SLO
        return pick_decode(decodes, self._rr, exclude, cached_blocks or {}, self.decode_hit_slack)

    def best_itl(self, num_prompt_tokens: int, exclude: frozenset[str] = frozenset()) -> float | None:
        """The least predicted ITL over the routable decode instances (seconds); None while one has no profile."""
        predictions = [
            self.predictor.itl(d, num_prompt_tokens) for d in self.decodes if d.routable and d.address not in exclude
        ]
        return None if not predictions or None in predictions else min(p for p in predictions if p is not None)

    def decode_reuse(self, decode: InstanceLoad, cached_blocks: Mapping[str, int]) -> int:
        """Leading prompt blocks `decode` holds by `lookup_prefix`'s answer, when they are worth
        a Reserve before Prefill (at least decode_reuse_min_blocks); else 0."""
        held = cached_blocks.get(decode.instance_id, 0) if decode.instance_id else 0
        return held if held >= self.decode_reuse_min_blocks else 0

    async def lookup_prefix(self, block_hashes) -> dict[str, int]:
        """instance_id -> leading blocks of `block_hashes` it holds in its page pool, from the
        prefix index, for the routable prefill and decode instances; {} without an index or
        while it is unreachable (never raises)."""
        return (await self.lookup_prefix_tiered(block_hashes))[0]

    async def lookup_prefix_tiered(self, block_hashes) -> tuple[dict[str, int], dict[str, int]]:
        """(lookup_prefix's answer, instance_id -> leading blocks in its pool or its second tier);
        the second is {} (and the index is asked of the pools alone) while no instance reports
        a second tier. Never raises."""
        insts = [i for i in (*self.prefills, *self.decodes) if i.routable and i.instance_id]
        tiered = any(i.kv_tier_medium for i in insts)
        return await self.prefix.leading_blocks_tiered(block_hashes, [i.instance_id for i in insts], tiered)

    def pick_prefill(
        self,
        num_prompt_tokens: int,
        cached_blocks,
        block_hashes,
        exclude: frozenset[str] = frozenset(),
        tiered_blocks: Mapping[str, int] | None = None,
        slo_ttft_s: float = 0.0,
        decode_cached_pages: int = 0,
    ) -> tuple[InstanceLoad, RouteDecision]:
        """(prefill instance, the decision: prompt tokens the index says it holds in its pool or
        second tier, the predicted TTFT with a TTFT SLO) by the routing policy, or within the
        SLO (`slo_ttft_s` > 0: router.within_slo, by this pool's predictor), from
        `lookup_prefix_tiered`'s answer (cached_blocks, tiered_blocks). Raises LookupError when
        none is routable.

        Synchronous: the caller counts the request on the instance before its next await, so
        concurrent requests see each other."""

        def predict(inst: InstanceLoad, cached_tokens: int) -> float | None:
            found = self.predictor.ttft(inst, num_prompt_tokens, cached_tokens, decode_cached_pages)
            return found.seconds if found is not None else None

        decision = self.router.choose(
            num_prompt_tokens, cached_blocks, self.page_size, block_hashes, exclude, tiered_blocks, slo_ttft_s, predict
        )
        prefill = next(i for i in self.prefills if i.address == decision.address)
        policy = "slo" if decision.predicted_ttft_s is not None else self.router.policy
        metrics.ROUTED_REQUESTS.labels(policy, "prefix" if self.prefix.informed else "load_only").inc()
        metrics.INDEX_CACHED_TOKENS.inc(decision.cached_tokens)
        return prefill, decision

    def pull_source(
        self, prefill: InstanceLoad, cached_blocks: Mapping[str, int], exclude: frozenset[str] = frozenset()
    ) -> tuple[str, int]:
        """(gRPC address, leading prompt blocks) of the routable prefill instance other than
        `prefill` (and not in `exclude`) that holds the most of the prompt in its pool, when that
        is at least pull_min_blocks more than `prefill` holds: where `prefill` may pull them
        from instead of computing them. ("", 0) when none qualifies or pulls are off."""
        if not self.pull_min_blocks:
            return "", 0
        own = cached_blocks.get(prefill.instance_id, 0) if prefill.instance_id else 0
        best: tuple[str, int] = ("", 0)
        for inst in self.prefills:
            if inst is prefill or not inst.routable or inst.address in exclude or not inst.instance_id:
                continue
            held = cached_blocks.get(inst.instance_id, 0)
            if held >= own + self.pull_min_blocks and held > best[1]:
                best = (inst.address, held)
        return best

    def max_queued_prefill_tokens(self, exclude: frozenset[str] = frozenset()) -> int:
        """The most prefill tokens queued on any routable prefill instance (not in `exclude`):
        a bound on the queue a request meets before its prefill instance is chosen."""
        return max((queued_tokens(i) for i in self.prefills if i.routable and i.address not in exclude), default=0)


class MismatchError(Exception):
    """Instances disagree with the gateway on page size or model (FAILED_PRECONDITION)."""
