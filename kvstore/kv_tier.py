"""A second tier for KV blocks the page pool evicts: pages are copied out before their page is
reused, kept by block hash (least recently used out first, at most `capacity_blocks`), and
copied back into a page on a later prefix hit, so an evicted prefix costs a copy instead of a
recompute. Two media (kvmesh.kvstore.kv_events.MEDIA):

    HostTier   `host`  one host-memory array of capacity_blocks pages, beside a GPU pool
    FileTier   `disk`  one file a block under a directory (testable on a CPU-only machine,
                       where the pool itself is host memory)

Each stored and evicted block is a KV event with the tier's medium, so the prefix index and
the router know a tier hit from a pool hit. A file is written whole under a temporary name
and renamed into place, and carries the BLAKE2b digest of the page's layout (its shape and
dtype, kvmesh.engine.kv_layout.PageLayout.describe) and bytes: a file that is missing,
truncated, corrupted or of another layout (a bf16 block where fp32 ones are kept) is a miss, dropped from
the tier with its event, never wrong bytes. A full disk makes `put` a no-op (logged once),
never an error for the request whose allocation evicted the page.

Reference: SGLang HiCache (host tier beside the GPU radix cache, write-through on eviction),
LMCache's local disk backend, vLLM's CPU offloading connector. Not thread-safe: use it from
the thread that uses the pool.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import struct
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kvmesh.kvstore.block_hash import BlockHash
from kvmesh.kvstore.kv_events import BlockRemoved, BlockStored, KVEvent

logger = logging.getLogger(__name__)

_MAGIC = b"KVMTIER1"
_HEADER = struct.Struct("<8s16sQ")  # magic, BLAKE2b-16 of the page, page bytes


def _page_bytes(page) -> np.ndarray:
    """A page buffer (numpy uint8, or a torch uint8 tensor on any device) as host uint8 bytes."""
    if isinstance(page, np.ndarray):
        return page.reshape(-1).view(np.uint8)
    return page.detach().reshape(-1).cpu().numpy().view(np.uint8)  # a device page: one copy to the host


def _copy_into(page, data: np.ndarray) -> None:
    """Copy host bytes `data` into the page buffer `page` (numpy or torch, any device)."""
    if isinstance(page, np.ndarray):
        np.copyto(page.reshape(-1).view(np.uint8), data)
    else:
        import torch

        page.reshape(-1).copy_(torch.from_numpy(data))


class _Tier:
    """The LRU bookkeeping and KV events both tiers share."""

    medium = ""

    def __init__(
        self, capacity_blocks: int, page_nbytes: int, on_events: Callable[[list[KVEvent]], None] | None = None
    ) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"a KV tier needs capacity_blocks >= 1, got {capacity_blocks}")
        if page_nbytes < 1:
            raise ValueError(f"page_nbytes must be >= 1, got {page_nbytes}")
        self.capacity_blocks = capacity_blocks
        self.page_nbytes = page_nbytes
        self.on_events = on_events
        """Hears the tier's KV events (the pool's KVCacheManager points it where the pool's go)."""
        self._lru: OrderedDict[BlockHash, int] = OrderedDict()  # hash -> slot; first = least recently used
        self.num_loads = 0
        """Blocks copied back into the pool (hits)."""
        self.num_failed_loads = 0
        """Hits whose bytes were gone or did not check out: dropped, and recomputed by the caller."""

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def cached_hashes(self) -> list[BlockHash]:
        """Every block hash the tier holds now (the index's resync)."""
        return list(self._lru)

    def put(self, block_hash: BlockHash, page) -> bool:
        """Keep a copy of `page` (page_nbytes bytes: numpy uint8 or a torch tensor) under
        `block_hash`, evicting the least recently used block when full; one BlockStored (and a
        BlockRemoved for what it evicted). Returns False when the copy could not be kept
        (a full disk), which loses nothing but the copy. Raises ValueError for a page of
        another size."""
        data = _page_bytes(page)
        if data.nbytes != self.page_nbytes:
            raise ValueError(f"a page of this tier holds {self.page_nbytes} bytes, got {data.nbytes}")
        if block_hash in self._lru:
            self._lru.move_to_end(block_hash)
            return True
        removed: list[BlockHash] = []
        if len(self._lru) >= self.capacity_blocks:
            old, slot = self._lru.popitem(last=False)
            self._drop(old, slot)
            removed.append(old)
        slot = self._free_slot()
        stored = self._write(block_hash, slot, data)
        if stored:
            self._lru[block_hash] = slot
        events: list[KVEvent] = [BlockRemoved(tuple(removed), self.medium)] if removed else []
        if stored:
            events.append(BlockStored((block_hash,), self.medium))
        self._emit(events)
        return stored

    def get(self, block_hash: BlockHash, page) -> bool:
        """Copy the block's bytes into `page` (a pool page: numpy uint8 or a torch tensor);
        False when the tier does not hold it, or its bytes are gone or do not check out (the
        block is then dropped, with its BlockRemoved: the caller recomputes it)."""
        slot = self._lru.get(block_hash)
        if slot is None:
            return False
        data = self._read(block_hash, slot)
        if data is None:
            del self._lru[block_hash]
            self._drop(block_hash, slot)
            self.num_failed_loads += 1
            self._emit([BlockRemoved((block_hash,), self.medium)])
            return False
        _copy_into(page, data)
        self._lru.move_to_end(block_hash)
        self.num_loads += 1
        return True

    def clear(self) -> None:
        """Drop every block (no events: call it when the index is cleared anyway, at start and stop)."""
        for block_hash, slot in list(self._lru.items()):
            self._drop(block_hash, slot)
        self._lru.clear()

    def close(self) -> None:
        """At shutdown: drop every block (and a FileTier's directory)."""
        self.clear()

    def _emit(self, events: list[KVEvent]) -> None:
        if events and self.on_events is not None:
            self.on_events(events)

    # what each medium does with the bytes
    def _free_slot(self) -> int:
        return 0

    def _write(self, block_hash: BlockHash, slot: int, data: np.ndarray) -> bool:
        raise NotImplementedError

    def _read(self, block_hash: BlockHash, slot: int) -> np.ndarray | None:
        raise NotImplementedError

    def _drop(self, block_hash: BlockHash, slot: int) -> None:
        pass


