"""`kvmesh plan`: how many prefill and decode instances, which chunk size and decode batch cap
serve a workload within an SLO at the least cost, with the TTFT and ITL it predicts; `--apply`
starts that mesh (`kvmesh up`).

    kvmesh plan --rate 0.5 --requests 200 --input-lengths 64:0.35,256:0.3,768:0.2,1536:0.15 \\
                --output-lengths 64 --slo-ttft-ms 3000 --slo-itl-ms 600 [--save-profile p.json]
    kvmesh plan --trace trace.jsonl --scale-tokens 32 --speedup 4 --profile p.json --apply

Without --profile it measures one first (kvmesh.planner.measure) on a mesh of one prefill and
one decode of --model that it starts on free ports and stops.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from kvmesh.planner.profile import Profile, load_profile
from kvmesh.planner.search import BATCH_CAPS, CHUNKS, Candidate, Slo, plan
from kvmesh.planner.simulate import MeshShape
from kvmesh.planner.workload import Workload, parse_lengths, synthetic, trace_workload

MAX_REQUESTS = 20_000
"""Requests a synthetic workload may have: each shape tried simulates all of them (seconds each)."""
MAX_INSTANCES = 32
"""Instances of a role the search may try (up to 32 x 32 counts, 25 shapes each)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("workload (a trace, or a rate and length distributions)")
    w.add_argument(
        "--trace", default="", help="a Mooncake-format JSONL trace (timestamp, input/output_length, hash_ids)"
    )
    w.add_argument("--limit", type=int, default=0, help="the trace's first N requests (default 0: all)")
    w.add_argument("--speedup", type=float, default=1.0, help="divide the trace's arrival times by this (default 1)")
    w.add_argument("--scale-tokens", type=int, default=0, help="tokens a trace block stands for (default 0: 512)")
    w.add_argument("--rate", type=float, default=0.0, help="requests/s, Poisson arrivals (no --trace)")
    w.add_argument("--requests", type=int, default=200, help="requests to plan over (default 200)")
    w.add_argument("--input-lengths", default="256", help="prompt tokens, TOKENS[:WEIGHT],... (default 256)")
    w.add_argument("--output-lengths", default="64", help="answer tokens, TOKENS[:WEIGHT],... (default 64)")
    w.add_argument("--shared-prefix-tokens", type=int, default=0, help="tokens of the shared system prompts")
    w.add_argument("--shared-share", type=float, default=0.0, help="share of prompts opening with one (0-1)")
    w.add_argument("--seed", type=int, default=0)
    s = p.add_argument_group("the target")
    s.add_argument("--slo-ttft-ms", type=float, required=True, help="TTFT target (ms)")
    s.add_argument("--slo-itl-ms", type=float, required=True, help="ITL target, a request's mean (ms)")
    s.add_argument("--percentile", type=float, default=90.0, help="share of requests meeting both (default 90)")
    m = p.add_argument_group("the mesh")
    m.add_argument("--profile", default="", help="a profile saved by --save-profile (default: measure one now)")
    m.add_argument("--save-profile", default="", help="write the measured profile here")
    m.add_argument("--model", default=None, help="the model to measure (default: kvmesh up's)")
    m.add_argument("--dtype", default=os.environ.get("KVMESH_DTYPE", "auto"), help="what it computes in (default auto)")
    m.add_argument("--max-prefill", type=int, default=4, help="most prefill instances (default 4)")
    m.add_argument("--max-decode", type=int, default=4, help="most decode instances (default 4)")
    m.add_argument("--prefill-cost", type=float, default=1.0, help="an instance's cost, to weigh (default 1)")
    m.add_argument("--decode-cost", type=float, default=1.0, help="an instance's cost, to weigh (default 1)")
    m.add_argument(
        "--dedicated",
        action="store_true",
        help="plan for instances on devices of their own (a cluster); default: one host's cores, as measured",
    )
    p.add_argument("--json", default="", help="write the plan and its predicted figures here")
    p.add_argument("--apply", action="store_true", help="start the planned mesh (`kvmesh up`) until Ctrl-C")


