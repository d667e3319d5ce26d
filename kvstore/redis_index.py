"""The prefix index in Redis: which instance holds which block hash.

Prefill and decode instances write it from their pools' KV events (each event in the stream
marked with the writer's role); gateways read it to send a prompt to the prefill instance
where its longest prefix is already cached, and to the decode instance that holds the most
of it (its pages are then not pushed again). Instance ids are unique across roles. Keys, for namespace `ns` and model
`model` (hashes in lowercase hex):

    {ns}:{model}:block:{hash}              set of instance ids holding the block in their page pool
    {ns}:{model}:tier:{hash}               set of instance ids holding it in their second tier
    {ns}:{model}:instance:{id}:blocks      set of hashes an instance holds in its pool (for clears)
    {ns}:{model}:instance:{id}:tier        set of hashes it holds in its second tier (for clears)
    {ns}:{model}:kv_events                 stream of every event (instance, role, seq, type, medium, hashes)
    {ns}:{model}:lease:{id}                the instance's lease: exists while it heartbeats (TTL)
    {ns}:{model}:instances                 set of instance ids that registered (for reaping)

The leases and the instances set are the instance registry's (kvstore/registry.py): a
prefill's lease holds its registry record, so gateways find it there and count its blocks
while it lives; decode instances register in the same set.

Each instance numbers its events 1, 2, ... (`seq` in the stream; a restart starts again at
1 with an `cleared` event), so a consumer of the stream sees gaps and restarts. Readers count
an instance's blocks only while its lease exists: an instance that stops heartbeating stops
counting at once, and `reap_expired` (run by every gateway now and then; idempotent, so
several gateways may) deletes its entries. Redis deletes a set when its last member goes,
so no empty block set lingers. Clearing an instance runs a small Lua script (it must read
the instance's set to know which block sets to touch), so the index targets a single Redis,
not a cluster.

Reference: vLLM's KV events published to an external indexer (llm-d's KV cache
manager / Dynamo's KV router follow the same scheme).
"""

from __future__ import annotations

from collections.abc import Sequence

import redis
import redis.asyncio

from kvmesh.kvstore.block_hash import BlockHash
from kvmesh.kvstore.kv_events import MEDIA, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvmesh.kvstore.registry import InstanceRecord, InstanceRegistry, RegistryKeys

STREAM_MAXLEN = 100_000

# KEYS[1] = the instance's set of hashes; ARGV = block-key prefix, instance id.
_CLEAR_INSTANCE_LUA = """
local hashes = redis.call('SMEMBERS', KEYS[1])
for _, h in ipairs(hashes) do
    redis.call('SREM', ARGV[1] .. h, ARGV[2])
end
redis.call('DEL', KEYS[1])
return #hashes
"""


class _Keys(RegistryKeys):
    def __init__(self, namespace: str, model: str) -> None:
        super().__init__(namespace, model)
        self.block_prefix = f"{self.prefix}:block:"
        self.tier_prefix = f"{self.prefix}:tier:"
        self.stream = f"{self.prefix}:kv_events"

    def block(self, block_hash: BlockHash | str, tier: bool = False) -> str:
        h = block_hash if isinstance(block_hash, str) else block_hash.hex()
        return (self.tier_prefix if tier else self.block_prefix) + h

    def instance(self, instance_id: str, tier: bool = False) -> str:
        return f"{self.prefix}:instance:{instance_id}:{'tier' if tier else 'blocks'}"


def _queue_longest_prefix(
    pipe, keys: _Keys, block_hashes: Sequence[BlockHash], instance_ids: list[str], tiered: bool = False
) -> None:
    """Queue longest_prefix's reads on a (sync or asyncio) pipeline: the leases, then
    SMISMEMBER per block (Redis >= 6.2), of the pool's sets and, `tiered`, of the second
    tiers' too. `_leading_runs` / `_tiered_runs` score what it returns."""
    pipe.mget([keys.lease(i) for i in instance_ids])
    for h in block_hashes:
        pipe.smismember(keys.block(h), instance_ids)
        if tiered:
            pipe.smismember(keys.block(h, tier=True), instance_ids)


def _tiered_runs(results: Sequence, instance_ids: Sequence[str]) -> dict[str, tuple[int, int]]:
    """Score `_queue_longest_prefix(tiered=True)`'s results: each instance's leading run of
    blocks in its pool, and of blocks in its pool or its second tier."""
    leases, *rows = results
    pool_rows, tier_rows = rows[0::2], rows[1::2]
    pool = _leading_runs([leases, *pool_rows], instance_ids)
    either = [[a or b for a, b in zip(p, t)] for p, t in zip(pool_rows, tier_rows)]
    total = _leading_runs([leases, *either], instance_ids)
    return {i: (pool[i], total[i]) for i in instance_ids}


