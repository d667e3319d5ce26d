"""`kvmesh plan` checked against the mesh it picks: predicted TTFT and ITL p50/p90/p99 beside
those measured when that mesh serves the same workload, in one run.

    python -P -m kvmesh.bench.plan_check [--rate 0.4] [--requests 80] [--profile p.json]
                                         [--slo-ttft-ms 3000 --slo-itl-ms 400]

The workload (seeded): Poisson arrivals at --rate, prompts of mixed lengths (INPUTS), half of
those longer than 256 tokens opening with one of four shared 256-token system prompts, answers
of --max-tokens tokens (EOS ignored). The profile is measured first on a mesh of one prefill and
one decode (kvmesh.planner.measure), unless --profile names a saved one; the plan is the least
cost mesh that meets the SLO (kvmesh.planner.search). That mesh is started (its own Redis) and
the workload replayed at its arrival times through the gateway, each block of a prompt the same
tokens wherever it appears (so shared prefixes hit the cache as planned). Printed: predicted and
measured percentiles and their ratio; the target is measured within 25% of predicted.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time

from kvmesh.planner.search import Slo, plan
from kvmesh.planner.simulate import SimResult
from kvmesh.planner.workload import Workload, parse_lengths, synthetic

INPUTS = "64:0.35,256:0.3,768:0.2,1536:0.15"


def prompts_of(workload: Workload, seed: int) -> list[list[int]]:
    """Each request's token ids: block id h is the same `block_tokens` tokens in every prompt."""
    blocks: dict[int, list[int]] = {}

    def block(h: int) -> list[int]:
        if h not in blocks:
            rng = random.Random(f"{seed}/{h}")
            blocks[h] = [rng.randrange(1000, 40000) for _ in range(workload.block_tokens)]
        return blocks[h]

    return [[t for h in r.hash_ids for t in block(h)][: r.input_tokens] for r in workload.requests]


async def replay(address: str, workload: Workload, prompts: list[list[int]]) -> tuple[SimResult, int, list]:
    """(the measured TTFT and ITL of each request, the requests that failed, each one's Final)."""
    import grpc

    from kvmesh.client import GatewayClient, make_request

    ttft, itl, failed = [0.0] * len(prompts), [0.0] * len(prompts), 0
    finals: list = [None] * len(prompts)
    start = time.perf_counter()
    async with GatewayClient(address) as client:

        async def one(i: int) -> None:
            nonlocal failed
            r = workload.requests[i]
            await asyncio.sleep(max(0.0, r.arrival_s - (time.perf_counter() - start)))
            request = make_request(prompt_token_ids=prompts[i], max_tokens=max(r.output_tokens, 1), ignore_eos=True)
            try:
                done = await client.complete(request, timeout_s=600)
            except grpc.aio.AioRpcError:
                failed += 1
                return
            ttft[i], itl[i], finals[i] = done.final.ttft_s, done.final.itl_s, done.final

        await asyncio.gather(*(one(i) for i in range(len(prompts))))
    return SimResult(ttft, itl, time.perf_counter() - start), failed, finals


def _by_length(workload: Workload, predicted: SimResult, measured: SimResult, finals: list) -> None:
    """Median TTFT predicted and measured by prompt length, with the measured wait for a decode
    slot (Final.queue_s) and cached tokens, and median ITL (a request's mean) predicted and
    measured: where a miss comes from."""
    import statistics

    print(
        f"\n{'prompt':>7} {'n':>3} {'TTFT pred':>10} {'measured':>9} {'slot wait':>9} {'cached':>7} "
        f"{'ITL pred':>9} {'measured':>9}"
    )
    for length in sorted({r.input_tokens for r in workload.requests}):
        idx = [i for i, r in enumerate(workload.requests) if r.input_tokens == length and finals[i] is not None]
        if not idx:
            continue
        med = statistics.median
        print(
            f"{length:>7} {len(idx):>3} {med(predicted.ttft_s[i] for i in idx) * 1000:>8.0f}ms "
            f"{med(measured.ttft_s[i] for i in idx) * 1000:>7.0f}ms {med(finals[i].queue_s for i in idx) * 1000:>7.0f}ms "
            f"{med(finals[i].cached_tokens for i in idx):>7.0f} {med(predicted.itl_s[i] for i in idx) * 1000:>7.0f}ms "
            f"{med(measured.itl_s[i] for i in idx) * 1000:>7.0f}ms"
        )


