"""Shared KV pools: finding pages in a region, and mapping a peer's region only when it is one."""

from __future__ import annotations

import os
import tempfile

import numpy as np
import torch

from kvmesh.kvstore import shared_memory
from kvmesh.kvstore.shared_memory import PeerRegions, RegionDescriptor, SharedRegion, locate, shared_zeros


def test_a_tensor_in_shared_memory_starts_zeroed_and_its_pages_are_located():
    cache, region = shared_zeros((4, 2, 3), torch.float32)
    assert cache.shape == (4, 2, 3) and cache.dtype == torch.float32 and not cache.any()
    assert region.nbytes == 4 * 2 * 3 * 4
    pages = [cache[i].view(-1).view(torch.uint8).numpy() for i in (2, 0)]
    desc, offsets = locate([p.ctypes.data for p in pages], [p.nbytes for p in pages])
    assert desc == region.descriptor and offsets == [2 * 24, 0]
    outside = np.zeros(24, dtype=np.uint8)
    assert locate([pages[0].ctypes.data, outside.ctypes.data], [24, 24]) is None
    assert locate([region.address + region.nbytes - 8], [16]) is None  # runs past the end
    assert locate([], []) is None


def test_a_peer_maps_the_region_read_only_and_sees_writes():
    region = SharedRegion(8192)
    region.array[:5] = [1, 2, 3, 4, 5]
    peers = PeerRegions()
    pool = peers.open(region.descriptor)  # this process plays the peer: /proc/self/fd works alike
    assert pool is not None and not pool.flags.writeable and pool.nbytes == 8192
    assert pool[:5].tolist() == [1, 2, 3, 4, 5]
    region.array[0] = 9  # the same memory, not a copy
    assert pool[0] == 9
    assert peers.open(region.descriptor) is pool  # kept


def test_what_is_not_a_kvmesh_region_is_refused():
    region = SharedRegion(4096)
    d = region.descriptor
    peers = PeerRegions()
    assert peers.open(RegionDescriptor(d.pid, d.fd, (d.nonce[0] ^ 1, d.nonce[1]), d.nbytes)) is None  # wrong nonce
    assert peers.open(RegionDescriptor(d.pid, d.fd, d.nonce, d.nbytes * 2)) is None  # wrong size
    with tempfile.TemporaryFile() as f:  # a plain file, whatever its first bytes
        f.write(b"\0" * (shared_memory.HEADER_NBYTES + 4096))
        f.flush()
        assert peers.open(RegionDescriptor(os.getpid(), f.fileno(), (0, 0), 4096)) is None
    assert peers.open(RegionDescriptor(2**22 + 12345, 3, d.nonce, d.nbytes)) is None  # no such process
