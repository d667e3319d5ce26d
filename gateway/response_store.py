"""Stored responses of the Responses API (POST /v1/responses with `store: true`): the response,
its input items and the conversation it ends, so that `previous_response_id` continues it and
GET / DELETE /v1/responses/{id} find it.

Two stores behind one interface (`ResponseStore`): Redis when the gateway has a --redis-url
(every gateway of the mesh reads the same records, and a gateway restart loses none), bounded
memory otherwise (least recently used dropped first). Records expire after a TTL in both.

A record belongs to the API key that stored it (its owner, kvmesh.gateway.auth.ApiKeys.owner_of):
the key a record lives under is a digest of the owner and the response id, so another key's
lookup of the same id finds nothing (404, never 403: an id says nothing about another tenant's
records), and an id from a URL is never part of a Redis key as it was sent.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from typing import Any, Protocol

import redis.asyncio
import redis.exceptions

Record = dict[str, Any]
"""A stored response: {"response": <the Response object>, "input_items": [<its input items>],
"messages": [<the conversation through its output, as chat messages>], "session": <the id of
the chain's first response>} (kvmesh.gateway.http.responses_call writes and reads it)."""

MAX_MEMORY_RECORDS = 10_000
"""Records a gateway without Redis keeps (least recently used dropped first)."""


class ResponseStoreError(RuntimeError):
    """The store cannot be reached (Redis down or slow): HTTP 503, nothing stored."""


class ResponseStore(Protocol):
    """Where stored responses live; every method raises ResponseStoreError when the store
    cannot be reached."""

    async def put(self, owner: str, response_id: str, record: Record) -> None: ...

    async def get(self, owner: str, response_id: str) -> Record | None: ...

    async def delete(self, owner: str, response_id: str) -> bool: ...

    async def close(self) -> None: ...


def record_key(owner: str, response_id: str) -> str:
    """The digest a record is kept under: sha256 of the owner and the id (hex)."""
    return hashlib.sha256(f"{owner}\0{response_id}".encode("utf-8", "surrogatepass")).hexdigest()


class MemoryResponseStore:
    """Records in this process: at most `max_records`, each for `ttl_s` seconds."""

    def __init__(self, ttl_s: float, max_records: int = MAX_MEMORY_RECORDS) -> None:
        self.ttl_s = ttl_s
        self.max_records = max_records
        self._records: OrderedDict[str, tuple[float, str]] = OrderedDict()  # key -> (expiry, JSON)

    def __len__(self) -> int:
        return len(self._records)

    async def put(self, owner: str, response_id: str, record: Record) -> None:
        key = record_key(owner, response_id)
        self._records[key] = (time.monotonic() + self.ttl_s, json.dumps(record))
        self._records.move_to_end(key)
        while len(self._records) > self.max_records:
            self._records.popitem(last=False)

    async def get(self, owner: str, response_id: str) -> Record | None:
        key = record_key(owner, response_id)
        found = self._records.get(key)
        if found is None:
            return None
        expiry, text = found
        if expiry < time.monotonic():
            del self._records[key]
            return None
        self._records.move_to_end(key)
        return json.loads(text)

    async def delete(self, owner: str, response_id: str) -> bool:
        return self._records.pop(record_key(owner, response_id), None) is not None

    async def close(self) -> None:
        self._records.clear()


class RedisResponseStore:
    """Records in Redis under `{namespace}:response:{record_key}` (a JSON string, SET with EX
    `ttl_s`), shared by every gateway with the same --redis-url. A call that Redis does not
    answer within `timeout_s` seconds raises ResponseStoreError."""

    def __init__(self, redis_url: str, ttl_s: float, namespace: str = "kvmesh", timeout_s: float = 2.0) -> None:
        self.ttl_s = ttl_s
        self.prefix = f"{namespace}:response:"
        self._redis = redis.asyncio.Redis.from_url(
            redis_url, decode_responses=True, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )

    async def put(self, owner: str, response_id: str, record: Record) -> None:
        try:
            await self._redis.set(self.prefix + record_key(owner, response_id), json.dumps(record), ex=self._ttl())
        except (redis.exceptions.RedisError, OSError) as exc:
            raise ResponseStoreError(f"the response store (Redis) failed: {type(exc).__name__}") from None

    async def get(self, owner: str, response_id: str) -> Record | None:
        try:
            text = await self._redis.get(self.prefix + record_key(owner, response_id))
        except (redis.exceptions.RedisError, OSError) as exc:
            raise ResponseStoreError(f"the response store (Redis) failed: {type(exc).__name__}") from None
        return json.loads(text) if text is not None else None

    async def delete(self, owner: str, response_id: str) -> bool:
        try:
            return bool(await self._redis.delete(self.prefix + record_key(owner, response_id)))
        except (redis.exceptions.RedisError, OSError) as exc:
            raise ResponseStoreError(f"the response store (Redis) failed: {type(exc).__name__}") from None

    async def close(self) -> None:
        await self._redis.aclose()

    def _ttl(self) -> int:
        return max(1, round(self.ttl_s))


def create_response_store(redis_url: str, ttl_s: float) -> ResponseStore:
    """Redis's store when `redis_url` is set, else this process's memory; records last `ttl_s` seconds."""
    if redis_url:
        return RedisResponseStore(redis_url, ttl_s)
    return MemoryResponseStore(ttl_s)
