"""Chained block hashes: the one key the gateway, the Redis index and every pool agree on.

A prompt is cut into blocks of `block_size` tokens. Block i's hash covers its own
token ids and block i-1's hash, so equal hashes mean equal prefixes, not just equal
blocks. Only full blocks are hashed: a trailing partial block can still grow, so it
has no stable identity yet.

The hash is blake2b with a 16-byte digest over the parent hash (16 zero bytes for the
first block) followed by the token ids as little-endian int64. It never uses Python's
`hash()`, so it is the same in every process and on every machine.

`hash_block` is the one definition; `hash_blocks` chains it over a token sequence. A tenant's
sequences chain from its own root (`tenant_root`) instead of the zero parent, so the first
block's hash, and every hash after it, covers the tenant: two tenants' equal prompts share no
hash (vLLM's `cache_salt`, mixed into the first block's hash the same way).

Reference: vLLM v1 prefix caching (`vllm/v1/core/kv_cache_utils.py`,
`hash_block_tokens` and the incremental request block hasher).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import NewType

import numpy as np

BlockHash = NewType("BlockHash", bytes)
"""16 bytes identifying a full block of tokens together with everything before it."""

HASH_NBYTES = 16
_NO_PARENT = bytes(HASH_NBYTES)


def tenant_root(tenant: str) -> BlockHash | None:
    """The parent of the first block of a tenant's sequences: blake2b (16 bytes) of the tenant's
    name under a domain prefix; None (the zero parent, as without tenants) for "", which is
    every request of a gateway without API keys."""
    if not tenant:
        return None
    return BlockHash(hashlib.blake2b(b"kvmesh-tenant\x00" + tenant.encode(), digest_size=HASH_NBYTES).digest())


def _as_token_array(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids as a contiguous little-endian int64 array (1-D)."""
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise TypeError(f"token_ids must be integers, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr, dtype="<i8")


def _check_parent(parent: BlockHash | None) -> bytes:
    if parent is None:
        return _NO_PARENT
    if len(parent) != HASH_NBYTES:
        raise ValueError(f"parent must be a {HASH_NBYTES}-byte BlockHash or None, got {len(parent)} bytes")
    return parent


def hash_block(parent: BlockHash | None, token_ids: Sequence[int] | np.ndarray) -> BlockHash:
    """Hash one block of tokens chained onto its parent block's hash.

    Args:
        parent: hash of the previous block, or None for the first block of a sequence.
        token_ids: the block's token ids (any integer sequence: list, tuple, numpy array).

    Returns:
        a 16-byte BlockHash, identical in every process and on every machine.

    Raises:
        ValueError: token_ids is empty, or parent is not 16 bytes.
        TypeError: token_ids are not integers.
    """
    tokens = _as_token_array(token_ids)
    if tokens.size == 0:
        raise ValueError("token_ids must not be empty: a block holds at least one token")
    h = hashlib.blake2b(_check_parent(parent), digest_size=HASH_NBYTES)
    h.update(tokens.data)  # the contiguous int64 buffer, no copy
    return BlockHash(h.digest())


def check_block_hashes(block_hashes: Sequence[bytes], num_tokens: int, block_size: int) -> None:
    """Raise ValueError unless `block_hashes` (a caller's, for a prompt of num_tokens tokens) is
    empty or holds one HASH_NBYTES-byte hash per full block of block_size tokens."""
    full = num_tokens // block_size
    if block_hashes and (len(block_hashes) != full or any(len(h) != HASH_NBYTES for h in block_hashes)):
        raise ValueError(
            f"block_hashes must hold one {HASH_NBYTES}-byte hash per full block of the prompt "
            f"({full} of {block_size} tokens), got {len(block_hashes)}"
        )


def hash_blocks(
    token_ids: Sequence[int] | np.ndarray, block_size: int, parent: BlockHash | None = None
) -> list[BlockHash]:
    """Chained hashes of every FULL block of `token_ids`: `hash_block` applied block by block.

    To hash incrementally as tokens arrive, pass the tokens after the last full block and
    that block's hash as `parent` (or call `hash_block(parent, block)` as each block fills).

    Args:
        token_ids: the sequence's token ids.
        block_size: tokens per block (page size), >= 1.
        parent: hash the first block chains onto (None at the start of a sequence).

    Returns:
        len(token_ids) // block_size hashes; a trailing partial block gets none.

    Raises:
        ValueError: block_size < 1, or parent is not 16 bytes.
        TypeError: token_ids are not integers.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    tokens = _as_token_array(token_ids)
    _check_parent(parent)  # a bad parent is an error even when no block is full yet
    hashes: list[BlockHash] = []
    for start in range(0, tokens.size - block_size + 1, block_size):
        parent = hash_block(parent, tokens[start : start + block_size])
        hashes.append(parent)
    return hashes
