"""`kvmesh fuzz`: random and hostile GenerateRequests against a gateway, over real gRPC (with
--http: against its HTTP front, every field of its four APIs, bench/fuzz_http.py).

Sends --requests requests (default 3000), --concurrency at a time (default 32), each with a
client deadline (--deadline-s, default 60 s). Each request is a plain valid one (1-8 tokens)
or one bent by one or more cases: random bytes and invalid UTF-8 as the prompt, empty,
whitespace or huge prompts, control-token text, chat messages with odd roles, prompt token
ids out of the vocabulary, sampling extremes (0, tiny, huge, negative, nan, inf), huge stop
lists, a wrong model name, weird request ids.

Outcomes are counted by gRPC status name, with a couple of example details for each. The
run fails (exit 1) when a request ended UNKNOWN or INTERNAL, when a small request (max_tokens
set and <= 64) ran into its deadline, when an OK stream was malformed (no Final, more tokens
than max_tokens), when a local service died or logged a servicer method that raised (an
UNKNOWN on an internal hop, which the gateway may pass on as UNAVAILABLE), or when at the end
a plain greedy request does not succeed within 60 s (the mesh stopped answering).

    .venv/bin/python -m kvmesh.bench.fuzz                    # its own mesh: 1 prefill, 1 decode
    .venv/bin/python -m kvmesh.bench.fuzz --requests 300 --json
    .venv/bin/python -m kvmesh.bench.fuzz --gateway 127.0.0.1:50051 --seed 3 --index 117

Request i is built from (--seed, i) alone, so a failure's seed and index replay it (--index).
Without --gateway the services' log goes to a temp file whose path is printed and kept.
The cases are built in bench/fuzz_cases.py and counted in bench/fuzz_report.py; this module
sends them and runs the command.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Callable

import grpc

from kvmesh.bench.fuzz_cases import Target, build_request
from kvmesh.bench.fuzz_report import Result, describe, log_exceptions, print_report, send_all, summarize
from kvmesh.client import GatewayClient, make_request

FAILURE_CAUSE_KEY = "kvmesh-failure-cause"  # kvmesh.runtime.wire.FAILURE_CAUSE_KEY, read without importing torch


def _check_ok(req, final, num_tokens: int) -> str:
    """Empty when an OK stream kept the protocol, else what it broke."""
    if final is None:
        return "stream ended OK without a Final message"
    mt = req.sampling.max_tokens if req.sampling.HasField("max_tokens") else None
    if final.finish_reason not in ("stop", "length", "abort"):
        return f"finish_reason {final.finish_reason!r}"
    if final.generated_tokens != num_tokens:
        return f"Final says {final.generated_tokens} tokens, the deltas carried {num_tokens}"
    if mt is not None and (
        final.generated_tokens > mt or (final.finish_reason == "length" and final.generated_tokens != mt)
    ):
        return f"{final.generated_tokens} tokens, finish {final.finish_reason!r}, for max_tokens {mt}"
    return ""


async def _send(client: GatewayClient, req, deadline_s: float) -> tuple[str, str]:
    final, num_tokens = None, 0
    try:
        async for msg in client.stream(req, timeout_s=deadline_s):
            if msg.HasField("final"):
                final = msg.final
            else:
                num_tokens += len(msg.delta.token_ids)
    except grpc.aio.AioRpcError as exc:
        cause = dict(exc.trailing_metadata() or ()).get(FAILURE_CAUSE_KEY)
        return exc.code().name, (exc.details() or "") + (f" (cause {cause})" if cause else "")
    problem = _check_ok(req, final, num_tokens)
    return ("OK_MALFORMED", problem) if problem else ("OK", "")


async def fuzz(
    address: str,
    seed: int,
    indices: list[int],
    t: Target,
    concurrency: int,
    deadline_s: float,
    say: Callable[..., None],
) -> list[Result]:
    """Send request i for each i in indices, `concurrency` at a time; one Result each, in order."""
    async with GatewayClient(address) as client:

        async def one(i: int) -> Result:
            case, req, small = build_request(seed, i, t)
            t0 = time.perf_counter()
            status, details = await _send(client, req, deadline_s)
            return Result(i, case, status, details, small, time.perf_counter() - t0, describe(req))

        return await send_all(indices, concurrency, one, say)


async def target_of(address: str) -> Target:
    async with GatewayClient(address) as client:
        m = await client.list_models(timeout_s=30)
    return Target(m.models[0] if m.models else "", m.max_context_tokens, m.max_tokens_limit, m.has_chat_template)


async def answering(address: str, chat: bool, timeout_s: float = 60.0) -> tuple[bool, str]:
    """(whether a plain greedy 8-token request succeeds within timeout_s, its text or error)."""
    req = make_request("What is the capital of France?", chat=chat, max_tokens=8, temperature=0.0)
    try:
        async with GatewayClient(address) as client:
            out = await client.complete(req, timeout_s=timeout_s)
    except grpc.aio.AioRpcError as exc:
        return False, f"{exc.code().name}: {exc.details()}"
    return out.final is not None and out.final.generated_tokens >= 1, out.text


def _start_local_mesh(args: argparse.Namespace, say) -> tuple | None:
    """A mesh of 1 prefill and 1 decode for the run, and the log its services write to; None
    (said why on stderr) when it did not start. With --http its gateway bounds a key's requests
    in flight at --max-requests-per-key (default --concurrency + 16: over what the cases hold at
    once, which the open-streams probe then fills) and its decode holds that many probe streams."""
    from kvmesh.bench.fuzz_probes import probe_pages
    from kvmesh.launcher import start_mesh
    from kvmesh.redis_server import free_port

    log = tempfile.NamedTemporaryFile("w+", prefix="kvmesh-fuzz-", suffix=".log", delete=False)
    say(f"starting a mesh (1 prefill, 1 decode); services log to {log.name}")
    gateway_args, decode_args = [], []
    if args.http:
        args.max_requests_per_key = args.max_requests_per_key or args.concurrency + 16
        gateway_args = ["--max-requests-per-key", str(args.max_requests_per_key)]
        decode_args = ["--num-pages", str(max(1024, probe_pages(args.max_requests_per_key)))]
    try:
        mesh = start_mesh(
            1,
            1,
            args.model,
            port=free_port(),
            log=log,
            env={"REDIS_URL": ""},
            http_port=free_port() if args.http else 0,
            extra_gateway_args=gateway_args,
            extra_decode_args=decode_args,
        )
    except Exception as exc:
        log.seek(0)
        print(log.read()[-4000:], file=sys.stderr)
        print(f"error: the mesh did not start: {exc} (log: {log.name})", file=sys.stderr)
        return None
    return mesh, log


def run(args: argparse.Namespace) -> int:
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else (lambda *a: print(*a, flush=True))
    if args.requests < 1 or args.concurrency < 1 or not args.deadline_s > 0:
        print("error: --requests and --concurrency must be >= 1 and --deadline-s > 0", file=sys.stderr)
        return 2
    indices = args.index or list(range(args.requests))
    if args.http and args.gateway and not args.http_url:
        print("error: with --http and --gateway, give the gateway's HTTP API as --http-url", file=sys.stderr)
        return 2
    mesh, log = None, None
    address, http_url = args.gateway, args.http_url
    if not address:
        started = _start_local_mesh(args, say)
        if started is None:
            return 1
        mesh, log = started
        address, http_url = mesh.gateway_address, mesh.http_address
    try:
        try:
            t = asyncio.run(target_of(address))
        except grpc.aio.AioRpcError as exc:
            print(f"error: ListModels on {address} failed: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
        say(
            f"gateway {address}: {t.model}, context {t.max_context} tokens, max_tokens <= {t.max_tokens_limit}; "
            f"{len(indices)} requests, {args.concurrency} at a time, seed {args.seed}"
        )
        start = time.perf_counter()
        probes: dict[str, str] = {}
        if args.http:
            results, probes = asyncio.run(_fuzz_http(http_url, t.model, args, indices, say))
        else:
            results = asyncio.run(fuzz(address, args.seed, indices, t, args.concurrency, args.deadline_s, say))
        seconds = time.perf_counter() - start
        ok, answer = asyncio.run(answering(address, t.chat))
        dead = [name for name, p in mesh.procs if p.poll() is not None] if mesh else []
    finally:
        if mesh is not None:
            mesh.stop()
    unhandled, tracebacks = log_exceptions(log.name) if log else (0, [])
    if args.http:
        from kvmesh.bench.fuzz_http import is_http_failure

        summary = summarize(results, seconds, ok, answer, dead, unhandled, tracebacks, is_http_failure)
        summary["probes"] = probes
        summary["num_failures"] += sum(v != "ok" for v in probes.values())
    else:
        summary = summarize(results, seconds, ok, answer, dead, unhandled, tracebacks)
    if args.json:
        print(json.dumps(summary))
    else:
        print_report(summary)
    if log:
        say(f"services' log kept in {log.name}")
    bad_logs = bool(tracebacks) and args.http  # every refusal of the HTTP front is answered, never raised
    return 1 if summary["num_failures"] or not ok or dead or unhandled or bad_logs else 0


async def _fuzz_http(http_url: str, model: str, args: argparse.Namespace, indices: list[int], say) -> tuple:
    """The HTTP cases (bench/fuzz_http.py) and, beside them, the bound probes."""
    from kvmesh.bench.fuzz_http import fuzz_http
    from kvmesh.bench.fuzz_probes import probe_bounds, probe_open_streams
    from kvmesh.gateway.http.body import BODY_READ_S
    from kvmesh.gateway.http.server import MAX_BODY_BYTES

    base = http_url.rstrip("/")
    probes = asyncio.ensure_future(probe_bounds(base, MAX_BODY_BYTES, BODY_READ_S))
    results = await fuzz_http(base, model, args.seed, indices, args.concurrency, args.deadline_s, MAX_BODY_BYTES, say)
    probed = await probes
    if args.max_requests_per_key:  # after the cases: their requests would share the key's bound
        probed["open_streams_past_the_key_bound"] = await probe_open_streams(base, model, args.max_requests_per_key)
    return results, probed


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gateway", default=None, help="gateway HOST:PORT (default: start a local mesh)")
    p.add_argument("--requests", type=int, default=3000, help="requests to send (default 3000)")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight at once (default 32)")
    p.add_argument("--seed", type=int, default=0, help="seed of the request generator (default 0)")
    p.add_argument(
        "--index", type=int, action="append", help="send only request INDEX of the seed, not --requests (repeatable)"
    )
    p.add_argument("--deadline-s", type=float, default=60.0, help="client deadline of each request (default 60)")
    p.add_argument("--model", default=None, help="model of the local mesh (default SmolLM2-135M-Instruct)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--http",
        action="store_true",
        help="fuzz the HTTP front instead: every field of chat completions, completions, Responses and Messages, "
        "headers, bodies at and past their bounds, clients that leave (bench/fuzz_http.py)",
    )
    p.add_argument("--http-url", default="", help="with --http and --gateway: the gateway's HTTP API base URL")
    p.add_argument(
        "--max-requests-per-key",
        type=int,
        default=0,
        help="with --http: the gateway's bound of requests in flight per key, for the open-streams probe "
        "(default: a local mesh's gateway is given --concurrency + 16; with --gateway, 0 leaves the probe out)",
    )


if __name__ == "__main__":
    from kvmesh.commands import Command

    sys.exit(Command(__doc__.splitlines()[0], add_arguments, run).main("kvmesh fuzz"))
