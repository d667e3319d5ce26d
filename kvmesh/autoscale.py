"""`kvmesh up --autoscale`: the local launcher adds and drains instances as the gateway advises.

The gateway decides (kvmesh.gateway.scale_advice: each role's desired count against the SLO,
`kvmesh_gateway_desired_instances` on its --metrics-port, the number a Kubernetes autoscaler
reads too); this loop reads it every `interval_s` and acts, one instance at a time, between
`bounds`:

- up: start one more instance (`Mesh.start_instance`); it registers in Redis and the gateway
  routes to it once it answers. Printed once it serves: how long after the advice it did.
- down: SIGTERM the newest instance of the role. It leaves the registry (the gateway stops
  routing to it), lets its requests finish within its --drain-grace, and exits: draining first,
  so no request fails because of a scaling step.

Nothing else happens while an instance is starting or draining: the next advice is taken on
the mesh that step left.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.launcher import Mesh

logger = logging.getLogger(__name__)

DESIRED = "kvmesh_gateway_desired_instances"
START_BOUND_S = 600.0
"""Seconds an instance may take to serve (model load, warm-up) before it is given up and stopped."""
DRAIN_BOUND_S = 60.0
"""Seconds a draining instance may take to exit (its --drain-grace, 25 s by default, and its
release) before it is killed: a frozen one (SIGSTOP) never blocks the scaler."""


@dataclass
class _Change:
    action: str
    """"up" (starting) or "down" (draining)."""
    role: str
    name: str
    proc: subprocess.Popen
    address: str
    advised_at: float
    """time.monotonic() when the advice this change follows was first read."""
    started_at: float
    """time.monotonic() when the instance was started or sent SIGTERM."""
    killed: bool = False
    """A drain that outlasted its bound and was killed."""


def read_desired(metrics_url: str, timeout_s: float = 2.0) -> dict[str, int]:
    """The gateway's desired instances per role, from its Prometheus text at `metrics_url`
    ({} when it does not answer or exports none)."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=timeout_s) as reply:
            text = reply.read().decode()
    except OSError:
        return {}
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name == DESIRED:
            for sample in family.samples:
                out[sample.labels["role"]] = int(sample.value)
    return out


