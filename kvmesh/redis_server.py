"""Finding or starting the Redis that holds the prefix index."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import tempfile
import time

import redis


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now on host (the OS picks it)."""
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
