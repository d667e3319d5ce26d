"""`kvmesh up` + `kvmesh generate` as a user runs them, and dead services."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import grpc

from kvmesh.redis_server import free_port
from tests.conftest import instance_stats
from tests.integration.meshutil import complete, running_mesh


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def test_kvmesh_up_then_generate_names_paris():
    port = free_port()
    env = {**os.environ, "REDIS_URL": ""}
    up = subprocess.Popen(
        [sys.executable, "-m", "kvmesh.cli", "up", "--port", str(port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        lines = []
        for line in up.stdout:
            lines.append(line)
            if "kvmesh is up" in line:
                break
        assert "kvmesh is up" in "".join(lines), "".join(lines)[-3000:]
        children = _children(up.pid)
        assert len(children) >= 4  # redis, prefill, decode, gateway
        gen = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvmesh.cli",
                "generate",
                "--gateway",
                f"127.0.0.1:{port}",
                "What is the capital of France?",
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert gen.returncode == 0, gen.stderr
        assert "Paris" in gen.stdout
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(timeout=60)
    assert up.returncode == 0
    time.sleep(0.5)
    assert not [p for p in children if _alive(p)]  # no orphans


def test_children_die_with_a_killed_launcher():
    # SIGKILL gives the launcher no chance to stop anything: the children's PDEATHSIG does
    port = free_port()
    up = subprocess.Popen(
        [sys.executable, "-m", "kvmesh.cli", "up", "--port", str(port)],
        env={**os.environ, "REDIS_URL": ""},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        for line in up.stdout:
            if "kvmesh is up" in line:
                break
        children = _children(up.pid)
        assert len(children) >= 4  # redis, prefill, decode, gateway
    finally:
        up.kill()
        up.wait(timeout=30)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and [p for p in children if _alive(p)]:
        time.sleep(0.2)
    assert not [p for p in children if _alive(p)]


def _expect_unavailable(mesh) -> None:
    start = time.monotonic()
    try:
        complete(mesh, "Hi", chat=True, max_tokens=2)
        raise AssertionError("expected UNAVAILABLE")
    except grpc.aio.AioRpcError as exc:
        assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
    assert time.monotonic() - start < 10


def test_dead_prefill_then_dead_decode_give_unavailable_quickly():
    with running_mesh(1, 1) as mesh:
        assert complete(mesh, "Hi", chat=True, max_tokens=2).final.generated_tokens >= 1
        procs = dict(mesh.procs)
        procs["prefill-0"].kill()
        procs["prefill-0"].wait()
        _expect_unavailable(mesh)
        # the reservation made on decode before prefill failed is given back
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            stats = instance_stats(mesh.decode_addresses[0], "decode")
            if stats.num_free_pages == stats.num_pages:
                break
            time.sleep(0.2)
        assert stats.num_free_pages == stats.num_pages and stats.integrity_error == ""
        procs["decode-0"].kill()
        procs["decode-0"].wait()
        _expect_unavailable(mesh)
