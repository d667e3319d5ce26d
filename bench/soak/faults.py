"""The soak's fault schedule: one fault at a time, each undone (resumed, restored, restarted)
before the next, the kinds in a seeded order that goes through every kind before it repeats one,
and seeded targets, holds and gaps.

    kill9               SIGKILL a prefill or decode; start it again
    freeze              SIGSTOP any service for 2-8 s; SIGCONT
    freeze_during_pull  a prefill pulls a prefix from its peer, and the peer is frozen a few ms
                        into the push for 3-9 s (the crash of docs/operations.md "Known limits")
    cut                 the link between two hosts, or one host's whole link, for 2-6 s
    redis_restart       SIGKILL Redis (it keeps nothing) and start it again
    tier_corrupt        truncate or bit-flip one of a prefill's tier files
    tier_full           fill a prefill's tier disk for 5-10 s, then free it
    decode_restart      SIGTERM a decode while pushes land on it (it drains); start it again
    gateway_restart     SIGKILL a gateway; start it again
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import random
import signal
import time
from dataclasses import dataclass

import grpc

from kvmesh.bench.soak.mesh import DECODES, GATEWAYS, HOSTS, INSTANCES, PREFILLS, SoakMesh
from kvmesh.protos.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc

FAULT_KINDS = [
    "kill9",
    "freeze",
    "freeze_during_pull",
    "cut",
    "redis_restart",
    "tier_corrupt",
    "tier_full",
    "decode_restart",
    "gateway_restart",
]
PULL_TOKENS = 960
"""The prompt a freeze_during_pull pulls: 60 pages, ~44 MB in fp32, long enough to freeze into."""


@dataclass
class Fault:
    """One fault: kind, target ("a" or "a-b"), seconds into the run it began and was undone,
    and what it did or saw."""

    kind: str
    target: str
    at: float
    ended: float = 0.0
    note: str = ""

    def json(self) -> dict:
        return {
            "kind": self.kind,
            "target": self.target,
            "at_s": round(self.at, 2),
            "ended_s": round(self.ended, 2),
            "note": self.note,
        }


class FaultSchedule:
    """Runs faults on `mesh` from `rng` until `stop_after` (seconds into the run): a gap of
    gap_s = (lo, hi) seconds, then one fault, undone before the next. `kinds` limits the kinds."""

    def __init__(
        self,
        mesh: SoakMesh,
        rng: random.Random,
        gap_s: tuple[float, float],
        stop_after: float,
        kinds: list[str] | None = None,
    ) -> None:
        self.mesh, self.rng, self.gap_s, self.stop_after = mesh, rng, gap_s, stop_after
        self.kinds = list(kinds or FAULT_KINDS)
        unknown = set(self.kinds) - set(FAULT_KINDS)
        if unknown:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}; known: {FAULT_KINDS}")
        self.done: list[Fault] = []
        self._order: list[str] = []

    def _next_kind(self) -> str:
        if not self._order:
            self._order = self.rng.sample(self.kinds, len(self.kinds))
        return self._order.pop()

    async def run(self) -> list[Fault]:
        while True:
            gap = self.rng.uniform(*self.gap_s)
            # no longer than the run has left: a gap past it (a run without faults) ends with the run
            await asyncio.sleep(min(gap, max(0.0, self.stop_after - self.mesh.now())))
            if self.mesh.now() >= self.stop_after:
                return self.done
            kind = self._next_kind()
            fault = Fault(kind, "", self.mesh.now())
            self.done.append(fault)
            try:
                await getattr(self, f"_{kind}")(fault)
            except Exception as exc:  # a fault that could not be done or undone is reported, not fatal
                fault.note += f" (failed: {type(exc).__name__}: {exc})"
            fault.ended = self.mesh.now()

    async def _kill9(self, f: Fault) -> None:
        f.target = self.rng.choice(INSTANCES)
        await self.mesh.kill(f.target)
        await asyncio.sleep(1.0)
        await self.mesh.restart(f.target)

    async def _freeze(self, f: Fault) -> None:
        f.target = self.rng.choice([*INSTANCES, *GATEWAYS, "redis"])
        hold = self.rng.uniform(2.0, 8.0)
        self.mesh.signal(f.target, signal.SIGSTOP)
        try:
            await asyncio.sleep(hold)
        finally:
            self.mesh.signal(f.target, signal.SIGCONT)
        f.note = f"held {hold:.1f} s"

    async def _freeze_during_pull(self, f: Fault) -> None:
        holder = self.rng.choice(PREFILLS)
        puller = next(p for p in PREFILLS if p != holder)
        f.target = holder
        n = len(self.done)

        async def pull(tag: str) -> tuple[asyncio.Future, float]:
            ids = [self.rng.randrange(100, 40000) for _ in range(PULL_TOKENS)]
            await _prefill_only(self.mesh.address[holder], ids, f"soak-hold-{n}-{tag}")
            fields = {"pull_from": self.mesh.address[holder], "pull_blocks": PULL_TOKENS // 16}
            call = _prefill_only(self.mesh.address[puller], ids, f"soak-pull-{n}-{tag}", **fields)
            return asyncio.ensure_future(call), time.monotonic()

        # an unfrozen pull first: how long one takes now, so the freeze lands inside the next one
        timed, sent = await pull("timed")
        answer = await asyncio.wait_for(timed, 120)
        took = time.monotonic() - sent
        frozen, sent = await pull("frozen")
        delay, hold = self.rng.uniform(0.2, 1.0) * took, self.rng.uniform(3.0, 9.0)
        await asyncio.sleep(max(0.0, sent + delay - time.monotonic()))
        self.mesh.signal(holder, signal.SIGSTOP)
        try:
            await asyncio.sleep(hold)
        finally:
            self.mesh.signal(holder, signal.SIGCONT)
        try:
            result = f"pulled {(await asyncio.wait_for(frozen, 120)).num_pulled_tokens} tokens"
        except (grpc.aio.AioRpcError, TimeoutError) as exc:
            result = f"its request ended {getattr(exc, 'code', lambda: 'TIMEOUT')()}"
        f.note = (
            f"an unfrozen pull took {took * 1000:.0f} ms ({answer.num_pulled_tokens} tokens pulled); the next "
            f"was frozen {delay * 1000:.0f} ms after it was sent, for {hold:.1f} s: {result}"
        )

    async def _cut(self, f: Fault) -> None:
        if self.rng.random() < 0.25:
            a, b = self.rng.choice([*INSTANCES, *GATEWAYS]), None
        else:
            a, b = self.rng.sample(HOSTS, 2)
        f.target = a if b is None else f"{a}-{b}"
        hold = self.rng.uniform(2.0, 6.0)
        await asyncio.to_thread(self.mesh.cluster.cut, a, b)
        try:
            await asyncio.sleep(hold)
        finally:
            await asyncio.to_thread(self.mesh.cluster.restore, a, b)
        f.note = f"held {hold:.1f} s"

    async def _redis_restart(self, f: Fault) -> None:
        f.target = "redis"
        await self.mesh.kill("redis")
        await asyncio.sleep(1.0)
        await self.mesh.restart("redis")

    async def _tier_corrupt(self, f: Fault) -> None:
        f.target = self.rng.choice(PREFILLS)
        files = sorted(self.mesh.tier_root(f.target).rglob("*.kv"))
        if not files:
            f.note = "no tier file yet"
            return
        path = self.rng.choice(files)
        size = path.stat().st_size
        if self.rng.random() < 0.5:
            os.truncate(path, size // 2)
            f.note = f"truncated {path.name} to {size // 2} of {size} bytes"
        else:
            offset = self.rng.randrange(64, size)
            with open(path, "r+b") as fh:
                fh.seek(offset)
                byte = fh.read(1)
                fh.seek(offset)
                fh.write(bytes([byte[0] ^ 0x10]))
            f.note = f"flipped a bit at byte {offset} of {path.name} ({len(files)} tier files)"

    async def _tier_full(self, f: Fault) -> None:
        f.target = self.rng.choice(PREFILLS)
        filler = self.mesh.tier_root(f.target) / "soak-filler"
        written = await asyncio.to_thread(_fill, filler)
        hold = self.rng.uniform(5.0, 10.0)
        try:
            await asyncio.sleep(hold)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(filler)
        f.note = f"filled with {written >> 20} MiB, for {hold:.1f} s"

    async def _decode_restart(self, f: Fault) -> None:
        f.target = self.rng.choice(DECODES)
        seconds = await self.mesh.terminate(f.target)
        await self.mesh.restart(f.target)
        f.note = f"drained and exited in {seconds:.1f} s"

    async def _gateway_restart(self, f: Fault) -> None:
        f.target = self.rng.choice(GATEWAYS)
        await self.mesh.kill(f.target)
        await asyncio.sleep(1.0)
        await self.mesh.restart(f.target)


def _fill(path) -> int:
    """Write zeros to `path` until its disk is full; bytes written."""
    chunk, written = bytes(1 << 20), 0
    with open(path, "wb", buffering=0) as fh:
        while True:
            try:
                written += fh.write(chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                return written


async def _prefill_only(address: str, token_ids: list[int], request_id: str, **fields) -> prefill_pb2.PrefillResponse:
    """A prefill-only call (no decode: its pages join the prefix cache)."""
    async with grpc.aio.insecure_channel(address) as ch:
        return await prefill_pb2_grpc.PrefillStub(ch).Prefill(
            prefill_pb2.PrefillRequest(
                request_id=request_id, token_ids=token_ids, sampling=common_pb2.SamplingParams(), **fields
            ),
            timeout=120,
        )
