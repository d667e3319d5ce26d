"""The second KV tier: evicted pages kept by block hash (host memory or files), LRU, loaded
back into a page on a hit; bytes that are gone or do not check out are a miss, never wrong
bytes; a full disk loses only the copy. Real files in a temporary directory."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from kvmesh.kvstore.block_hash import hash_blocks
from kvmesh.kvstore.kv_events import BlockRemoved, BlockStored
from kvmesh.kvstore.kv_tier import FileTier, HostTier

PAGE = 4096


def _pages(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, PAGE), dtype=np.uint8)


def _hashes(n: int):
    return hash_blocks(list(range(n * 4)), 4)


@pytest.fixture(params=["disk", "host"])
def make_tier(request, tmp_path):
    def make(capacity: int, events: list):
        if request.param == "disk":
            return FileTier(tmp_path / "tier", capacity, PAGE, events.extend)
        return HostTier(capacity, PAGE, events.extend)

    return make


def test_blocks_come_back_bitwise_and_the_least_recently_used_goes_first(make_tier):
    events: list = []
    tier = make_tier(3, events)
    pages, hashes = _pages(4), _hashes(4)
    for h, p in zip(hashes[:3], pages[:3]):
        assert tier.put(h, p)
    out = np.zeros(PAGE, dtype=np.uint8)
    assert tier.get(hashes[0], out) and np.array_equal(out, pages[0])  # block 0 is now the most recent
    assert tier.put(hashes[3], pages[3])  # full: block 1, the least recently used, goes
    assert hashes[1] not in tier and all(h in tier for h in (hashes[0], hashes[2], hashes[3]))
    assert not tier.get(hashes[1], out)
    medium = tier.medium
    assert events == [
        BlockStored((hashes[0],), medium),
        BlockStored((hashes[1],), medium),
        BlockStored((hashes[2],), medium),
        BlockRemoved((hashes[1],), medium),
        BlockStored((hashes[3],), medium),
    ]
    # into a torch page too (a GPU pool's page is a device tensor; here a CPU one)
    page = torch.zeros(PAGE, dtype=torch.uint8)
    assert tier.get(hashes[3], page) and np.array_equal(page.numpy(), pages[3])
    assert tier.num_loads == 2 and tier.num_failed_loads == 0
    with pytest.raises(ValueError, match=f"holds {PAGE} bytes"):
        tier.put(_hashes(5)[4], np.zeros(PAGE - 1, dtype=np.uint8))


def test_a_deleted_truncated_or_corrupted_file_is_a_miss_with_its_event(tmp_path):
    events: list = []
    tier = FileTier(tmp_path / "tier", 8, PAGE, events.extend)
    pages, hashes = _pages(3), _hashes(3)
    for h, p in zip(hashes, pages):
        tier.put(h, p)
    events.clear()
    files = {h: tmp_path / "tier" / f"{h.hex()}.kv" for h in hashes}
    os.unlink(files[hashes[0]])  # deleted under the running service
    with open(files[hashes[1]], "r+b") as f:  # truncated
        f.truncate(100)
    raw = bytearray(files[hashes[2]].read_bytes())  # one byte flipped: same size, wrong digest
    raw[-1] ^= 0xFF
    files[hashes[2]].write_bytes(bytes(raw))
    out = np.full(PAGE, 7, dtype=np.uint8)
    for h in hashes:
        assert not tier.get(h, out)
        assert h not in tier
    assert (out == 7).all(), "a failed load wrote into the page"
    assert events == [BlockRemoved((h,), "disk") for h in hashes]
    assert tier.num_failed_loads == 3 and not any(p.exists() for p in files.values())


def test_a_block_of_another_layout_is_a_miss_even_of_the_same_size(tmp_path):
    # the layout (shape and dtype) enters each file's digest: a bf16 page where fp32 ones of the
    # same byte count are kept (twice the tokens a page) never checks out as one of them
    bf16 = FileTier(tmp_path / "bf16", 8, PAGE, layout="[P, L, 2, S, K, D] (1, 2, 32, 4, 4) () bfloat16")
    fp32 = FileTier(tmp_path / "fp32", 8, PAGE, layout="[P, L, 2, S, K, D] (1, 2, 16, 4, 4) () float32")
    (h,), (page,) = _hashes(1), _pages(1)
    bf16.put(h, page)
    fp32.put(h, page)
    (tmp_path / "fp32" / f"{h.hex()}.kv").write_bytes((tmp_path / "bf16" / f"{h.hex()}.kv").read_bytes())
    out = np.zeros(PAGE, dtype=np.uint8)
    assert not fp32.get(h, out) and not out.any()
    assert bf16.get(h, out) and np.array_equal(out, page)


def test_a_full_disk_loses_only_the_copy(tmp_path):
    events: list = []
    tier = FileTier(tmp_path / "tier", 8, PAGE, events.extend)
    (h,) = _hashes(1)
    # the block's file is written through /dev/full, which fails every write with ENOSPC
    (tmp_path / "tier" / f"{h.hex()}.tmp").symlink_to("/dev/full")
    assert not tier.put(h, _pages(1)[0])
    assert len(tier) == 0 and h not in tier and events == [] and tier.num_failed_writes == 1
    assert list((tmp_path / "tier").iterdir()) == []  # nothing left behind
    assert tier.put(h, _pages(1)[0]) and h in tier  # room again: kept


def test_a_directory_removed_or_replaced_under_the_tier_costs_copies_never_an_error(tmp_path):
    import shutil

    events: list = []
    tier = FileTier(tmp_path / "tier", 8, PAGE, events.extend)
    pages, hashes = _pages(3), _hashes(3)
    assert tier.put(hashes[0], pages[0])
    shutil.rmtree(tmp_path / "tier")  # rm -rf under the running service
    out = np.zeros(PAGE, dtype=np.uint8)
    assert not tier.get(hashes[0], out) and hashes[0] not in tier  # a miss, dropped
    assert tier.put(hashes[1], pages[1]) and tier.get(hashes[1], out)  # the directory is made again
    shutil.rmtree(tmp_path / "tier")
    (tmp_path / "tier").write_bytes(b"not a directory")  # replaced by a file: no copy can be kept
    assert not tier.put(hashes[2], pages[2]) and hashes[2] not in tier
    assert not tier.get(hashes[1], out)  # nor read back
    assert tier.num_failed_writes == 1 and len(tier) == 0
    tier.close()