def _work(predicted: dict[str, float], measured: dict[str, float]) -> None:
    """The work predicted and the instances' counters of it over the replay (GetStats): a miss
    in the percentiles comes from the forwards' and steps' cost under load, or from the order the
    simulation gives them."""
    print(f"\n{'work':<22} {'predicted':>10} {'measured':>10} {'ratio':>7}")
    for role, runs, seconds, tokens in (
        ("prefill", "num_forwards", "forward_seconds", "num_prompt_tokens_computed"),
        ("decode", "num_steps", "step_seconds", "num_generated_tokens"),
    ):
        rows = []
        for d in (predicted, measured):
            n = max(d[f"{role}.{runs}"], 1)
            rows.append(
                (
                    d[f"{role}.{runs}"],
                    d[f"{role}.{seconds}"],
                    d[f"{role}.{tokens}"] / n,
                    1000 * d[f"{role}.{seconds}"] / n,
                )
            )
        for i, name in enumerate((runs.removeprefix("num_"), f"{role} seconds", "tokens each", "ms each")):
            p, m = rows[0][i], rows[1][i]
            print(f"{role[0]} {name:<20} {p:>10.1f} {m:>10.1f} {m / p if p else float('nan'):>7.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=0.4)
    parser.add_argument("--requests", type=int, default=80)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--slo-ttft-ms", type=float, default=3000.0)
    parser.add_argument("--slo-itl-ms", type=float, default=400.0)
    parser.add_argument("--profile", default="", help="a saved profile (default: measure one)")
    parser.add_argument("--max-prefill", type=int, default=2)
    parser.add_argument("--max-decode", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from kvmesh.bench.peer import work_counters
    from kvmesh.launcher import SHARED_CORES_FORWARD_TOKENS, start_mesh
    from kvmesh.planner.command import up_command
    from kvmesh.planner.measure import measure
    from kvmesh.planner.profile import load_profile
    from kvmesh.redis_server import free_port

    workload = synthetic(
        args.rate, args.requests, parse_lengths(INPUTS), ((args.max_tokens, 1.0),), 256, 0.5, seed=args.seed
    )
    slo = Slo(args.slo_ttft_ms / 1000, args.slo_itl_ms / 1000)
    with tempfile.NamedTemporaryFile("w+", prefix="kvmesh-bench-plan-", suffix=".log") as log:
        if args.profile:
            profile = load_profile(args.profile)
        else:
            profile = measure(
                lambda env: start_mesh(1, 1, port=free_port(), log=log, env={"REDIS_URL": "", **env}),
                SHARED_CORES_FORWARD_TOKENS,
                args.seed,
            )
        print(f"profile: {profile}", flush=True)
        best, _ = plan(workload, profile, slo, args.max_prefill, args.max_decode)
        if best is None:
            print("no mesh up to the caps meets the SLO: raise it or lower --rate")
            return 1
        print(f"plan: {best.shape}, {len(workload.requests)} requests at {workload.rate:.2f}/s", flush=True)
        env, _ = up_command(best.shape)
        mesh = start_mesh(
            best.shape.num_prefill, best.shape.num_decode, port=free_port(), log=log, env={"REDIS_URL": "", **env}
        )
        try:
            instances = (mesh.prefill_addresses, mesh.decode_addresses)
            before = work_counters(*instances)
            measured, failed, finals = asyncio.run(
                replay(mesh.gateway_address, workload, prompts_of(workload, args.seed))
            )
            after = work_counters(*instances)
        finally:
            mesh.stop()
    print(f"\nmeasured on the planned mesh ({failed} failed)")
    print(f"{'':<10} {'predicted':>10} {'measured':>10} {'ratio':>7}")
    within = 0
    for which in ("ttft", "itl"):
        for q in (50, 90, 99):
            p, m = best.result.percentile(which, q), measured.percentile(which, q)
            ok = abs(m - p) <= 0.25 * p
            within += ok
            print(
                f"{which} p{q:<4} {p * 1000:>8.0f}ms {m * 1000:>8.0f}ms {m / p if p else float('nan'):>7.2f}{'' if ok else '  (off by more than 25%)'}"
            )
    print(f"{within} of 6 within 25%")
    _by_length(workload, best.result, measured, finals)
    _work(best.result.work, {k: after[k] - before.get(k, 0.0) for k in after})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