def serving(address: str, timeout_s: float = 1.0) -> bool:
    """The instance at `address` reports SERVING on grpc.health.v1."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


class Autoscaler:
    """Acts on the gateway's advice for `mesh`; call `tick()` every so often (`kvmesh up`'s loop).

    metrics_url: the gateway's /metrics; bounds: role -> (fewest, most) instances."""

    def __init__(
        self,
        mesh: Mesh,
        metrics_url: str,
        bounds: dict[str, tuple[int, int]],
        interval_s: float = 1.0,
        start_bound_s: float = START_BOUND_S,
        drain_bound_s: float = DRAIN_BOUND_S,
    ):
        for role, (low, high) in bounds.items():
            if not 1 <= low <= high:
                raise ValueError(f"{role} instances: need 1 <= fewest <= most, got {low} and {high}")
        self.mesh, self.metrics_url, self.bounds, self.interval_s = mesh, metrics_url, bounds, interval_s
        self.start_bound_s, self.drain_bound_s = start_bound_s, drain_bound_s
        self._pending: _Change | None = None
        """The instance starting or draining now (nothing else happens meanwhile)."""
        self._next = 0.0
        self._advised: dict[str, float] = {}
        self.events: list[dict] = []
        """What it did: {"at", "role", "action": "up" | "down", "instance", "react_s"} (react_s:
        seconds from the advice to the instance serving, or to its drain's end)."""

    def addresses(self, role: str) -> list[str]:
        return self.mesh.prefill_addresses if role == "prefill" else self.mesh.decode_addresses

    def tick(self) -> None:
        now = time.monotonic()
        if self._pending is not None:
            self._follow(self._pending, now)
            return
        if now < self._next:
            return
        self._next = now + self.interval_s
        desired = read_desired(self.metrics_url)
        for role, (low, high) in self.bounds.items():
            have = len(self.addresses(role))
            want = min(max(desired.get(role, have), low), high)
            if want == have:
                self._advised.pop(role, None)
                continue
            advised_at = self._advised.setdefault(role, now)
            if want > have:
                name, proc, address = self.mesh.start_instance(role)
                print(f"autoscale: {role} {have} -> {have + 1}: starting {name} at {address}", flush=True)
                self._pending = _Change("up", role, name, proc, address, advised_at, now)
            else:
                self._drain(role, have, advised_at)
            return

    def close(self) -> None:
        """Stop an instance still starting (it is not in the mesh's processes yet); before Mesh.stop."""
        pending, self._pending = self._pending, None
        if pending is None or pending.proc.poll() is not None:
            return
        if pending.action == "up":
            _stop(pending.proc)
        else:  # draining since its SIGTERM: a frozen one would never go
            pending.proc.kill()
            pending.proc.wait()

    def lost(self, name: str, proc: subprocess.Popen) -> None:
        """An instance of the mesh died (kill -9, a crash): it leaves the mesh, and the advice
        decides whether another takes its place (at once, when fewer than the fewest are left)."""
        address = next(
            (a for role in self.bounds for a in self.addresses(role) if self._port_of(proc) == a.rsplit(":", 1)[1]),
            None,
        )
        self.mesh.procs.remove((name, proc))
        for role in self.bounds:
            if address in self.addresses(role):
                self.addresses(role).remove(address)
        print(f"autoscale: {name} exited (code {proc.returncode}); the mesh goes on without it", flush=True)

    def _drain(self, role: str, have: int, advised_at: float) -> None:
        """SIGTERM the newest instance of `role`: it stops taking requests and finishes its own."""
        address = self.addresses(role)[-1]
        name, proc = self._proc_of(role, address)
        self.mesh.procs.remove((name, proc))
        self.addresses(role).remove(address)
        print(f"autoscale: {role} {have} -> {have - 1}: draining {name} at {address}", flush=True)
        proc.send_signal(signal.SIGTERM)
        self._pending = _Change("down", role, name, proc, address, advised_at, time.monotonic())

    def _proc_of(self, role: str, address: str) -> tuple[str, subprocess.Popen]:
        """The (name, process) of the instance at `address` ("--port N" in its command line)."""
        port = address.rsplit(":", 1)[1]
        for name, proc in self.mesh.procs:
            if name.startswith(role) and self._port_of(proc) == port:
                return name, proc
        raise LookupError(f"no process of {role} at {address}")

    @staticmethod
    def _port_of(proc: subprocess.Popen) -> str:
        """The "--port N" of an instance's command line ("" without one)."""
        args = proc.args if isinstance(proc.args, list) else []
        return str(args[args.index("--port") + 1]) if "--port" in args else ""

    def _follow(self, change: _Change, now: float) -> None:
        """A starting instance joins the mesh once it serves (or is given up when it died); a
        draining one is done once it exited."""
        exited = change.proc.poll() is not None
        late = now - change.started_at
        if change.action == "down":
            if not exited and late > self.drain_bound_s:
                print(f"autoscale: {change.name} still runs {late:.0f} s after SIGTERM; killing it", flush=True)
                change.proc.kill()
                change.proc.wait()
                exited = change.killed = True
            if exited:
                self._done(change, now)
        elif exited:
            print(f"autoscale: {change.name} exited while starting (see its log)", flush=True)
            self._pending = None
        elif late > self.start_bound_s:
            print(f"autoscale: {change.name} does not serve {late:.0f} s after its start; stopping it", flush=True)
            _stop(change.proc)
            self._pending = None
        elif serving(change.address):
            self.mesh.procs.append((change.name, change.proc))
            self.addresses(change.role).append(change.address)
            self._done(change, now)

    def _done(self, change: _Change, now: float) -> None:
        react = now - change.advised_at
        verb = "serves" if change.action == "up" else "was killed" if change.killed else "drained and exited"
        print(f"autoscale: {change.name} {verb}, {react:.1f} s after the advice", flush=True)
        self.events.append(
            {"at": time.time(), "role": change.role, "action": change.action, "instance": change.name, "react_s": react}
        )
        self._advised.pop(change.role, None)
        self._pending = None


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 30 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
