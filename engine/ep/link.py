"""The control link between rank 0 of expert-parallel decode and one other rank: a
multiprocessing connection (a pipe to a spawned rank on this host, or an authenticated TCP
connection to a rank on another host, `multiprocessing.connection` with an HMAC key) with a
reader thread and a heartbeat each way.

Why heartbeats: a rank behind a cut network link neither answers nor closes its socket, so
silence is the only sign. Each side sends ("alive",) every HEARTBEAT_S; `silent_s` says how long
the peer has said nothing, which is how rank 0 names the rank it lost when a collective times
out, and how a remote rank notices that rank 0 is gone while it waits for work.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Any

logger = logging.getLogger(__name__)

HEARTBEAT_S = 0.5
"""Seconds between two heartbeats on a link (each way)."""
STOP = ("stop",)
"""Rank 0's last message on a link: leave the world."""
SILENT_AFTER_S = 3.0
"""A peer that said nothing (heartbeats included) for this many seconds counts as gone."""


class Link:
    """One end of a control link over `conn` (a multiprocessing Connection, already
    authenticated). Messages are picklable objects; ("alive",) is the heartbeat and never
    reaches `get`. Thread-safe `send`; one reader thread fills the inbox."""

    def __init__(self, conn, name: str) -> None:
        self.conn, self.name = conn, name
        self._send_lock = threading.Lock()
        self._inbox: queue.Queue = queue.Queue()
        self.closed = threading.Event()
        """Set once the connection is closed or broken (EOF, reset)."""
        self._heard = time.monotonic()
        threading.Thread(target=self._read, name=f"ep-link-read-{name}", daemon=True).start()
        threading.Thread(target=self._beat, name=f"ep-link-beat-{name}", daemon=True).start()

    def send(self, msg: Any) -> None:
        """Send one message. Raises OSError / ValueError when the link is closed or broken."""
        with self._send_lock:
            self.conn.send(msg)

    def get(self, timeout_s: float) -> Any | None:
        """The next message within timeout_s seconds, or None (none came, or the link closed)."""
        try:
            return self._inbox.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def drain(self) -> list[Any]:
        """Every message received and not yet taken, without waiting."""
        out = []
        while True:
            try:
                out.append(self._inbox.get_nowait())
            except queue.Empty:
                return out

    @property
    def silent_s(self) -> float:
        """Seconds since the peer last said anything."""
        return time.monotonic() - self._heard

    def close(self) -> None:
        self.closed.set()
        try:
            self.conn.close()
        except OSError:
            pass

    def _read(self) -> None:
        while not self.closed.is_set():
            try:
                msg = self.conn.recv()
            except (EOFError, OSError, ValueError):
                break
            except Exception:  # an unpicklable message: the link is unusable
                logger.exception("EP link %s: a message could not be read", self.name)
                break
            self._heard = time.monotonic()
            if msg != ("alive",):
                self._inbox.put(msg)
        self.closed.set()

    def _beat(self) -> None:
        while not self.closed.wait(HEARTBEAT_S):
            try:
                self.send(("alive",))
            except (OSError, ValueError):
                self.closed.set()
                return


def parse_init_addr(text: str) -> tuple[str, int]:
    """'HOST:PORT' (or '[IPv6]:PORT') -> (host, port). Raises ValueError saying what is wrong."""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"an EP init address is HOST:PORT with a port in [1, 65535], got {text!r}")
    return host, int(port)


def ep_secret() -> bytes:
    """The key ranks on separate hosts authenticate each other with: KVMESH_EP_SECRET, which
    must be the same on every rank. Raises ValueError when it is unset or shorter than 16
    characters (anyone who can reach rank 0's port could otherwise drive its ranks)."""
    key = os.environ.get("KVMESH_EP_SECRET", "")
    if len(key) < 16:
        raise ValueError(
            "EP ranks on separate hosts need KVMESH_EP_SECRET (at least 16 characters, the same on every rank)"
        )
    return key.encode()
