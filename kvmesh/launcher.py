"""`kvmesh up`: a whole local mesh on loopback (Redis, N prefill, M decode, the gateway).

Every instance registers in Redis (kvstore/registry.py) and the gateway is given the
instances it starts with and finds more in the registry: an instance started later by hand
(`kvmesh serve prefill --redis-url URL`) takes traffic without a gateway restart.

Children are tied to the launcher (PR_SET_PDEATHSIG), so even a killed launcher leaves
no orphans; on Ctrl-C or SIGTERM they are stopped in order: gateway first (stop
admitting), then prefill and decode, then Redis.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from kvmesh.redis_server import RedisProcess, free_port, ping

_PR_SET_PDEATHSIG = 1
PARENT_PID_ENV = "KVMESH_PARENT_PID"
CPU_SHARE_ENV = "KVMESH_CPU_SHARE"
"""`--cpu-share` of every instance a mesh starts (`kvmesh.runtime.cpu_share`): a file of the mesh's own
unless the caller's environment sets it ("" turns the sharing off)."""
SHARED_CORES_FORWARD_TOKENS = 256
"""Prefill's `--max-batch-tokens` and `--chunked-prefill-size` in a mesh whose instances take turns
on the cores (unless the caller's environment sets KVMESH_MAX_BATCH_TOKENS /
KVMESH_CHUNKED_PREFILL_SIZE): a decode step waits for at most one forward of this many prompt
tokens. `kvmesh bench-peer --where`, 32 random 256-token prompts, AMD EPYC without AVX-512, 2
cores, prefill's defaults (4096 / 512) then 256: 16 streams 44.4 -> 61.6 out tok/s, ITL p99 1,286
-> 775 ms (a 1,234-token forward outlasted decode's 2 s bound, and the two ran at once); 4 streams
56.0 -> 49.7 tok/s, ITL p99 838 -> 675 ms (one run each, docs/benchmarks.md)."""


def die_with_parent() -> None:
    """In a child the launcher started (KVMESH_PARENT_PID set): get SIGTERM when it dies.

    Done by the child after exec rather than in a preexec_fn: forking a process whose gRPC
    threads are running and then running Python before exec sometimes killed the child
    (gRPC's poller: "epoll_wait error: Bad file descriptor"); without preexec_fn,
    subprocess uses vfork/posix_spawn and runs no Python in between.
    """
    parent = os.environ.pop(PARENT_PID_ENV, "")
    if not parent:
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        return
    if os.getppid() != int(parent):  # the launcher died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


@dataclass
class Mesh:
    """Handles on a running local mesh."""

    gateway_address: str
    redis_url: str
    prefill_addresses: list[str]
    decode_addresses: list[str]
    http_address: str = ""
    """The gateway's OpenAI-compatible HTTP API ("http://host:port"), "" when off."""
    procs: list[tuple[str, subprocess.Popen]] = field(default_factory=list)
    redis: RedisProcess | None = None
    cpu_share: str = ""
    """The file its prefill and decode instances share their cores through (`kvmesh.runtime.cpu_share`),
    unlinked once they all run (they keep it mapped) unless more may start later (`start_instance`);
    "" when the caller set KVMESH_CPU_SHARE."""
    host: str = "127.0.0.1"
    env: dict[str, str] = field(default_factory=dict)
    """The environment every instance started with (what `start_instance` gives the next one)."""
    role_args: dict[str, list[str]] = field(default_factory=dict)
    """The extra flags of each role's instances ("prefill", "decode")."""
    log: object = None
    started: dict[str, int] = field(default_factory=dict)
    """Instances of each role started so far (the next one's name: prefill-N)."""

    def start_instance(self, kind: str) -> tuple[str, subprocess.Popen, str]:
        """Start one more `kind` instance on a free port; it registers in the mesh's Redis and the
        gateway finds it there. Returns (its name, its process, its address), not waited on and
        not in `procs` (the caller adds it once it serves)."""
        port = free_port(self.host)
        args = ["--host", self.host, "--port", str(port), "--redis-url", self.redis_url, *self.role_args.get(kind, [])]
        n = self.started.get(kind, 0)
        self.started[kind] = n + 1
        return f"{kind}-{n}", _serve(kind, args, self.env, self.log), f"{self.host}:{port}"

    def stop(self) -> None:
        """Stop every child: SIGTERM in order (gateway first, then the instances, the newest
        first), SIGKILL after 15 s."""
        order = sorted(reversed(self.procs), key=lambda named: named[0] != "gateway")  # stable
        for _name, proc in order:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for _name, proc in order:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.redis is not None:
            self.redis.stop()
        self.remove_cpu_share()

    def remove_cpu_share(self) -> None:
        """Unlink the CPU-share file; the instances that mapped it keep sharing through it."""
        if self.cpu_share:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.cpu_share)


