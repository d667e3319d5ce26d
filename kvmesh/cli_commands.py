"""What each of the `kvmesh` command's own subcommands does, given its parsed flags (the flags
are declared in kvmesh/cli.py): generate, up, serve (a service, or an expert-parallel rank),
warm, eplb plan and eplb stats. Each, `_cmd_<command>`, is its parser's `func` (private: only
kvmesh/cli.py calls them) and returns the process's exit status."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import NoReturn

import grpc


def _cmd_generate(args: argparse.Namespace) -> int:
    """Stream an answer from a gateway to stdout; errors go to stderr with status 1."""
    state = {"printed": False}
    try:
        return asyncio.run(_generate(args, state))
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except grpc.aio.AioRpcError as exc:
        hint = ""
        if exc.code() == grpc.StatusCode.UNAVAILABLE and "connect" in (exc.details() or ""):
            hint = f"\nno gateway answers at {args.gateway}: start one with `kvmesh up` or pass --gateway HOST:PORT"
        lead = "\n" if state["printed"] else ""  # a stream cut mid-answer: start a new line
        print(f"{lead}error: {exc.code().name}: {exc.details()}{hint}", file=sys.stderr)
        return 1


async def _generate(args: argparse.Namespace, state: dict[str, bool]) -> int:
    """`kvmesh generate`'s stream; state["printed"] turns True once text was written."""
    from kvmesh.client import GatewayClient, make_request

    ca = None
    if args.tls_ca:
        with open(args.tls_ca, "rb") as f:
            ca = f.read()
    async with GatewayClient(args.gateway, args.api_key, ca) as client:
        chat = args.chat
        if chat is None:
            chat = (await client.list_models()).has_chat_template
        # argv that is not UTF-8 travels as its raw bytes; the gateway says what is wrong
        prompt = args.prompt.encode("utf-8", "surrogateescape")
        request = make_request(
            prompt,
            chat=chat,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            stop=args.stop or [],
            model=args.model or "",
        )
        async for msg in client.stream(request):
            if msg.HasField("delta"):
                sys.stdout.write(msg.delta.text)
                sys.stdout.flush()
                state["printed"] = True
            elif args.verbose:
                _print_final(msg.final)
        print()
    return 0


def _print_final(f) -> None:
    """The final message's counts, timings and instances, to stderr (`generate -v`)."""
    print(
        f"\n[{f.finish_reason}: {f.prompt_tokens} prompt ({f.cached_tokens} cached), "
        f"{f.generated_tokens} generated, TTFT {f.ttft_s * 1000:.0f} ms, "
        f"ITL {f.itl_s * 1000:.1f} ms, prefill {f.prefill_instance}, decode {f.decode_instance}"
        + (f", drafts {f.accepted_tokens}/{f.drafted_tokens} accepted" if f.drafted_tokens else "")
        + "]",
        file=sys.stderr,
    )


def _cmd_up(args: argparse.Namespace) -> int:
    from kvmesh.up import run_up

    try:
        return run_up(
            args.prefill,
            args.decode,
            args.model,
            args.port,
            args.prefill_threads,
            args.decode_threads,
            args.speculative,
            args.num_draft_tokens,
            args.http_port,
            args.decode_ep,
            args.dtype,
            (args.slo_ttft_ms, args.slo_itl_ms),
            _autoscale_bounds(args),
            quantization=args.quantization,
        )
    except (ValueError, RuntimeError, FileNotFoundError, TimeoutError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def _autoscale_bounds(args: argparse.Namespace) -> tuple[int, int] | None:
    """`kvmesh up`'s (most prefill, most decode) with --autoscale (4 each by default), else None.
    Raises ValueError for a bound given without --autoscale, where it would do nothing."""
    if not args.autoscale:
        if args.max_prefill is not None or args.max_decode is not None:
            raise ValueError("--max-prefill / --max-decode bound --autoscale: add --autoscale, or leave them out")
        return None
    return (4 if args.max_prefill is None else args.max_prefill, 4 if args.max_decode is None else args.max_decode)


def _cmd_serve(args: argparse.Namespace) -> int:
    import faulthandler
    import importlib

    from kvmesh.launcher import die_with_parent

    die_with_parent()
    if args.log_format not in ("text", "json"):
        print(f"error: --log-format must be text or json, got {args.log_format!r}", file=sys.stderr)
        return 2
    os.environ["KVMESH_LOG_FORMAT"] = args.log_format  # read by the service's setup_logging
    if args.service == "prefill":
        # before torch (and its OpenMP runtime) loads: prefill's idle OpenMP threads must not
        # spin, which starves a decode service on the same cores (16-request rounds on 2 cores:
        # TTFT up to 5-7 s with libgomp's default spinning, 0.6-1.6 s with sleeping threads);
        # but between the back-to-back parallel regions of one chunk's GEMMs (oneDNN) a short
        # spin, ~10k iterations, saves each region a wake-up: 2048 tokens in 512-token chunks,
        # 690 tok/s with OMP_WAIT_POLICY=PASSIVE, 744-788 with GOMP_SPINCOUNT=10000
        if "OMP_WAIT_POLICY" not in os.environ:
            os.environ.setdefault("GOMP_SPINCOUNT", "10000")
    faulthandler.enable()  # a crash in native code prints every thread's Python stack to the log
    try:
        importlib.import_module(f"{args.service_module}.main").main(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    _exit_now(0)


def _exit_now(code: int) -> NoReturn:
    """Leave a service process that has shut down in order (registry left, requests drained,
    UCX, Redis and the ranks released, traces flushed) without the interpreter's finalization:
    native threads still alive then (UCX's progress thread, gRPC's pollers, OpenMP teams) can
    touch Python objects being torn down; a decode died with SIGSEGV in libpython at that point
    during a rolling restart (2026-12-04), after its last request had been served."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _cmd_serve_ep_rank(args: argparse.Namespace) -> int:
    import faulthandler
    import logging
    import multiprocessing

    from kvmesh.decode_svc.ep import serve_rank
    from kvmesh.launcher import die_with_parent

    die_with_parent()
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s ep-rank-{args.rank} %(levelname)s %(name)s: %(message)s"
    )
    faulthandler.enable()
    try:
        code = serve_rank(args.model, args.ep_init_addr, args.rank, args.torch_threads, args.join_timeout)
    except SystemExit as exc:  # this rank's step failed (it said why): leave as below, with its status
        code = exc.code if isinstance(exc.code, int) else 1
    except multiprocessing.AuthenticationError:
        print(f"error: the decode at {args.ep_init_addr} refused this rank's KVMESH_EP_SECRET", file=sys.stderr)
        return 2
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    _exit_now(code)  # the world is over: its gloo and link threads need no teardown


def _cmd_warm(args: argparse.Namespace) -> int:
    from kvmesh.warm import warm

    try:
        seconds = warm(args.model)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"warm: {args.model or 'the default model'} converted and its kernels compiled ({seconds:.1f} s)")
    return 0


def _cmd_eplb_plan(args: argparse.Namespace) -> int:
    from kvmesh.eplb_tool import run

    return run(args)


def _cmd_eplb_stats(args: argparse.Namespace) -> int:
    from kvmesh.eplb_tool import run_stats

    return run_stats(args)
