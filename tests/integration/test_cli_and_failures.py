"""`kvmesh up` + `kvmesh generate` as a user runs them. (Dead services behind a gateway:
test_faults.py, which ends by killing its mesh's instances.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvmesh import launcher
from kvmesh.redis_server import free_port
from tests.integration.meshutil import SHARED_CORES_ENV, compile_block_kernels


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _mapped_cpu_share(pid: int) -> str:
    """The kvmesh CPU-share file process pid maps ("" for none), as /proc/PID/maps names it."""
    with open(f"/proc/{pid}/maps") as f:
        names = {line.split(maxsplit=5)[-1].strip() for line in f if "kvmesh-cpu-share-" in line}
    return names.pop() if len(names) == 1 else ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except (ProcessLookupError, FileNotFoundError):  # it was reaped between the two looks
        return False


def _gone(pids: list[int], timeout_s: float = 20) -> bool:
    """Wait until none of `pids` is alive; False if one still is after timeout_s seconds."""
    deadline = time.monotonic() + timeout_s
    while [p for p in pids if _alive(p)]:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


class Launcher:
    """A `kvmesh up` on a free port (its own Redis), its output in a file."""

    def __init__(self, out_path: str) -> None:
        self.port = free_port()
        self.http_port = free_port()  # not the default 8000: two start together, and others may run
        self.out_path = out_path
        with open(out_path, "w") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "kvmesh.cli",
                    "up",
                    "--port",
                    str(self.port),
                    "--http-port",
                    str(self.http_port),
                ],
                env={**os.environ, "REDIS_URL": "", **SHARED_CORES_ENV},
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def wait_up(self, timeout_s: float = 600) -> str:
        """Its output up to the "kvmesh is up" line (all of it if it exits first)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with open(self.out_path) as f:
                text = f.read()
            if "kvmesh is up" in text or self.proc.poll() is not None:
                return text
            time.sleep(0.2)
        return text


@pytest.fixture(scope="module")
def launchers(tmp_path_factory):
    """Two `kvmesh up`, started together so that their start-ups (model loads, with each
    gateway loading its tokenizer beside them) overlap."""
    compile_block_kernels()
    out = tmp_path_factory.mktemp("up")
    ups = {name: Launcher(str(out / f"{name}.log")) for name in ("generate", "killed")}
    yield ups
    for up in ups.values():
        if up.proc.poll() is None:
            up.proc.kill()
            up.proc.wait()


def test_kvmesh_up_then_generate_names_paris(launchers):
    up = launchers["generate"]
    try:
        text = up.wait_up()
        assert "kvmesh is up" in text, text[-3000:]
        children = _children(up.proc.pid)
        assert len(children) >= 4  # redis, prefill, decode, gateway
        # prefill and decode map one file of this mesh's to share the cores (runtime/cpu_share.py),
        # which the launcher removed once they were up: nothing is left behind, even after a SIGKILL
        mapped = [name for name in map(_mapped_cpu_share, children) if name]
        assert len(mapped) == 2 and mapped[0] == mapped[1] and mapped[0].endswith("(deleted)"), mapped
        # and prefill's forwards are small enough that a decode step never waits long for one
        prefill = next(pid for pid in children if b"prefill" in Path(f"/proc/{pid}/cmdline").read_bytes())
        environ = dict(v.split(b"=", 1) for v in Path(f"/proc/{prefill}/environ").read_bytes().split(b"\0") if v)
        want = str(launcher.SHARED_CORES_FORWARD_TOKENS).encode()
        assert environ[b"KVMESH_MAX_BATCH_TOKENS"] == want and environ[b"KVMESH_CHUNKED_PREFILL_SIZE"] == want
        gen = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvmesh.cli",
                "generate",
                "--gateway",
                f"127.0.0.1:{up.port}",
                "What is the capital of France?",
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert gen.returncode == 0, gen.stderr
        assert "Paris" in gen.stdout
        # the OpenAI-compatible HTTP API, printed beside the gRPC address, answers too
        http = f"http://127.0.0.1:{up.http_port}"
        assert f"OpenAI HTTP {http}/v1" in text and f"curl {http}/v1/chat/completions" in text
        body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0}
        answer = httpx.post(f"{http}/v1/chat/completions", json=body, timeout=120).json()
        assert "Paris" in answer["choices"][0]["message"]["content"], answer
    finally:
        up.proc.send_signal(signal.SIGTERM)
        up.proc.wait(timeout=60)
    assert up.proc.returncode == 0
    assert _gone(children, timeout_s=0.5)  # no orphans: the launcher stopped them before it exited


def test_children_die_with_a_killed_launcher(launchers):
    # SIGKILL gives the launcher no chance to stop anything: the children's PDEATHSIG does
    up = launchers["killed"]
    try:
        assert "kvmesh is up" in up.wait_up()
        children = _children(up.proc.pid)
        assert len(children) >= 4  # redis, prefill, decode, gateway
    finally:
        up.proc.kill()
        up.proc.wait(timeout=30)
    assert _gone(children, timeout_s=20)
