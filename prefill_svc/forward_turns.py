"""Each prefill forward's turn on CPU cores shared with a decode instance (kvmesh.runtime.cpu_share),
the tokens a forward may compute while that decode has steps to run, and the counts of both."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

from kvmesh.runtime.cpu_share import CpuShare, NoCpuShare


class ForwardTurns:
    """The turns of one prefill engine's forwards.

    Args:
        cpu_share: the file the two instances take turns through; None or a NoCpuShare when this
            instance has cores of its own.
        forward_tokens_beside_decode: tokens, 0 = off: with a shared file, the most a forward
            computes while the decode instance has steps to run (`CpuShare.decode_busy`).
    """

    def __init__(self, cpu_share: CpuShare | NoCpuShare | None, forward_tokens_beside_decode: int) -> None:
        self.cpu_share = cpu_share if cpu_share is not None else NoCpuShare()
        self.forward_tokens_beside_decode = forward_tokens_beside_decode
        self.num_forwards = 0
        self.forward_seconds = 0.0
        """Wall seconds this instance's forwards took (its chunks), since start."""
        self.cpu_share_wait_seconds = 0.0
        """Seconds its forwards waited for a decode step on the same cores (--cpu-share)."""

    @contextlib.contextmanager
    def turn(self, since: float | None = None, while_waiting: Callable[[], object] | None = None) -> Iterator[None]:
        """Around each forward: its turn on shared cores, counted. since: when the oldest request
        of the forward's batch arrived (time.perf_counter() seconds), its place in the order of
        the forwards of the prefill instances on these cores (kvmesh.runtime.cpu_share); None:
        now. while_waiting: called each time the wait wakes (`CpuShare.wake`, a peer's turn ending, a
        heartbeat) while the turn is waited for."""
        since_ns = None if since is None else time.monotonic_ns() - int((time.perf_counter() - since) * 1e9)
        with self.cpu_share.prefill_forward(since_ns, while_waiting) as waited:
            started = time.perf_counter()
            try:
                yield
            finally:
                self.forward_seconds += time.perf_counter() - started
                self.cpu_share_wait_seconds += waited
                self.num_forwards += 1

    def budget_of_forwards(self) -> Callable[[], int] | None:
        """What kvmesh.prefill_svc.chunked.prefill_batch asks before each forward for its budget
        (`_budget`); None when no budget applies (no shared cores, or no bound asked for)."""
        return self._budget if self.cpu_share.shared and self.forward_tokens_beside_decode else None

    def _budget(self) -> int:
        """Tokens the next forward may compute: forward_tokens_beside_decode while the decode
        instance on these cores is stepping, else 0 (no bound beyond the chunk size)."""
        return self.forward_tokens_beside_decode if self.cpu_share.decode_busy() else 0
