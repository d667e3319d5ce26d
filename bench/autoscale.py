"""`kvmesh up --autoscale` under a load step up and down: instances added and drained as the
gateway advises, every request answered, and how long each step took to react.

    python -P -m kvmesh.bench.autoscale [--low 0.2 --high 1.5] [--phase-s 40 60 60]
                                        [--slo-ttft-ms 2000 --slo-itl-ms 600]

A mesh of one prefill and one decode (its own Redis) whose gateway has the SLO and its metrics
on, and the launcher's autoscaler (kvmesh.autoscale) between 1 and --max-prefill /
--max-decode instances, ticking beside the load. The closed-loop capacity (4 in flight) is
measured first; then Poisson arrivals at --low x capacity, --high x capacity, --low x capacity
for the three --phase-s, 512-token prompts of their own, --max-tokens answer tokens (EOS
ignored); then it waits (at most --settle-s) for the mesh to scale back to one of each.
Printed: requests sent, answered, failed by status; each scaling step, when it came after the
load step that caused it, and its reaction time from the advice to the instance serving (up)
or drained and gone (down).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import tempfile
import threading
import time


async def load(address: str, phases: list[tuple[float, float]], max_tokens: int, seed: int) -> collections.Counter:
    """Send Poisson arrivals at each (rate, seconds) phase in turn; the outcomes by status."""
    import grpc

    from kvmesh.client import GatewayClient, make_request

    rng, outcomes, tasks = random.Random(seed), collections.Counter(), []
    async with GatewayClient(address) as client:

        async def one(prompt: list[int]) -> None:
            request = make_request(prompt_token_ids=prompt, max_tokens=max_tokens, ignore_eos=True)
            try:
                await client.complete(request, timeout_s=600)
                outcomes["OK"] += 1
            except grpc.aio.AioRpcError as exc:
                outcomes[exc.code().name] += 1

        for rate, seconds in phases:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                await asyncio.sleep(rng.expovariate(rate))
                tasks.append(asyncio.ensure_future(one([rng.randrange(1000, 40000) for _ in range(512)])))
        await asyncio.gather(*tasks)
    outcomes["sent"] = len(tasks)
    return outcomes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--low", type=float, default=0.2, help="the quiet rate, x the measured capacity")
    parser.add_argument("--high", type=float, default=1.5, help="the busy rate, x the measured capacity")
    parser.add_argument("--phase-s", type=float, nargs=3, default=(40.0, 60.0, 60.0))
    parser.add_argument("--settle-s", type=float, default=180.0)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    parser.add_argument("--slo-itl-ms", type=float, default=600.0)
    parser.add_argument("--max-prefill", type=int, default=2)
    parser.add_argument("--max-decode", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from kvmesh.autoscale import Autoscaler
    from kvmesh.bench.slo import capacity
    from kvmesh.launcher import start_mesh
    from kvmesh.redis_server import free_port

    metrics_port = free_port()
    gateway_args = ["--slo-ttft-ms", str(args.slo_ttft_ms), "--slo-itl-ms", str(args.slo_itl_ms)]
    with tempfile.NamedTemporaryFile("w+", prefix="kvmesh-bench-autoscale-", suffix=".log") as log:
        mesh = start_mesh(
            1,
            1,
            port=free_port(),
            log=log,
            env={"REDIS_URL": ""},
            extra_gateway_args=[*gateway_args, "--metrics-port", str(metrics_port)],
            keep_cpu_share=True,
        )
        bounds = {"prefill": (1, args.max_prefill), "decode": (1, args.max_decode)}
        scaler = Autoscaler(mesh, f"http://127.0.0.1:{metrics_port}/metrics", bounds)
        stop = threading.Event()
        thread = None
        try:
            cap = asyncio.run(capacity(mesh.gateway_address, args.max_tokens, args.seed))
            rates = (args.low * cap, args.high * cap, args.low * cap)
            print(f"capacity {cap:.2f} req/s; phases {[f'{r:.2f}/s x {s:g} s' for r, s in zip(rates, args.phase_s)]}")

            def tick() -> None:
                while not stop.wait(0.5):
                    scaler.tick()

            thread = threading.Thread(target=tick, daemon=True)
            thread.start()
            started = time.time()
            outcomes = asyncio.run(
                load(mesh.gateway_address, list(zip(rates, args.phase_s)), args.max_tokens, args.seed)
            )
            deadline = time.monotonic() + args.settle_s
            while time.monotonic() < deadline and (len(mesh.prefill_addresses), len(mesh.decode_addresses)) != (1, 1):
                time.sleep(1)
        finally:
            stop.set()
            if thread is not None:
                thread.join(timeout=30)
            scaler.close()
            mesh.stop()
    step_up, step_down = started + args.phase_s[0], started + args.phase_s[0] + args.phase_s[1]
    print(f"\nrequests: {dict(outcomes)}")
    for e in scaler.events:
        since = e["at"] - (step_up if e["action"] == "up" else step_down)
        print(
            f"{e['action']:<5} {e['role']:<8} {e['instance']:<10} done {since:+7.1f} s after the load stepped "
            f"{'up' if e['action'] == 'up' else 'down'}; {e['react_s']:.1f} s from the advice"
        )
    failed = sum(n for k, n in outcomes.items() if k not in ("OK", "sent"))
    print(f"failed requests: {failed}; final mesh: {len(mesh.prefill_addresses)}P {len(mesh.decode_addresses)}D")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
