"""KV pools in shared memory, so that a decode process on the same host can pull a request's
pages from prefill's pool with one copy.

A `SharedRegion` is a memfd (an anonymous file in RAM, not limited by /dev/shm's size) mapped
into this process; the runners allocate their KV pages in one (`shared_zeros`). When prefill
pushes pages that lie in a region, the KV push tells the receiver where they are (the region's
`descriptor` and each page's offset); a receiver in another process of the same host maps the
region read-only through /proc/PID/fd/FD and copies the pages into its reserved pages itself:
one memcpy, as UCX's CMA and XPMEM transports or an RDMA READ move bytes, decided by the
receiver, which can always finish or drop its own copy (a stopped or dead sender cannot hold
decode's pages). A receiver that cannot map the region (another host or container, another
user) falls back to the UCX data path.

The peers are the mesh's own services (trusted, as for token ids and KV addresses); the
region is still checked before use: the fd must be a kvmesh memfd and its header must hold
the 16-byte nonce the sender sent.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

MEMFD_NAME = "kvmesh-kv"
HEADER_NBYTES = 4096
"""The region's first page: 16 bytes of nonce, then nothing; the pool starts after it."""

_regions: list[SharedRegion] = []
_regions_lock = threading.Lock()


@dataclass(frozen=True)
class RegionDescriptor:
    """What a peer needs to map a region: pid, fd, nonce (two uint64), pool bytes."""

    pid: int
    fd: int
    nonce: tuple[int, int]
    nbytes: int


class SharedRegion:
    """`nbytes` bytes of zeroed shared memory (a memfd) in this process, registered so that a
    KV push can find the pages that lie in it (`locate`). Lives as long as the process.

    Raises OSError when memfd_create or the mapping fails (e.g. too little memory).
    """

    def __init__(self, nbytes: int) -> None:
        if nbytes < 1:
            raise ValueError(f"a shared region needs at least 1 byte, got {nbytes}")
        self.fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC)
        os.ftruncate(self.fd, HEADER_NBYTES + nbytes)
        self._map = mmap.mmap(self.fd, HEADER_NBYTES + nbytes)
        nonce = np.frombuffer(os.urandom(16), dtype="<u8")
        self._map[:16] = nonce.tobytes()
        self.array = np.frombuffer(self._map, dtype=np.uint8, count=nbytes, offset=HEADER_NBYTES)
        """The pool's bytes, [nbytes] uint8, writable."""
        self.address = self.array.ctypes.data
        self.descriptor = RegionDescriptor(os.getpid(), self.fd, (int(nonce[0]), int(nonce[1])), nbytes)
        with _regions_lock:
            _regions.append(self)

    @property
    def nbytes(self) -> int:
        return self.descriptor.nbytes


def shared_zeros(shape: Sequence[int], dtype: torch.dtype) -> tuple[torch.Tensor, SharedRegion]:
    """A zeroed torch tensor of `shape` and `dtype` in a new SharedRegion: (tensor, region).

    Raises OSError as SharedRegion does."""
    import torch

    numel = 1
    for n in shape:
        numel *= int(n)
    itemsize = torch.empty((), dtype=dtype).element_size()
    region = SharedRegion(max(1, numel * itemsize))
    tensor = torch.frombuffer(region.array, dtype=dtype, count=numel).view(*shape)
    return tensor, region


def locate(pointers: Sequence[int], sizes: Sequence[int]) -> tuple[RegionDescriptor, list[int]] | None:
    """The region holding every buffer (start addresses `pointers`, `sizes` bytes) and each
    buffer's offset in its pool; None when some buffer lies outside every region (or all of
    them lie in no single one)."""
    if not pointers:
        return None
    with _regions_lock:
        regions = list(_regions)
    for region in regions:
        lo, hi = region.address, region.address + region.nbytes
        if all(lo <= p and p + s <= hi for p, s in zip(pointers, sizes)):
            return region.descriptor, [p - lo for p in pointers]
    return None


def map_region(desc: RegionDescriptor, writable: bool) -> mmap.mmap:
    """Map another process's kvmesh shared region (same host, same user), header included,
    read-only or read-write. Raises ValueError when /proc/PID/fd/FD is not that region (not a
    kvmesh memfd, size or nonce differs) and OSError when it cannot be opened."""
    path = f"/proc/{desc.pid}/fd/{desc.fd}"
    if not os.readlink(path).startswith(f"/memfd:{MEMFD_NAME}"):
        raise ValueError(f"{path} is not a kvmesh memfd")
    fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC)
    try:
        if os.fstat(fd).st_size != HEADER_NBYTES + desc.nbytes:
            raise ValueError(f"{path} is not {HEADER_NBYTES + desc.nbytes} bytes long")
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        mapped = mmap.mmap(fd, HEADER_NBYTES + desc.nbytes, flags=mmap.MAP_SHARED, prot=prot)
    finally:
        os.close(fd)
    nonce = np.frombuffer(mapped[:16], dtype="<u8")  # a copy: mapped can still close
    if (int(nonce[0]), int(nonce[1])) != desc.nonce:
        mapped.close()
        raise ValueError(f"{path} holds another region (nonce differs)")
    return mapped


class PeerRegions:
    """Read-only mappings of other processes' regions, opened on first use and kept (at most
    `capacity`, least recently used dropped). Not thread-safe: use from one thread."""

    def __init__(self, capacity: int = 8) -> None:
        self.capacity = capacity
        self._maps: OrderedDict[RegionDescriptor, tuple[mmap.mmap, np.ndarray]] = OrderedDict()
        self._failed: set[RegionDescriptor] = set()

    def open(self, desc: RegionDescriptor) -> np.ndarray | None:
        """The peer's pool as a read-only [nbytes] uint8 array; None when it cannot be mapped
        here (another host, pid namespace or user; not a kvmesh memfd; a wrong nonce)."""
        if desc in self._maps:
            self._maps.move_to_end(desc)
            return self._maps[desc][1]
        if desc in self._failed:
            return None
        try:
            # no MAP_POPULATE: a prefill pool may be GBs; pages fault in as pulls touch them
            mapped = map_region(desc, writable=False)
        except (OSError, ValueError) as exc:
            logger.info("cannot map the sender's KV pool (%s); its pages come over UCX", exc)
            self._failed.add(desc)
            return None
        pool = np.frombuffer(mapped, dtype=np.uint8, count=desc.nbytes, offset=HEADER_NBYTES)
        self._maps[desc] = (mapped, pool)
        while len(self._maps) > self.capacity:
            self._maps.popitem(last=False)  # the mmap closes when no array refers to it
        return pool

    def close(self) -> None:
        self._maps.clear()
