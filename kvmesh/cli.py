"""The `kvmesh` command: up, generate, serve, warm, eplb, and the subcommands other
packages register (kvmesh/commands.py; the lab's `kvmesh bench`, `routesim`, `fuzz`)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import NoReturn

import grpc

from kvmesh.commands import add_plugin_commands
from kvmesh.runtime import settings
from kvmesh.runtime.settings import env_flag


def _seed(value: str) -> int:
    seed = int(value)
    if not 0 <= seed < 2**63:
        raise argparse.ArgumentTypeError(f"seed must be in [0, 2**63), got {seed}")
    return seed


def _cmd_generate(args: argparse.Namespace) -> int:
    from kvmesh.client import GatewayClient, make_request

    state = {"printed": False}

    async def run() -> int:
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
                    f = msg.final
                    print(
                        f"\n[{f.finish_reason}: {f.prompt_tokens} prompt ({f.cached_tokens} cached), "
                        f"{f.generated_tokens} generated, TTFT {f.ttft_s * 1000:.0f} ms, "
                        f"ITL {f.itl_s * 1000:.1f} ms, prefill {f.prefill_instance}, decode {f.decode_instance}"
                        + (f", drafts {f.accepted_tokens}/{f.drafted_tokens} accepted" if f.drafted_tokens else "")
                        + "]",
                        file=sys.stderr,
                    )
            print()
        return 0

    try:
        return asyncio.run(run())
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
        )
    except (ValueError, RuntimeError, FileNotFoundError, TimeoutError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


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


def build_parser(with_plugins: bool = True) -> argparse.ArgumentParser:
    """The whole command line (also used by tests to check compose's commands); with_plugins=False
    leaves out the commands other packages add (kvmesh.commands)."""
    from kvmesh.decode_svc import config as decode_config
    from kvmesh.gateway import config as gateway_config
    from kvmesh.prefill_svc import config as prefill_config

    parser = argparse.ArgumentParser(
        prog="kvmesh",
        description="kvmesh: an LLM serving mesh with disaggregated prefill and decode. "
        "Start a local mesh with `kvmesh up`, then ask it with `kvmesh generate PROMPT`.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start a local mesh (Redis, prefill, decode, gateway) until Ctrl-C")
    up.add_argument("--prefill", type=int, default=1, help="prefill instances (default 1)")
    up.add_argument("--decode", type=int, default=1, help="decode instances (default 1)")
    up.add_argument("--model", default=None, help="model name or path (default SmolLM2-135M-Instruct)")
    up.add_argument("--port", type=int, default=50051, help="gateway port (default 50051)")
    up.add_argument(
        "--http-port",
        type=gateway_config.port_or_off,
        default=8000,
        help="the gateway's OpenAI-compatible HTTP port (default 8000; 0 or off: none)",
    )
    up.add_argument(
        "--prefill-threads",
        type=int,
        default=0,
        help="model threads of each prefill (default 0: every core; prefill's idle threads wait passively)",
    )
    up.add_argument(
        "--decode-threads",
        type=int,
        default=0,
        help="model threads of each decode (default 0: every core)",
    )
    up.add_argument(
        "--speculative",
        default="off",
        choices=["off", "ngram", "mtp"],
        help="speculative decoding on every decode (default off; ngram: prompt-lookup drafts; mtp: a DeepSeek-V4 "
        "checkpoint's multi-token-prediction module; the same output either way)",
    )
    up.add_argument("--num-draft-tokens", type=int, default=4, help="most draft tokens a step (default 4)")
    up.add_argument(
        "--decode-ep",
        type=int,
        default=1,
        help="expert-parallel ranks of each decode (MoE models; default 1: single-process decode)",
    )
    up.set_defaults(func=_cmd_up)

    gen = sub.add_parser("generate", help="stream an answer from a gateway")
    gen.add_argument("prompt")
    env_flag(gen, "--gateway", "KVMESH_GATEWAY", "127.0.0.1:50051", "gateway address HOST:PORT")
    env_flag(gen, "--api-key", "KVMESH_API_KEY", "", "API key of a gateway that needs one (better in the variable)")
    env_flag(gen, "--tls-ca", "KVMESH_TLS_CA", "", "PEM certificate(s) to trust for a gateway serving TLS")
    gen.add_argument("--max-tokens", type=int, default=None, help="tokens to generate (default: the gateway's, 256)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default 0)")
    gen.add_argument("--top-p", type=float, default=None, help="nucleus mass in (0, 1] (default 1)")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 is off (default 0)")
    gen.add_argument("--seed", type=_seed, default=None, help="sampling seed in [0, 2**63)")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--model", default=None)
    gen.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="apply the chat template (default: on when the model has one)",
    )
    gen.add_argument(
        "-v", "--verbose", action="store_true", help="print token counts, timings and the instances used (to stderr)"
    )
    gen.set_defaults(func=_cmd_generate)

    serve = sub.add_parser("serve", help="run one service (for deployments across machines)")
    kinds = serve.add_subparsers(dest="service", required=True)
    for name, module, config_cls in (
        ("gateway", gateway_config, gateway_config.GatewayConfig),
        ("prefill", prefill_config, prefill_config.PrefillConfig),
        ("decode", decode_config, decode_config.DecodeConfig),
    ):
        p = kinds.add_parser(name, help=f"the {name} service")
        settings.add_arguments(p, config_cls)
        env_flag(p, "--log-format", "KVMESH_LOG_FORMAT", "text", "text for people, json for machines")
        p.set_defaults(func=_cmd_serve, service_module=module.__package__, config_cls=config_cls)
    rank = kinds.add_parser("ep-rank", help="one expert-parallel rank of a decode on another host (its --ep-init-addr)")
    rank.add_argument("--ep-init-addr", required=True, metavar="HOST:PORT", help="the decode's --ep-init-addr")
    rank.add_argument("--rank", type=int, required=True, help="this rank, 1..N-1 of the decode's --ep N")
    rank.add_argument(
        "--model", required=True, help="this host's copy of the decode's model (a path; the same config.json)"
    )
    rank.add_argument("--torch-threads", type=int, default=0, help="torch threads (0: the decode's setting)")
    rank.add_argument(
        "--join-timeout", type=float, default=600.0, help="seconds to keep trying to reach the decode (default 600)"
    )
    rank.set_defaults(func=_cmd_serve_ep_rank)

    warm = sub.add_parser("warm", help="convert a model and compile its kernels now, into the cache every clone shares")
    warm.add_argument("--model", default=None, help="a path or name (default: SmolLM2-135M-Instruct)")
    warm.set_defaults(func=_cmd_warm)

    from kvmesh.eplb_tool import add_arguments as add_eplb_arguments
    from kvmesh.eplb_tool import add_stats_arguments as add_eplb_stats_arguments

    eplb = sub.add_parser("eplb", help="expert-parallel load balancing (DeepSeek's EPLB)")
    eplb_sub = eplb.add_subparsers(dest="eplb_command", required=True)
    eplb_plan = eplb_sub.add_parser("plan", help="a placement from per-expert token counts, balancedness before/after")
    add_eplb_arguments(eplb_plan)
    eplb_plan.set_defaults(func=_cmd_eplb_plan)
    eplb_stats = eplb_sub.add_parser("stats", help="record live instances' per-expert token counts")
    add_eplb_stats_arguments(eplb_stats)
    eplb_stats.set_defaults(func=_cmd_eplb_stats)

    # the lab's commands (`kvmesh bench`, `routesim`, `fuzz`, ...), which live in bench/ and
    # register themselves as entry points: the product never imports them
    if with_plugins:
        add_plugin_commands(sub)
    return parser


OWN_COMMANDS = ("up", "generate", "serve", "warm", "eplb")
"""The commands build_parser adds itself (a test keeps this list equal to them)."""


def _own_command(argv: list[str]) -> bool:
    """argv names one of kvmesh's own commands (`serve`, `up`, ...), not one a plugin adds."""
    return bool(argv) and argv[0] in OWN_COMMANDS


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # every service process starts as `kvmesh serve ...`: it skips the scan of the installed
    # packages for plugin commands (0.1-0.3 s a process)
    args = build_parser(with_plugins=not _own_command(argv)).parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
