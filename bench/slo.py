"""Latency-aware routing against today's, and the TTFT predictor's error, on one mesh in one run.

    python -P -m kvmesh.bench.slo [--prefill 2 --decode 2] [--requests 60] [--rate R]
                                  [--slo-ttft-ms 3000] [--slo-itl-ms 600] [--predictor-log PATH]

A mesh of --prefill prefill and --decode decode instances of the default model (its own Redis),
its gateway, and a second gateway on the same instances started with --slo-miss shed. A trace of
--requests requests (seeded): Poisson arrivals at --rate requests/s (default: --load, 0.6, of the
capacity a closed-loop warm-up of 4 in flight measured: near saturation, since open arrivals
queue where a closed loop does not), prompts of mixed lengths (LENGTHS), half of them opening
with one of four shared 256-token system prompts (prefix reuse to weigh; the warm-up caches
them), --max-tokens tokens each (EOS ignored). The trace is replayed three times, each after the
last one's requests ended, its prompts' own tokens new each time (no replay hits the one
before's cache):

    today      the mesh's gateway, no SLO: routing by prefix and load (cache_aware)
    slo        the same gateway, each request carrying the SLO (GenerateRequest.slo_ttft_ms /
               slo_itl_ms): routed where the predicted TTFT meets it, most prefix reuse first;
               a request none is predicted to meet is queued where it is predicted fastest
    slo+shed   the second gateway: such a request is refused at once (RESOURCE_EXHAUSTED)

With --closed-loop C ...: no replays; --requests requests of the trace's mix at each
concurrency C instead (requests/s, TTFT and ITL p50/p99), the mesh's own throughput.

Printed per run: requests answered and shed, TTFT and ITL p50/p99 (ms), SLO attainment (TTFT
and ITL both met) over the answered requests and over all, output tokens/s over the run's wall
time, and the predictor: the fraction of answered requests whose predicted TTFT (Final's
predicted_ttft_s, made when the request was routed) is within 25% of the measured one, and
the median |error|; for slo+shed, the answered requests whose prediction said they would miss
(0 by construction: shed happens before routing, on the same prediction). With --predictor-log,
where each gateway's predictor missed, by part (kvmesh.bench.predictor_log).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from kvmesh.bench import predictor_log

LENGTHS = ((64, 0.35), (256, 0.3), (768, 0.2), (1536, 0.15))
"""Prompt lengths (tokens) and their shares of the trace."""
SYSTEM_TOKENS = 256


@dataclass(frozen=True)
class Sent:
    at_s: float
    prompt: list[int]


@dataclass
class Outcome:
    ttft_s: float = 0.0
    itl_s: float = 0.0
    predicted_ttft_s: float = 0.0
    tokens: int = 0
    shed: bool = False
    error: str = ""
    prompt_tokens: int = 0
    sent_at_s: float = 0.0


def make_trace(n: int, rate: float, seed: int, run: int = 0) -> list[Sent]:
    """The trace of `seed`: arrivals, lengths and system prompts the same in every run; the
    prompts' own tokens new in each `run` (a replay must not hit the last one's cache)."""
    rng, tokens = random.Random(seed), random.Random(f"{seed}/{run}")
    systems = [[rng.randrange(1000, 40000) for _ in range(SYSTEM_TOKENS)] for _ in range(4)]
    lengths, weights = zip(*LENGTHS)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        length = rng.choices(lengths, weights)[0]
        head = rng.choice(systems) if rng.random() < 0.5 and length > SYSTEM_TOKENS else []
        body = [tokens.randrange(1000, 40000) for _ in range(length - len(head))]
        out.append(Sent(t, head + body))
    return out


async def replay(
    address: str, trace: list[Sent], max_tokens: int, slo: tuple[float, float]
) -> tuple[list[Outcome], float]:
    """Send each request of `trace` at its time; (outcomes in trace order, the run's wall seconds)."""
    import grpc

    from kvmesh.client import GatewayClient, make_request

    outcomes = [Outcome() for _ in trace]
    start = time.perf_counter()

    async with GatewayClient(address) as client:

        async def one(i: int, sent: Sent) -> None:
            await asyncio.sleep(max(0.0, sent.at_s - (time.perf_counter() - start)))
            request = make_request(prompt_token_ids=sent.prompt, max_tokens=max_tokens, ignore_eos=True)
            request.slo_ttft_ms, request.slo_itl_ms = slo
            try:
                done = await client.complete(request, timeout_s=600)
            except grpc.aio.AioRpcError as exc:
                shed = exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                outcomes[i] = Outcome(shed=shed, error="" if shed else exc.code().name)
                return
            f = done.final
            outcomes[i] = Outcome(
                f.ttft_s,
                f.itl_s,
                f.predicted_ttft_s,
                f.generated_tokens,
                prompt_tokens=len(sent.prompt),
                sent_at_s=sent.at_s,
            )

        await asyncio.gather(*(one(i, s) for i, s in enumerate(trace)))
    return outcomes, time.perf_counter() - start


async def capacity(address: str, max_tokens: int, seed: int, concurrency: int = 4, n: int = 16) -> float:
    """Requests/s the mesh answers with `concurrency` in flight (closed loop): the warm-up, which
    also fills the instances' latency profiles and the gateway's calibration."""
    trace = make_trace(n, 1.0, seed, run=-1)  # the system prompts get cached, as in a mesh that has served
    from kvmesh.client import GatewayClient, make_request

    sem = asyncio.Semaphore(concurrency)
    async with GatewayClient(address) as client:

        async def one(sent: Sent) -> None:
            async with sem:
                await client.complete(
                    make_request(prompt_token_ids=sent.prompt, max_tokens=max_tokens, ignore_eos=True)
                )

        start = time.perf_counter()
        await asyncio.gather(*(one(s) for s in trace))
        return n / (time.perf_counter() - start)


async def closed_loop(address: str, n: int, concurrency: int, max_tokens: int, seed: int) -> dict:
    """`n` requests of the trace's mix (its system prompts cached by the warm-up), `concurrency`
    in flight (a closed loop): requests/s, TTFT and ITL p50/p99 (ms)."""
    from kvmesh.client import GatewayClient, make_request

    trace = make_trace(n, 1.0, seed, run=concurrency)
    sem = asyncio.Semaphore(concurrency)
    ttft: list[float] = []
    itl: list[float] = []
    async with GatewayClient(address) as client:

        async def one(sent: Sent) -> None:
            async with sem:
                done = await client.complete(
                    make_request(prompt_token_ids=sent.prompt, max_tokens=max_tokens, ignore_eos=True), timeout_s=600
                )
                ttft.append(done.final.ttft_s)
                itl.append(done.final.itl_s)

        start = time.perf_counter()
        await asyncio.gather(*(one(s) for s in trace))
        wall = time.perf_counter() - start
    return {
        "run": f"closed loop {concurrency}",
        "requests/s": f"{n / wall:.2f}",
        "ttft p50/p99 ms": f"{_pct(ttft, 0.5) * 1000:.0f} / {_pct(ttft, 0.99) * 1000:.0f}",
        "itl p50/p99 ms": f"{_pct(itl, 0.5) * 1000:.0f} / {_pct(itl, 0.99) * 1000:.0f}",
    }


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def report(name: str, outcomes: list[Outcome], wall_s: float, slo_s: tuple[float, float]) -> dict:
    answered = [o for o in outcomes if not o.shed and not o.error]
    met = [o for o in answered if o.ttft_s <= slo_s[0] and o.itl_s <= slo_s[1]]
    predicted = [o for o in answered if o.predicted_ttft_s > 0]
    within = [o for o in predicted if abs(o.predicted_ttft_s - o.ttft_s) <= 0.25 * o.ttft_s]
    errors = [abs(o.predicted_ttft_s - o.ttft_s) / o.ttft_s for o in predicted]
    admitted_miss = sum(o.predicted_ttft_s > slo_s[0] for o in answered)
    return {
        "run": name,
        "answered": len(answered),
        "shed": sum(o.shed for o in outcomes),
        "failed": sum(bool(o.error) for o in outcomes),
        "ttft p50/p99 ms": f"{_pct([o.ttft_s for o in answered], 0.5) * 1000:.0f} / {_pct([o.ttft_s for o in answered], 0.99) * 1000:.0f}",
        "itl p50/p99 ms": f"{_pct([o.itl_s for o in answered], 0.5) * 1000:.0f} / {_pct([o.itl_s for o in answered], 0.99) * 1000:.0f}",
        "SLO met (answered)": f"{len(met) / max(len(answered), 1):.2f}",
        "SLO met (all)": f"{len(met) / max(len(outcomes), 1):.2f}",
        "output tok/s": f"{sum(o.tokens for o in answered) / wall_s:.1f}",
        "predicted within 25%": f"{len(within) / max(len(predicted), 1):.2f} of {len(predicted)}",
        "median |error|": f"{statistics.median(errors) if errors else float('nan'):.2f}",
        "admitted, predicted to miss": admitted_miss,
    }


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)

    from kvmesh.launcher import start_mesh
    from kvmesh.redis_server import free_port
    from kvmesh.runtime.service import wait_for_health

    with tempfile.NamedTemporaryFile("w+", prefix="kvmesh-bench-slo-", suffix=".log") as log:
        logs = (
            [f"--predictor-log={args.predictor_log}.{name}" for name in ("gateway", "shed")]
            if args.predictor_log
            else []
        )
        mesh = start_mesh(
            args.prefill, args.decode, port=free_port(), log=log, env={"REDIS_URL": ""}, extra_gateway_args=logs[:1]
        )
        shed_port = free_port()
        shed = subprocess.Popen(
            [sys.executable, "-P", "-m", "kvmesh.cli", "serve", "gateway", "--port", str(shed_port),
             *(f"--prefill={a}" for a in mesh.prefill_addresses), *(f"--decode={a}" for a in mesh.decode_addresses),
             "--redis-url", mesh.redis_url, "--slo-miss", "shed", *logs[1:]],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            asyncio.run(wait_for_health(f"127.0.0.1:{shed_port}", 120))
            gateways = {
                "today": mesh.gateway_address,
                "slo": mesh.gateway_address,
                "slo+shed": f"127.0.0.1:{shed_port}",
            }
            rate = args.rate
            for address in {mesh.gateway_address, gateways["slo+shed"]}:  # profiles and calibration, both gateways
                measured = asyncio.run(capacity(address, args.max_tokens, args.seed))
            rate = rate or args.load * measured
            print(
                f"{args.prefill} prefill + {args.decode} decode, {args.requests} requests at {rate:.2f}/s "
                f"(warm-up capacity {measured:.2f}/s), SLO TTFT {args.slo_ttft_ms:.0f} ms, ITL {args.slo_itl_ms:.0f} ms",
                flush=True,
            )
            rows, outcomes_of = _runs(args, gateways, rate)
        finally:
            shed.terminate()
            shed.wait(timeout=30)
            mesh.stop()
    _print(rows)
    for path in [f"{args.predictor_log}.{name}" for name in ("gateway", "shed")] if args.predictor_log else []:
        print()
        predictor_log.print_summary(path, "(the warm-up's requests included)")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"rate": rate, "rows": rows, "outcomes": outcomes_of}, out, indent=1)
    return 0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefill", type=int, default=2)
    parser.add_argument("--decode", type=int, default=2)
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--rate", type=float, default=0.0, help="requests/s (0: --load x the warm-up's capacity)")
    parser.add_argument("--load", type=float, default=0.6, help="the rate as a fraction of the warm-up's capacity")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--slo-ttft-ms", type=float, default=3000.0)
    parser.add_argument("--slo-itl-ms", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="also write each run's rows and every request's outcome here")
    parser.add_argument(
        "--predictor-log",
        metavar="PATH",
        help="the gateways' --predictor-log: PATH.gateway (today, slo) and PATH.shed (slo+shed)",
    )
    parser.add_argument(
        "--closed-loop",
        type=int,
        nargs="+",
        metavar="C",
        help="instead of the replays: --requests requests at each concurrency C (a closed loop), "
        "requests/s, TTFT and ITL on the mesh's gateway",
    )
    return parser.parse_args(argv)


def _runs(args: argparse.Namespace, gateways: dict[str, str], rate: float) -> tuple[list[dict], dict[str, list[dict]]]:
    """The closed loops (--closed-loop) on the mesh's gateway, else the trace's replays on
    `gateways` at `rate`: each run's printed row, and each replay's outcomes by run name."""
    slo_ms = (args.slo_ttft_ms, args.slo_itl_ms)
    slo_s = (args.slo_ttft_ms / 1000, args.slo_itl_ms / 1000)
    rows = []
    outcomes_of: dict[str, list[dict]] = {}
    for concurrency in args.closed_loop or ():
        rows.append(asyncio.run(closed_loop(gateways["today"], args.requests, concurrency, args.max_tokens, args.seed)))
        print(rows[-1], flush=True)
    for run, (name, address) in enumerate(gateways.items() if not args.closed_loop else ()):
        trace = make_trace(args.requests, rate, args.seed, run)
        outcomes, wall = asyncio.run(replay(address, trace, args.max_tokens, slo_ms if name != "today" else (0, 0)))
        rows.append(report(name, outcomes, wall, slo_s))
        print(rows[-1], flush=True)
        outcomes_of[name] = [dataclasses.asdict(o) for o in outcomes]
    return rows, outcomes_of


def _print(rows: list[dict]) -> None:
    keys = [k for k in rows[0] if k != "run"]
    width = max(len(k) for k in keys)
    print(f"\n{'':<{width}}  " + "  ".join(f"{r['run']:>14}" for r in rows))
    for k in keys:
        print(f"{k:<{width}}  " + "  ".join(f"{r[k]!s:>14}" for r in rows))


if __name__ == "__main__":
    raise SystemExit(main())
