# P=pages, R=state slots, B=rows of one rank, W=floats of one gathered row
"""What moves between rank 0 and the other ranks in a step besides the MoE exchange
(kvmesh.engine.ep.dispatch), over torch.distributed:

- every rank's rows (its logits, and with MTP drafting its rows' last hidden streams) padded
  and gathered to rank 0 (`gather_rows`, a collective every rank joins, with rows or without);
- a remote rank's pages and state slots (kvmesh.engine.ep.mirrors says which), packed into one
  flat fp32 tensor (`pack` / `unpack`) and sent point-to-point: rank 0 sends what the rank lacks
  before the step (`send_installs`; the rank takes it with `recv_from_zero`) and takes back what
  the rank wrote after it (`take_back`).

Every wait is bounded by the process group's timeout (RuntimeError past it).
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from kvmesh.engine.ep.world import comm_device

if TYPE_CHECKING:
    from kvmesh.engine.ep.plan import Moves


def stream_width(config) -> int:
    """Floats of one row's last hidden streams (hc_mult streams of hidden_size)."""
    return config.hc_mult * config.hidden_size


def gather_rows(rows: torch.Tensor | None, max_rows: int, width: int, backend: str, rank: int) -> list | None:
    """Every rank's rows [B_r, width] fp32 (its logits, or its last hidden streams flattened)
    padded to [max_rows, width] and gathered to rank 0: the list of R tensors on rank 0, None
    elsewhere. A collective."""
    device = comm_device(backend, rank)
    padded = torch.zeros(max_rows, width, dtype=torch.float32, device=device)
    if rows is not None:
        padded[: rows.shape[0]] = rows.to(device)
    if rank:
        dist.gather(padded, None, dst=0)
        return None
    out = [torch.empty_like(padded) for _ in range(dist.get_world_size())]
    dist.gather(padded, out, dst=0)
    return [t.cpu() for t in out]


def pack_size(page_ids: Sequence[int], slot_ids: Sequence[int], pages, slots) -> int:
    """Floats of pack(page_ids, slot_ids, ...)."""
    return len(page_ids) * pages.shape[1] + len(slot_ids) * slots.shape[1]


def pack(page_ids: Sequence[int], slot_ids: Sequence[int], pages, slots):
    """The pages' rows [n, page_floats] then the slots' rows [m, slot_floats], as one flat fp32
    tensor (what moves between rank 0 and a remote rank)."""
    return torch.cat([pages[list(page_ids)].reshape(-1), slots[list(slot_ids)].reshape(-1)])


def unpack(flat, page_ids: Sequence[int], slot_ids: Sequence[int], pages, slots) -> None:
    """Write pack's output back into pages and slots (in place)."""
    n = len(page_ids) * pages.shape[1]
    if page_ids:
        pages[list(page_ids)] = flat[:n].view(len(page_ids), pages.shape[1])
    if slot_ids:
        slots[list(slot_ids)] = flat[n:].view(len(slot_ids), slots.shape[1])


def wait_within(work, bound: datetime.timedelta) -> None:
    """Wait for a point-to-point op (torch.distributed isend / irecv) within `bound`;
    RuntimeError past it."""
    assert work is not None, "point-to-point ops return their work outside a coalescing manager"
    work.wait(bound)


def recv_from_zero(numel: int, timeout_s: float):
    """numel fp32 from rank 0, point-to-point, within timeout_s seconds (RuntimeError past it)."""
    flat = torch.empty(numel, dtype=torch.float32)
    wait_within(dist.irecv(flat, src=0), datetime.timedelta(seconds=timeout_s))
    return flat


def send_installs(moves: Sequence[Moves], pages, slots) -> list:
    """Rank 0 starts sending each remote rank r the pages and slots moves[r] installs, from its
    home copy (isend); the works to wait on (`take_back` waits on them)."""
    return [
        dist.isend(pack(moves[r].install_pages, moves[r].install_slots, pages, slots), dst=r)
        for r in range(1, len(moves))
        if moves[r].install_pages or moves[r].install_slots
    ]


def take_back(sends: list, moves: Sequence[Moves], pages, slots, timeout_s: float) -> None:
    """Rank 0 waits for `sends`, then receives from each remote rank r the pages and slots
    moves[r] writes back, into its home copy; each wait within timeout_s seconds (RuntimeError
    past it)."""
    bound = datetime.timedelta(seconds=timeout_s)
    for work in sends:
        wait_within(work, bound)
    for r in range(1, len(moves)):
        back_pages, back_slots = moves[r].writeback_pages, moves[r].writeback_slots
        if back_pages or back_slots:
            flat = torch.empty(len(back_pages) * pages.shape[1] + len(back_slots) * slots.shape[1])
            wait_within(dist.irecv(flat, src=r), bound)
            unpack(flat, back_pages, back_slots, pages, slots)
