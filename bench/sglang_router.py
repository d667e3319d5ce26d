"""Replay a request trace through a real sglang-router and read back where it sent each request.

`kvmesh routesim` compares routing policies by feeding each policy's per-request instance
assignments into one cache simulation. This module gets those assignments for SGLang's own
router (PyPI `sglang-router`, a Rust binary wheel; verified with 0.3.2): it starts the router
as a subprocess in front of N stub workers on loopback, sends every trace request through it,
and asks each stub which requests it received.

Policies (our name -> what runs in sglang-router 0.3.2):
- "cache_aware" -> `cache_aware` with SGLang's defaults (cache_threshold=0.3,
  balance_abs_threshold=64, balance_rel_threshold=1.5): a per-worker radix tree over request
  *characters*; a request goes to the worker with the longest matched prefix if more than 30% of
  its text matched, else to the worker with the fewest requests in flight (ties: the router's
  first worker), and to the least-loaded worker regardless of prefixes once the in-flight counts
  differ by more than 64 and by more than 1.5x (sgl-project/sglang,
  sgl-model-gateway/src/policies/cache_aware.rs; the below-threshold choice checked by experiment).
- "prefix_hash" -> `consistent_hashing` keyed by the prompt's first `prefix_tokens` tokens.
  The router's own `prefix_hash` policy cannot be used here: 0.3.2's HTTP router hands policies
  no token ids (`tokens: None`), so `prefix_hash` finds no worker and every request fails with
  503 no_available_workers; its gRPC router, which does tokenize, panics at start-up without
  internet access because it downloads the Harmony (o200k) vocabulary. `prefix_hash` itself
  is "hash the first 256 tokens, look the hash up on the worker hash ring, fall back to the least
  loaded worker if the ring's pick is over 1.25x the average load"; the HTTP router does not track
  load for it, so what is left is the ring lookup, which `consistent_hashing` does on the same ring
  with the key we pass in the X-SMG-Routing-Key header (policies/prefix_hash.rs,
  policies/consistent_hashing.rs, routers/http/router.rs of the same tree).

Prompts: SGLang's cache_aware matches text, so each hash id becomes one deterministic text block
that starts with a character no other id < 131,068 starts with (a Private Use Area code point);
two requests sharing their first k hash ids share exactly their first k blocks of text.

Nothing leaves loopback: the router, its metrics listener and the stubs bind 127.0.0.1, the stubs
report no model path (so the router does not fetch a tokenizer from the Hugging Face hub), and the
router runs with HTTP(S)_PROXY pointing at a closed loopback port as a guard.

The router's process is started and stopped in bench/sglang_router_process.py, the stub workers
live in bench/sglang_stub_workers.py; this module replays the trace through them.
"""

from __future__ import annotations

import hashlib
import heapq
import http.client
import importlib.util
import json
import math
import threading
import time

from kvmesh.bench.sglang_router_process import log_tail, router_process
from kvmesh.bench.sglang_stub_workers import Board, Pending, StubWorker

POLICIES = ("cache_aware", "prefix_hash")
TRACE_BLOCK_TOKENS = 512  # tokens per hash id in Mooncake traces
INSTALL_HINT = "install it with: pip install 'sglang-router>=0.3.2'  (or: pip install -e '.[test]')"

# sglang-router policy that runs for each of our names; see the module docstring for prefix_hash.
_ROUTER_POLICY = {"cache_aware": "cache_aware", "prefix_hash": "consistent_hashing"}

_PUA_PLANE = 65534  # code points in each Supplementary Private Use Area (U+F0000, U+100000)


def sglang_available() -> bool:
    """True if the sglang-router package and its Rust extension are installed."""
    try:
        return importlib.util.find_spec("sglang_router.sglang_router_rs") is not None
    except ModuleNotFoundError:
        return False


def block_text(block_id: int, block_words: int) -> str:
    """Deterministic text standing for one trace block (512 tokens) with hash id `block_id`.

    The text is a lead character, the id and `block_words` 4-hex-digit words, newline-terminated.
    The lead character is unique for ids in [0, 131068), so two different ids in that range give
    texts that differ from their first character and a radix tree matches no part of them.
    """
    n = block_id % (2 * _PUA_PLANE)
    lead = chr(0xF0000 + n) if n < _PUA_PLANE else chr(0x100000 + n - _PUA_PLANE)
    digits = hashlib.shake_128(str(block_id).encode()).hexdigest(2 * block_words)
    words = " ".join(digits[i : i + 4] for i in range(0, len(digits), 4))
    return f"{lead}{block_id}: {words}\n"


