"""Rank 0's hold on ranks 1..N-1 of expert-parallel decode: spawned processes (each runs
engine.ep_worker.worker_main) and the pipes to them. Rank 0 starts them, waits for what they
report while starting, sends each step's plan down the pipes, says why they went down when a
step fails, and stops them (engine.ep_runner is rank 0's runner over them).
"""

from __future__ import annotations

import multiprocessing
import time
from typing import Any

import torch

from engine.ep_worker import WorldSpec, worker_main


class EPWorldError(RuntimeError):
    """A rank died, failed or timed out: the EP world cannot step any more (UNAVAILABLE)."""


def pick_backend(num_ranks: int) -> str:
    """NCCL when this host has a GPU for every rank, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= num_ranks else "gloo"


class RankProcesses:
    """Ranks 1..spec.num_ranks-1 as spawned processes, started here; `conns[w]` is the pipe to
    rank w + 1 and `procs[w]` its process."""

    def __init__(self, spec: WorldSpec) -> None:
        ctx = multiprocessing.get_context("spawn")  # no fork: the service has threads
        self.conns: list[Any] = []
        self.procs: list[Any] = []
        for rank in range(1, spec.num_ranks):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(spec, rank, child), name=f"ep-rank-{rank}", daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def await_all(self, what: str, timeout_s: float) -> dict[int, Any]:
        """Wait until every worker has sent (`what`, payload); return the payloads by worker
        index. EPWorldError naming a worker that died or failed, or the first still missing after
        timeout_s."""
        deadline = time.monotonic() + timeout_s
        waiting = set(range(len(self.conns)))
        payloads: dict[int, Any] = {}
        while waiting:
            for w in list(waiting):
                if self.conns[w].poll(0.05):
                    kind, payload = self.conns[w].recv()
                    if kind == "error":
                        raise EPWorldError(f"EP rank {w + 1} failed while starting:\n{payload}")
                    if kind == what:
                        waiting.discard(w)
                        payloads[w] = payload
                elif not self.procs[w].is_alive():
                    raise EPWorldError(f"EP rank {w + 1} exited with code {self.procs[w].exitcode} while starting")
            if waiting and time.monotonic() > deadline:
                raise EPWorldError(f"EP ranks {sorted(w + 1 for w in waiting)} not {what} after {timeout_s:.0f} s")
        return payloads

    def why_down(self) -> str:
        """What went wrong with the workers: their errors and exit codes."""
        reasons = []
        for w, (conn, proc) in enumerate(zip(self.conns, self.procs)):
            try:
                while conn.poll(0):
                    kind, payload = conn.recv()
                    if kind == "error":
                        reasons.append(f"rank {w + 1} failed:\n{payload}")
            except (EOFError, OSError):
                pass
            proc.join(0.5 if not reasons else 0)
            if proc.exitcode is not None:
                reasons.append(f"rank {w + 1} exited with code {proc.exitcode}")
        return "; ".join(reasons) or "a collective failed or timed out"

    def close(self) -> None:
        """Stop the workers: None on their pipes, then terminate what is left."""
        for conn in self.conns:
            try:
                conn.send(None)
            except (OSError, ValueError):
                pass
        for proc in self.procs:
            proc.join(5.0)
            if proc.is_alive():
                proc.terminate()
                proc.join(2.0)
        for conn in self.conns:
            conn.close()
        self.conns, self.procs = [], []
