"""Peer processes for the UCX transfer tests: a decode-side receiver and a prefill-side sender.

Each runs in its own process (multiprocessing "spawn") with its own event loop and UCX
context, and is driven over a Pipe by the test: `Peer.call("expect", ...)` and so on.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import time

import numpy as np


def page_data(seed: int, num_pages: int, page_nbytes: int) -> np.ndarray:
    """Deterministic random pages [num_pages, page_nbytes] uint8, the same in every process."""
    return np.random.default_rng(seed).integers(0, 256, size=(num_pages, page_nbytes), dtype=np.uint8)


class Peer:
    """A child process answering commands sent over a pipe."""

    def __init__(self, target, *args) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, *args), daemon=True)
        self.proc.start()
        child.close()
        self.hello = self.reply(timeout=60)

    def reply(self, timeout: float = 30):
        if not self.conn.poll(timeout):
            raise TimeoutError(f"peer {self.proc.pid} did not answer in {timeout} s")
        kind, value = self.conn.recv()
        if kind == "exc":
            raise RuntimeError(f"peer failed: {value}")
        return value

    def call(self, *cmd, timeout: float = 30):
        self.conn.send(cmd)
        return self.reply(timeout)

    def stop_process(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("close", timeout=15)
            except (TimeoutError, EOFError, OSError, RuntimeError):
                pass
            self.proc.join(15)
        self.kill()


async def _serve_commands(conn, handle) -> None:
    loop = asyncio.get_running_loop()
    while True:
        cmd = await loop.run_in_executor(None, conn.recv)
        try:
            result = await handle(*cmd)
        except Exception as exc:  # report, keep serving
            conn.send(("exc", repr(exc)))
            continue
        conn.send(("ok", result))
        if cmd[0] == "close":
            return


def receiver_main(conn, num_pages: int, page_nbytes: int, reservation_wait_s: float = 2.0) -> None:
    """Decode side: a KV pool of num_pages pages and a KVReceiver landing pushes in it."""
    import uvloop

    from kvmesh.kvstore.ucx_transfer import KVReceiver, TransferError

    async def main() -> None:
        pool = np.zeros((num_pages, page_nbytes), dtype=np.uint8)
        rx = KVReceiver("127.0.0.1", 0, reservation_wait_s=reservation_wait_s)
        await rx.start()
        futures: dict[int, asyncio.Future] = {}

        async def handle(op, *args):
            if op == "expect":
                tid, page_ids = args
                futures[tid] = rx.expect(tid, [pool[p] for p in page_ids])
                return None
            if op == "wait":  # -> ("ok", nbytes, num_buffers) | ("error", msg) | ("cancelled",) | ("pending",)
                tid, timeout = args
                try:
                    res = await asyncio.wait_for(asyncio.shield(futures[tid]), timeout)
                    return ("ok", res.nbytes, res.num_buffers)
                except TransferError as exc:
                    return ("error", str(exc))
                except asyncio.CancelledError:
                    return ("cancelled",)
                except TimeoutError:
                    return ("pending",)
            if op == "started":
                entry = rx._expected.get(args[0])
                return entry is not None and entry.landing
            if op == "awaited":  # a push for this id came before its expect() and waits for it
                return args[0] in rx._awaited
            if op == "pulled":  # pushes the receiver copied from the sender's shared pool itself
                return rx.num_pulled
            if op == "cancel":
                rx.cancel(args[0])
                return futures[args[0]].done()
            if op == "refuse":
                rx.refuse(args[0])
                return None
            if op == "pool":
                return pool.copy()
            if op in ("close", "close_receiver"):  # close_receiver keeps answering commands
                await rx.close()
                return None
            raise ValueError(f"unknown command {op!r}")

        conn.send(("ok", rx.address))
        await _serve_commands(conn, handle)

    uvloop.run(main())


def sender_main(conn) -> None:
    """Prefill side: pushes deterministic pages on command."""
    import uvloop

    from kvmesh.kvstore.ucx_transfer import KVSender

    async def main() -> None:
        tx = KVSender(connect_timeout_s=5.0)

        async def handle(op, *args):
            if op == "push_many":  # (address, [(tid, seed, num_pages, page_nbytes)]) -> [nbytes]
                address, jobs = args
                started = time.perf_counter()
                results = await asyncio.gather(
                    *(tx.push(address, tid, list(page_data(seed, n, nbytes))) for tid, seed, n, nbytes in jobs)
                )
                return [r.nbytes for r in results], time.perf_counter() - started
            if op == "close":
                await tx.close()
                return None
            raise ValueError(f"unknown command {op!r}")

        conn.send(("ok", os.getpid()))
        await _serve_commands(conn, handle)

    uvloop.run(main())
