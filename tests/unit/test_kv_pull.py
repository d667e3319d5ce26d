"""The pull's choice (prefill_svc/kv_pull.py): pull a peer's blocks only where the estimate says
the pull beats computing them. The engine is a test double here (the choice is under test; the
pull itself runs between real prefill processes in tests/integration/test_prefix_routing.py)."""

from __future__ import annotations

import asyncio
import concurrent.futures

from kvmesh.engine.request import Request
from kvmesh.kvstore.block_hash import hash_blocks
from kvmesh.prefill_svc.kv_pull import ROUND_TRIP_S, KVPuller


class Cache:
    page_nbytes = 1_000_000


class Engine:
    page_size = 16
    kv_cache = Cache()

    def __init__(self, tokens_per_s: float | None, cached_tokens: int = 0) -> None:
        self.rate = tokens_per_s
        self.cached_tokens = cached_tokens
        self.released: list = []

    def tokens_per_s(self):
        return self.rate

    def allocate_now(self, request: Request) -> bool:
        request.block_ids = list(range(request.num_prompt_tokens // 16 + 1))
        request.num_cached_tokens = self.cached_tokens
        return True

    def call(self, fn, *args):
        f: concurrent.futures.Future = concurrent.futures.Future()
        f.set_result(fn(*args))
        return f


def _job(n: int) -> Request:
    ids = list(range(1000, 1000 + n))
    return Request("r", ids, block_hashes=hash_blocks(ids, 16))


def test_the_estimate_is_bytes_over_bandwidth_against_tokens_over_prefill_rate():
    puller = KVPuller(Engine(tokens_per_s=2000.0), receiver=None, page_layout="x")  # type: ignore[arg-type]
    puller.bytes_per_s = 1e9
    pull_s, compute_s = puller.estimate(160, 10 * 1_000_000)
    assert abs(pull_s - (ROUND_TRIP_S + 0.010)) < 1e-12 and compute_s == 160 / 2000.0
    assert KVPuller(Engine(None), None, "x").estimate(160, 1)[1] is None  # type: ignore[arg-type]


def test_no_pull_where_computing_is_cheaper_or_the_instance_holds_as_much():
    # a fast prefill (1M tokens/s) beats a slow link (10 MB/s): 10 blocks of 1 MB take 1 s to
    # pull and 160 us to compute; the job keeps its pages and is computed
    slow = KVPuller(Engine(tokens_per_s=1e6), None, "x")  # type: ignore[arg-type]
    slow.bytes_per_s = 1e7
    job = _job(200)
    got = asyncio.run(slow.pull(job, "peer:1", 10))
    assert got.tokens == 0 and got.seconds == 0 and "computing is cheaper" in got.why_not
    assert job.block_ids  # allocated: the compute uses them
    # the instance holds 12 blocks already (its own cache): the peer's 10 add nothing
    holder = KVPuller(Engine(tokens_per_s=10.0, cached_tokens=12 * 16), None, "x")  # type: ignore[arg-type]
    got = asyncio.run(holder.pull(_job(200), "peer:1", 10))
    assert got.tokens == 0 and got.why_not == "holds as much as the peer"


def test_a_pull_whose_bytes_do_not_check_out_is_cancelled_and_computed_never_used():
    """The peer answers with a digest the landed bytes do not match (corrupted on the way): the
    receive is cancelled, nothing counts as cached, and the compute does those blocks. The cache
    and its pages are real (kvmesh.engine.kv_cache.KVCacheManager over host memory); the peer and the
    receiver are doubles that land corrupted bytes."""
    import numpy as np
    import torch

    from kvmesh.engine.kv_cache import KVCacheManager
    from kvmesh.engine.kv_layout import llama_layout
    from kvmesh.kvstore.transport import pages_digest
    from kvmesh.protos.v1 import prefill_pb2
    from tests.unit.test_kv_cache import MemoryRunner

    runner = MemoryRunner(llama_layout(1, 16, 1, 2, torch.float32), 16)
    cache = KVCacheManager(runner, 16, 16, True)

    class RealEngine(Engine):
        kv_cache = cache  # type: ignore[assignment]

        def allocate_now(self, request):
            cache.allocate_prompt(request)
            return True

    class Receiver:
        address = "127.0.0.1:9"
        cancelled: list[int] = []

        def expect(self, transfer_id, buffers):
            for b in buffers:
                b[:] = 0xAB  # "landed", but not the peer's bytes
            f = asyncio.get_running_loop().create_future()
            f.set_result(None)
            return f

        def cancel(self, transfer_id):
            self.cancelled.append(transfer_id)

    good = [np.zeros(runner.page_nbytes, dtype=np.uint8) for _ in range(3)]

    class Peer:
        async def PushBlocks(self, request, timeout=None):
            return prefill_pb2.PushBlocksResponse(
                num_blocks=len(request.block_hashes), kv_digest=pages_digest(good, "x")
            )

    receiver = Receiver()
    puller = KVPuller(RealEngine(tokens_per_s=None), receiver, "x", digest=True)  # type: ignore[arg-type]
    puller._stub = lambda address: Peer()  # type: ignore[method-assign,assignment,return-value]
    job = _job(60)  # 3 full blocks before the last token's
    got = asyncio.run(puller.pull(job, "peer:1", 3))
    assert got.tokens == 0 and "digest differs" in got.why_not and len(receiver.cancelled) == 1
    assert job.num_cached_tokens == 0 and not cache.pool.cached_hashes()  # nothing taken as the prompt's KV
    assert puller.num_failed == 1
    cache.free(job.block_ids, job.state_slot)
    cache.check_integrity()


def test_the_kv_digest_names_the_page_layout_and_dtype():
    import numpy as np
    import torch

    from kvmesh.engine.kv_layout import llama_layout
    from kvmesh.kvstore.transport import pages_digest

    page = np.arange(64, dtype=np.uint8)
    fp32 = llama_layout(1, 16, 1, 2, torch.float32).describe()
    bf16 = llama_layout(1, 16, 1, 2, torch.bfloat16).describe()
    assert fp32 != bf16 and "float32" in fp32
    # the same bytes held as another dtype are not the same KV: their digests differ
    assert pages_digest([page], fp32) != pages_digest([page], bf16)
    assert pages_digest([page], fp32) == pages_digest([page.copy()], fp32)
    assert pages_digest([page], fp32) != pages_digest([page[::-1].copy()], fp32)