def _serve(kind: str, args: list[str], env: dict[str, str], log) -> subprocess.Popen:
    # -P: the working directory is not put on sys.path, so a kvmesh checkout's folders
    # (kernels/, engine/, ...) never shadow other distributions' top-level names (Hugging Face's
    # `kernels`, which transformers imports)
    cmd = [sys.executable, "-P", "-m", "kvmesh.cli", "serve", kind, *args]
    return subprocess.Popen(cmd, env={**env, PARENT_PID_ENV: str(os.getpid())}, stdout=log, stderr=subprocess.STDOUT)


def start_mesh(
    num_prefill: int = 1,
    num_decode: int = 1,
    model: str | None = None,
    port: int = 50051,
    host: str = "127.0.0.1",
    extra_prefill_args: list[str] | None = None,
    extra_decode_args: list[str] | None = None,
    extra_gateway_args: list[str] | None = None,
    env: dict[str, str] | None = None,
    log=None,
    ready_timeout_s: float = 600.0,
    http_port: int = 0,
    keep_cpu_share: bool = False,
) -> Mesh:
    """Start Redis (unless REDIS_URL answers), the instances and the gateway; wait until all are SERVING.

    http_port: the gateway's OpenAI-compatible HTTP API (0: none). keep_cpu_share: keep the
    CPU-share file until `stop` (instances started later, `Mesh.start_instance`, open it too).

    Raises ValueError for an unknown model, RuntimeError when a child exits during start-up,
    TimeoutError when one is not ready within ready_timeout_s seconds.
    """
    from kvmesh.engine.loader import resolve_model

    _check_start(num_prefill, num_decode, host, port, http_port)
    resolve_model(model)  # converts the GGUF once here, before the children race for it
    env = {**os.environ, **(env or {})}
    if model:
        env["KVMESH_MODEL"] = model
    env.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    redis_proc, redis_url = _redis(env)
    cpu_share = _cpu_share(env)
    mesh = Mesh(
        gateway_address=f"{host}:{port}",
        redis_url=redis_url,
        prefill_addresses=[],
        decode_addresses=[],
        redis=redis_proc,
        cpu_share=cpu_share,
        http_address=f"http://{host}:{http_port}" if http_port else "",
        host=host,
        env=env,
        role_args={"prefill": list(extra_prefill_args or []), "decode": list(extra_decode_args or [])},
        log=log,
    )
    try:
        for kind, count, addresses in (
            ("decode", num_decode, mesh.decode_addresses),
            ("prefill", num_prefill, mesh.prefill_addresses),
        ):
            for _ in range(count):
                name, proc, address = mesh.start_instance(kind)
                mesh.procs.append((name, proc))
                addresses.append(address)
        # the gateway starts beside the instances (its imports and tokenizer overlap their model
        # loads) and reports SERVING only once they all do (--wait-for-instances)
        gw_args = _gateway_args(mesh, host, port, ready_timeout_s, http_port, extra_gateway_args)
        mesh.procs.append(("gateway", _serve("gateway", gw_args, env, log)))
        _wait_ready(mesh, [*mesh.prefill_addresses, *mesh.decode_addresses, mesh.gateway_address], ready_timeout_s)
        if not keep_cpu_share:
            mesh.remove_cpu_share()  # every instance maps it now; nothing is left behind, even after a SIGKILL
    except BaseException:
        mesh.stop()
        raise
    return mesh