class HostTier(_Tier):
    """`host`: capacity_blocks pages of host memory (one numpy array), beside a GPU pool.

    Raises ValueError for a capacity < 1 or a page size < 1; MemoryError when the host lacks
    capacity_blocks * page_nbytes bytes."""

    medium = "host"

    def __init__(self, capacity_blocks: int, page_nbytes: int, on_events=None) -> None:
        super().__init__(capacity_blocks, page_nbytes, on_events)
        self._pages = np.empty((capacity_blocks, page_nbytes), dtype=np.uint8)
        self._free = list(range(capacity_blocks - 1, -1, -1))

    def _free_slot(self) -> int:
        return self._free.pop()

    def _write(self, block_hash: BlockHash, slot: int, data: np.ndarray) -> bool:
        self._pages[slot] = data
        return True

    def _read(self, block_hash: BlockHash, slot: int) -> np.ndarray | None:
        return self._pages[slot]

    def _drop(self, block_hash: BlockHash, slot: int) -> None:
        self._free.append(slot)


class FileTier(_Tier):
    """`disk`: one file a block, `<directory>/<hash hex>.kv` (a header with the page's digest,
    then its bytes), at most capacity_blocks files. `layout` names what a page holds (its shape and
    dtype): it enters every digest, so only a page of this layout checks out.

    The directory is this tier's alone: files found there at start are an earlier run's and
    are removed (its index entries were cleared with the instance). Raises ValueError for a
    capacity < 1 or a page size < 1, OSError when the directory cannot be made."""

    medium = "disk"

    def __init__(
        self, directory: str | Path, capacity_blocks: int, page_nbytes: int, on_events=None, layout: str = ""
    ) -> None:
        super().__init__(capacity_blocks, page_nbytes, on_events)
        self.layout = layout
        self.directory = Path(directory)
        if self.directory.exists():
            shutil.rmtree(self.directory)
        self.directory.mkdir(parents=True, mode=0o700)
        self._disk_full_logged = False
        self.num_failed_writes = 0

    def _path(self, block_hash: BlockHash) -> Path:
        return self.directory / f"{block_hash.hex()}.kv"  # hex of a hash we made: never a user's text

    def _digest(self, data: np.ndarray) -> bytes:
        """BLAKE2b-16 of this tier's layout, then the page's bytes."""
        h = hashlib.blake2b(self.layout.encode(), digest_size=16)
        h.update(data.data)
        return h.digest()

    def _write(self, block_hash: BlockHash, slot: int, data: np.ndarray) -> bool:
        path = self._path(block_hash)
        tmp = path.with_suffix(".tmp")
        digest = self._digest(data)
        try:
            if not self.directory.is_dir():  # removed under the running service: made again
                self.directory.mkdir(parents=True, mode=0o700, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(_HEADER.pack(_MAGIC, digest, data.nbytes))
                f.write(data.data)
            os.replace(tmp, path)
        except OSError as exc:
            self.num_failed_writes += 1
            if not self._disk_full_logged:
                logger.warning("KV tier %s cannot keep evicted blocks (%s); they are dropped", self.directory, exc)
                self._disk_full_logged = True
            try:
                tmp.unlink(missing_ok=True)
            except OSError:  # the directory itself is gone or replaced: nothing was left there
                pass
            return False
        return True

    def _read(self, block_hash: BlockHash, slot: int) -> np.ndarray | None:
        path = self._path(block_hash)
        try:
            raw = np.fromfile(path, dtype=np.uint8)  # one read, into a writable array
        except OSError as exc:
            logger.warning("KV tier block %s unreadable (%s); recomputing it", block_hash.hex(), exc)
            return None
        if raw.nbytes != _HEADER.size + self.page_nbytes:
            logger.warning("KV tier block %s is %d bytes, not %d; recomputing it", block_hash.hex(), raw.nbytes,
                           _HEADER.size + self.page_nbytes)  # fmt: skip
            return None
        magic, digest, nbytes = _HEADER.unpack(raw[: _HEADER.size].tobytes())
        data = raw[_HEADER.size :]
        if magic != _MAGIC or nbytes != self.page_nbytes or self._digest(data) != digest:
            logger.warning("KV tier block %s does not check out; recomputing it", block_hash.hex())
            return None
        return data

    def _drop(self, block_hash: BlockHash, slot: int) -> None:
        try:
            self._path(block_hash).unlink(missing_ok=True)
        except OSError:  # the directory itself is gone or replaced
            pass

    def close(self) -> None:
        """Remove the directory and every block in it."""
        self._lru.clear()
        shutil.rmtree(self.directory, ignore_errors=True)


KVTier = HostTier | FileTier


def create_tier(
    capacity_blocks: int, page_nbytes: int, directory: str, device_type: str, instance_id: str, layout: str = ""
) -> KVTier | None:
    """The second tier a service's settings ask for: none for capacity 0; a FileTier of pages of
    `layout` in a directory of its own under `directory` (named by a digest of the instance id)
    when one is given; else a HostTier beside a GPU pool. Raises ValueError for a host tier beside a pool
    that is host memory already (on the CPU: give a directory)."""
    if capacity_blocks == 0:
        return None
    if directory:
        name = "kvmesh-tier-" + hashlib.sha256(instance_id.encode()).hexdigest()[:16]
        return FileTier(Path(directory) / name, capacity_blocks, page_nbytes, layout=layout)
    if device_type == "cpu":
        raise ValueError(
            "--kv-tier-blocks beside a pool in host memory (--device cpu) needs --kv-tier-dir: a host tier "
            "would hold nothing the pool could not"
        )
    return HostTier(capacity_blocks, page_nbytes)
