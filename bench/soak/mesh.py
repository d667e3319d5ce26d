"""The soak's mesh: Redis, two gateways, two prefill and two decode instances, each on a host of
its own (kvmesh.bench.hosts), every feature on: decode-side reuse, peer pulls, a disk tier on
each prefill (a small disk of its own, so it can fill), KV digests, two API keys (two tenants,
two priorities), sessions, fp32 (every answer exact, so that a wrong one cannot hide in rounding).

`SoakMesh` starts and stops the services, knows which exits the fault schedule caused (a
SIGKILL or SIGTERM it sent), and reports any other exit as a crash with the tail of the
service's log (faulthandler's stacks land there) and the kernel's lines about it; `sample()`
reads each instance's pages (GetStats) and each service's RSS (/proc/PID/status).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from kvmesh.bench.hosts import Cluster
from kvmesh.protos.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc
from kvmesh.redis_server import ping
from kvmesh.runtime.service import wait_for_health

HOSTS = ["redis", "gateway0", "gateway1", "prefill0", "prefill1", "decode0", "decode1"]
GATEWAYS = ["gateway0", "gateway1"]
PREFILLS = ["prefill0", "prefill1"]
DECODES = ["decode0", "decode1"]
INSTANCES = PREFILLS + DECODES
PORT = 50051
HTTP_PORT = 8000
KV_PORT = 7100
TIER_DIR = "/kvmesh-soak-tier"
"""Where each prefill's disk tier lives: a disk of TIER_MIB of its own (bench/hosts.py `spawn`)."""
TIER_MIB = 192
PREFILL_PAGES = 160
"""Few enough that a few long prompts evict pages into the tier, and later hits read them back."""
TIER_BLOCKS = 400
DECODE_PAGES = 512
API_KEYS = ("kvmesh-soak-key-a", "kvmesh-soak-key-b")
"""Two tenants: the first in the default priority band, the second in a higher one."""
START_BOUND_S = 600.0
"""A service that does not serve within this many seconds of its start fails the soak."""
STOP_BOUND_S = 60.0
"""A SIGTERM'd service that has not exited by then is killed (SIGKILL)."""
ENV = {
    "OMP_WAIT_POLICY": "PASSIVE",  # the services share two cores (tests/integration/meshutil.py)
    "KVMESH_KV_DIGEST": "1",
    "KVMESH_CPU_SHARE": "",  # hosts share no /dev/shm
    "UCX_WARN_UNUSED_ENV_VARS": "n",
    "PYTHONFAULTHANDLER": "1",
    "UCXX_LOG_LEVEL": "WARN",  # ucxx's own warnings (timeouts of its blocking calls) reach the log
}


@dataclass
class Service:
    """One service's current life: its `unshare` process, the service's pid in the root
    namespace, when it started, whether the schedule asked it to exit, and where its log is."""

    name: str
    proc: subprocess.Popen
    pid: int
    started: float
    log_path: Path
    log_offset: int
    """Where this life's output starts in the log (a restart appends)."""
    expected_exit: bool = False
    lives: int = 1


@dataclass
class Crash:
    """A service that exited without the schedule's asking: `at` (seconds into the run)."""

    service: str
    at: float
    returncode: int | None
    log_tail: str
    kernel: list[str] = field(default_factory=list)

    def json(self) -> dict:
        return {
            "service": self.service,
            "at_s": round(self.at, 1),
            "returncode": self.returncode,
            "log_tail": self.log_tail,
            "kernel": self.kernel,
        }