def _check_start(num_prefill: int, num_decode: int, host: str, port: int, http_port: int) -> None:
    """Raise ValueError for fewer than one instance of a role, RuntimeError for a port in use."""
    if num_prefill < 1 or num_decode < 1:
        raise ValueError(f"need at least one prefill and one decode, got {num_prefill} and {num_decode}")
    if not _port_free(host, port):
        raise RuntimeError(f"port {port} on {host} is in use (another kvmesh?): pick another with --port")
    if http_port and not _port_free(host, http_port):
        raise RuntimeError(
            f"HTTP port {http_port} on {host} is in use (another kvmesh?): pick another with --http-port (0: none)"
        )


def _redis(env: dict[str, str]) -> tuple[RedisProcess | None, str]:
    """(the redis-server started for the mesh, or None, and its URL): REDIS_URL's, when it answers
    (RuntimeError when it does not), else a private one on a free port."""
    redis_url = env.get("REDIS_URL", "")
    if redis_url:
        if not ping(redis_url):
            raise RuntimeError(f"REDIS_URL={redis_url} does not answer; unset it to start a private redis-server")
        return None, redis_url
    redis_proc = RedisProcess(die_with_parent=True)
    return redis_proc, redis_proc.url


def _cpu_share(env: dict[str, str]) -> str:
    """The CPU-share file the mesh's instances take turns on the cores through, made and set in
    `env` with the shared-cores prefill sizes; "" when the caller's environment set one."""
    if CPU_SHARE_ENV in env:
        return ""
    # the instances share this machine's cores: prefill goes first
    fd, cpu_share = tempfile.mkstemp(prefix="kvmesh-cpu-share-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.close(fd)  # empty: the first instance to open it sizes it (`CpuShare`)
    env[CPU_SHARE_ENV] = cpu_share
    for name in ("KVMESH_MAX_BATCH_TOKENS", "KVMESH_CHUNKED_PREFILL_SIZE"):
        env.setdefault(name, str(SHARED_CORES_FORWARD_TOKENS))
    return cpu_share


def _gateway_args(
    mesh: Mesh, host: str, port: int, ready_timeout_s: float, http_port: int, extra: list[str] | None
) -> list[str]:
    """The gateway's flags: the mesh's instances, waited for up to ready_timeout_s seconds."""
    return [
        "--host",
        host,
        "--port",
        str(port),
        "--redis-url",
        mesh.redis_url,
        *[a for d in mesh.prefill_addresses for a in ("--prefill", d)],
        *[a for d in mesh.decode_addresses for a in ("--decode", d)],
        "--wait-for-instances",
        str(ready_timeout_s),
        *(["--http-port", str(http_port)] if http_port else []),
        *(extra or []),
    ]


def _port_free(host: str, port: int) -> bool:
    """Nothing listens on host:port. SO_REUSEADDR, as the servers bind: connections of a server
    that just stopped (TIME_WAIT) do not count, a listener does (`kvmesh bench-peer` started
    `kvmesh up` on the port vLLM had just left and was refused)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _wait_ready(mesh: Mesh, addresses: list[str], timeout_s: float) -> None:
    import asyncio

    from kvmesh.runtime.service import wait_for_health

    async def all_ready() -> None:
        tasks = [asyncio.ensure_future(wait_for_health(a, timeout_s)) for a in addresses]
        try:
            while not all(t.done() for t in tasks):
                dead = [n for n, p in mesh.procs if p.poll() is not None]
                if dead:
                    raise RuntimeError(f"{', '.join(dead)} exited during start-up (see its log above)")
                await asyncio.sleep(0.2)
            for t in tasks:
                t.result()
        finally:
            for t in tasks:
                t.cancel()

    asyncio.run(all_ready())
