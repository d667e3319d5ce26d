"""sglang-router as a subprocess on loopback: start it in front of given workers, wait until it is ready, stop it.

The router (PyPI `sglang-router`, verified with 0.3.2) runs in its own process group with its
output in a temp log file, whose tail goes into every error raised here and in the replay
(bench/sglang_router.py). Nothing leaves loopback: the router and its metrics listener bind
127.0.0.1, and HTTP(S)_PROXY point at a closed loopback port as a guard.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

from kvmesh.redis_server import free_port

logger = logging.getLogger(__name__)

# 0.3.2's --policy choices omit consistent_hashing although its Router accepts it, so parse the
# router's own CLI and set the policy afterwards.
_LAUNCHER = (
    "import sys\n"
    "from sglang_router.launch_router import launch_router, parse_router_args\n"
    "args = parse_router_args(sys.argv[2:])\n"
    "args.policy = sys.argv[1]\n"
    "launch_router(args)\n"
)

_STARTUP_TIMEOUT_S = 60.0
_LOG_TAIL_BYTES = 4000


@contextmanager
def router_process(worker_urls: list[str], policy: str, deadline: float) -> Iterator[tuple[int, str]]:
    """Run sglang-router on loopback until the block exits; yield (port, log file path).

    `policy` is the router's own policy name; `deadline` (time.monotonic() seconds) bounds the
    start-up, which gets 60 s at most. RuntimeError (with the log tail) if the router exits or
    does not list every worker as healthy in time.
    """
    port, metrics_port = free_port(), free_port()
    cmd = [
        sys.executable,
        "-c",
        _LAUNCHER,
        policy,
        "--worker-urls",
        *worker_urls,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(metrics_port),
        "--log-level",
        "warn",
    ]
    # Anything the router tries to fetch from outside goes to a closed loopback port instead.
    guard = "http://127.0.0.1:9"
    env = dict(
        os.environ,
        HTTP_PROXY=guard,
        HTTPS_PROXY=guard,
        ALL_PROXY=guard,
        http_proxy=guard,
        https_proxy=guard,
        all_proxy=guard,
        NO_PROXY="127.0.0.1,localhost",
        no_proxy="127.0.0.1,localhost",
    )
    fd, log_path = tempfile.mkstemp(prefix="sglang-router-", suffix=".log")
    logger.debug("starting sglang-router (%s) on 127.0.0.1:%d for %s, log %s", policy, port, worker_urls, log_path)
    try:
        with os.fdopen(fd, "wb") as log:
            proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        try:
            _wait_ready(proc, port, len(worker_urls), min(deadline, time.monotonic() + _STARTUP_TIMEOUT_S), log_path)
            yield port, log_path
        finally:
            _stop(proc)
    finally:
        os.unlink(log_path)


def _wait_ready(proc: subprocess.Popen, port: int, num_workers: int, deadline: float, log_path: str) -> None:
    """Block until the router lists all workers as healthy; RuntimeError if it exits or stalls."""
    while True:
        if proc.poll() is not None:
            raise RuntimeError(
                f"sglang-router exited with code {proc.returncode} before it was ready\n{log_tail(log_path)}"
            )
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/workers")
            workers = json.loads(conn.getresponse().read()).get("workers", [])
            conn.close()
            if sum(bool(w.get("is_healthy")) for w in workers) == num_workers:
                return
        except (OSError, ValueError, http.client.HTTPException):
            pass  # not listening yet, or workers still registering
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"sglang-router did not register {num_workers} healthy workers in time\n{log_tail(log_path)}"
            )
        time.sleep(0.1)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the router's process group, SIGKILL it if it has not exited within 5 s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            return
        os.killpg(proc.pid, sig)  # its own group (start_new_session), so nothing else is hit
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def log_tail(log_path: str) -> str:
    """The last 4,000 bytes of the router's log, headed for an error message."""
    with open(log_path, "rb") as f:
        f.seek(max(0, os.path.getsize(log_path) - _LOG_TAIL_BYTES))
        return "sglang-router log tail:\n" + f.read().decode(errors="replace")
