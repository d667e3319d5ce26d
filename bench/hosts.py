"""Separate hosts on one Linux machine, for the multi-host tests (issue 28) and the soak
(`kvmesh soak`, bench/soak/).

Each host is a network namespace with its own address on a bridge, its own hostname (UTS
namespace), process ids (`unshare --pid --mount-proc`: a service there cannot see another
host's processes, so it cannot map their KV pools through /proc/PID/fd), SysV IPC, /dev/shm (a
tmpfs in its own mount namespace) and boot id (UCX's test for "the same node"). The bridge lives in a switch namespace of its own; the test process
reaches the hosts through one more link from the root namespace (`Cluster.client_address`).

A link is cut in two ways, neither needing traffic control (netem is not on the test machines):
- a host's whole link: its port on the switch goes down (`cut(host)`);
- one pair of hosts: a blackhole route to each other's address in both (`cut(a, b)`). Packets
  between the two are dropped as on a partition; established TCP connections stay open and
  see nothing but silence, as on a real cut.

Everything a cluster makes is named `kvmh-<pid>-...`: `close()` removes it even when the test
failed (processes by PID, then every process left in each namespace, then the namespaces, which
takes their links along), and `sweep_stale()` removes what a killed run left behind.

Needs root, iproute2 (`ip`) and util-linux's `unshare`; `unavailable()` says why when one is
missing. The tests' module fixture is tests/multihost/hosts.py `running_cluster`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass, field

PREFIX = "kvmh"
STOP_TIMEOUT_S = 30.0
"""How long `stop` waits for a service to exit after SIGTERM before SIGKILL."""


def _ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", *(["-n", netns] if netns else []), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {proc.stderr.strip()}")
    return proc


def unavailable() -> str | None:
    """Why hosts cannot be made on this machine (None when they can)."""
    if os.geteuid() != 0:
        return "needs root (network and pid namespaces)"
    for tool in ("ip", "unshare", "redis-server"):
        if shutil.which(tool) is None:
            return f"needs {tool!r} on PATH"
    probe = f"{PREFIX}-{os.getpid()}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _netns_names() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_netns(netns: str) -> None:
    """SIGKILL every process in `netns`, then delete it (its links go with it)."""
    pids = _ip("netns", "pids", netns, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    _ip("netns", "del", netns, check=False)


def sweep_stale() -> list[str]:
    """Remove the namespaces of clusters whose test process is gone; returns their names."""
    swept = []
    for name in _netns_names():
        parts = name.split("-")
        if len(parts) < 3 or parts[0] != PREFIX or not parts[1].isdigit():
            continue
        if int(parts[1]) == os.getpid() or os.path.exists(f"/proc/{parts[1]}"):
            continue
        _kill_netns(name)
        swept.append(name)
    return swept


def leftovers() -> tuple[list[str], list[str]]:
    """(namespaces, root-namespace links) named after this process: what `close` must remove."""
    mine = f"{PREFIX}-{os.getpid()}-"
    links = _ip("-o", "link", "show", check=False).stdout
    link_prefix = f"{PREFIX}{os.getpid()}"
    return (
        [n for n in _netns_names() if n.startswith(mine)],
        [line.split(":")[1].strip().split("@")[0] for line in links.splitlines() if link_prefix in line],
    )


@dataclass
class Host:
    """One host: its namespace, address and the services it runs (`Cluster.spawn`)."""

    name: str
    netns: str
    address: str
    port: str
    """Its link's port on the switch (in the switch namespace)."""
    boot_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    """What /proc/sys/kernel/random/boot_id reads on this host: UCX tells hosts apart by it
    (`ucs_get_system_id`), and with the machine's one it takes every peer for one on its node and
    moves data through SysV shared memory."""
    procs: list[subprocess.Popen] = field(default_factory=list)