def workload_of(args: argparse.Namespace) -> Workload:
    """The workload the flags describe. Raises ValueError for neither or both sources."""
    if args.trace and args.rate:
        raise ValueError("give one workload: --trace PATH or --rate R, not both")
    if not args.trace and not args.rate:
        raise ValueError("give a workload: --trace PATH, or --rate R (with --input-lengths / --output-lengths)")
    if args.rate < 0:
        raise ValueError(f"--rate must be > 0 requests/s, got {args.rate}")
    if not 0 <= args.shared_share <= 1:
        raise ValueError(f"--shared-share must be in [0, 1], got {args.shared_share}")
    if not 1 <= args.requests <= MAX_REQUESTS:
        raise ValueError(f"--requests must be in [1, {MAX_REQUESTS}], got {args.requests}")
    if args.trace:
        return trace_workload(args.trace, args.limit, args.speedup, args.scale_tokens)
    return synthetic(
        args.rate,
        args.requests,
        parse_lengths(args.input_lengths),
        parse_lengths(args.output_lengths),
        args.shared_prefix_tokens,
        args.shared_share,
        seed=args.seed,
    )


def up_command(shape: MeshShape) -> tuple[dict[str, str], list[str]]:
    """(the environment, the `kvmesh up` flags) that start a mesh of `shape`."""
    env = {
        "KVMESH_CHUNKED_PREFILL_SIZE": str(shape.chunk_tokens),
        "KVMESH_MAX_BATCH_TOKENS": str(shape.chunk_tokens),
        "KVMESH_MAX_BATCH_SIZE": str(shape.max_batch_size),
    }
    return env, ["--prefill", str(shape.num_prefill), "--decode", str(shape.num_decode)]


def run(args: argparse.Namespace) -> int:
    try:
        workload = workload_of(args)
        slo = Slo(args.slo_ttft_ms / 1000, args.slo_itl_ms / 1000, args.percentile)
        if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
            raise ValueError(f"--json {args.json}: its folder does not exist")
        if not (1 <= args.max_prefill <= MAX_INSTANCES and 1 <= args.max_decode <= MAX_INSTANCES):
            raise ValueError(f"--max-prefill / --max-decode must be in [1, {MAX_INSTANCES}]")
        if args.apply and args.dedicated:
            raise ValueError("--apply starts a mesh on this host's cores: leave out --dedicated")
        profile = load_profile(args.profile) if args.profile else _measure(args)
        if args.save_profile:
            profile.save(args.save_profile)
        best, tried = plan(
            workload,
            profile,
            slo,
            args.max_prefill,
            args.max_decode,
            args.prefill_cost,
            args.decode_cost,
            CHUNKS,
            BATCH_CAPS,
            False if args.dedicated else None,
        )
    except (ValueError, RuntimeError, TimeoutError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    _print(workload, profile, slo, best, tried)
    if args.json:
        try:
            with open(args.json, "w") as f:
                json.dump(_as_json(workload, slo, best, tried), f, indent=2)
        except OSError as exc:
            print(f"error: --json {args.json}: {exc.strerror}", file=sys.stderr)
            return 1
    if best is None:
        return 1
    if args.apply:
        from kvmesh.up import run_up

        env, _ = up_command(best.shape)
        os.environ.update(env)
        return run_up(best.shape.num_prefill, best.shape.num_decode, args.model, 50051, dtype=args.dtype)
    return 0


def _measure(args: argparse.Namespace) -> Profile:
    """Measure the profile on meshes of one prefill and one decode on free ports, at two chunk
    sizes, one after the other (kvmesh.planner.measure.measure)."""
    from kvmesh import launcher
    from kvmesh.planner.measure import measure
    from kvmesh.redis_server import free_port

    chunk = int(os.environ.get("KVMESH_CHUNKED_PREFILL_SIZE", launcher.SHARED_CORES_FORWARD_TOKENS))
    print(f"measuring a profile: 1 prefill, 1 decode of {args.model or 'the default model'} ...", flush=True)

    def start(env: dict[str, str]) -> launcher.Mesh:
        return launcher.start_mesh(
            1,
            1,
            args.model,
            port=free_port("127.0.0.1"),
            extra_prefill_args=["--dtype", args.dtype],
            extra_decode_args=["--dtype", args.dtype],
            env=env,
            log=open(os.devnull, "w"),  # noqa: SIM115 (the children hold it; closed with them)
        )

    return measure(start, chunk, args.seed, {"model": args.model or "default", "dtype": args.dtype})


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:,.0f} ms"


