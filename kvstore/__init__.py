"""kvstore: paged KV block pool, its second tier (`kvmesh.kvstore.kv_tier`), block hashing, KV events
and their publisher thread, the Redis prefix index and the KV transport (the interface in `kvmesh.kvstore.transport`, made by name with `create_sender` /
`create_receiver`; UCX is the implementation).

The Redis and UCX parts load on first use (`import ucxx` alone takes ~0.6 s), so a
process that only hashes blocks or manages a pool does not pay for them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from kvmesh.kvstore.block_hash import BlockHash, hash_block, hash_blocks
from kvmesh.kvstore.block_pool import Allocation, BlockPool, NoFreeBlocksError, PrefixMatch
from kvmesh.kvstore.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvmesh.kvstore.transport import KVPushReceiver, KVPushSender, TransferError, TransferResult
from kvmesh.kvstore.transports import create_receiver, create_sender

if TYPE_CHECKING:
    from kvmesh.kvstore.redis_index import AsyncRedisKVIndexReader, RedisKVIndex
    from kvmesh.kvstore.ucx_transfer import KVReceiver, KVSender

_LAZY = {
    "RedisKVIndex": "kvmesh.kvstore.redis_index",
    "AsyncRedisKVIndexReader": "kvmesh.kvstore.redis_index",
    "KVReceiver": "kvmesh.kvstore.ucx_transfer",
    "KVSender": "kvmesh.kvstore.ucx_transfer",
}

__all__ = [
    "BlockHash",
    "hash_block",
    "hash_blocks",
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "KVEvent",
    "BlockPool",
    "PrefixMatch",
    "Allocation",
    "NoFreeBlocksError",
    "KVPushSender",
    "KVPushReceiver",
    "TransferError",
    "TransferResult",
    "create_sender",
    "create_receiver",
    *_LAZY,
]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvstore' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
