"""Wake-ups between the instances that take turns on shared cores (kvmesh.runtime.cpu_share): a
side waiting for its turn sleeps until a peer whose turn ended wakes it, or its heartbeat passes.

Each record of a turns file has a socket: an abstract Unix datagram socket named by the file's
device and inode and the record's index, so nothing is left on disk and it goes with its
process. A side whose turn ends sends a byte to every side that asks; a waiter that gets none (a
peer that died, one in another network namespace) looks at the file again at its heartbeat.

Polling instead, as the turns did until 2026-12-07, cost the side that ran: 120 fp32 matmuls of
512x896x4864 on two threads took 2.39 s beside one side polling every 0.2 ms, against 1.75-1.88 s
alone (2 cores, Intel Xeon with AMX; polls every 1 ms cost 6%, every 20 ms nothing
measurable). Each wake-up of the waiter takes a core from the running side's OpenMP team for a
moment, and the team's other thread spins at its barrier meanwhile.
"""

from __future__ import annotations

import logging
import select
import socket
import time

log = logging.getLogger(__name__)


class TurnWakes:
    """The wake-ups of one instance on the turns file whose identity is `file_id` (its st_dev and
    st_ino: the same in every process that maps it, even once the launcher unlinks it).

    record: this instance's record in the file; None when it holds none (it can wake the others,
    and nothing wakes it). heartbeat_s: the longest `sleep` lasts (seconds). path: the file, for
    the log. Raises OSError when no socket can be made.
    """

    def __init__(self, path: str, file_id: str, record: int | None, heartbeat_s: float) -> None:
        self.file_id = file_id
        self.heartbeat_s = heartbeat_s
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._socket.setblocking(False)
        self._poll = select.poll()  # not select.select: a service's sockets may number past 1,024
        self._poll.register(self._socket, select.POLLIN)
        self.record = record
        self.wakeable = False
        """Whether peers' wakes reach this instance (its record's socket is bound)."""
        if record is None:
            return
        try:
            self._socket.bind(self.address(record))
            self.wakeable = True
        except OSError as exc:
            log.warning(
                "cpu share %s: no wake-up socket (%s); a turn starts within %.0f ms of the one before",
                path,
                exc,
                heartbeat_s * 1000,
            )

    def address(self, record: int) -> bytes:
        """The abstract Unix socket name of `record`'s wake-ups."""
        return f"\0kvmesh-cpu-share-{self.file_id}-{record}".encode()

    def send(self, record: int) -> None:
        """Wake `record`'s wait, if it waits (a wake that finds none is dropped when it next asks)."""
        try:
            self._socket.sendto(b"\0", self.address(record))
        except OSError:  # gone, or its queue full of wakes: it looks again at its heartbeat
            pass

    def wake_self(self) -> None:
        """Wake this instance's own wait (from another thread of it)."""
        if self.wakeable and self.record is not None:
            self.send(self.record)

    def sleep(self) -> None:
        """Until a peer wakes this instance or heartbeat_s passes; the wakes queued are dropped."""
        if not self.wakeable:
            time.sleep(self.heartbeat_s)
            return
        self._poll.poll(self.heartbeat_s * 1000)
        self.drop()

    def drop(self) -> None:
        """Forget the wakes queued so far (before a wait: a turn that ends after this wakes it)."""
        try:
            while self._socket.recv(16):
                pass
        except OSError:  # BlockingIOError: none left
            pass

    def close(self) -> None:
        self._socket.close()