def _print(workload: Workload, profile: Profile, slo: Slo, best: Candidate | None, tried: list[Candidate]) -> None:
    prompts = sorted(r.input_tokens for r in workload.requests)
    print(
        f"workload: {len(prompts)} requests over {workload.duration_s:,.0f} s ({workload.rate:.2f}/s), "
        f"prompts p50 {prompts[(len(prompts) - 1) // 2]} / mean {sum(prompts) / len(prompts):,.0f} / max "
        f"{prompts[-1]} tokens"
    )
    print(
        f"profile: forward {_ms(profile.per_forward_s)} + {profile.per_token_s * 1e6:.0f} us/token, first token "
        f"+{_ms(profile.first_token_s)}; decode step {_ms(profile.step_s)} + {_ms(profile.per_row_s)}/row "
        f"({', '.join(f'{k} {v}' for k, v in profile.about.items())})"
    )
    print(f"SLO: TTFT <= {_ms(slo.ttft_s)} and ITL <= {_ms(slo.itl_s)} for {slo.percentile:g}% of requests")
    shown = {}
    for c in tried:  # the best of each instance count tried, to compare (the plan's own for its count)
        key = (c.shape.num_prefill, c.shape.num_decode)
        if key not in shown or _key(c, slo) < _key(shown[key], slo):
            shown[key] = c
    if best is not None:
        shown[(best.shape.num_prefill, best.shape.num_decode)] = best
    print(f"{'mesh':<34} {'meets':<6} {'TTFT p50':>10} {'p99':>10} {'ITL p50':>10} {'p99':>10}")
    for c in sorted(shown.values(), key=lambda c: (c.cost, c.shape.num_prefill)):
        f = c.figures()
        print(
            f"{str(c.shape):<34} {'yes' if c.meets else 'no':<6} {_ms(f['ttft_p50_s']):>10} {_ms(f['ttft_p99_s']):>10} "
            f"{_ms(f['itl_p50_s']):>10} {_ms(f['itl_p99_s']):>10}"
        )
    if best is None:
        print("plan: no mesh up to the caps meets the SLO (raise --max-prefill / --max-decode, or the SLO)")
        return
    env, flags = up_command(best.shape)
    print(f"plan: {best.shape} (cost {best.cost:g})")
    print(f"start it: {' '.join(f'{k}={v}' for k, v in env.items())} kvmesh up {' '.join(flags)}")


def _key(c: Candidate, slo: Slo) -> tuple[bool, float]:
    return (not c.meets, c.result.percentile("ttft", slo.percentile))


def _as_json(workload: Workload, slo: Slo, best: Candidate | None, tried: list[Candidate]) -> dict:
    def one(c: Candidate) -> dict:
        s = c.shape
        return {
            "prefill": s.num_prefill,
            "decode": s.num_decode,
            "chunk_tokens": s.chunk_tokens,
            "max_batch_size": s.max_batch_size,
            "cost": c.cost,
            "meets": c.meets,
            **c.figures(),
        }

    return {
        "requests": len(workload.requests),
        "rate": workload.rate,
        "slo": {"ttft_s": slo.ttft_s, "itl_s": slo.itl_s, "percentile": slo.percentile},
        "plan": one(best) if best else None,
        "tried": [one(c) for c in tried],
    }
