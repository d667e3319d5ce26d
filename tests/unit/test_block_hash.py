"""Block hashing: deterministic, chained, full blocks only, incremental == batch, same in every process."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvmesh.kvstore.block_hash import hash_block, hash_blocks

REPO = Path(__file__).resolve().parents[2]


def test_hash_is_blake2b_16_over_parent_and_int64_le_tokens():
    # the definition other languages / services can reimplement: blake2b-128 over
    # 16 zero bytes (no parent) followed by the ids as little-endian int64
    expected = hashlib.blake2b(
        bytes(16) + b"".join(t.to_bytes(8, "little", signed=True) for t in (1, 2, 3)), digest_size=16
    ).digest()
    assert hash_block(None, [1, 2, 3]) == expected


def _reference_chain(tokens: list[int], block_size: int) -> list[bytes]:
    """The chained hash written out with hashlib alone: block i = blake2b-128(hash i-1 || ids as int64 LE)."""
    parent, out = bytes(16), []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        ids = b"".join(t.to_bytes(8, "little", signed=True) for t in tokens[start : start + block_size])
        parent = hashlib.blake2b(parent + ids, digest_size=16).digest()
        out.append(parent)
    return out


def test_hash_blocks_equals_the_chain_written_out_with_hashlib():
    # negative and > 2**31 ids too: the int64 LE encoding, not int32 or text
    tokens = [7, -1, 2**40 + 3, 0, 49151, 5, 6, 2**31, 9, 10, 11]  # 11 tokens: 2 full blocks of 4 + 3
    expected = _reference_chain(tokens, 4)
    assert len(expected) == 2
    assert hash_blocks(tokens, 4) == expected
    assert hash_block(expected[0], tokens[4:8]) == expected[1]


def test_changing_one_token_changes_its_block_and_every_later_one_only():
    tokens = list(range(1000, 1024))  # 6 blocks of 4
    before = hash_blocks(tokens, 4)
    for i in range(6):
        changed = list(tokens)
        changed[4 * i + 2] += 1  # one token of block i
        after = hash_blocks(changed, 4)
        assert after[:i] == before[:i], i  # the blocks before it keep their hashes
        assert all(a != b for a, b in zip(after[i:], before[i:])), i  # block i and all after it change
        assert after == _reference_chain(changed, 4)


def test_deterministic_and_input_type_independent():
    h = hash_block(None, [5, 6, 7, 8])
    assert hash_block(None, [5, 6, 7, 8]) == h
    assert hash_block(None, (5, 6, 7, 8)) == h
    assert hash_block(None, np.array([5, 6, 7, 8], dtype=np.int32)) == h
    assert hash_block(None, [5, 6, 7, 9]) != h  # one token differs
    assert hash_block(None, [8, 7, 6, 5]) != h  # order matters


def test_chaining_same_block_under_different_parents_differs():
    p1 = hash_block(None, [1, 1])
    p2 = hash_block(None, [2, 2])
    assert hash_block(p1, [9, 9]) != hash_block(p2, [9, 9])
    assert hash_block(p1, [9, 9]) != hash_block(None, [9, 9])
    # hash_blocks chains exactly like repeated hash_block
    assert hash_blocks([1, 1, 9, 9], 2) == [p1, hash_block(p1, [9, 9])]


def test_partial_trailing_block_gets_no_hash():
    tokens = list(range(10))
    hashes = hash_blocks(tokens, 4)
    # 10 tokens, blocks of 4: blocks [0..3], [4..7]; tokens 8, 9 are a partial block
    assert len(hashes) == 2
    assert hashes == hash_blocks(tokens[:8], 4)
    assert hash_blocks(tokens[:3], 4) == []
    assert hash_blocks([], 4) == []


def test_parent_argument_continues_a_chain():
    tokens = list(range(12))
    full = hash_blocks(tokens, 4)
    assert hash_blocks(tokens[4:], 4, parent=full[0]) == full[1:]


def test_errors():
    with pytest.raises(ValueError, match="empty"):
        hash_block(None, [])
    with pytest.raises(ValueError, match="16-byte"):
        hash_block(b"short", [1])
    with pytest.raises(ValueError, match="block_size"):
        hash_blocks([1, 2], 0)
    with pytest.raises(TypeError, match="integers"):
        hash_block(None, [1.5, 2.0])


def test_incremental_equals_batch():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50_000, size=37).tolist()
    # hashing as tokens arrive: the tokens after the last full block, chained onto its hash
    hashes: list = []
    pending: list[int] = []

    def extend(new: list[int]) -> list:
        nonlocal pending
        pending = pending + new
        done = hash_blocks(pending, 4, parent=hashes[-1] if hashes else None)
        hashes.extend(done)
        pending = pending[4 * len(done) :]
        return done

    completed = []
    # feed in uneven chunks: 3, then 1 (completes block 0), then 10, then the rest
    completed.append(extend(tokens[:3]))
    assert completed[-1] == [] and hashes == []
    completed.append(extend(tokens[3:4]))
    assert len(completed[-1]) == 1
    completed.append(extend(tokens[4:14]))  # 14 tokens so far: 3 full blocks
    assert len(completed[-1]) == 2
    completed.append(extend(tokens[14:]))  # 37 tokens: 9 full blocks, 1 token pending
    assert len(completed[-1]) == 6
    assert 4 * len(hashes) + len(pending) == 37 and pending == tokens[36:]
    assert hashes == hash_blocks(tokens, 4)
    assert [h for chunk in completed for h in chunk] == hashes
    # one token at a time, hash_block as each block fills, gives the same again
    one_by_one: list = []
    block: list[int] = []
    for t in tokens:
        block.append(t)
        if len(block) == 4:
            one_by_one.append(hash_block(one_by_one[-1] if one_by_one else None, block))
            block = []
    assert one_by_one == hashes


def test_same_hash_in_another_process():
    tokens = list(range(100, 133))  # 33 tokens, block 8: 4 hashes
    code = f"from kvmesh.kvstore.block_hash import hash_blocks; print(','.join(h.hex() for h in hash_blocks({tokens!r}, 8)))"
    # a different PYTHONHASHSEED proves Python's hash() plays no part
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True, cwd=REPO)
    assert out.stdout.strip().split(",") == [h.hex() for h in hash_blocks(tokens, 8)]
    # and values fixed forever: changing the hash silently would orphan every index entry
    hashes = hash_blocks(tokens, 8)
    assert hashes[0].hex() == "5034d2f40833ce42a16153e92da915b8"
    assert hashes[3].hex() == "931ba12784f328e406605314ce9b7ae0"
