"""The lab's `kvmesh` subcommands: `bench`, `bench-v4`, `bench-transfer`, `bench-peer`, `routesim`, `fuzz`,
`soak`, `make-tiny-model`.

pyproject.toml registers each object below under the entry-point group ``kvmesh.commands``;
`kvmesh.cli` finds them there (kvmesh/commands.py), so the product never imports bench/. Each
command's module is imported only when its flags are added or it runs, so one broken module
costs only its own command, and nothing here loads torch while `kvmesh up` builds its parser.
"""

from __future__ import annotations

import argparse
import sys

from kvmesh.commands import Command


def _bench_arguments(parser: argparse.ArgumentParser) -> None:
    from kvmesh.bench.trace import add_arguments as add_trace_arguments

    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens each request decodes (default 64)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per concurrency level; the median counts")
    parser.add_argument("--model", default=None)
    parser.add_argument(
        "--speculative",
        action="store_true",
        help="single-stream decode with and without n-gram speculation, quoting and plain prompts",
    )
    parser.add_argument("--num-draft-tokens", type=int, default=4, help="with --speculative: drafts a step (default 4)")
    parser.add_argument(
        "--pull",
        action="store_true",
        help="prefill pulling a prefix from a peer against computing it, per prompt length (bench/pull.py)",
    )
    parser.add_argument(
        "--pull-lengths", default="256,1024,2048", help="with --pull: prompt lengths, tokens, comma-separated"
    )
    parser.add_argument(
        "--fields",
        action="store_true",
        help="n choices against n requests, and one stream plain / with logprobs / under a grammar (bench/fields.py)",
    )
    parser.add_argument("--fields-prompt", type=int, default=512, help="with --fields: prompt tokens (default 512)")
    add_trace_arguments(parser)


def _bench(args: argparse.Namespace) -> int:
    if args.fields:
        from kvmesh.bench.fields import run_fields_bench

        return run_fields_bench(args)
    if args.pull:
        from kvmesh.bench.pull import run_pull_bench

        return run_pull_bench(args)
    if args.speculative:
        from kvmesh.bench.speculative import run_speculative_bench

        return run_speculative_bench(args)
    if args.trace and args.multiturn:
        from kvmesh.bench.multiturn import run_multiturn_bench

        return run_multiturn_bench(args)
    if args.trace:
        from kvmesh.bench.trace import run_trace_bench

        return run_trace_bench(args)
    from kvmesh.bench.mesh import run_bench

    return run_bench(args)


def _bench_v4_arguments(parser: argparse.ArgumentParser) -> None:
    from kvmesh.bench.v4 import add_arguments

    add_arguments(parser)


def _bench_v4(args: argparse.Namespace) -> int:
    from kvmesh.bench.v4 import run_bench_v4

    return run_bench_v4(args)


def _bench_transfer_arguments(parser: argparse.ArgumentParser) -> None:
    from kvmesh.bench.transfer import add_arguments

    add_arguments(parser)


def _bench_transfer(args: argparse.Namespace) -> int:
    from kvmesh.bench.transfer import run

    return run(args)


def _bench_peer_arguments(parser: argparse.ArgumentParser) -> None:
    from kvmesh.bench.peer import add_arguments

    add_arguments(parser)


def _bench_peer(args: argparse.Namespace) -> int:
    from kvmesh.bench.peer import run

    return run(args)


def _routesim_arguments(parser: argparse.ArgumentParser) -> None:
    from kvmesh.bench.routesim import add_arguments

    add_arguments(parser)


def _routesim(args: argparse.Namespace) -> int:
    from kvmesh.bench.routesim import run

    try:
        return run(args)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _fuzz_arguments(parser: argparse.ArgumentParser) -> None:
    from kvmesh.bench.fuzz import add_arguments

    add_arguments(parser)


def _fuzz(args: argparse.Namespace) -> int:
    from kvmesh.bench.fuzz import run

    return run(args)


def _soak_arguments(parser: argparse.ArgumentParser) -> None:
    from kvmesh.bench.soak.options import add_arguments

    add_arguments(parser)


def _soak(args: argparse.Namespace) -> int:
    from kvmesh.bench.soak.run import run

    return run(args)


def _make_tiny_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arch", required=True, choices=["deepseek_v4"], help="model architecture")
    parser.add_argument("--seed", type=int, default=0, help="weights seed (default 0)")
    parser.add_argument(
        "--skew-routers",
        type=float,
        default=0.0,
        help="make experts 0 and 1 hot in every MoE layer, as trained routers are (0: random routers; 0.12 gives "
        "balancedness ~0.4 at 4 ranks on real text), for EPLB",
    )
    parser.add_argument(
        "--mtp",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="write a random multi-token-prediction module (mtp.0.*, for --speculative mtp; default on)",
    )
    parser.add_argument("out_dir", help="folder to write config.json, model.safetensors and the tokenizer into")


def _make_tiny_model(args: argparse.Namespace) -> int:
    from kvmesh.bench.tiny_models import make_tiny_model

    try:
        print(make_tiny_model(args.arch, args.out_dir, seed=args.seed, skew_routers=args.skew_routers, mtp=args.mtp))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


BENCH = Command("decode speed vs transformers, TTFT, at 1/4/16 concurrent requests", _bench_arguments, _bench)
BENCH_V4 = Command(
    "DeepSeek-V4 tiny config: 8-concurrent decode and 2K prefill vs transformers", _bench_v4_arguments, _bench_v4
)
BENCH_TRANSFER = Command(
    "KV push between two processes next to memcpy and Mooncake TE (GB/s)", _bench_transfer_arguments, _bench_transfer
)
BENCH_PEER = Command(
    "kvmesh and vLLM's CPU build in turn through `vllm bench serve`: tok/s, TTFT, TPOT, ITL and ratios",
    _bench_peer_arguments,
    _bench_peer,
)
ROUTESIM = Command(
    "replay a Mooncake trace against the routing policies (simulated instances): hit rate vs oracle, "
    "balancedness, queueing",
    _routesim_arguments,
    _routesim,
)
FUZZ = Command(
    "random and hostile requests against a gateway: counts by status, fails on UNKNOWN/INTERNAL or a mesh "
    "that stops answering",
    _fuzz_arguments,
    _fuzz,
)
SOAK = Command(
    "every feature under faults on a multi-host mesh for --duration seconds: nothing hung, wrong, crashed or leaked",
    _soak_arguments,
    _soak,
)
MAKE_TINY_MODEL = Command(
    "write a small random checkpoint (DeepSeek-V4 as transformers defines it) for tests and benchmarks",
    _make_tiny_model_arguments,
    _make_tiny_model,
)
