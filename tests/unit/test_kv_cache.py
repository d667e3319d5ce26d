"""The KV cache manager both engines use: prefix match and allocation, state slots, scratch
slots, the buffers a push moves, its figures and its integrity check; and the page layouts.

The runner is a stand-in holding real memory of a layout (the model is not under test)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvmesh.engine.kv_cache import KVCacheManager
from kvmesh.engine.kv_layout import DEEPSEEK_V4_PAGE, LLAMA_PAGE, flat_layout, llama_layout
from kvmesh.engine.request import Request
from kvmesh.kvstore.block_hash import hash_blocks
from kvmesh.kvstore.block_pool import NoFreeBlocksError
from kvmesh.kvstore.kv_events import BlockRemoved, BlockStored
from kvmesh.kvstore.kv_tier import FileTier
from kvmesh.kvstore.staging import choose_push_path


class MemoryRunner:
    """Pages (and slots) of a layout; resume_state_slot records what it was asked."""

    def __init__(self, layout, num_pages: int, num_slots: int = 0) -> None:
        self.memory = layout.allocate(num_pages, num_slots)
        self.page_layout = layout
        self.num_state_slots = num_slots
        self.page_nbytes = layout.page_nbytes
        self.resumed: list[tuple[int, int]] = []

    def page_buffer(self, page_id):
        return self.memory.page_buffer(page_id)

    def state_buffers(self, slot):
        return self.memory.state_buffers(slot)

    def resume_state_slot(self, slot, page):
        self.resumed.append((slot, page))


def test_the_llama_layout_is_page_major_and_its_buffers_are_zero_copy():
    layout = llama_layout(num_layers=2, page_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    assert layout.name == LLAMA_PAGE and layout.page_shape == (2, 2, 4, 2, 8)
    assert layout.page_nbytes == 2 * 2 * 4 * 2 * 8 * 4 and layout.slot_nbytes == 0 and layout.device == "cpu"
    memory = layout.allocate(3)
    assert memory.pages.shape == (3, 2, 2, 4, 2, 8) and memory.pages.is_contiguous()
    buf = memory.page_buffer(1)
    assert buf.nbytes == layout.page_nbytes and buf.dtype == np.uint8
    buf.view(np.float32)[:] = 2.0  # writes land in page 1 only
    assert torch.all(memory.pages[1] == 2.0) and not memory.pages[0].any() and not memory.pages[2].any()
    assert memory.state_buffers(None) == []
    with pytest.raises(ValueError, match=r"page_id must be in \[0, 3\), got 3"):
        memory.page_buffer(3)
    # what a Reserve names when two sides' layouts differ (a GPU's: tests/unit/test_device_resident.py)
    assert layout.describe() == "[P, L, 2, S, K, D] (2, 2, 4, 2, 8) () float32"
    assert (
        llama_layout(2, 4, 2, 8, torch.bfloat16, "cuda:1").describe()
        == "[P, L, 2, S, K, D] (2, 2, 4, 2, 8) () bfloat16"
    )


def test_the_flat_layout_keeps_pages_then_slots_in_one_region():
    layout = flat_layout(page_floats=6, slot_floats=3)
    assert layout.name == DEEPSEEK_V4_PAGE and (layout.page_nbytes, layout.slot_nbytes) == (24, 12)
    memory = layout.allocate(2, 4)
    assert memory.pages.shape == (2, 6) and memory.slots.shape == (4, 3)
    # the slots follow the pages in the same storage: expert-parallel ranks map it as split() does
    assert memory.slots.data_ptr() == memory.pages.data_ptr() + 2 * 24
    (state,) = memory.state_buffers(1)
    state.view(np.float32)[:] = 7.0
    assert torch.all(memory.slots[1] == 7.0) and memory.slots.sum() == 21.0
    flat = torch.zeros(2 * 6 + 4 * 3)  # a region mapped elsewhere: split() finds the same places
    again = layout.split(flat, 2, 4)
    assert again.pages.data_ptr() == flat.data_ptr() and again.slots.data_ptr() == flat.data_ptr() + 2 * 24
    with pytest.raises(ValueError, match=r"state slot must be in \[0, 4\), got None"):
        memory.state_buffers(None)


def _prefill_cache(num_pages=6, num_slots=0, caching=True):
    events: list = []
    runner = MemoryRunner(llama_layout(1, 4, 1, 2, torch.float32), num_pages, num_slots)
    return KVCacheManager(runner, num_pages, 4, caching, events.extend), runner, events


def test_prefill_reuses_the_cached_prefix_and_recomputes_the_last_prompt_token():
    cache, _, events = _prefill_cache()
    tokens = list(range(100, 112))  # 3 full pages of 4
    a = Request("a", tokens)
    cache.allocate_prompt(a)
    assert a.block_ids == [0, 1, 2] and a.num_cached_tokens == 0 and a.num_prompt_pages == 3
    assert a.block_hashes == hash_blocks(tokens, 4)
    cache.cache_prompt(a)
    assert events == [BlockStored(tuple(hash_blocks(tokens, 4)))]
    cache.check_integrity()
    cache.free(a.block_ids, a.state_slot)
    cache.check_integrity()
    # the same prompt: 2 pages cached, the third recomputed so the last token's logits exist
    b = Request("b", tokens)
    cache.allocate_prompt(b)
    assert b.block_ids == [0, 1, 3] and b.num_cached_tokens == b.num_computed_tokens == 8
    stats = cache.stats()
    assert stats == {
        "num_pages": 6,
        "num_free_pages": 3,  # pages 4, 5 free and page 2 cached, evictable
        "num_cached_pages": 3,
        "num_referenced_pages": 3,
        "integrity_error": "",
    }
    cache.free(b.block_ids, b.state_slot)
    cache.check_integrity()
    assert cache.num_holders == 0 and cache.pool.num_referenced_blocks == 0


def test_a_prompt_short_of_pages_holds_nothing_and_says_when_it_would_fit():
    cache, _, _ = _prefill_cache(num_pages=4)
    a = Request("a", list(range(12)))
    cache.allocate_prompt(a)
    cache.cache_prompt(a)
    b = Request("b", [*range(8), 99, 98, 97, 96, 95])  # shares 2 cached pages, needs 2 more: 1 is free
    with pytest.raises(NoFreeBlocksError):
        cache.allocate_prompt(b)
    assert cache.pool.num_referenced_blocks == 3 and cache.num_holders == 1  # the match was given back
    assert cache.fits_later() and cache.fits_ever(16) and not cache.fits_ever(17)
    cache.check_integrity()
    cache.free(a.block_ids, a.state_slot)
    assert not cache.fits_later()
    cache.check_integrity()


def test_state_slots_resume_from_a_cached_prefix_and_run_out_as_capacity():
    cache, runner, _ = _prefill_cache(num_slots=1)
    tokens = list(range(9))  # 2 full pages and one token
    a = Request("a", tokens)
    cache.allocate_prompt(a)
    assert a.state_slot == 0 and runner.resumed == []  # nothing cached: a fresh slot
    with pytest.raises(NoFreeBlocksError, match="all 1 state slots are in use"):
        cache.allocate_prompt(Request("b", tokens))
    cache.check_integrity()
    cache.cache_prompt(a)
    cache.free(a.block_ids, a.state_slot)
    b = Request("b", tokens)
    cache.allocate_prompt(b)
    assert b.num_cached_tokens == 8 and runner.resumed == [(0, b.block_ids[1])]  # the last cached page's end
    cache.check_integrity()
    cache.free(b.block_ids, b.state_slot)
    cache.check_integrity()


def test_decode_allocates_for_the_whole_answer_and_sets_scratch_slots_apart():
    runner = MemoryRunner(flat_layout(4, 2), 8, num_slots=4)
    cache = KVCacheManager(runner, 8, 4)
    assert cache.hold_scratch_slots(2) == [0, 1]
    r = Request("r", num_prompt_tokens=10, max_tokens=7)
    cache.allocate(r, 16, RuntimeError)
    assert r.block_ids == [0, 1, 2, 3] and r.num_prompt_pages == 3 and r.state_slot == 2
    cache.check_integrity()  # the scratch slots count as held by no request, on purpose
    bufs = cache.push_buffers(r.block_ids[: r.num_prompt_pages], r.state_slot)
    assert [b.nbytes for b in bufs] == [16, 16, 16, 8]  # three pages, then the slot
    assert len(cache.push_buffers(r.block_ids[:1], r.state_slot, with_state=False)) == 1
    with pytest.raises(RuntimeError, match="needs 5 KV pages, 4 of 8 are free"):
        cache.allocate(Request("big", num_prompt_tokens=16, max_tokens=5), 20, RuntimeError)
    cache.allocate(Request("s", [1]), 1, RuntimeError)  # the last slot
    with pytest.raises(RuntimeError, match="all 4 state slots are in use"):
        cache.allocate(Request("t", [1]), 1, RuntimeError)
    cache.check_integrity()
    cache.free(r.block_ids, r.state_slot)
    cache.check_integrity()


def test_the_integrity_check_names_what_nobody_holds():
    cache, _, _ = _prefill_cache(num_slots=2)
    a = Request("a", [1, 2, 3])
    cache.allocate_prompt(a)
    cache.slots.free(a.state_slot)  # a slot lost track of: the check says so
    assert cache.integrity_error() == "0 state slots held, 1 requests hold pages"
    assert cache.stats(check=False)["integrity_error"] == ""  # unchecked
    cache.num_holders = 0
    assert cache.integrity_error() == "1 pages referenced by no request"


def test_the_staged_push_path_copies_through_host_buffers_and_lands_on_completion():
    # what a GPU instance without a CUDA-capable UCX does, here on host pages (the same copies)
    sender_runner = MemoryRunner(llama_layout(1, 4, 1, 2, torch.float32), 4)
    sender = KVCacheManager(sender_runner, 4, 4, push_path="staged")
    receiver_runner = MemoryRunner(llama_layout(1, 4, 1, 2, torch.float32), 4)
    receiver = KVCacheManager(receiver_runner, 4, 4, push_path="staged")
    assert sender.push_path == "staged" and "host buffers" in sender.push_path_reason
    sender_runner.memory.pages[1] = 3.0
    sender_runner.memory.pages[2] = 4.0
    sent = sender.outbound([1, 2])
    sender_runner.memory.pages[1] = 5.0  # the copies were taken when asked for, not views
    assert [bytes(b) for b in sent] == [bytes(np.full(16, 3.0, np.float32)), bytes(np.full(16, 4.0, np.float32))]
    landing = receiver.inbound(7, [3, 0])
    assert receiver.inbound(7, [3, 0]) is landing  # the same host buffers on every call

    for host, src in zip(landing, sent):  # what UCX does: the push lands in the host buffers
        host[:] = src
    assert not receiver_runner.memory.pages.any()  # nothing reached the pages yet
    receiver.landed(7)
    assert torch.all(receiver_runner.memory.pages[3] == 3.0) and torch.all(receiver_runner.memory.pages[0] == 4.0)
    receiver.landed(7)  # once only: the host buffers are gone
    receiver.inbound(8, [1])
    receiver.forget_landing(8)  # a request that ended before its push landed leaves nothing behind
    assert receiver._landings == {}


def test_the_push_path_follows_the_pages_device_and_what_ucx_loaded():
    assert choose_push_path("cpu")[0] == "host"
    assert choose_push_path("cuda:0", transports={"tcp", "cuda_copy", "cuda_ipc"}) == (
        "direct",
        "pages on cuda:0, moved by UCX itself (cuda_copy, cuda_ipc)",
    )
    assert choose_push_path("cuda:0", transports={"tcp", "posix"})[0] == "staged"
    assert choose_push_path("cuda:0", "staged", transports={"cuda_copy"})[0] == "staged"
    with pytest.raises(ValueError, match="--kv-push-path direct: UCX loaded no CUDA transport"):
        choose_push_path("cuda:1", "direct", transports={"tcp"})
    with pytest.raises(ValueError, match=r"KV push path must be one of \['auto', 'direct', 'staged'\]"):
        choose_push_path("cpu", "rdma")


def test_evicted_blocks_spill_to_the_second_tier_and_come_back_bitwise_on_a_hit(tmp_path):
    """Pages the pool evicts go to the tier (their events say `disk`); a later prompt that
    shares them loads them into fresh pages (which rejoin the pool's cache) instead of computing
    them; a block whose file was deleted stops the run there and is recomputed."""
    events: list = []
    runner = MemoryRunner(llama_layout(1, 4, 1, 2, torch.float32), 4)
    tier = FileTier(tmp_path / "tier", 8, runner.page_nbytes)
    cache = KVCacheManager(runner, 4, 4, True, events.extend, tier=tier)
    first = list(range(100, 113))  # 3 full pages + 1 token
    a = Request("a", first)
    cache.allocate_prompt(a)
    kv = {b: np.random.default_rng(b).integers(0, 256, runner.page_nbytes, dtype=np.uint8) for b in a.block_ids}
    for b, data in kv.items():
        runner.page_buffer(b)[:] = data  # "the compute"
    cache.cache_prompt(a)
    cache.free(a.block_ids, a.state_slot)
    hashes = hash_blocks(first, 4)
    # another prompt takes every page: a's 3 cached pages are evicted, and spilled
    b = Request("b", list(range(500, 516)))
    cache.allocate_prompt(b)
    assert BlockRemoved(tuple(hashes)) in events
    assert [e for e in events if isinstance(e, BlockStored) and e.medium == "disk"] == [
        BlockStored((h,), "disk") for h in hashes
    ]
    assert all(h in tier for h in hashes) and cache.snapshot()[1] == BlockStored(tuple(hashes), "disk")
    cache.free(b.block_ids, b.state_slot)
    # a's prompt again: its 3 blocks come back from the tier, none recomputed
    again = Request("again", first)
    cache.allocate_prompt(again)
    assert again.num_cached_tokens == again.num_tier_tokens == 12
    for k in range(3):
        assert np.array_equal(runner.page_buffer(again.block_ids[k]), kv[a.block_ids[k]])
    assert set(hashes) <= cache.pool.cached_hashes()  # back in the pool's cache (device events)
    stats = cache.stats()
    assert stats["kv_tier_medium"] == "disk" and stats["num_tier_loads"] == 3
    cache.free(again.block_ids, again.state_slot)
    cache.check_integrity()
    # evict them again, delete the second block's file under the running cache: the run stops there
    c = Request("c", list(range(700, 716)))
    cache.allocate_prompt(c)
    cache.free(c.block_ids, c.state_slot)
    (tmp_path / "tier" / f"{hashes[1].hex()}.kv").unlink()
    last = Request("last", first)
    cache.allocate_prompt(last)
    assert last.num_cached_tokens == last.num_tier_tokens == 4 and hashes[1] not in tier
    assert BlockRemoved((hashes[1],), "disk") in events
    assert cache.stats()["num_tier_failed_loads"] == 1
    cache.free(last.block_ids, last.state_slot)
    cache.check_integrity()
