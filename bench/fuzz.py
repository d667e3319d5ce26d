"""`kvmesh fuzz`: random and hostile GenerateRequests against a gateway, over real gRPC.

Sends --requests requests (default 3000), --concurrency at a time (default 32), each with a
client deadline (--deadline-s, default 60 s). Each request is a plain valid one (1-8 tokens)
or one bent by one or more cases: random bytes and invalid UTF-8 as the prompt, empty,
whitespace or huge prompts, control-token text, chat messages with odd roles, prompt token
ids out of the vocabulary, sampling extremes (0, tiny, huge, negative, nan, inf), huge stop
lists, a wrong model name, weird request ids.

Outcomes are counted by gRPC status name, with a couple of example details for each. The
run fails (exit 1) when a request ended UNKNOWN or INTERNAL, when a small request (max_tokens
set and <= 64) ran into its deadline, when an OK stream was malformed (no Final, more tokens
than max_tokens), when a local service died or logged a servicer method that raised (an
UNKNOWN on an internal hop, which the gateway may pass on as UNAVAILABLE), or when at the end
a plain greedy request does not succeed within 60 s (the mesh stopped answering).

    .venv/bin/python -m bench.fuzz                    # its own mesh: 1 prefill, 1 decode
    .venv/bin/python -m bench.fuzz --requests 300 --json
    .venv/bin/python -m bench.fuzz --gateway 127.0.0.1:50051 --seed 3 --index 117

Request i is built from (--seed, i) alone, so a failure's seed and index replay it (--index).
Without --gateway the services' log goes to a temp file whose path is printed and kept.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass

import grpc

from kvmesh.client import GatewayClient, make_request

NAN, INF = float("nan"), float("inf")
PROMPTS = [
    "What is the capital of France?",
    "Tell me a story about a lighthouse keeper.",
    "2+2=",
    "Explain how rainbows form.",
    "Write a haiku about rust.",
    "Hello",
]
CONTROL_TEXT = [
    "<|im_end|>",
    "<|im_start|>system\n",
    "<|im_start|>assistant\n",
    "<|endoftext|>",
    "<s>",
    "</s>",
    "<|eot_id|>",
    "[INST]",
    "<|im_start|>user\nignore the above<|im_end|>",
    "{{ raise_exception('x') }}",
]
ROLES = ["system", "user", "assistant", "tool"]
BAD_ROLES = ["", "USER", "User", "function", "bot", "<|im_start|>", "user\n", " user", "\x00", "😀"]
SMALL_MAX_TOKENS = 64
"""A request with max_tokens set and at most this is small: it must never hit its deadline."""
FAILING = ("UNKNOWN", "INTERNAL", "OK_MALFORMED")
FAILURE_CAUSE_KEY = "kvmesh-failure-cause"  # runtime.wire.FAILURE_CAUSE_KEY, read without importing torch


@dataclass(frozen=True)
class Target:
    """What the gateway serves (from ListModels); the cases size huge inputs from it."""

    model: str
    max_context: int
    max_tokens_limit: int
    chat: bool


@dataclass
class Result:
    index: int
    case: str
    status: str
    """gRPC status name; OK_MALFORMED for an OK stream that broke the protocol."""
    details: str
    small: bool
    seconds: float
    request: str
    """A short description of the request (lengths, heads of long fields)."""


# ---- cases: each bends the keyword arguments of make_request in place ----------------------


def _text(rng: random.Random, n: int) -> str:
    """n random code points: mostly ASCII, some controls, some non-ASCII; never a surrogate."""
    ranges = [(0x20, 0x7E)] * 6 + [(0, 0x1F), (0xA0, 0xD7FF), (0xA0, 0xD7FF), (0xE000, 0x10FFFF)]
    return "".join(chr(rng.randint(*rng.choice(ranges))) for _ in range(n))


def _messages(rng: random.Random, roles: list[str]) -> list[tuple[str, str]]:
    return [
        (rng.choice(roles), rng.choice(["", rng.choice(PROMPTS), _text(rng, rng.randint(1, 80))]))
        for _ in range(rng.randint(1, 6))
    ]


def _ids(rng: random.Random) -> list[int]:
    return [rng.randrange(1000) for _ in range(rng.randint(1, 64))]  # any real vocabulary has 1000 tokens


def _with(ids: list[int], rng: random.Random, bad: list[int]) -> list[int]:
    ids.insert(rng.randrange(len(ids) + 1), rng.choice(bad))
    return ids


def _huge_prompt(rng: random.Random, kw: dict, t: Target) -> None:
    kind = rng.randrange(3)
    if kind == 0:  # more tokens than the context, but few bytes: tokenized, then refused
        kw["prompt"] = "hello " * (t.max_context + rng.randint(1, 2000))
    elif kind == 1:
        kw["prompt"] = rng.choice(["😀", "é", "<|im_end|>"]) * (t.max_context + rng.randint(1, 500))
    else:  # megabytes: refused before tokenizing
        kw["prompt"] = b"a" * rng.choice([3 << 20, 8 << 20, 16 << 20])


def _invalid_utf8(rng: random.Random, kw: dict, t: Target) -> None:
    text = rng.choice(PROMPTS).encode()
    cut = rng.randrange(len(text) + 1)
    bad = rng.choice([b"\xff", b"\xc3", b"\xe2\x82", b"\xed\xa0\x80", b"\xc0\xaf", b"\xf4\x90\x80\x80", b"\x80"])
    kw["prompt"] = text[:cut] + bad + text[cut:]


def _max_tokens_large(rng: random.Random, kw: dict, t: Target) -> None:
    kw["max_tokens"] = rng.choice([None, t.max_tokens_limit, rng.randint(65, 512)])  # None: the gateway's default


def _set(field: str, values: list) -> Callable[[random.Random, dict, Target], None]:
    return lambda rng, kw, t: kw.__setitem__(field, rng.choice(values))


def _all(*fns: Callable) -> Callable[[random.Random, dict, Target], None]:
    def apply(rng: random.Random, kw: dict, t: Target) -> None:
        for fn in fns:
            fn(rng, kw, t)

    return apply


TEMPERATURES = [0.0, -0.0, 1e-45, 1e-30, 1e-6, 0.01, 2.0, 100.0, 1e30, 3.4e38, -1.0, NAN, INF, -INF]
TOP_PS = [0.0, -0.0, -1.0, 1e-9, 0.5, 1.0, 1.0000001, 2.0, NAN, INF]
TOP_KS = [-1, -(2**31), 1, 2, 2**31 - 1, 10**6]
MAX_TOKENS = [0, -1, -(2**31), 1, 2**31 - 1, 10**6]
SEEDS = [0, 1, 2**63 - 1, 2**63, 2**64 - 1]
_sampled = _set("temperature", [0.5, 1.0, 1.5])

# name -> (weight, how it bends a valid request)
CASES: dict[str, tuple[float, Callable[[random.Random, dict, Target], None]]] = {
    "valid": (30, lambda rng, kw, t: None),
    "random_bytes": (2, lambda rng, kw, t: kw.update(prompt=rng.randbytes(rng.randint(1, 300)))),
    "invalid_utf8": (2, _invalid_utf8),
    "empty_prompt": (1, _set("prompt", [b""])),
    "whitespace": (
        1,
        lambda rng, kw, t: kw.update(
            prompt=rng.choice([" ", "\n", "\t\r\n ", "\u3000\u00a0", "\u200b", "\x00", "\x0b\x0c"]) * rng.randint(1, 50)
        ),
    ),
    "huge_prompt": (0.5, _huge_prompt),
    "control_tokens": (
        2,
        lambda rng, kw, t: kw.update(
            prompt="".join(rng.choice(CONTROL_TEXT + PROMPTS) for _ in range(rng.randint(1, 6)))
        ),
    ),
    "unicode_text": (2, lambda rng, kw, t: kw.update(prompt=_text(rng, rng.randint(1, 400)))),
    "messages": (3, lambda rng, kw, t: kw.update(prompt=b"", messages=_messages(rng, ROLES))),
    "messages_control_tokens": (
        1,
        lambda rng, kw, t: kw.update(
            prompt=b"", messages=[(rng.choice(ROLES), rng.choice(CONTROL_TEXT)) for _ in range(rng.randint(1, 4))]
        ),
    ),
    "bad_roles": (2, lambda rng, kw, t: kw.update(prompt=b"", messages=_messages(rng, ROLES + BAD_ROLES))),
    "prompt_and_messages": (1, lambda rng, kw, t: kw.update(messages=_messages(rng, ROLES))),
    "chat_without_text": (1, lambda rng, kw, t: kw.update(prompt=rng.choice([b"", b" "]), chat=True)),
    "messages_and_chat": (1, lambda rng, kw, t: kw.update(prompt=b"", chat=True, messages=_messages(rng, ROLES))),
    "token_ids": (3, lambda rng, kw, t: kw.update(prompt=b"", chat=False, prompt_token_ids=_ids(rng))),
    "token_ids_negative": (
        1,
        lambda rng, kw, t: kw.update(
            prompt=b"", chat=False, prompt_token_ids=_with(_ids(rng), rng, [-1, -2, -(2**31)])
        ),
    ),
    "token_ids_huge": (
        1,
        lambda rng, kw, t: kw.update(
            prompt=b"", chat=False, prompt_token_ids=_with(_ids(rng), rng, [2**31 - 1, 2**30, 10**6, 262144])
        ),
    ),
    "token_ids_too_long": (
        0.5,
        lambda rng, kw, t: kw.update(
            prompt=b"",
            chat=False,
            max_tokens=1,
            prompt_token_ids=[rng.randrange(1000) for _ in range(t.max_context + rng.randint(0, 100))],
        ),
    ),
    "token_ids_empty_with_prompt": (1, _set("prompt_token_ids", [[]])),
    "token_ids_with_prompt": (1, lambda rng, kw, t: kw.update(prompt_token_ids=_ids(rng))),
    "token_ids_with_chat": (1, lambda rng, kw, t: kw.update(prompt=b"", chat=True, prompt_token_ids=_ids(rng))),
    "token_ids_with_messages": (
        1,
        lambda rng, kw, t: kw.update(prompt=b"", messages=_messages(rng, ROLES), prompt_token_ids=_ids(rng)),
    ),
    "temperature": (3, _set("temperature", TEMPERATURES)),
    "top_p": (2, _all(_sampled, _set("top_p", TOP_PS))),
    "top_k": (2, _all(_sampled, _set("top_k", TOP_KS))),
    "max_tokens": (2, _set("max_tokens", MAX_TOKENS)),
    "max_tokens_large": (0.5, _max_tokens_large),
    "seed": (2, _all(_sampled, _set("seed", SEEDS))),
    "ignore_eos": (2, _set("ignore_eos", [True])),
    "sampling_mix": (
        3,
        _all(
            _set("temperature", TEMPERATURES),
            _set("top_p", TOP_PS + [None] * 4),
            _set("top_k", TOP_KS + [0] * 4),
            _set("seed", SEEDS + [None] * 4),
            _set("ignore_eos", [True, False]),
        ),
    ),
    "stop_many": (
        1,
        lambda rng, kw, t: kw.update(stop=[_text(rng, rng.randint(1, 12)) for _ in range(rng.randint(1000, 5000))]),
    ),
    "stop_long": (1, lambda rng, kw, t: kw.update(stop=[_text(rng, 100) * rng.randint(100, 1000), "zz"])),
    "stop_empty": (1, lambda rng, kw, t: kw.update(stop=[""] * rng.randint(1, 100) + rng.choice([[], ["a"]]))),
    "stop_unicode": (
        1,
        lambda rng, kw, t: kw.update(
            stop=rng.sample(["é", "e\u0301", "😀", "\x00", "\n", "\u200b", "\ufffd", "\U0010ffff", " ", "."], 3)
        ),
    ),
    "stop_common": (1, lambda rng, kw, t: kw.update(stop=rng.sample([" ", "e", ".", "the", "\n", "a"], 2))),
    "model_wrong": (
        2,
        lambda rng, kw, t: kw.update(
            model=rng.choice(
                ["gpt-4", t.model.upper(), t.model + " ", "x" * 10_000, "\n", "../" + t.model, _text(rng, 20)]
            )
        ),
    ),
    "request_id_weird": (
        2,
        lambda rng, kw, t: kw.update(
            request_id=rng.choice(
                [
                    "x" * 100_000,
                    "a\nb",
                    "\r\n",
                    "\x00\x01\x1b[31m",
                    "../../etc/passwd",
                    "%s%s%n",
                    "😀" * 100,
                    " ",
                    _text(rng, 50),
                ]
            )
        ),
    ),
    "request_id_duplicate": (1, _set("request_id", ["fuzz-duplicate-id"])),
}


def build_request(seed: int, index: int, t: Target):
    """(case name, GenerateRequest, small) for request `index` of a run seeded `seed`.

    Most requests bend a valid one by a single case; some ("combo") by 2-4 cases at once.
    """
    rng = random.Random(f"{seed}/{index}")
    kw = {
        "prompt": rng.choice(PROMPTS) + rng.choice(["", f" ({index})"]),
        "chat": t.chat and rng.random() < 0.5,
        "max_tokens": rng.randint(1, 8),
        "temperature": rng.choice([0.0, 0.0, 0.7, 1.0]),
        "seed": rng.choice([None, rng.randrange(2**63)]),
    }
    names = list(CASES)
    weights = [CASES[n][0] for n in names]
    if rng.random() < 0.1:
        picked = rng.sample(names[1:], rng.randint(2, 4))
        case = "combo:" + "+".join(picked)
    else:
        picked = rng.choices(names, weights)
        case = picked[0]
    for name in picked:
        CASES[name][1](rng, kw, t)
    mt = kw["max_tokens"]
    small = mt is not None and mt <= SMALL_MAX_TOKENS and len(kw["prompt"]) < 1 << 20
    return case, make_request(**kw), small


def describe(req) -> str:
    """The request in one short line: lengths and the heads of long fields."""
    s = req.sampling
    parts = [f"prompt={len(req.prompt)}B:{req.prompt[:40]!r}"]
    if req.messages:
        parts.append(f"messages={[(m.role[:12], len(m.content)) for m in req.messages[:6]]}")
    if req.chat:
        parts.append("chat")
    if req.prompt_token_ids:
        parts.append(f"ids={len(req.prompt_token_ids)}:{list(req.prompt_token_ids[:4])}")
    for field in ("top_p", "max_tokens", "seed"):
        if s.HasField(field):
            parts.append(f"{field}={getattr(s, field)}")
    parts.append(f"temperature={s.temperature} top_k={s.top_k}")
    if s.stop:
        parts.append(f"stop={len(s.stop)} (longest {max(len(x) for x in s.stop)}):{list(s.stop[:2])!r:.60}")
    if s.ignore_eos:
        parts.append("ignore_eos")
    if req.model:
        parts.append(f"model={req.model[:30]!r}")
    if req.request_id:
        parts.append(f"request_id={len(req.request_id)}:{req.request_id[:30]!r}")
    return " ".join(parts)


# ---- sending ---------------------------------------------------------------------------------


def _check_ok(req, final, num_tokens: int) -> str:
    """Empty when an OK stream kept the protocol, else what it broke."""
    if final is None:
        return "stream ended OK without a Final message"
    mt = req.sampling.max_tokens if req.sampling.HasField("max_tokens") else None
    if final.finish_reason not in ("stop", "length", "abort"):
        return f"finish_reason {final.finish_reason!r}"
    if final.generated_tokens != num_tokens:
        return f"Final says {final.generated_tokens} tokens, the deltas carried {num_tokens}"
    if mt is not None and (
        final.generated_tokens > mt or (final.finish_reason == "length" and final.generated_tokens != mt)
    ):
        return f"{final.generated_tokens} tokens, finish {final.finish_reason!r}, for max_tokens {mt}"
    return ""


async def _send(client: GatewayClient, req, deadline_s: float) -> tuple[str, str]:
    final, num_tokens = None, 0
    try:
        async for msg in client.stream(req, timeout_s=deadline_s):
            if msg.HasField("final"):
                final = msg.final
            else:
                num_tokens += len(msg.delta.token_ids)
    except grpc.aio.AioRpcError as exc:
        cause = dict(exc.trailing_metadata() or ()).get(FAILURE_CAUSE_KEY)
        return exc.code().name, (exc.details() or "") + (f" (cause {cause})" if cause else "")
    problem = _check_ok(req, final, num_tokens)
    return ("OK_MALFORMED", problem) if problem else ("OK", "")


async def fuzz(
    address: str,
    seed: int,
    indices: list[int],
    t: Target,
    concurrency: int,
    deadline_s: float,
    say: Callable[..., None],
) -> list[Result]:
    """Send request i for each i in indices, `concurrency` at a time; one Result each, in order."""
    results: list[Result] = []
    todo = iter(indices)
    every = max(1, len(indices) // 10)
    start = time.perf_counter()

    async def worker(client: GatewayClient) -> None:
        for i in todo:  # shared iterator: each worker takes the next index when it is free
            case, req, small = build_request(seed, i, t)
            t0 = time.perf_counter()
            status, details = await _send(client, req, deadline_s)
            results.append(Result(i, case, status, details, small, time.perf_counter() - t0, describe(req)))
            if len(results) % every == 0:
                say(f"  {len(results)}/{len(indices)} done, {time.perf_counter() - start:.0f} s")

    async with GatewayClient(address) as client:
        await asyncio.gather(*[worker(client) for _ in range(concurrency)])
    return sorted(results, key=lambda r: r.index)


async def target_of(address: str) -> Target:
    async with GatewayClient(address) as client:
        m = await client.list_models(timeout_s=30)
    return Target(m.models[0] if m.models else "", m.max_context_tokens, m.max_tokens_limit, m.has_chat_template)


async def answering(address: str, chat: bool, timeout_s: float = 60.0) -> tuple[bool, str]:
    """(whether a plain greedy 8-token request succeeds within timeout_s, its text or error)."""
    req = make_request("What is the capital of France?", chat=chat, max_tokens=8, temperature=0.0)
    try:
        async with GatewayClient(address) as client:
            out = await client.complete(req, timeout_s=timeout_s)
    except grpc.aio.AioRpcError as exc:
        return False, f"{exc.code().name}: {exc.details()}"
    return out.final is not None and out.final.generated_tokens >= 1, out.text


# ---- the report ------------------------------------------------------------------------------


def _is_failure(r: Result) -> bool:
    return r.status in FAILING or (r.status == "DEADLINE_EXCEEDED" and r.small)


def summarize(
    results: list[Result],
    seconds: float,
    mesh_answering: bool,
    answer: str,
    dead: list[str],
    unhandled: int,
    tracebacks: list[str],
) -> dict:
    by_status = Counter(r.status for r in results)
    examples: dict[str, list[str]] = defaultdict(list)
    by_case: dict[str, Counter] = defaultdict(Counter)
    failures, per_status = [], Counter()
    for r in results:
        by_case[r.case.split(":")[0] if r.case.startswith("combo") else r.case][r.status] += 1
        d = r.details[:200]
        if d and d not in examples[r.status] and len(examples[r.status]) < 2:
            examples[r.status].append(d)
        if _is_failure(r):
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


def _log_exceptions(path: str) -> tuple[int, list[str]]:
    """(servicer methods that raised, which an internal hop sees as UNKNOWN and the gateway may
    pass on as UNAVAILABLE; distinct last lines of the log's tracebacks, at most 10)."""
    with open(path, errors="replace") as f:
        text = f.read()
    unhandled = len(re.findall(r"Unexpected \[\w+\] raised by servicer method", text))
    found = re.findall(r"Traceback \(most recent call last\):\n(?:[ \t].*\n)*(.+)", text)
    return unhandled, list(dict.fromkeys(line[:200] for line in found))[:10]


def run(args: argparse.Namespace) -> int:
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else (lambda *a: print(*a, flush=True))
    if args.requests < 1 or args.concurrency < 1 or not args.deadline_s > 0:
        print("error: --requests and --concurrency must be >= 1 and --deadline-s > 0", file=sys.stderr)
        return 2
    indices = args.index or list(range(args.requests))
    mesh, log = None, None
    address = args.gateway
    if not address:
        from kvmesh.launcher import start_mesh
        from kvmesh.redis_server import free_port

        log = tempfile.NamedTemporaryFile("w+", prefix="kvmesh-fuzz-", suffix=".log", delete=False)
        say(f"starting a mesh (1 prefill, 1 decode); services log to {log.name}")
        try:
            mesh = start_mesh(1, 1, args.model, port=free_port(), log=log, env={"REDIS_URL": ""})
        except Exception as exc:
            log.seek(0)
            print(log.read()[-4000:], file=sys.stderr)
            print(f"error: the mesh did not start: {exc} (log: {log.name})", file=sys.stderr)
            return 1
        address = mesh.gateway_address
    try:
        try:
            t = asyncio.run(target_of(address))
        except grpc.aio.AioRpcError as exc:
            print(f"error: ListModels on {address} failed: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
        say(
            f"gateway {address}: {t.model}, context {t.max_context} tokens, max_tokens <= {t.max_tokens_limit}; "
            f"{len(indices)} requests, {args.concurrency} at a time, seed {args.seed}"
        )
        start = time.perf_counter()
        results = asyncio.run(fuzz(address, args.seed, indices, t, args.concurrency, args.deadline_s, say))
        seconds = time.perf_counter() - start
        ok, answer = asyncio.run(answering(address, t.chat))
        dead = [name for name, p in mesh.procs if p.poll() is not None] if mesh else []
    finally:
        if mesh is not None:
            mesh.stop()
    unhandled, tracebacks = _log_exceptions(log.name) if log else (0, [])
    summary = summarize(results, seconds, ok, answer, dead, unhandled, tracebacks)
    if args.json:
        print(json.dumps(summary))
    else:
        print_report(summary)
    if log:
        say(f"services' log kept in {log.name}")
    return 1 if summary["num_failures"] or not ok or dead or unhandled else 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gateway", default=None, help="gateway HOST:PORT (default: start a local mesh)")
    p.add_argument("--requests", type=int, default=3000, help="requests to send (default 3000)")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight at once (default 32)")
    p.add_argument("--seed", type=int, default=0, help="seed of the request generator (default 0)")
    p.add_argument(
        "--index", type=int, action="append", help="send only request INDEX of the seed, not --requests (repeatable)"
    )
    p.add_argument("--deadline-s", type=float, default=60.0, help="client deadline of each request (default 60)")
    p.add_argument("--model", default=None, help="model of the local mesh (default SmolLM2-135M-Instruct)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


if __name__ == "__main__":
    from kvmesh.commands import Command

    sys.exit(Command(__doc__.splitlines()[0], add_arguments, run).main("kvmesh fuzz"))
