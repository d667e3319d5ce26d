"""The fuzzer's report: one Result a request, counted by gRPC status, with what counts as a failure.

A request fails the run (FAILING, is_failure) when it ended UNKNOWN or INTERNAL, when an OK
stream was malformed (OK_MALFORMED), or when a small request (max_tokens set and at most
kvmesh.bench.fuzz_cases.SMALL_MAX_TOKENS) ran into its deadline. The services' log is read for
servicer methods that raised and for tracebacks (log_exceptions).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass

FAILING = ("UNKNOWN", "INTERNAL", "OK_MALFORMED")


@dataclass
class Result:
    """What one request got back: its index and case, status and details, and time taken (seconds)."""

    index: int
    case: str
    status: str
    """gRPC status name; OK_MALFORMED for an OK stream that broke the protocol."""
    details: str
    small: bool
    seconds: float
    request: str
    """A short description of the request (lengths, heads of long fields)."""


async def send_all(
    indices: list[int], concurrency: int, one: Callable[[int], Awaitable[Result]], say: Callable[..., None]
) -> list[Result]:
    """`one(i)` for each i in indices, `concurrency` at a time (each worker takes the next index
    when it is free), saying how far it got every tenth; the Results in index order."""
    results: list[Result] = []
    todo = iter(indices)
    every = max(1, len(indices) // 10)
    start = time.perf_counter()

    async def worker() -> None:
        for i in todo:
            results.append(await one(i))
            if len(results) % every == 0:
                say(f"  {len(results)}/{len(indices)} done, {time.perf_counter() - start:.0f} s")

    await asyncio.gather(*[worker() for _ in range(concurrency)])
    return sorted(results, key=lambda r: r.index)


def describe(req) -> str:
    """The request in one short line: lengths and the heads of long fields."""
    s = req.sampling
    # (shown?, text): each optional field once, in the order it is printed
    optional = [
        (req.messages, f"messages={[(m.role[:12], len(m.content)) for m in req.messages[:6]]}"),
        (req.chat, "chat"),
        (req.prompt_token_ids, f"ids={len(req.prompt_token_ids)}:{list(req.prompt_token_ids[:4])}"),
        *((s.HasField(field), f"{field}={getattr(s, field)}") for field in ("top_p", "max_tokens", "seed")),
        (True, f"temperature={s.temperature} top_k={s.top_k}"),
        (s.stop, f"stop={len(s.stop)} (longest {max(map(len, s.stop), default=0)}):{list(s.stop[:2])!r:.60}"),
        (s.ignore_eos, "ignore_eos"),
        (req.model, f"model={req.model[:30]!r}"),
        (req.request_id, f"request_id={len(req.request_id)}:{req.request_id[:30]!r}"),
    ]
    return " ".join([f"prompt={len(req.prompt)}B:{req.prompt[:40]!r}"] + [text for shown, text in optional if shown])


def is_failure(r: Result) -> bool:
    """A request that fails the run (see the module docstring)."""
    return r.status in FAILING or (r.status == "DEADLINE_EXCEEDED" and r.small)


def summarize(
    results: list[Result],
    seconds: float,
    mesh_answering: bool,
    answer: str,
    dead: list[str],
    unhandled: int,
    tracebacks: list[str],
    failing: Callable[[Result], bool] | None = None,
) -> dict:
    """The run in one JSON-able dict: counts by status and by case, examples, up to 5 failures a
    status (`failing`: what fails the run; default is_failure, the gRPC fuzzer's)."""
    failing = failing or is_failure
    by_status = Counter(r.status for r in results)
    examples: dict[str, list[str]] = defaultdict(list)
    by_case: dict[str, Counter] = defaultdict(Counter)
    failures: list[dict] = []
    per_status: Counter[str] = Counter()
    for r in results:
        by_case[r.case.split(":")[0] if r.case.startswith("combo") else r.case][r.status] += 1
        d = r.details[:200]
        if d and d not in examples[r.status] and len(examples[r.status]) < 2:
            examples[r.status].append(d)
        if failing(r):
            per_status[r.status] += 1
            if per_status[r.status] <= 5:
                failures.append({**asdict(r), "details": r.details[:500], "seconds": round(r.seconds, 3)})
    return {
        "requests": len(results),
        "by_status": dict(by_status.most_common()),
        "seconds": round(seconds, 1),
        "mesh_answering": mesh_answering,
        "answer": answer[:200],
        "num_failures": sum(per_status.values()),
        "failures": failures,
        "examples": dict(examples),
        "by_case": {c: dict(n) for c, n in sorted(by_case.items())},
        "dead_services": dead,
        "unhandled_service_errors": unhandled,
        "service_tracebacks": tracebacks,
    }


def print_report(s: dict) -> None:
    """Print summarize()'s dict as tables: by status with example details, by case, then failures."""
    print(f"\n{s['requests']} requests in {s['seconds']} s\n")
    print(f"{'status':<22}{'count':>7}{'share':>8}  example details")
    for status, n in s["by_status"].items():
        ex = s["examples"].get(status, [""])
        print(f"{status:<22}{n:>7}{n / s['requests']:>8.1%}  {ex[0][:100]}")
        for more in ex[1:]:
            print(f"{'':<39}{more[:100]}")
    print("\nby case:")
    for case, counts in s["by_case"].items():
        print(f"  {case:<28}" + " ".join(f"{k}={v}" for k, v in sorted(counts.items())))
    print(f"\nmesh answering at the end: {'yes' if s['mesh_answering'] else 'NO'} ({s['answer'][:80]!r})")
    if s["dead_services"]:
        print(f"services that died: {', '.join(s['dead_services'])}")
    if s["unhandled_service_errors"]:
        print(f"servicer methods that raised (UNKNOWN on an internal RPC): {s['unhandled_service_errors']}")
    if s["service_tracebacks"]:
        print(f"exceptions in the services' log: {s['service_tracebacks']}")
    if s["failures"]:
        print(
            f"\n{s['num_failures']} failing requests (UNKNOWN, INTERNAL, malformed OK, small ones past "
            f"their deadline); up to 5 per status:"
        )
        for f in s["failures"]:
            print(
                f"  #{f['index']} {f['case']}: {f['status']} after {f['seconds']} s: {f['details'][:300]}\n"
                f"      {f['request'][:300]}"
            )


def log_exceptions(path: str) -> tuple[int, list[str]]:
    """(servicer methods that raised, which an internal hop sees as UNKNOWN and the gateway may
    pass on as UNAVAILABLE; distinct last lines of the log's tracebacks, at most 10)."""
    with open(path, errors="replace") as f:
        text = f.read()
    unhandled = len(re.findall(r"Unexpected \[\w+\] raised by servicer method", text))
    found = re.findall(r"Traceback \(most recent call last\):\n(?:[ \t].*\n)*(.+)", text)
    return unhandled, list(dict.fromkeys(line[:200] for line in found))[:10]