def _leading_runs(results: Sequence, instance_ids: Sequence[str]) -> dict[str, int]:
    """Score `_queue_longest_prefix`'s results: [leases, row 0, row 1, ...] where rows[i][j] = 1
    when instance j holds block i; count each instance's leading 1s. Instances whose lease is
    missing (leases[j] falsy) count 0."""
    leases, *rows = results
    counts = dict.fromkeys(instance_ids, 0)
    alive = {j for j in range(len(instance_ids)) if leases[j]}
    for row in rows:
        alive = {j for j in alive if row[j]}
        if not alive:
            break
        for j in alive:
            counts[instance_ids[j]] += 1
    return counts


class RedisKVIndex:
    """Synchronous writer of the prefix index (prefill instances use it); gateways read it
    with AsyncRedisKVIndexReader, which also reaps expired instances.

    Args:
        redis_url: e.g. "redis://127.0.0.1:6379/0"; timeouts can ride in the query
            string (`?socket_timeout=0.5&socket_connect_timeout=0.5`).
        model: model name; each model has its own index.
        namespace: key prefix shared by the mesh.
        role: the writer's role ("prefill" or "decode"), recorded with each event in the stream.

    Every method raises redis.exceptions.RedisError (ConnectionError when Redis is down).
    """

    def __init__(self, redis_url: str, model: str, namespace: str = "kvmesh", role: str = "prefill") -> None:
        self.model = model
        self.namespace = namespace
        self.role = role
        self._keys = _Keys(namespace, model)
        # bounded by default: a stopped Redis must not hold a caller forever (the URL may override)
        self._redis = redis.Redis.from_url(
            redis_url, decode_responses=True, socket_timeout=2.0, socket_connect_timeout=2.0
        )
        self._clear_script = self._redis.register_script(_CLEAR_INSTANCE_LUA)
        self._seq: dict[str, int] = {}
        self.registry = InstanceRegistry(self._redis, model, namespace)
        """The instance registry on this index's connection (the lease is its entry)."""

    def heartbeat(self, instance_id: str, ttl_s: float, record: InstanceRecord | None = None) -> bool:
        """Register `instance_id` and renew its lease for ttl_s seconds (call every ttl_s / 3),
        holding its registry `record` (InstanceRegistry.heartbeat; None: an index-only lease).

        Returns True when the instance was not registered: the first heartbeat, or the index
        lost it (a Redis restart, or reaped after a long pause), so the caller should re-publish
        what it holds (`resync`).
        """
        return self.registry.heartbeat(instance_id, ttl_s, record)

    def resync(self, instance_id: str, block_hashes: Sequence[BlockHash]) -> None:
        """Replace the instance's entries with exactly `block_hashes` (what its cache holds now)."""
        events: list[KVEvent] = [AllBlocksCleared()]
        if block_hashes:
            events.append(BlockStored(tuple(block_hashes)))
        self.publish(instance_id, events)

    def leave(self, instance_id: str) -> None:
        """Clear the instance's entries and drop its lease and registration (clean shutdown)."""
        self.clear_instance(instance_id)
        self.registry.leave(instance_id)

    def publish(self, instance_id: str, events: Sequence[KVEvent]) -> None:
        """Append `events` to the stream and apply them to the index, in order, in ONE transaction.

        Raises:
            TypeError: an event is not a KVEvent.
        """
        if not events:
            return
        keys = self._keys
        pipe = self._redis.pipeline(transaction=True)
        for event in events:
            medium = "device"
            if isinstance(event, BlockStored):
                kind, hexes, medium = "stored", [h.hex() for h in event.block_hashes], event.medium
            elif isinstance(event, BlockRemoved):
                kind, hexes, medium = "removed", [h.hex() for h in event.block_hashes], event.medium
            elif isinstance(event, AllBlocksCleared):
                kind, hexes = "cleared", []
            else:
                raise TypeError(f"not a KV event: {event!r}")
            if medium not in MEDIA:
                raise ValueError(f"medium must be one of {MEDIA}, got {medium!r}")
            seq = self._seq[instance_id] = self._seq.get(instance_id, 0) + 1  # this writer's count
            pipe.xadd(
                keys.stream,
                {
                    "instance": instance_id,
                    "role": self.role,
                    "seq": seq,
                    "type": kind,
                    "medium": medium,
                    "hashes": ",".join(hexes),
                },
                maxlen=STREAM_MAXLEN,
                approximate=True,
            )
            if kind == "cleared":
                for tier in (False, True):
                    self._clear_script(
                        keys=[keys.instance(instance_id, tier)],
                        args=[keys.tier_prefix if tier else keys.block_prefix, instance_id],
                        client=pipe,
                    )
            elif hexes:
                tier = medium != "device"
                op = pipe.sadd if kind == "stored" else pipe.srem
                for h in hexes:
                    op(keys.block(h, tier), instance_id)
                op(keys.instance(instance_id, tier), *hexes)
        pipe.execute()

    def clear_instance(self, instance_id: str) -> None:
        """Forget every block of `instance_id` (at start-up and shutdown); recorded as a `cleared` event."""
        self.publish(instance_id, [AllBlocksCleared()])

    def longest_prefix(self, block_hashes: Sequence[BlockHash], instance_ids: Sequence[str]) -> dict[str, int]:
        """For each instance, how many consecutive leading blocks of `block_hashes` it holds.

        One pipelined round trip (the leases, then SMISMEMBER per block, Redis >= 6.2); an
        instance without a live lease counts 0 blocks.

        Returns:
            {instance_id: number of leading blocks held} for every id in instance_ids.
        """
        instance_ids = list(instance_ids)
        if not instance_ids or not block_hashes:
            return dict.fromkeys(instance_ids, 0)
        pipe = self._redis.pipeline(transaction=False)
        _queue_longest_prefix(pipe, self._keys, block_hashes, instance_ids)
        return _leading_runs(pipe.execute(), instance_ids)

    def close(self) -> None:
        """Release the connection pool."""
        self._redis.close()


