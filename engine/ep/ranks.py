"""Rank 0's hold on ranks 1..N-1 of expert-parallel decode, over one control link each
(kvmesh.engine.ep.link): ranks it spawns on this host (`RankProcesses`, each runs
kvmesh.engine.ep.worker.worker_main and maps rank 0's pages), or ranks on other hosts that join it over
the network (`RemoteRanks`, each a `kvmesh serve ep-rank` process running
kvmesh.engine.ep.worker.remote_main with pages of its own). Rank 0 waits for what they report while
starting, sends each step's plan down the links, says why they went down when a step fails,
and stops them (kvmesh.engine.ep.runner is rank 0's runner over them).
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
import time
from multiprocessing.connection import Listener
from typing import Any

import torch

from kvmesh.engine.ep.link import SILENT_AFTER_S, STOP, Link
from kvmesh.engine.ep.worker import worker_main
from kvmesh.engine.ep.world import WorldSpec

logger = logging.getLogger(__name__)


class EPWorldError(RuntimeError):
    """A rank died, failed or timed out: the EP world cannot step any more (UNAVAILABLE)."""


def pick_backend(num_ranks: int) -> str:
    """NCCL when this host has a GPU for every rank, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= num_ranks else "gloo"


class _Ranks:
    """Links to ranks 1..N-1: `links[w]` is rank w + 1's."""

    links: list[Link]

    def where(self, w: int) -> str:
        """Rank w + 1, as an operator finds it (its pid or its host)."""
        return f"rank {w + 1}"

    def exit_code(self, w: int) -> int | None:
        return None

    def await_all(self, what: str, timeout_s: float) -> dict[int, Any]:
        """Wait until every rank has sent (`what`, payload); return the payloads by worker
        index. EPWorldError naming a rank that died, failed, or is still missing after
        timeout_s."""
        deadline = time.monotonic() + timeout_s
        waiting = set(range(len(self.links)))
        payloads: dict[int, Any] = {}
        while waiting:
            for w in list(waiting):
                msg = self.links[w].get(0.05)
                if msg is not None:
                    kind, payload = msg
                    if kind == "error":
                        raise EPWorldError(f"EP {self.where(w)} failed while starting:\n{payload}")
                    if kind == what:
                        waiting.discard(w)
                        payloads[w] = payload
                elif self.exit_code(w) is not None:
                    raise EPWorldError(f"EP {self.where(w)} exited with code {self.exit_code(w)} while starting")
                elif self.links[w].closed.is_set():
                    raise EPWorldError(f"EP {self.where(w)} closed its control link while starting")
            if waiting and time.monotonic() > deadline:
                raise EPWorldError(
                    f"EP {', '.join(self.where(w) for w in sorted(waiting))} not {what} after {timeout_s:.0f} s"
                )
        return payloads

    def why_down(self) -> str:
        """What went wrong with the ranks: their errors, exit codes, closed or silent links."""
        reasons = []
        for w, link in enumerate(self.links):
            for msg in link.drain():
                if isinstance(msg, tuple) and msg and msg[0] == "error":
                    reasons.append(f"{self.where(w)} failed:\n{msg[1]}")
            code = self.exit_code(w)
            if code is not None:
                reasons.append(f"{self.where(w)} exited with code {code}")
            elif link.closed.is_set():
                reasons.append(f"{self.where(w)} closed its control link")
            elif link.silent_s > SILENT_AFTER_S:
                reasons.append(f"{self.where(w)} silent for {link.silent_s:.1f} s (unreachable or stopped)")
        return "; ".join(reasons) or "a collective failed or timed out"

    def close(self) -> None:
        """Tell every rank to leave (STOP on its link) and close the links."""
        for link in self.links:
            try:
                link.send(STOP)
            except (OSError, ValueError):
                pass
        for link in self.links:
            link.close()
        self.links = []


class RankProcesses(_Ranks):
    """Ranks 1..spec.num_ranks-1 as processes spawned here; `procs[w]` is rank w + 1's."""

    def __init__(self, spec: WorldSpec) -> None:
        ctx = multiprocessing.get_context("spawn")  # no fork: the service has threads
        self.links = []
        self.procs: list[Any] = []
        for rank in range(1, spec.num_ranks):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(spec, rank, child), name=f"ep-rank-{rank}", daemon=True)
            proc.start()
            child.close()
            self.links.append(Link(parent, f"rank-{rank}"))
            self.procs.append(proc)

    def where(self, w: int) -> str:
        pid = self.procs[w].pid if w < len(self.procs) else None
        return f"rank {w + 1} (pid {pid})"

    def exit_code(self, w: int) -> int | None:
        proc = self.procs[w]
        proc.join(0)
        return proc.exitcode

    def why_down(self) -> str:
        for proc in self.procs:  # a rank that just failed is given a moment to exit
            proc.join(0.5)
            if proc.exitcode is not None:
                break
        return super().why_down()

    def close(self) -> None:
        """Stop the ranks: STOP on their links, then terminate what is left."""
        super().close()
        for proc in self.procs:
            proc.join(5.0)
            if proc.is_alive():
                proc.terminate()
                proc.join(2.0)
        self.procs = []


