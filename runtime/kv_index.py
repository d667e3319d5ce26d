"""An instance's KV events on their way to the prefix index (kvmesh.kvstore.redis_index): the Redis
writer, the publisher thread that keeps them off the model's thread (kvmesh.kvstore.kv_publisher),
the re-publish after a lost lease or dropped events, and the clean leave at shutdown. Prefill
and decode both run one; each event in the stream names the writer's role.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from kvmesh.kvstore.kv_publisher import KVEventPublisher
from kvmesh.kvstore.redis_index import RedisKVIndex

logger = logging.getLogger(__name__)


class KVIndexWriter:
    """This instance's entries in the prefix index.

    Args:
        redis_url: the index's Redis.
        model: the served model's name (each model has its own index).
        instance_id: this instance's id (unique across roles).
        role: "prefill" or "decode".

    Clears the instance's old entries at once (a restart starts with an empty cache); a Redis
    that does not answer then is logged, and the events are retried as they come.
    """

    def __init__(self, redis_url: str, model: str, instance_id: str, role: str) -> None:
        self.instance_id = instance_id
        self.index = RedisKVIndex(redis_url, model=model, role=role)
        try:
            self.index.clear_instance(instance_id)
        except Exception as exc:
            logger.warning("Redis index unreachable at start (%s); KV events will be retried as they come", exc)
        self.publisher = KVEventPublisher(lambda events: self.index.publish(instance_id, events))

    def after_beat(self, resync: Callable[[], Awaitable[None]]) -> Callable[[bool], Awaitable[None]]:
        """A Registration's after_beat: when the index has forgotten this instance (its first
        lease, or Redis restarted empty) or events were dropped while Redis was down, await
        `resync()`, which must call `publisher.resync(hashes)` where the cache emits its events
        (so no event slips between the snapshot and the publish)."""

        async def after_beat(lost: bool) -> None:
            if lost or self.publisher.needs_resync:
                await resync()
                logger.info(
                    "prefix cache re-published to the index (%s)", "lease was new" if lost else "events dropped"
                )

        return after_beat

    async def leave(self) -> None:
        """At shutdown: send the KV events still queued, clear this instance's entries, close."""
        await asyncio.to_thread(self.publisher.close)
        try:
            await asyncio.to_thread(self.index.leave, self.instance_id)
        except Exception as exc:
            logger.warning("could not clear index entries at shutdown: %s", exc)
        self.index.close()
