"""Pull, don't recompute: a prefill instance that lacks a prompt's prefix which a peer prefill
holds (the prefix index says so, and the gateway names the peer in PrefillRequest.pull_from)
copies those blocks' pages from the peer instead of computing them, when that is the cheaper.

The request's pages are allocated first (engine.allocate_now: this instance's own prefix and
second-tier hits count as ever); the blocks after them that the peer holds are asked of it with
one PushBlocks call, which pushes their pages over the KV transport into this instance's KV
receiver, straight into the request's pages. Once they landed (and, with KVMESH_KV_DIGEST=1,
their digest matches the peer's), they count as cached and join the prefix cache, and the
compute starts after them. Reference: llm-d's "Pull, Don't Recompute" (KV cache transfer
between prefill peers on load spill); Mooncake's and LMCache's P2P KV sharing.

The choice: the pull's estimated seconds (its bytes over the pull bandwidth measured so far,
plus a fixed round trip) against the compute's (the tokens over this instance's measured
prefill rate, engine.tokens_per_s). The crossover is where KV bytes per token x prefill tokens
per second = pull bytes per second: SmolLM2-135M's 46,080 B a token at 1,000-3,000 tokens/s on
two CPU cores needs 46-140 MB/s; a pull between two processes on one host ran 1.2-1.5 GB/s
(docs/benchmarks.md).

Every wait is bounded: the call and the landing together by a deadline of a few times the
estimate (at least `min_timeout_s`); a peer that is gone, frozen (SIGSTOP) or holds fewer
blocks than asked, or bytes that do not check out, make the pull fail: the receive is
cancelled, and once no byte can land any more the request computes those blocks itself.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass

import grpc

from kvmesh.engine.request import Request
from kvmesh.kvstore.transport import KVPushReceiver, TransferError, pages_digest
from kvmesh.prefill_svc.engine import PrefillEngine
from kvmesh.protos.v1 import prefill_pb2, prefill_pb2_grpc

logger = logging.getLogger(__name__)

ROUND_TRIP_S = 0.002
"""The pull's fixed cost in the estimate: the PushBlocks call and the receive's set-up (s)."""


class PullFailed(Exception):
    """The peer could not give the blocks (fewer held than asked, or bytes that did not check out)."""


class PullStuck(RuntimeError):
    """A cancelled pull's receive did not let go of the request's pages within its bound: the
    request cannot be computed into them; they are freed once it does (the request fails)."""


@dataclass(frozen=True)
class Pulled:
    """What a pull did: prompt tokens it brought (0: none, the compute does them), its seconds
    (0 when none was tried), and why not, when it failed or was not worth it."""

    tokens: int
    seconds: float
    why_not: str = ""


class KVPuller:
    """Pulls prefix blocks from peer prefill instances into this instance's pages.

    Args:
        engine: this instance's engine (allocation, its prefill rate, the cache).
        receiver: this instance's KV receiver (kvmesh.kvstore.transport.KVPushReceiver), started.
        page_layout: the pages' layout description (kvmesh.engine.kv_layout.PageLayout.describe); the
            peer refuses another.
        digest: check the pages' SHA-256 against the peer's (KVMESH_KV_DIGEST).
        min_timeout_s: the least a pull may take before it is given up (seconds).
    """

    def __init__(
        self,
        engine: PrefillEngine,
        receiver: KVPushReceiver,
        page_layout: str,
        digest: bool = False,
        min_timeout_s: float = 1.0,
    ) -> None:
        self.engine = engine
        self.receiver = receiver
        self.page_layout = page_layout
        self.digest = digest
        self.min_timeout_s = min_timeout_s
        self.bytes_per_s = 1e9
        """Pull bandwidth measured so far (an EWMA of finished pulls; 1 GB/s before the first)."""
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.num_pulls = 0
        self.num_failed = 0

    def estimate(self, num_tokens: int, nbytes: int) -> tuple[float, float | None]:
        """(the pull's estimated seconds, the compute's; None before any compute was measured)."""
        rate = self.engine.tokens_per_s()
        return ROUND_TRIP_S + nbytes / self.bytes_per_s, (num_tokens / rate if rate else None)

    async def pull(self, job: Request, address: str, num_blocks: int) -> Pulled:
        """Allocate `job`'s pages now and pull from the peer at `address` (gRPC) the blocks after
        this instance's own hits, up to num_blocks (short of the last prompt token's), when that
        is estimated cheaper than computing them. Never raises for the peer's faults: a failed
        pull returns Pulled(0, seconds, why) and the compute does those blocks (PullStuck only
        when a cancelled receive did not let go of the pages: the request then fails). The job holds
        its pages from here on (submit() computes it without allocating again), unless the
        allocation found none free (then it is left as it was)."""
        allocation = self.engine.call(self.engine.allocate_now, job)
        try:
            allocated = await asyncio.shield(asyncio.wrap_future(allocation))
        except asyncio.CancelledError:  # the caller left: pages allocated after all go back
            allocation.add_done_callback(
                lambda f: not f.cancelled() and f.result() and self.engine.release(job.block_ids, job.state_slot)
            )
            raise
        if not allocated:
            return Pulled(0, 0.0, "no free pages to pull into")
        size = self.engine.page_size
        have = job.num_cached_tokens // size
        want = min(num_blocks, (job.num_prompt_tokens - 1) // size)
        if want <= have:
            return Pulled(0, 0.0, "holds as much as the peer")
        nbytes = (want - have) * self.engine.kv_cache.page_nbytes
        pull_s, compute_s = self.estimate((want - have) * size, nbytes)
        if compute_s is not None and pull_s >= compute_s:
            return Pulled(0, 0.0, f"computing is cheaper ({compute_s * 1000:.1f} ms vs {pull_s * 1000:.1f} ms)")
        started = time.perf_counter()
        timeout_s = max(self.min_timeout_s, 4 * pull_s)
        try:
            await self._pull(job, address, have, want, timeout_s)
        except (TimeoutError, grpc.aio.AioRpcError, TransferError, PullFailed, ValueError) as exc:
            self.num_failed += 1
            why = f"pull of {want - have} blocks from {address} failed ({_reason(exc, timeout_s)}); computing them"
            logger.warning("[%s] %s", job.request_id, why)
            return Pulled(0, time.perf_counter() - started, why)
        seconds = time.perf_counter() - started
        self.num_pulls += 1
        self.bytes_per_s = 0.7 * self.bytes_per_s + 0.3 * nbytes / max(seconds, 1e-6)
        return Pulled((want - have) * size, seconds)

    async def _pull(self, job: Request, address: str, have: int, want: int, timeout_s: float) -> None:
        """Receive blocks [have, want) of `job` from the peer into its pages, then count them
        cached. On any failure the receive is cancelled and this returns (raising) only once no
        byte can land in the pages any more."""
        kv_cache = self.engine.kv_cache
        pages = job.block_ids[have:want]
        transfer_id = random.getrandbits(63) or 1
        landed = self.receiver.expect(transfer_id, kv_cache.inbound(transfer_id, pages, None))
        request = prefill_pb2.PushBlocksRequest(
            request_id=job.request_id,
            block_hashes=(job.block_hashes or [])[have:want],
            kv_address=self.receiver.address,
            transfer_id=transfer_id,
            page_size=self.engine.page_size,
            kv_layout=self.page_layout,
        )
        try:
            async with asyncio.timeout(timeout_s):
                answer = await self._stub(address).PushBlocks(request, timeout=timeout_s)
                if answer.num_blocks != want - have:
                    raise PullFailed(f"the peer holds {answer.num_blocks} of the {want - have} blocks now")
                await asyncio.shield(landed)
            kv_cache.landed(transfer_id)
            ours = pages_digest(kv_cache.push_buffers(pages, with_state=False), self.page_layout) if self.digest else ""
            if self.digest and ours != answer.kv_digest:
                raise PullFailed("the pages' digest differs from the peer's")
        except BaseException:
            self.receiver.cancel(transfer_id)
            kv_cache.forget_landing(transfer_id)
            # the pages are the request's: compute may write them only once UCX let go of them
            await asyncio.wait({landed}, timeout=5.0)
            if landed.done() and not landed.cancelled():
                landed.exception()  # retrieved: the failure is reported once, below
            if not landed.done():
                landed.add_done_callback(lambda _f: self.engine.release(job.block_ids, job.state_slot))
                raise PullStuck(f"[{job.request_id}] a cancelled pull from {address} still holds its pages") from None
            raise
        await asyncio.wrap_future(self.engine.call(kv_cache.mark_cached, job, want))

    def _stub(self, address: str) -> prefill_pb2_grpc.PrefillStub:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = grpc.aio.insecure_channel(address)
        return prefill_pb2_grpc.PrefillStub(channel)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()


def _reason(exc: BaseException, timeout_s: float) -> str:
    if isinstance(exc, TimeoutError):
        return f"no answer within {timeout_s:.1f} s"
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc) or type(exc).__name__
