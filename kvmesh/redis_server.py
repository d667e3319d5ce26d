"""Finding or starting the Redis that holds the prefix index."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import redis

FIRST_FREE_PORT = 20000
"""free_port picks from [FIRST_FREE_PORT, the start of the ephemeral range)."""
_PORT_RNG = random.SystemRandom()
"""free_port's choice: the OS's randomness, which no `random.seed` in the process repeats (two
test workers that each seeded `random` with 0 picked the same ports in turn)."""


def _ephemeral_start() -> int:
    """The first port of the range the OS assigns to port-0 binds and outgoing connections."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; IANA's range starts higher still (49152)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now on host, for a process started next to bind.

    Chosen at random below the OS's ephemeral range: a port the OS hands out (the old way,
    binding port 0) is soon handed out again, as the source port of an outgoing connection
    or to another port-0 bind, and on a busy machine one took a port between this choice and
    the child's bind (a `kvmesh up` gateway failed with "Address already in use"). Only
    another free_port caller can still take the same port, at random among ~12,000. Falls
    back to a port the OS picks when that range is empty or full.
    """
    low, high = FIRST_FREE_PORT, _ephemeral_start()
    for _ in range(50 if high > low else 0):
        port = _PORT_RNG.randrange(low, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def ping(url: str, timeout_s: float = 1.0) -> bool:
    """True when a Redis answers PING at url."""
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except redis.exceptions.RedisError:
        return False


class RedisProcess:
    """A private redis-server on a free loopback port, nothing persisted; stop() ends it.

    Raises FileNotFoundError when redis-server is not installed (Debian: apt-get install
    redis-server) and TimeoutError when it does not answer within timeout_s seconds.
    """

    def __init__(self, die_with_parent: bool = False, timeout_s: float = 10.0, port: int = 0) -> None:
        """port 0 picks a free one; a given port restarts a server where clients expect it.
        die_with_parent: the server gets SIGTERM when this process dies (Linux PDEATHSIG, set by
        a small exec shim, so no Python runs between fork and exec)."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError(
                "redis-server not found: install it (apt-get install redis-server) or set REDIS_URL"
            )
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._dir = tempfile.TemporaryDirectory(prefix="kvmesh-redis-")
        shim = [
            sys.executable,
            "-c",
            "import ctypes, os, signal, sys; "
            "ctypes.CDLL('libc.so.6').prctl(1, signal.SIGTERM); os.execv(sys.argv[1], sys.argv[1:])",
        ]
        self.proc = subprocess.Popen(
            [
                *(shim if die_with_parent else []),
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self._dir.name,
                "--daemonize",
                "no",
                "--loglevel",
                "warning",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        while not ping(self.url):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"redis-server on port {self.port} did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._dir.cleanup()
