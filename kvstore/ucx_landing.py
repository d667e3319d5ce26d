"""How one push's pages land on the decode side (the UCX receiver's, kvstore/ucx_receiver.py):
received over UCX into the reserved buffers (`receive_pages`, all receives posted at once), or
copied by the receiver itself from the sender's shared KV pool when both run on this host
(`sender_pool`, `pull_pages`); and the GO and ACK answers to the sender (protocol in
kvstore/ucx_transfer.py). Each way marks the transfer landing in its table while it writes and
fails the transfer when it breaks off (kvstore/ucx_table.py)."""

from __future__ import annotations

import asyncio

import numpy as np

import kvmesh.kvstore.shared_memory as shared_memory
from kvmesh.kvstore.transport import TransferError
from kvmesh.kvstore.ucx_common import _DATA_TAG_BIT, _TAG_ACK, _TAG_GO, ACK_OK, _post_all, abort_endpoint, check_open
from kvmesh.kvstore.ucx_table import ExpectedTransfer, TransferTable


def data_tag_base(push_number: int) -> int:
    """The raw tag base of the receiver's `push_number`th push: its pages travel with tags
    `_DATA_TAG_BIT | push number << 20 | page index` (ucx_common._DATA_TAG_BIT)."""
    return _DATA_TAG_BIT | (push_number % (1 << 43)) << 20


async def send_go(ep, code: int, tag_base: int = 0) -> None:
    """Answer a header: ACK_OK and the push's data tag base, or why the pages are refused
    (then none are sent). Raises UCXCloseError when the endpoint is closed."""
    check_open(ep)
    await ep.send(np.array([code, tag_base], dtype="<u8"), tag=_TAG_GO)


async def send_ack(ep, code: int) -> None:
    """End a push: ACK_OK when every page landed, or why the header was refused. Raises
    UCXCloseError when the endpoint is closed."""
    check_open(ep)
    await ep.send(np.array([code], dtype=np.uint8), tag=_TAG_ACK)


async def receive_pages(
    ep, where: str, table: TransferTable, entry: ExpectedTransfer, first: int, n: int, tag_base: int
) -> None:
    """Receive buffers [first, first + n) of `entry`, all receives posted at once, after
    telling the sender to go (with `tag_base`). The receives are posted on the connection's
    endpoint (UCX matches tags per worker, so the pages the sender sends over its data endpoint
    land in them), so aborting that endpoint cancels them.

    `where` names the push in errors ("from <peer> to <host:port>"). On any error, cancellation
    included, the endpoint is aborted (no receive stays posted into the pages), the transfer
    fails with TransferError, and the error is raised again.
    """
    table.start_landing(entry, first, ep)
    error: BaseException | None = None
    receives: list[asyncio.Future] = []
    try:
        check_open(ep)  # a closed endpoint fails the transfer as a receive on it would
        buffers = entry.buffers[first : first + n]
        receives = [asyncio.ensure_future(c) for c in _post_all(ep, ep.recv, buffers, tag_base)]
        await asyncio.sleep(0)  # each task posts its receive at its first step
        await send_go(ep, ACK_OK, tag_base)
        results = await asyncio.gather(*receives, return_exceptions=True)
        error = next((r for r in results if isinstance(r, BaseException)), None)
    except BaseException as exc:  # cancelled by close()
        error = exc
        for receive in receives:
            receive.cancel()
    if error is not None:
        abort_endpoint(ep)  # no receive may stay posted into pages once the future is done
        table.finish(entry, error=TransferError(f"[transfer {entry.transfer_id}] push {where} broke off: {error!r}"))
        raise error


def sender_pool(peer_pools: shared_memory.PeerRegions, source: np.ndarray, sizes: np.ndarray) -> np.ndarray | None:
    """The sender's pool, mapped here, when the pages lie in one this process can map and
    every page is inside it; None otherwise (the pages then come over UCX). `source` is the
    push's SOURCE message: pid, fd, nonce (2), pool bytes, then each page's offset."""
    pid, fd, nonce0, nonce1, nbytes = (int(x) for x in source[:5])
    if pid == 0:
        return None
    pool = peer_pools.open(shared_memory.RegionDescriptor(pid, fd, (nonce0, nonce1), nbytes))
    if pool is None or any(int(o) + int(s) > nbytes for o, s in zip(source[5:], sizes)):
        return None
    return pool


async def pull_pages(
    peer: str, table: TransferTable, entry: ExpectedTransfer, first: int, pool: np.ndarray, offsets: list[int]
) -> None:
    """Copy buffers [first, first + len(offsets)) of `entry` from the sender's pool (mapped
    here) on a worker thread. A cancel meanwhile waits for the copy (it cannot hang: both
    sides are this process's memory) and then cancels the future. On any error the transfer
    fails with TransferError and the error is raised again."""
    table.start_landing(entry, first, None)  # nothing to cut off: the copy is ours and ends by itself
    views = entry.views[first : first + len(offsets)]

    def copy() -> None:
        for view, offset in zip(views, offsets):
            np.copyto(view, pool[offset : offset + view.nbytes])

    copying = asyncio.ensure_future(asyncio.to_thread(copy))
    try:
        await asyncio.shield(copying)
    except BaseException as exc:
        if not copying.done():  # cancelled (close): the thread still writes the pages
            await asyncio.wait({copying})
        table.finish(
            entry, error=TransferError(f"[transfer {entry.transfer_id}] pull from {peer}'s pool failed: {exc!r}")
        )
        raise
