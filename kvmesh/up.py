"""`kvmesh up`: start a local mesh (kvmesh.launcher), say where it answers, and keep it up until
Ctrl-C, SIGTERM or the death of one of its processes."""

from __future__ import annotations

import signal
import sys
import threading

from kvmesh import launcher
from kvmesh.engine.precision import check_dtype_spec, check_quantization_spec


def run_up(
    num_prefill: int,
    num_decode: int,
    model: str | None,
    port: int,
    prefill_threads: int = 0,
    decode_threads: int = 0,
    speculative: str = "off",
    num_draft_tokens: int = 4,
    http_port: int = 8000,
    decode_ep: int = 1,
    dtype: str = "auto",
    slo_ms: tuple[float, float] = (0.0, 0.0),
    autoscale: tuple[int, int] | None = None,
    quantization: str = "none",
) -> int:
    """The `kvmesh up` command: start, print the gateway address, wait for Ctrl-C/SIGTERM or a child's death.

    prefill_threads / decode_threads: each instance's model threads (`--torch-threads`; 0:
    every core). The default split on a small machine: both use every core, decode's threads
    spin between steps, prefill's spin briefly, then sleep, and the two take turns through one
    --cpu-share file (docs/operations.md, Threads), so a prefill burst slows decode only while
    it computes. speculative / num_draft_tokens go to every decode
    (`kvmesh serve decode --speculative ... --num-draft-tokens ...`), decode_ep too (`--ep N`:
    each decode runs N expert-parallel ranks; MoE models only). http_port: the gateway's
    OpenAI-compatible HTTP API (0: none). dtype: every instance's `--dtype` (auto|float32|bfloat16;
    ValueError for another). slo_ms: the gateway's (--slo-ttft-ms, --slo-itl-ms), 0: none.
    autoscale: (most prefill, most decode) instances to scale between, from the starting counts
    down to one each, as the gateway advises (kvmesh.autoscale); None: a fixed mesh. quantization:
    every instance's `--quantization` (none|int8; ValueError for another).
    """
    check_dtype_spec(dtype)
    check_quantization_spec(quantization)
    if autoscale is not None and not any(slo_ms):
        raise ValueError("--autoscale scales to a target: give --slo-ttft-ms and/or --slo-itl-ms")
    if min(slo_ms) < 0:
        raise ValueError(f"SLO targets must be >= 0 ms (0: none), got {slo_ms[0]} and {slo_ms[1]}")
    if autoscale is not None and (autoscale[0] < num_prefill or autoscale[1] < num_decode):
        raise ValueError(
            f"--max-prefill {autoscale[0]} / --max-decode {autoscale[1]}: each must be at least the starting "
            f"count (--prefill {num_prefill} / --decode {num_decode})"
        )
    if decode_ep < 1:
        raise ValueError(f"decode_ep must be >= 1, got {decode_ep}")
    if prefill_threads < 0 or decode_threads < 0:
        raise ValueError(f"thread counts must be >= 0 (0: every core), got {prefill_threads} and {decode_threads}")
    _interrupt_on_signals()
    print(f"starting kvmesh: {num_prefill} prefill, {num_decode} decode ...", flush=True)
    metrics_port = launcher.free_port("127.0.0.1") if autoscale else 0
    quantization_args = ["--quantization", quantization] if quantization != "none" else []
    gateway_args = [
        *(["--slo-ttft-ms", str(slo_ms[0])] if slo_ms[0] else []),
        *(["--slo-itl-ms", str(slo_ms[1])] if slo_ms[1] else []),
        *(["--metrics-port", str(metrics_port)] if metrics_port else []),
    ]
    try:
        mesh = launcher.start_mesh(
            num_prefill,
            num_decode,
            model,
            port,
            extra_prefill_args=[
                "--dtype",
                dtype,
                *(["--torch-threads", str(prefill_threads)] if prefill_threads else []),
                *quantization_args,
            ],
            extra_decode_args=[
                "--dtype",
                dtype,
                *_decode_args(decode_threads, speculative, num_draft_tokens, decode_ep),
                *quantization_args,
            ],
            extra_gateway_args=gateway_args,
            http_port=http_port,
            keep_cpu_share=autoscale is not None,
        )
    except KeyboardInterrupt:
        print("start-up interrupted; stopped everything it started", file=sys.stderr, flush=True)
        return 130
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    _print_where(mesh)
    scaler = None
    if autoscale is not None:
        from kvmesh.autoscale import Autoscaler

        bounds = {"prefill": (1, autoscale[0]), "decode": (1, autoscale[1])}
        scaler = Autoscaler(mesh, f"http://127.0.0.1:{metrics_port}/metrics", bounds)
        print(f"autoscaling: 1-{autoscale[0]} prefill, 1-{autoscale[1]} decode, as the gateway advises", flush=True)
    return _watch(mesh, stop, scaler)


def _interrupt_on_signals() -> None:
    """During start-up Ctrl-C and SIGTERM abort at once (even when the shell started us with
    SIGINT ignored, as it does for background jobs); afterwards they stop `_watch`."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt  # start_mesh stops what it started on the way out

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)


def _decode_args(decode_threads: int, speculative: str, num_draft_tokens: int, decode_ep: int) -> list[str]:
    """The flags `kvmesh up` adds to every decode's `kvmesh serve decode`, beside --dtype."""
    return [
        *(["--torch-threads", str(decode_threads)] if decode_threads else []),
        *(["--speculative", speculative, "--num-draft-tokens", str(num_draft_tokens)] if speculative != "off" else []),
        *(["--ep", str(decode_ep)] if decode_ep > 1 else []),
    ]


def _print_where(mesh: launcher.Mesh) -> None:
    """Say where the mesh answers, how to ask it and how to grow it."""
    http = f", OpenAI HTTP {mesh.http_address}/v1" if mesh.http_address else ""
    print(
        f"kvmesh is up: gateway {mesh.gateway_address}{http} (prefill {', '.join(mesh.prefill_addresses)}; "
        f"decode {', '.join(mesh.decode_addresses)}; redis {mesh.redis_url})",
        flush=True,
    )
    print(f'try: kvmesh generate --gateway {mesh.gateway_address} "What is the capital of France?"', flush=True)
    if mesh.http_address:
        print(
            f"  or: curl {mesh.http_address}/v1/chat/completions -H 'Content-Type: application/json' "
            """-d '{"messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0}'""",
            flush=True,
        )
    print(f"scale: kvmesh serve prefill|decode --redis-url {mesh.redis_url} joins this gateway", flush=True)


def _watch(mesh: launcher.Mesh, stop: threading.Event, scaler=None) -> int:
    """Keep the mesh up until `stop` is set (0) or one of its processes dies (1); then stop it.
    scaler: a kvmesh.autoscale.Autoscaler, ticked in between."""
    code = 0
    try:
        while not stop.wait(0.5):
            if scaler is not None:
                for name, proc in [(n, p) for n, p in mesh.procs if n != "gateway" and p.poll() is not None]:
                    scaler.lost(name, proc)  # an instance the scaler can replace; the gateway it cannot
                scaler.tick()
            dead = [n for n, p in mesh.procs if p.poll() is not None]
            if dead:
                print(f"{', '.join(dead)} exited; stopping the mesh", file=sys.stderr, flush=True)
                code = 1
                break
    finally:
        print("stopping kvmesh ...", flush=True)
        if scaler is not None:
            scaler.close()
        mesh.stop()
    return code