class SoakMesh:
    """The mesh on `cluster` (hosts HOSTS), its logs and key file under `workdir`.

    Raises RuntimeError from `start_all` when a service does not start or serve within
    START_BOUND_S."""

    def __init__(self, cluster: Cluster, workdir: Path) -> None:
        self.cluster = cluster
        self.workdir = workdir
        (workdir / "logs").mkdir(parents=True, exist_ok=True)
        self.key_file = workdir / "api_keys"
        self.key_file.write_text(f"{API_KEYS[0]}\n{API_KEYS[1]} priority=1\n")
        h = cluster.hosts
        self.address = {name: f"{h[name].address}:{PORT}" for name in HOSTS}
        self.http = {g: f"http://{h[g].address}:{HTTP_PORT}/v1" for g in GATEWAYS}
        self.redis_url = f"redis://{h['redis'].address}:6379"
        self.services: dict[str, Service] = {}
        self.starts: dict[str, list[float]] = defaultdict(list)
        """Every life's start of each service (seconds, `now()`)."""
        self.crashes: list[Crash] = []
        self.t0 = time.monotonic()
        self.env = {**os.environ, **ENV}
        self._kernel_seen = len(_kernel_lines())
        """The kernel's crash lines from before this mesh (not its crashes)."""

    def argv(self, name: str) -> list[str]:
        host = self.cluster.hosts[name].address
        if name == "redis":
            return ["redis-server", "--bind", host, "--port", "6379", "--save", "", "--appendonly", "no"] + [
                "--protected-mode",
                "no",
            ]
        serve = [sys.executable, "-P", "-m", "kvmesh.cli", "serve"]
        common = ["--host", host, "--port", str(PORT), "--redis-url", self.redis_url]
        model = ["--dtype", "float32", "--lease-ttl", "3", "--kv-port", str(KV_PORT)]
        if name in PREFILLS:
            tier = ["--num-pages", str(PREFILL_PAGES), "--kv-tier-blocks", str(TIER_BLOCKS), "--kv-tier-dir", TIER_DIR]
            return [*serve, "prefill", *common, *model, *tier]
        if name in DECODES:
            return [*serve, "decode", *common, *model, "--num-pages", str(DECODE_PAGES), "--max-batch-size", "8"]
        instances = [f"--prefill={self.address[p]}" for p in PREFILLS] + [
            f"--decode={self.address[d]}" for d in DECODES
        ]
        return [*serve, "gateway", *common, "--http-port", str(HTTP_PORT), *instances] + [
            "--api-key-file",
            str(self.key_file),
            "--wait-for-instances",
            str(int(START_BOUND_S)),
        ]

    def now(self) -> float:
        """Seconds since the mesh was made."""
        return time.monotonic() - self.t0

    def start(self, name: str) -> Service:
        """Start `name` (again: a new life, its log appended)."""
        log_path = self.workdir / "logs" / f"{name}.log"
        log = open(log_path, "a")  # noqa: SIM115 (the child keeps it; closed below once handed over)
        offset = log.tell()
        disk = (TIER_DIR, TIER_MIB) if name in PREFILLS else None
        proc = self.cluster.spawn(name, self.argv(name), self.env, log, disk=disk)
        log.close()
        pid = self.cluster.service_pid(proc)
        old = self.services.get(name)
        svc = Service(name, proc, pid, self.now(), log_path, offset, lives=old.lives + 1 if old else 1)
        self.services[name] = svc
        self.starts[name].append(svc.started)
        return svc

    async def wait_serving(self, names: list[str], timeout_s: float = START_BOUND_S) -> None:
        """Until every service in `names` serves (Redis: answers PING); TimeoutError past timeout_s."""

        async def one(name: str) -> None:
            if name == "redis":
                deadline = time.monotonic() + timeout_s
                while not await asyncio.to_thread(ping, self.redis_url):
                    if time.monotonic() > deadline:
                        raise TimeoutError("redis did not answer")
                    await asyncio.sleep(0.1)
            else:
                await wait_for_health(self.address[name], timeout_s)

        await asyncio.gather(*(one(n) for n in names))

    async def start_all(self) -> None:
        self.start("redis")
        await self.wait_serving(["redis"], 30)
        for name in [*DECODES, *PREFILLS, *GATEWAYS]:
            self.start(name)
        try:
            await self.wait_serving([*DECODES, *PREFILLS, *GATEWAYS])
        except TimeoutError as exc:
            raise RuntimeError(f"the soak's mesh did not start within {START_BOUND_S:.0f} s: {exc}") from None

    def signal(self, name: str, sig: int) -> None:
        """Send `sig` to the service (SIGKILL and SIGTERM mark its exit as the schedule's)."""
        svc = self.services[name]
        if sig in (signal.SIGKILL, signal.SIGTERM):
            svc.expected_exit = True
        with contextlib.suppress(ProcessLookupError):
            os.kill(svc.pid, sig)

    async def kill(self, name: str) -> None:
        """SIGKILL the service and wait for its process to go."""
        self.signal(name, signal.SIGKILL)
        await asyncio.to_thread(self.services[name].proc.wait, STOP_BOUND_S)

    async def terminate(self, name: str) -> float:
        """SIGTERM (the service drains), then SIGKILL once STOP_BOUND_S passed; seconds to exit."""
        svc = self.services[name]
        started = time.monotonic()
        self.signal(name, signal.SIGTERM)
        try:
            await asyncio.to_thread(svc.proc.wait, STOP_BOUND_S)
        except subprocess.TimeoutExpired:
            await self.kill(name)
        return time.monotonic() - started

    async def restart(self, name: str) -> None:
        """Start `name` again and wait until it serves."""
        self.start(name)
        await self.wait_serving([name])

    def check_crashes(self) -> list[str]:
        """Services that exited since the last call without the schedule's asking: recorded as
        crashes; returns their names (the caller restarts them)."""
        crashed = []
        for name, svc in self.services.items():
            if svc.expected_exit or svc.proc.poll() is None:
                continue
            svc.expected_exit = True  # counted once
            crashed.append(name)
            kernel = _kernel_lines()
            new, self._kernel_seen = kernel[self._kernel_seen :], len(kernel)
            self.crashes.append(Crash(name, self.now(), svc.proc.returncode, self._log_tail(svc), new))
        return crashed

    def _log_tail(self, svc: Service, lines: int = 60) -> str:
        with open(svc.log_path, errors="replace") as f:
            f.seek(svc.log_offset)
            return "\n".join(f.read().splitlines()[-lines:])

    def read_logs(self) -> str:
        """Every service's log, every life."""
        out = []
        for path in sorted((self.workdir / "logs").glob("*.log")):
            out.append(path.read_text(errors="replace"))
        return "\n".join(out)

    def tier_root(self, name: str) -> Path:
        """The prefill `name`'s tier disk, as this process reaches it (its mount namespace)."""
        return Path(f"/proc/{self.services[name].pid}/root{TIER_DIR}")

    async def stats(self, name: str, timeout_s: float = 3.0):
        """The instance's GetStats; None when it does not answer within timeout_s."""
        stub_of = prefill_pb2_grpc.PrefillStub if name in PREFILLS else decode_pb2_grpc.DecodeStub
        try:
            async with grpc.aio.insecure_channel(self.address[name]) as ch:
                return await stub_of(ch).GetStats(common_pb2.StatsRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return None

    async def sample(self) -> dict:
        """{"t": s, "pages_used": {instance: pages}, "rss_mb": {service: MiB}} now: a decode's pages
        in use, a prefill's referenced ones (a frozen or dead instance is left out)."""
        stats = await asyncio.gather(*(self.stats(n, 2.0) for n in INSTANCES))
        pages = {}
        for name, s in zip(INSTANCES, stats, strict=True):
            if s is not None:
                pages[name] = s.num_referenced_pages if name in PREFILLS else s.num_pages - s.num_free_pages
        rss = {}
        for name, svc in self.services.items():
            mb = _rss_mb(svc.pid)
            if mb is not None and svc.proc.poll() is None:
                rss[name] = mb
        return {"t": round(self.now(), 2), "pages_used": pages, "rss_mb": rss}

    def close(self) -> None:
        for svc in self.services.values():
            svc.expected_exit = True
        self.cluster.close()


def _rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _kernel_lines() -> list[str]:
    """The kernel's lines about crashed processes (segfault, general protection), oldest first,
    when dmesg may be read here (else none)."""
    try:
        out = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line for line in out.splitlines() if "segfault" in line or "general protection" in line]
