"""The instance registry in Redis: which prefill and decode instances are alive, and where.

Every instance renews a lease while it serves; the lease is the registry entry. Keys, for
namespace `ns` and model `model` (the prefix index's keys, kvstore/redis_index.py, share
them: one registry for discovery and for the index):

    {ns}:{model}:lease:{id}     the instance's record as JSON, with a TTL (ttl_s after the last renewal)
    {ns}:{model}:instances      set of instance ids that registered (the readers' list, and for reaping)

A record (`InstanceRecord`) says where to reach the instance (its gRPC address), its role
(prefill or decode), its model fingerprint and page size. An instance that drains deletes
its lease (`leave`); one that dies or freezes stops renewing it and Redis drops it ttl_s
later. Readers (`live`) list the instances set and read every lease in one round trip; an
id whose lease is gone is not alive (the gateways' reaping removes it from the set).

The lease of an older prefill holds "1" instead of a record: it still counts for the prefix
index, but is no registry entry (it cannot be dialled).

Reference: the lease-based membership of etcd and Consul (a key with a TTL, renewed by the
member, gone when it stops), as the SGLang and vLLM routers' service discovery reads it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass

import redis
import redis.asyncio

logger = logging.getLogger(__name__)

ROLES = ("prefill", "decode")


class RegistryKeys:
    """Key names of one model's registry (and prefix index) under `namespace`."""

    def __init__(self, namespace: str, model: str) -> None:
        if not namespace or not model:
            raise ValueError(f"namespace and model must be non-empty, got {namespace!r}, {model!r}")
        self.prefix = f"{namespace}:{model}"
        self.instances = f"{self.prefix}:instances"

    def lease(self, instance_id: str) -> str:
        return f"{self.prefix}:lease:{instance_id}"


@dataclass(frozen=True)
class InstanceRecord:
    """One instance's registry entry: who it is, where to reach it, what it serves."""

    instance_id: str
    role: str
    """prefill or decode."""
    address: str
    """host:port of its gRPC server, as other machines reach it (not a wildcard bind address)."""
    model_fingerprint: str = ""
    page_size: int = 0
    """Token slots per KV page (0: not said)."""

    def __post_init__(self) -> None:
        if not self.instance_id:
            raise ValueError("instance_id must be non-empty")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {list(ROLES)}, got {self.role!r}")
        host, _, port = self.address.rpartition(":")
        if not host or host in ("0.0.0.0", "::", "[::]") or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"address must be a reachable host:port, got {self.address!r}")
        if self.page_size < 0:
            raise ValueError(f"page_size must be >= 0, got {self.page_size}")

    def encode(self) -> str:
        """The lease's value: JSON with sorted keys."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def decode(cls, text: str | None) -> InstanceRecord | None:
        """The record in a lease's value; None for a missing lease, an older prefill's "1",
        or a value that is no record (logged: another writer's, or a newer format)."""
        if not text or text == "1":
            return None
        try:
            data = json.loads(text)
            return cls(**{k: data[k] for k in ("instance_id", "role", "address", "model_fingerprint", "page_size")})
        except (ValueError, TypeError, KeyError) as exc:
            logger.warning("registry entry %r is not an instance record (%s); ignored", text[:200], exc)
            return None


class InstanceRegistry:
    """Synchronous writer of registry entries (the services; call from a worker thread).

    Args:
        client: a redis.Redis with decode_responses=True (`from_url` makes one); shared with
            the prefix index on prefill.
        model, namespace: as the prefix index's (kvmesh.kvstore.redis_index.RedisKVIndex).

    Every method raises redis.exceptions.RedisError (ConnectionError when Redis is down).
    """

    def __init__(self, client: redis.Redis, model: str, namespace: str = "kvmesh") -> None:
        self._redis = client
        self.keys = RegistryKeys(namespace, model)

    @classmethod
    def from_url(cls, redis_url: str, model: str, namespace: str = "kvmesh") -> InstanceRegistry:
        """A registry on its own connection pool; socket timeouts of 2 s unless the URL sets them."""
        client = redis.Redis.from_url(redis_url, decode_responses=True, socket_timeout=2.0, socket_connect_timeout=2.0)
        return cls(client, model, namespace)

    def heartbeat(self, instance_id: str, ttl_s: float, record: InstanceRecord | None = None) -> bool:
        """Register `instance_id` and renew its lease for ttl_s seconds (call every ttl_s / 3),
        holding `record` (None: "1", a lease that is no registry entry).

        Returns True when the instance was not registered: the first heartbeat, or the
        registry lost it (a Redis restart, or reaped after a long pause).

        Raises:
            ValueError: ttl_s <= 0, or a record of another instance id.
        """
        if ttl_s <= 0:
            raise ValueError(f"lease ttl must be > 0 s, got {ttl_s}")
        if record is not None and record.instance_id != instance_id:
            raise ValueError(f"record of {record.instance_id!r} given for {instance_id!r}")
        pipe = self._redis.pipeline(transaction=True)
        pipe.set(self.keys.lease(instance_id), record.encode() if record else "1", px=max(1, int(ttl_s * 1000)))
        pipe.sadd(self.keys.instances, instance_id)
        return bool(pipe.execute()[1])

    def leave(self, instance_id: str) -> None:
        """Drop the instance's lease and registration: readers stop seeing it at once (drain)."""
        pipe = self._redis.pipeline(transaction=True)
        pipe.delete(self.keys.lease(instance_id))
        pipe.srem(self.keys.instances, instance_id)
        pipe.execute()

    def close(self) -> None:
        """Release the connection pool."""
        self._redis.close()


class AsyncRegistryReader:
    """Asyncio reader of the registry, for the gateway's event loop.

    Errors are not wrapped: redis.exceptions.RedisError reaches the caller (the gateway keeps
    the instances it knows meanwhile).
    """

    def __init__(self, redis_url: str, model: str, namespace: str = "kvmesh") -> None:
        self.keys = RegistryKeys(namespace, model)
        self._redis = redis.asyncio.Redis.from_url(
            redis_url, decode_responses=True, socket_timeout=2.0, socket_connect_timeout=2.0
        )

    async def live(self) -> list[InstanceRecord]:
        """The records of every registered instance whose lease exists now, by instance id.

        Two round trips (SMEMBERS, then MGET of the leases); leases holding no record
        (an older prefill's "1") are left out.
        """
        # decode_responses=True: the members are str (redis' stubs say bytes | str)
        members: set[str] = await self._redis.smembers(self.keys.instances)  # type: ignore[assignment]
        ids = sorted(members)
        if not ids:
            return []
        values: list[str | None] = await self._redis.mget([self.keys.lease(i) for i in ids])  # type: ignore[assignment]
        records = []
        for instance_id, value in zip(ids, values):
            record = InstanceRecord.decode(value)
            if record is not None and record.instance_id == instance_id:
                records.append(record)
        return records

    async def close(self) -> None:
        """Release the connection pool."""
        await self._redis.aclose()
