"""KV events: what a prefix cache tells the world about the blocks it holds.

A block pool (and its second tier) emits them as it caches and evicts blocks; prefill and
decode publish them to the Redis prefix index, which the gateway reads to route by cached
prefix. Each stored/removed event names its medium (MEDIA).
Reference: vLLM's KV cache events (`vllm/distributed/kv_events.py`: BlockStored,
BlockRemoved, AllBlocksCleared).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.kvstore.block_hash import BlockHash

MEDIA = ("device", "host", "disk")
"""Where a block is held: `device`, the page pool the model reads (GPU memory, or host memory on
a CPU-only machine); `host`, a second tier in host memory beside a GPU pool; `disk`, a second
tier of files (kvmesh.kvstore.kv_tier). A hit in a second tier is loaded into the pool before use."""


@dataclass(frozen=True)
class BlockStored:
    """These blocks are now cached (full, hashed, reusable by later requests) in `medium`."""

    block_hashes: tuple[BlockHash, ...]
    medium: str = "device"


@dataclass(frozen=True)
class BlockRemoved:
    """These blocks were evicted from `medium`: their hashes are no longer held there."""

    block_hashes: tuple[BlockHash, ...]
    medium: str = "device"


@dataclass(frozen=True)
class AllBlocksCleared:
    """The instance dropped its whole prefix cache (every medium): it holds no block hash any more."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
