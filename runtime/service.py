"""What every kvmesh service process shares: logging, uvloop, the gRPC server with the
standard health service, and one shutdown order (stop admitting, drain, stop the server
with a grace period, release resources).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import signal
import threading
from collections.abc import Awaitable, Callable

import grpc
import uvloop
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvmesh.runtime.warming_gate import WarmingGate

logger = logging.getLogger(__name__)

# 64 MiB: token id lists of long prompts travel in one message.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_MESSAGE_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
# Every channel pings its peer every 2 s and gives up after 3 s without an answer. A peer
# that is stopped (SIGSTOP) or wedged keeps its TCP connection open and never answers:
# without these pings its calls hang until their deadline (or forever). grpc's own
# ping_timeout defaults to 60 s and overrides keepalive_timeout, so both are set.
KEEPALIVE_TIME_S = 2.0
KEEPALIVE_TIMEOUT_S = 3.0
GRPC_OPTIONS = [
    *_MESSAGE_OPTIONS,
    ("grpc.keepalive_time_ms", int(KEEPALIVE_TIME_S * 1000)),
    ("grpc.keepalive_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),
    ("grpc.http2.ping_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
"""Options of every client channel (gateway -> services, kvmesh clients)."""
_HEALTH_WAIT_OPTIONS = [
    *GRPC_OPTIONS,
    # a service opens its port only after imports and the model load (seconds): with grpc's
    # default reconnect backoff (1 s, growing 1.6x a try) the wait noticed an open port up to
    # ~2 s late; retrying as often as it polls, it notices within one poll
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 200),
]
SERVER_OPTIONS = [
    *_MESSAGE_OPTIONS,
    # accept the clients' 2 s pings (the default policy answers them with GOAWAY
    # too_many_pings), and ping clients too, so a frozen caller's streams end
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 1000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.keepalive_time_ms", 5000),
    ("grpc.keepalive_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),
    ("grpc.http2.ping_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),
]
"""Options of every kvmesh gRPC server."""


def set_torch_threads(num_threads: int) -> None:
    """Intra-op threads for this process's model, torch's and the GGUF block kernels' (0 keeps
    the defaults: every core).

    Call on the main thread. Several services on one machine share its cores; giving
    each fewer threads keeps OpenMP teams from stalling on each other.
    """
    if num_threads < 0:
        raise ValueError(f"torch threads must be >= 0 (0 = all cores), got {num_threads}")
    if num_threads:
        import numba
        import torch

        torch.set_num_threads(num_threads)
        numba.set_num_threads(min(num_threads, numba.config.NUMBA_NUM_THREADS))  # type: ignore[attr-defined]  # kvmesh.kernels.quant


def setup_logging(name: str) -> None:
    """Configure this service's logging (kvmesh.runtime.logs: text or JSON, request and trace ids)."""
    from kvmesh.runtime.logs import setup_logging as setup

    setup(name)