class AsyncRedisKVIndexReader:
    """Asyncio reader of the prefix index, for the gateway's event loop.

    Errors are not wrapped: redis.exceptions.ConnectionError (and TimeoutError when the
    URL sets socket timeouts) reach the caller, which routes by load alone meanwhile.
    """

    def __init__(self, redis_url: str, model: str, namespace: str = "kvmesh") -> None:
        self.model = model
        self.namespace = namespace
        self._keys = _Keys(namespace, model)
        self._redis = redis.asyncio.Redis.from_url(
            redis_url, decode_responses=True, socket_timeout=2.0, socket_connect_timeout=2.0
        )
        self._clear_script = self._redis.register_script(_CLEAR_INSTANCE_LUA)

    async def longest_prefix(self, block_hashes: Sequence[BlockHash], instance_ids: Sequence[str]) -> dict[str, int]:
        """Same as RedisKVIndex.longest_prefix, one pipelined round trip."""
        instance_ids = list(instance_ids)
        if not instance_ids or not block_hashes:
            return dict.fromkeys(instance_ids, 0)
        async with self._redis.pipeline(transaction=False) as pipe:
            _queue_longest_prefix(pipe, self._keys, block_hashes, instance_ids)
            results = await pipe.execute()
        return _leading_runs(results, instance_ids)

    async def longest_prefix_tiered(
        self, block_hashes: Sequence[BlockHash], instance_ids: Sequence[str]
    ) -> dict[str, tuple[int, int]]:
        """For each instance, (leading blocks of `block_hashes` in its page pool, leading blocks
        in its pool or its second tier), one pipelined round trip (two SMISMEMBER a block)."""
        instance_ids = list(instance_ids)
        if not instance_ids or not block_hashes:
            return dict.fromkeys(instance_ids, (0, 0))
        async with self._redis.pipeline(transaction=False) as pipe:
            _queue_longest_prefix(pipe, self._keys, block_hashes, instance_ids, tiered=True)
            results = await pipe.execute()
        return _tiered_runs(results, instance_ids)

    async def reap_expired(self) -> list[str]:
        """Delete the entries of registered instances whose lease expired; return their ids.

        Idempotent: several gateways may run it; the second finds nothing to do.
        """
        # decode_responses=True: the members are str (redis' stubs say bytes | str)
        members: set[str] = await self._redis.smembers(self._keys.instances)  # type: ignore[assignment]
        ids = sorted(members)
        if not ids:
            return []
        leases = await self._redis.mget([self._keys.lease(i) for i in ids])
        dead = [i for i, lease in zip(ids, leases) if not lease]
        for i in dead:
            for tier in (False, True):
                prefix = self._keys.tier_prefix if tier else self._keys.block_prefix
                await self._clear_script(keys=[self._keys.instance(i, tier)], args=[prefix, i])
            await self._redis.srem(self._keys.instances, i)
        return dead

    async def close(self) -> None:
        """Release the connection pool."""
        await self._redis.aclose()
