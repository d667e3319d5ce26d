# R=state slots
"""A runner's state slots as requests hold them: the free list kvmesh.engine.kv_cache's
KVCacheManager hands a request its slot from (DeepSeek-V4 keeps a request's open compressor
windows there; Llama has none)."""

from __future__ import annotations


class StateSlots:
    """Free list of a runner's state slots; `allocate()` gives None for runners without slots."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    def allocate(self) -> int | None:
        """A free slot id (None when the runner has none); RuntimeError when all are taken."""
        if not self.num_slots:
            return None
        if not self._free:
            raise RuntimeError(f"all {self.num_slots} state slots are in use; retry later")
        return self._free.pop()

    def free(self, slot: int | None) -> None:
        """Return `slot` to the free list (None, from a runner without slots, is ignored)."""
        if slot is not None:
            assert slot not in self._free, f"state slot {slot} freed twice"
            self._free.append(slot)

    @property
    def num_free(self) -> int:
        return len(self._free) if self.num_slots else 1 << 30

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)