class Service:
    """A grpc.aio server plus health reporting for one kvmesh service.

    `serving_names` are the fully-qualified service names ("kvmesh.v1.Decode") whose
    health flips to SERVING once `mark_serving()` is called (after the model is warm):
    readiness is not liveness. Until `admit()` (or `mark_serving()`), every other RPC is refused
    UNAVAILABLE (kvmesh.runtime.warming_gate): nothing reaches a model that is still warming.
    """

    def __init__(
        self,
        serving_names: list[str],
        host: str,
        port: int,
        tls: tuple[bytes, bytes] | None = None,
    ) -> None:
        """tls: (PEM private key, PEM certificate chain) to serve TLS; None: plain TCP.

        Raises OSError when the port cannot be bound."""
        # no SO_REUSEPORT: a second server on a taken port must fail, not share it silently
        self.admitting = False
        self._gate = WarmingGate(" ".join(serving_names), lambda: self.admitting)
        self.server = grpc.aio.server(interceptors=[self._gate], options=[*SERVER_OPTIONS, ("grpc.so_reuseport", 0)])
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        # grpcurl / grpcui can list and call the services without the .proto files
        reflection.enable_server_reflection([*serving_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server)
        self.serving_names = serving_names
        try:
            if tls is not None:
                self.port = self.server.add_secure_port(f"{host}:{port}", grpc.ssl_server_credentials([tls]))
            else:
                self.port = self.server.add_insecure_port(f"{host}:{port}")
        except RuntimeError:
            self.port = 0
        if self.port == 0:
            raise OSError(f"could not bind {host}:{port}: is another kvmesh service using it? pick another --port")
        self.address = f"{host}:{self.port}"
        self._gate.name = f"{self._gate.name} at {self.address}"

    async def start(self) -> None:
        """Start serving RPCs; health stays NOT_SERVING until mark_serving()."""
        for name in ["", *self.serving_names]:
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()

    def admit(self) -> None:
        """Open the gate: every RPC reaches its servicer from now on (health may still say NOT_SERVING)."""
        self.admitting = True

    async def mark_serving(self) -> None:
        """Admit (if not yet) and report SERVING."""
        self.admit()
        for name in ["", *self.serving_names]:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def stop(self, grace_s: float) -> None:
        """Report NOT_SERVING, then stop the server giving in-flight RPCs grace_s seconds."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)


def start_metrics_server(port: int, host: str, registry) -> None:
    """Serve `registry` as Prometheus text on http://host:port/metrics (port 0: nothing)."""
    if port:
        from prometheus_client import start_http_server

        start_http_server(port, addr=host, registry=registry)
        logger.info("metrics on http://%s:%d/metrics", host, port)


class MainThreadExecutor(concurrent.futures.Executor):
    """Runs submitted callables on the process's main thread, in order.

    PyTorch's CPU kernels are fast only on the main thread: ATen's OpenMP parallel
    regions cost ~140 us more each when entered from another thread (an element-wise op
    on 200K floats: 40 us on the main thread, 177 us on a second one; one decode step of
    the default model: 26 ms vs 41 ms). So the model runs here and the event loop runs
    in a background thread.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        if self._closed:
            raise RuntimeError("executor is shut down")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((future, fn, args, kwargs))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._closed = True
        self._queue.put(None)

    def run_forever(self) -> None:
        """Call on the main thread: run work until shutdown()."""
        while True:
            try:
                item = self._queue.get(timeout=0.5)
            except queue.Empty:
                continue
            if item is None:
                return
            future, fn, args, kwargs = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # handed to whoever awaits the future
                future.set_exception(exc)


def run(main: Callable[[asyncio.Event, MainThreadExecutor], Awaitable[None]]) -> None:
    """Run `main(stop_event, executor)` on uvloop in a background thread while the main
    thread executes what is submitted to `executor`; SIGINT/SIGTERM set stop_event.

    Raises whatever `main` raised, after the executor has stopped.
    """
    executor = MainThreadExecutor()
    state: dict = {"stop_requested": False}
    errors: list[BaseException] = []

    def on_signal(signum, frame) -> None:
        state["stop_requested"] = True
        loop, stop = state.get("loop"), state.get("stop")
        if loop is not None and stop is not None:
            # a second signal (a terminal's Ctrl-C reaches every process of the group, the
            # launcher then sends SIGTERM) may come after the loop closed: it is stopping already
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(stop.set)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)

    async def runner() -> None:
        # hold one reference to grpc.aio's process-wide state for the whole process: each aio
        # server and channel takes one and gives it back when collected, and the last to go
        # shuts the poller's completion queue and gRPC core down on whichever thread collects
        # it, with gRPC's own threads still about (grpc/grpc#22365, #43364). The process leaves
        # with os._exit (kvmesh.cli), so that teardown never needs to run. (The decode SIGSEGV at
        # shutdown seen in multihost runs was UCX's teardown: kvmesh.kvstore.ucx_common.keep_until_exit.)
        grpc.aio.init_grpc_aio()
        stop = asyncio.Event()
        state["loop"], state["stop"] = asyncio.get_running_loop(), stop
        if state["stop_requested"]:
            stop.set()
        await main(stop, executor)

    def event_loop_thread() -> None:
        try:
            uvloop.run(runner())
        except BaseException as exc:
            errors.append(exc)
        finally:
            executor.shutdown()

    thread = threading.Thread(target=event_loop_thread, name="event-loop")
    thread.start()
    executor.run_forever()
    thread.join()
    if errors:
        raise errors[0]


async def wait_for_health(
    address: str, timeout_s: float, service: str = "", root_certificates: bytes | None = None
) -> None:
    """Poll grpc.health.v1 at `address` until SERVING; TimeoutError after timeout_s seconds.

    root_certificates: PEM certificates to trust for a TLS port (None: plain TCP)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    if root_certificates is not None:
        creds = grpc.ssl_channel_credentials(root_certificates)
        channel = grpc.aio.secure_channel(address, creds, options=_HEALTH_WAIT_OPTIONS)
    else:
        channel = grpc.aio.insecure_channel(address, options=_HEALTH_WAIT_OPTIONS)
    async with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                # the call's own deadline did not always end it on a machine out of memory (a
                # helper saw one hang for 30 min), so the loop bounds it too
                async with asyncio.timeout(2.0):
                    resp = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except (grpc.aio.AioRpcError, TimeoutError):
                pass
            if loop.time() > deadline:
                raise TimeoutError(f"{address} not SERVING after {timeout_s:.0f} s")
            await asyncio.sleep(0.2)