def sglang_assignments(
    requests: list[dict],
    num_instances: int,
    policy: str,
    *,
    block_words: int = 64,
    prefix_tokens: int = 256,
    prefill_tokens_per_s: float = 10_000.0,
    decode_tokens_per_s: float = 25.0,
    timeout_s: float = 900.0,
) -> list[int]:
    """Replay `requests` through a real sglang-router in front of `num_instances` stub workers.

    Args:
        requests: trace rows (dicts with 'timestamp' in ms, 'input_length' and 'output_length' in
            tokens, 'hash_ids'), replayed in list order.
        num_instances: number of stub workers, >= 1.
        policy: "cache_aware" or "prefix_hash" (see the module docstring for what each runs).
        block_words: words of synthesized text per hash id (one 512-token block).
        prefix_tokens: for "prefix_hash", how many leading prompt tokens the key covers, counted at
            the trace's 512 tokens per hash id and rounded up to whole blocks; 256 is the router's
            PrefixHashConfig default, which on Mooncake traces is just the first block.
        prefill_tokens_per_s, decode_tokens_per_s: simulated service speed of one worker for one
            request (tokens/s); a request stays in flight for input_length / prefill_tokens_per_s
            + output_length / decode_tokens_per_s trace seconds (defaults: ~15 s on average on
            the Mooncake conversation trace, so ~11 requests in flight per worker of 4).
        timeout_s: wall-clock budget in seconds for start-up plus replay.

    Returns:
        One worker index in [0, num_instances) per request, in trace order; workers are numbered
        in order of first use (the stubs are identical), which makes runs repeatable.

    Replay (virtual time): requests go out one at a time in trace order; each stub holds every
    /generate until the replay releases it at the request's simulated finish time. Before sending
    a request that arrives at trace time t, the replay releases every request that finished by t
    and waits until the router's per-worker load counters (GET /workers) equal the requests still
    in flight; then it sends the request and waits until a stub has received it. So the router
    decides with exactly the in-flight counts of a real-time replay at the trace's own rate,
    independent of this machine's speed, and the run is repeatable (4,000 dev-trace requests take
    about a minute on 2 cores). A plain sequential replay was rejected: with every load at zero,
    0.3.2's cache_aware sends each request that matches no cached prefix to the same (first)
    worker, so all traffic lands on one instance. Prefill time does not shrink with cache hits.

    Raises:
        ValueError: unknown policy or a non-positive size or speed argument.
        ImportError: sglang-router is not installed (the message says how to install it).
        RuntimeError: the router would not start or failed a request (with its log tail).
        TimeoutError: start-up plus replay took longer than `timeout_s`.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if min(num_instances, block_words, prefix_tokens) < 1 or min(prefill_tokens_per_s, decode_tokens_per_s) <= 0:
        raise ValueError(
            "num_instances, block_words, prefix_tokens must be >= 1 and the speeds > 0, got "
            f"{num_instances}, {block_words}, {prefix_tokens}, {prefill_tokens_per_s}, {decode_tokens_per_s}"
        )
    if not sglang_available():
        raise ImportError(f"sglang-router is not installed; {INSTALL_HINT}")
    if not requests:
        return []

    deadline = time.monotonic() + timeout_s
    board = Board(deadline)
    stubs = [StubWorker(i, board) for i in range(num_instances)]
    try:
        urls = [s.url for s in stubs]
        with router_process(urls, _ROUTER_POLICY[policy], deadline) as (port, log_path):
            key_blocks = math.ceil(prefix_tokens / TRACE_BLOCK_TOKENS) if policy == "prefix_hash" else 0
            # the router keeps load counters only for cache_aware (and manual)
            replay = _Replay(port, urls, log_path, board, deadline, policy == "cache_aware", key_blocks)
            try:
                return replay.run(requests, block_words, prefill_tokens_per_s, decode_tokens_per_s)
            finally:
                board.release_all()  # let held requests finish before the router is stopped
                replay.join()
    finally:
        for s in stubs:
            s.close()


class _Replay:
    """Sends trace requests through the router in virtual time (see sglang_assignments)."""

    def __init__(
        self,
        port: int,
        urls: list[str],
        log_path: str,
        board: Board,
        deadline: float,
        track_load: bool,
        key_blocks: int,
    ) -> None:
        self.port, self.urls, self.log_path, self.board, self.deadline = port, urls, log_path, board, deadline
        self.track_load = track_load  # sync with the router's load counters before each decision
        self.key_blocks = key_blocks  # > 0: send X-SMG-Routing-Key built from this many leading blocks
        self.threads: list[threading.Thread] = []

    def run(self, requests: list[dict], block_words: int, prefill_tps: float, decode_tps: float) -> list[int]:
        texts: dict[int, str] = {}
        finishing: list[tuple[float, int, Pending]] = []  # heap of (finish time s, index, request)
        inflight = [0] * len(self.urls)
        assignments = []
        now = 0.0
        for i, row in enumerate(requests):
            if self._remaining() == 0:
                raise TimeoutError(f"replay ran past timeout_s after {i} of {len(requests)} requests")
            now = max(now, row["timestamp"] / 1000.0)  # virtual time never runs backwards
            released = False
            while finishing and finishing[0][0] <= now:
                p = heapq.heappop(finishing)[2]
                self._finish(p)
                inflight[p.worker] -= 1
                released = True
            if released and self.track_load:
                self._wait_loads(inflight)

            for h in row["hash_ids"]:
                if h not in texts:
                    texts[h] = block_text(h, block_words)
            blocks = [texts[h] for h in row["hash_ids"]]
            p = self._send(f"kvmesh-{i}", blocks)
            inflight[p.worker] += 1
            assignments.append(p.worker)
            service_s = row["input_length"] / prefill_tps + row["output_length"] / decode_tps
            heapq.heappush(finishing, (now + service_s, i, p))
        while finishing:
            self._finish(heapq.heappop(finishing)[2])
        # Number workers by first use: the router orders its workers by which stub registered
        # first, a race that would otherwise permute the labels from run to run.
        label: dict[int, int] = {}
        return [label.setdefault(w, len(label)) for w in assignments]

    def join(self) -> None:
        for t in self.threads:
            t.join(timeout=max(0.0, self.deadline - time.monotonic()) + 5)

    def _send(self, rid: str, blocks: list[str]) -> Pending:
        """Post one request from its own thread; return once a stub holds it."""
        body = {"text": "".join(blocks), "sampling_params": {"max_new_tokens": 1}, "rid": rid}
        headers = {"Content-Type": "application/json"}
        if self.key_blocks:
            prefix = "".join(blocks[: self.key_blocks]).encode()
            headers["X-SMG-Routing-Key"] = hashlib.blake2b(prefix, digest_size=16).hexdigest()
        p = self.board.add(rid)
        data = json.dumps(body, ensure_ascii=False).encode()
        p.thread = threading.Thread(target=self._post, args=(p, data, headers), name=rid, daemon=True)
        self.threads.append(p.thread)
        p.thread.start()
        if not p.arrived.wait(self._remaining()):
            raise TimeoutError(f"request {rid} did not reach a worker in time\n{log_tail(self.log_path)}")
        if p.error:
            raise RuntimeError(f"request {rid}: {p.error}\n{log_tail(self.log_path)}")
        return p

    def _post(self, p: Pending, data: bytes, headers: dict[str, str]) -> None:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self._remaining() + 5)
            conn.request("POST", "/generate", data, headers)
            resp = conn.getresponse()
            body = resp.read()
            conn.close()
            if resp.status != 200:
                p.error = f"router answered {resp.status} {body[:300]!r}"
            elif json.loads(body)["meta_info"]["id"] != p.rid:
                p.error = f"response for another request: {body[:300]!r}"
        except (OSError, ValueError, KeyError, http.client.HTTPException) as e:
            p.error = f"{type(e).__name__}: {e}"
        finally:
            p.arrived.set()  # wakes the replay if it failed before any stub saw it

    def _finish(self, p: Pending) -> None:
        """Let the stub answer `p` and wait until the router has passed the answer back."""
        p.release.set()
        assert p.thread is not None
        p.thread.join(self._remaining())
        if p.thread.is_alive():
            raise TimeoutError(f"request {p.rid} was released but never completed\n{log_tail(self.log_path)}")
        if p.error:
            raise RuntimeError(f"request {p.rid}: {p.error}\n{log_tail(self.log_path)}")

    def _wait_loads(self, inflight: list[int]) -> None:
        """Poll GET /workers until the router's load counters equal our in-flight counts."""
        expected = dict(zip(self.urls, inflight))
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            while True:
                conn.request("GET", "/workers")
                loads = {w["url"]: w.get("load") for w in json.loads(conn.getresponse().read())["workers"]}
                if loads == expected:
                    return
                if time.monotonic() > self.deadline:
                    raise TimeoutError(f"replay ran past timeout_s waiting for router loads {expected}, saw {loads}")
                time.sleep(0.0005)
        finally:
            conn.close()

    def _remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())
