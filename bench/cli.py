"""The lab's `kvmesh` subcommands: `bench`, `bench-v4`, `bench-transfer`, `routesim`, `fuzz`.

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
    from bench.trace import add_arguments as add_trace_arguments

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
        from bench.fields import run_fields_bench

        return run_fields_bench(args)
    if args.pull:
        from bench.pull import run_pull_bench

        return run_pull_bench(args)
    if args.speculative:
        from bench.speculative import run_speculative_bench

        return run_speculative_bench(args)
    if args.trace and args.multiturn:
        from bench.multiturn import run_multiturn_bench

        return run_multiturn_bench(args)
    if args.trace:
        from bench.trace import run_trace_bench

        return run_trace_bench(args)
    from bench.mesh import run_bench

    return run_bench(args)


def _bench_v4_arguments(parser: argparse.ArgumentParser) -> None:
    from bench.v4 import add_arguments

    add_arguments(parser)


def _bench_v4(args: argparse.Namespace) -> int:
    from bench.v4 import run_bench_v4

    return run_bench_v4(args)


def _bench_transfer_arguments(parser: argparse.ArgumentParser) -> None:
    from bench.transfer import add_arguments

    add_arguments(parser)


def _bench_transfer(args: argparse.Namespace) -> int:
    from bench.transfer import run

    return run(args)


def _bench_peer_arguments(parser: argparse.ArgumentParser) -> None:
    from bench.peer import add_arguments

    add_arguments(parser)


def _bench_peer(args: argparse.Namespace) -> int:
    from bench.peer import run

    return run(args)


def _routesim_arguments(parser: argparse.ArgumentParser) -> None:
    from bench.routesim import add_arguments

    add_arguments(parser)


def _routesim(args: argparse.Namespace) -> int:
    from bench.routesim import run

    try:
        return run(args)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _fuzz_arguments(parser: argparse.ArgumentParser) -> None:
    from bench.fuzz import add_arguments

    add_arguments(parser)


def _fuzz(args: argparse.Namespace) -> int:
    from bench.fuzz import run

    return run(args)


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