class Cluster:
    """Hosts on a bridge, made by `start()` and removed by `close()` (or `with Cluster(...)`).

    names: the hosts' names (also their hostnames). Addresses come from 198.18.0.0/15 (RFC 2544's
    benchmarking range), one /24 a cluster chosen by the test process's pid.
    """

    def __init__(self, names: list[str]) -> None:
        pid = os.getpid()
        self.tag = f"{PREFIX}-{pid}"
        self.subnet = f"198.{18 + (pid >> 8) % 2}.{pid % 256}"
        self.switch = f"{self.tag}-switch"
        self.client_link = f"{PREFIX}{pid}c"
        self.client_address = f"{self.subnet}.254"
        self.hosts = {
            name: Host(name, f"{self.tag}-{name}", f"{self.subnet}.{10 + i}", f"p{i}") for i, name in enumerate(names)
        }
        self._cuts: set[tuple[str, ...]] = set()

    def __enter__(self) -> Cluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Make the switch, the hosts and the client link. Raises RuntimeError when `ip` fails
        (everything made so far is removed)."""
        sweep_stale()
        try:
            _ip("netns", "add", self.switch)
            _ip("link", "add", "br0", "type", "bridge", netns=self.switch)
            _ip("link", "set", "br0", "up", netns=self.switch)
            for i, host in enumerate(self.hosts.values()):
                _ip("netns", "add", host.netns)
                self._link(f"{PREFIX}{os.getpid()}h{i}", host.netns, "eth0", host.port)
                _ip("addr", "add", f"{host.address}/24", "dev", "eth0", netns=host.netns)
                _ip("link", "set", "eth0", "up", netns=host.netns)
                _ip("link", "set", "lo", "up", netns=host.netns)
            self._link(self.client_link, None, self.client_link, "pc")
            _ip("addr", "add", f"{self.client_address}/24", "dev", self.client_link)
            _ip("link", "set", self.client_link, "up")
        except BaseException:
            self.close()
            raise

    def _link(self, name: str, netns: str | None, inside: str, port: str) -> None:
        """A veth pair: one end `inside` in `netns` (None: the root namespace), the other `port`
        on the switch's bridge."""
        _ip("link", "add", name, "type", "veth", "peer", "name", f"{name}p")
        if netns is not None:
            _ip("link", "set", name, "netns", netns)
            _ip("link", "set", name, "name", inside, netns=netns)
        _ip("link", "set", f"{name}p", "netns", self.switch)
        _ip("link", "set", f"{name}p", "name", port, netns=self.switch)
        _ip("link", "set", port, "master", "br0", netns=self.switch)
        _ip("link", "set", port, "up", netns=self.switch)

    def spawn(
        self, host: str, argv: list[str], env: dict[str, str], log, disk: tuple[str, int] | None = None
    ) -> subprocess.Popen:
        """Run argv on `host`: in its network namespace, as pid 1 of a new pid namespace, with
        the host's name and a private /dev/shm; output to `log` (a file). disk: (an absolute
        path, MiB): a disk of that size mounted there, private to this process (a tmpfs: what it
        holds goes with the process; another process reads it through /proc/PID/root). The
        returned process is `unshare`, whose only child is the service; killing it kills the
        service (SIGKILL). Stop the service gracefully with `stop`."""
        h = self.hosts[host]
        setup = 'hostname "$0" && mount -t tmpfs -o size=8g kvmesh-shm /dev/shm && echo "$1" > /dev/shm/.boot_id'
        if disk is not None:
            path, mib = disk
            if not path.startswith("/") or "'" in path or not 0 < mib < 1 << 20:
                raise ValueError(f"disk must be (an absolute path without quotes, MiB in [1, 2^20)), got {disk!r}")
            setup += f" && mkdir -p '{path}' && mount -t tmpfs -o size={int(mib)}m kvmesh-disk '{path}'"
        setup += ' && mount --bind -o ro /dev/shm/.boot_id /proc/sys/kernel/random/boot_id && shift && exec "$@"'
        cmd = ["ip", "netns", "exec", h.netns, "unshare", "--pid", "--fork", "--mount-proc", "--uts", "--ipc"]
        cmd += ["--kill-child=SIGKILL", "--", "sh", "-c", setup, host, h.boot_id, *argv]
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        h.procs.append(proc)
        return proc

    @staticmethod
    def service_pid(proc: subprocess.Popen, timeout_s: float = 10.0) -> int:
        """The root-namespace pid of the service `spawn` started (unshare's child)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
                    children = f.read().split()
                if children:
                    return int(children[0])
            if proc.poll() is not None:
                raise RuntimeError(f"unshare {proc.pid} exited ({proc.returncode}) before its service started")
            time.sleep(0.02)
        raise TimeoutError(f"unshare {proc.pid} started no service within {timeout_s} s")

    def stop(self, proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """Send `sig` to the service of `proc` and wait for it to exit (SIGKILL after timeout_s);
        its exit status."""
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, RuntimeError, TimeoutError):
                os.kill(self.service_pid(proc, timeout_s=1.0), sig)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()

    def cut(self, a: str, b: str | None = None) -> None:
        """Cut host a's whole link (b None) or only the path between hosts a and b."""
        self._route("add", a, b)

    def restore(self, a: str, b: str | None = None) -> None:
        """Undo `cut(a, b)` (nothing when it was not cut)."""
        if ((a,) if b is None else tuple(sorted((a, b)))) in self._cuts:
            self._route("del", a, b)

    def _route(self, op: str, a: str, b: str | None) -> None:
        key = (a,) if b is None else tuple(sorted((a, b)))
        if b is None:
            _ip("link", "set", self.hosts[a].port, "down" if op == "add" else "up", netns=self.switch)
        else:
            for x, y in ((a, b), (b, a)):
                _ip("route", op, "blackhole", f"{self.hosts[y].address}/32", netns=self.hosts[x].netns)
        if op == "add":
            self._cuts.add(key)
        else:
            self._cuts.discard(key)

    def close(self) -> None:
        """SIGKILL every process and remove every namespace and link this cluster made."""
        for host in self.hosts.values():
            for proc in host.procs:
                if proc.poll() is None:
                    proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=10)
        for name in [h.netns for h in self.hosts.values()] + [self.switch]:
            if name in _netns_names():
                _kill_netns(name)
        _ip("link", "del", self.client_link, check=False)  # gone with the switch, unless it failed before