class RemoteRanks(_Ranks):
    """Ranks 1..num_ranks-1 that join over the network: rank 0 listens on (host, port) for
    `kvmesh serve ep-rank --ep-init-addr HOST:PORT --rank R` processes, each authenticated by
    `authkey` (HMAC, multiprocessing.connection), and takes the first of each rank. SGLang's
    multi-node launch (`--dist-init-addr`, `--node-rank`) is the model.

    Raises OSError when the address cannot be bound, EPWorldError when a rank has not joined
    within timeout_s seconds (naming the ranks missing)."""

    def __init__(self, host: str, port: int, num_ranks: int, authkey: bytes, timeout_s: float) -> None:
        self.listener = Listener((host, port), authkey=authkey)
        self.hosts: list[str] = [""] * (num_ranks - 1)
        self.links = []
        self._address, self._num_ranks = (host, port), num_ranks
        self._joined: dict[int, tuple[Link, str]] = {}  # rank -> its link and its host
        self._done = threading.Event()
        self._lock = threading.Lock()
        thread = threading.Thread(target=self._accept, name="ep-accept", daemon=True)
        thread.start()
        try:
            self._await_joined(timeout_s)
        except BaseException:
            self._done.set()
            self._stop_accepting(thread)
            for link, _ in self._joined.values():
                link.close()
            raise
        self._stop_accepting(thread)
        for rank in range(1, num_ranks):
            link, self.hosts[rank - 1] = self._joined[rank]
            self.links.append(link)

    def _await_joined(self, timeout_s: float) -> None:
        """Wait until every rank joined; EPWorldError naming the ranks missing after timeout_s."""
        if not self._done.wait(timeout_s):
            host, port = self._address
            missing = sorted(set(range(1, self._num_ranks)) - set(self._joined))
            raise EPWorldError(
                f"EP ranks {missing} did not join {host}:{port} within {timeout_s:.0f} s "
                "(start `kvmesh serve ep-rank --ep-init-addr HOST:PORT --rank R` on their hosts, with the "
                "same KVMESH_EP_SECRET)"
            )

    def _stop_accepting(self, thread: threading.Thread) -> None:
        """End the accept thread and close the listener."""
        _wake(*self._address)  # the accept thread is blocked in accept(): one connection ends it
        thread.join(5.0)
        self.listener.close()

    def _accept(self) -> None:
        """The accept thread: admit each authenticated connection that says hello as its rank,
        until every rank joined (or the wake-up connection of `_stop_accepting` comes)."""
        host, port = self._address
        while not self._done.is_set():
            try:
                conn = self.listener.accept()
            except (OSError, EOFError, multiprocessing.AuthenticationError) as exc:
                if self._done.is_set():  # the wake-up connection
                    return
                logger.warning("EP: refused a connection to %s:%d: %r (wrong KVMESH_EP_SECRET?)", host, port, exc)
                continue
            if self._done.is_set():
                conn.close()
                return
            peer = self.listener.last_accepted
            try:
                rank = _hello(conn, self._num_ranks)
            except (EOFError, OSError, ValueError, TypeError) as exc:
                logger.warning("EP: dropping a connection from %s: %s", peer, exc)
                conn.close()
                continue
            self._admit(rank, conn, peer)

    def _admit(self, rank: int, conn, peer: Any) -> None:
        """Take `conn` as rank `rank`'s link (the first of each rank; a second is closed)."""
        with self._lock:
            if rank in self._joined:
                logger.warning("EP: rank %d joined twice (from %s); keeping the first", rank, peer)
                conn.close()
                return
            self._joined[rank] = (Link(conn, f"rank-{rank}"), f"{peer[0]}" if isinstance(peer, tuple) else str(peer))
            logger.info("EP: rank %d joined from %s", rank, peer)
            if len(self._joined) == self._num_ranks - 1:
                self._done.set()

    def where(self, w: int) -> str:
        return f"rank {w + 1} (host {self.hosts[w]})"


def _hello(conn, num_ranks: int) -> int:
    """The rank a new connection says it is: its first message past any heartbeats must be
    ("hello", rank in [1, num_ranks)) within 10 s. ValueError / TypeError otherwise, EOFError /
    OSError when the connection breaks."""
    msg: Any = ("alive",)
    while msg == ("alive",):  # its heartbeats may come first
        if not conn.poll(10.0):
            raise ValueError("no hello within 10 s")
        msg = conn.recv()
    kind, rank = msg
    if kind != "hello" or not isinstance(rank, int) or not 1 <= rank < num_ranks:
        raise ValueError(f"expected ('hello', rank in [1, {num_ranks})), got {(kind, rank)!r}")
    return rank


def _wake(host: str, port: int) -> None:
    """Connect to (host, port) and hang up at once (a listener's accept() returns)."""
    import socket

    target = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    try:
        socket.create_connection((target, port), timeout=2.0).close()
    except OSError:
        pass
