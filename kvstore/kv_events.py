"""KV events: what a prefix cache tells the world about the blocks it holds.

A block pool emits them as it caches and evicts blocks; the prefill service publishes
them to the Redis prefix index, which the gateway reads to route by cached prefix.
Reference: vLLM's KV cache events (`vllm/distributed/kv_events.py`: BlockStored,
BlockRemoved, AllBlocksCleared).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.block_hash import BlockHash


@dataclass(frozen=True)
class BlockStored:
    """These blocks are now cached (full, hashed, reusable by later requests)."""

    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True)
class BlockRemoved:
    """These blocks were evicted: their hashes are no longer held."""

    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    """The instance dropped its whole prefix cache: it holds no block hash any more."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
