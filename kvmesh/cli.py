"""The `kvmesh` command: up, generate, serve, warm, eplb, and the subcommands other
packages register (kvmesh/commands.py; the lab's `kvmesh bench`, `routesim`, `fuzz`).

This module declares the flags, one function a subcommand; what each one does is in
kvmesh/cli_commands.py."""

from __future__ import annotations

import argparse
import os
import sys

from kvmesh.cli_commands import (
    _cmd_eplb_plan,
    _cmd_eplb_stats,
    _cmd_generate,
    _cmd_serve,
    _cmd_serve_ep_rank,
    _cmd_up,
    _cmd_warm,
)
from kvmesh.commands import add_plugin_commands
from kvmesh.runtime import settings
from kvmesh.runtime.settings import env_flag

Subparsers = argparse._SubParsersAction
"""What `add_subparsers` returns: the set of subcommands each `_add_*` adds one to."""


def _seed(value: str) -> int:
    seed = int(value)
    if not 0 <= seed < 2**63:
        raise argparse.ArgumentTypeError(f"seed must be in [0, 2**63), got {seed}")
    return seed


def build_parser(with_plugins: bool = True) -> argparse.ArgumentParser:
    """The whole command line (also used by tests to check compose's commands); with_plugins=False
    leaves out the commands other packages add (kvmesh.commands)."""
    parser = argparse.ArgumentParser(
        prog="kvmesh",
        description="kvmesh: an LLM serving mesh with disaggregated prefill and decode. "
        "Start a local mesh with `kvmesh up`, then ask it with `kvmesh generate PROMPT`.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_up(sub)
    _add_generate(sub)
    _add_serve(sub)
    _add_warm(sub)
    _add_eplb(sub)
    _add_plan(sub)
    # the lab's commands (`kvmesh bench`, `routesim`, `fuzz`, ...), which live in bench/ and
    # register themselves as entry points: the product never imports them
    if with_plugins:
        add_plugin_commands(sub)
    return parser


def _add_up(sub: Subparsers) -> None:
    from kvmesh.gateway import config as gateway_config

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
    up.add_argument(
        "--dtype",
        default=os.environ.get("KVMESH_DTYPE", "auto"),
        help="what every prefill and decode computes in: auto (bfloat16 where the hardware has it natively, "
        "else float32), float32 or bfloat16 (env KVMESH_DTYPE; default auto; docs/precision.md)",
    )
    up.add_argument(
        "--quantization",
        default=os.environ.get("KVMESH_QUANTIZATION", "none"),
        help="every prefill's and decode's matmul activations: none (as --dtype) or int8 (W4A8 against the GGUF "
        "file's Q4_1 layers; Llama on the CPU) (env KVMESH_QUANTIZATION; default none; docs/precision.md)",
    )
    up.add_argument("--slo-ttft-ms", type=float, default=0.0, help="the gateway's TTFT target (ms; default 0: none)")
    up.add_argument("--slo-itl-ms", type=float, default=0.0, help="the gateway's ITL target (ms; default 0: none)")
    up.add_argument(
        "--autoscale",
        action="store_true",
        help="add and drain instances as the gateway advises against the SLO (needs --slo-ttft-ms or --slo-itl-ms)",
    )
    up.add_argument(
        "--max-prefill", type=int, default=None, help="with --autoscale: most prefill instances (default 4)"
    )
    up.add_argument("--max-decode", type=int, default=None, help="with --autoscale: most decode instances (default 4)")
    up.set_defaults(func=_cmd_up)


def _add_generate(sub: Subparsers) -> None:
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


def _add_serve(sub: Subparsers) -> None:
    from kvmesh.decode_svc import config as decode_config
    from kvmesh.gateway import config as gateway_config
    from kvmesh.prefill_svc import config as prefill_config

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
    _add_serve_ep_rank(kinds)


def _add_serve_ep_rank(kinds: Subparsers) -> None:
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


def _add_warm(sub: Subparsers) -> None:
    warm = sub.add_parser("warm", help="convert a model and compile its kernels now, into the cache every clone shares")
    warm.add_argument("--model", default=None, help="a path or name (default: SmolLM2-135M-Instruct)")
    warm.set_defaults(func=_cmd_warm)


def _add_eplb(sub: Subparsers) -> None:
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


def _add_plan(sub: Subparsers) -> None:
    from kvmesh.planner import command

    plan = sub.add_parser("plan", help="size a mesh to a workload and an SLO (prefill, decode, chunk, batch cap)")
    command.add_arguments(plan)
    plan.set_defaults(func=command.run)


OWN_COMMANDS = ("up", "generate", "serve", "warm", "eplb", "plan")
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
