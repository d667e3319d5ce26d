"""A mesh of P prefill and D decode instances replaying a workload, by a measured profile: each
request's TTFT and mean ITL, as the planner predicts them.

The mesh as kvmesh runs it:
- A request arrives at the gateway, which reserves a place at the decode instance with the fewest
  requests (`max_batch_size` each: when every decode is full the request waits, first come first
  served) and routes the prompt to the prefill instance holding its longest cached prefix, then
  the one with the fewest queued tokens.
- A prefill instance computes its queue first come first served, in batches of the whole prompts
  that fit `chunk_tokens` together (a longer prompt alone, over several forwards of at most
  `chunk_tokens`: chunked prefill), a batch at a time, as its engine does;
  a prompt's full blocks stay cached there (no eviction is modelled). Its first token comes
  `first_token_s` after its last forward, and it then joins its decode's batch.
- A decode instance runs steps while it has requests: every request in a step gets one token.

Cores: with `shared_cores` every instance runs on one host's cores and they take turns (the
launcher's --cpu-share: with both roles waiting, a decode step, then a prefill forward; the prefill
instances' forwards first come first served by their oldest request, the decode instances' steps
each in turn); otherwise each instance has its own device and runs beside the others.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass, field

from kvmesh.planner.profile import Profile
from kvmesh.planner.workload import Workload

WORK_COUNTERS = (
    "prefill.num_forwards",
    "prefill.forward_seconds",
    "prefill.num_prompt_tokens_computed",
    "decode.num_steps",
    "decode.step_seconds",
    "decode.num_generated_tokens",
)
"""The role and GetStats field of each count of the work a simulation did (SimResult.work)."""


@dataclass(frozen=True)
class MeshShape:
    """What the planner chooses."""

    num_prefill: int
    num_decode: int
    chunk_tokens: int
    """Prefill's --chunked-prefill-size and --max-batch-tokens (tokens a forward)."""
    max_batch_size: int
    """Decode's --max-batch-size (requests reserved or running at once)."""

    def __str__(self) -> str:
        return f"{self.num_prefill}P {self.num_decode}D chunk {self.chunk_tokens} batch<={self.max_batch_size}"


@dataclass
class SimResult:
    ttft_s: list[float]
    """Each request's TTFT (seconds from its arrival), in workload order."""
    itl_s: list[float]
    """Each request's mean ITL over its answer (seconds; 0 for answers of one token)."""
    end_s: float
    """When the last request finished (seconds from the workload's start)."""
    work: dict[str, float] = field(default_factory=dict)
    """What the instances computed (WORK_COUNTERS, summed over each role's instances): what the
    plan check compares with the mesh's own counters."""

    def percentile(self, which: str, q: float) -> float:
        """The q-th percentile (0-100, nearest rank) of "ttft" or "itl" (requests with an ITL)."""
        xs = sorted(self.ttft_s if which == "ttft" else [x for x in self.itl_s if x > 0])
        if not xs:
            return 0.0
        return xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))]


@dataclass
class _Request:
    index: int
    arrival_s: float
    prompt: int
    answer: int
    cached: int = 0
    done: int = 0
    """Prompt tokens in its KV so far (cached + computed)."""
    decode: int = -1
    routed_s: float = 0.0
    first_token_s: float = 0.0
    tokens: int = 0
    last_token_s: float = 0.0


@dataclass
class _Decode:
    reserved: int = 0
    landing: list[tuple[float, int]] = field(default_factory=list)
    """(when its first token is out and it joins the batch, request index)."""
    running: list[int] = field(default_factory=list)


class _Sim:
    def __init__(self, workload: Workload, shape: MeshShape, profile: Profile, shared_cores: bool) -> None:
        self.w, self.shape, self.p = workload, shape, profile
        self.requests = [
            _Request(i, r.arrival_s, r.input_tokens, max(r.output_tokens, 1)) for i, r in enumerate(workload.requests)
        ]
        self.prefill_queues: list[deque[int]] = [deque() for _ in range(shape.num_prefill)]
        self.prefill_cached: list[set[int]] = [set() for _ in range(shape.num_prefill)]
        self.batch = [0] * shape.num_prefill
        """How many requests at the head of each prefill's queue are the batch it computes."""
        self.decodes = [_Decode() for _ in range(shape.num_decode)]
        self.waiting: deque[int] = deque()
        # actors: prefill 0..P-1, then decode P..P+D-1; each in one core group
        actors = shape.num_prefill + shape.num_decode
        self.group_of = [0] * actors if shared_cores else list(range(actors))
        num_groups = max(self.group_of) + 1
        self.idle = [True] * num_groups
        self.last_side = ["decode"] * num_groups
        self.turn: dict[tuple[int, str], int] = {}
        """(group, "decode") -> the actor from which the next decode step is looked for."""
        self.events: list[tuple[float, int, str, int]] = []
        self.seq = 0
        self.now = 0.0
        self.work = dict.fromkeys(WORK_COUNTERS, 0.0)

    def push(self, t: float, kind: str, arg: int) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, arg))

    def run(self) -> SimResult:
        for r in self.requests:
            self.push(r.arrival_s, "arrive", r.index)
        while self.events:
            self.now, _, kind, arg = heapq.heappop(self.events)
            if kind == "arrive":
                self.waiting.append(arg)
                self.admit()
            elif kind == "land":
                self.kick(self.group_of[self.shape.num_prefill + arg])
            elif kind == "finish":
                self.done(self.requests[arg])
            elif kind == "free":
                self.idle[arg] = True
                self.kick(arg)
        ttft = [r.first_token_s - r.arrival_s for r in self.requests]
        itl = [(r.last_token_s - r.first_token_s) / (r.tokens - 1) if r.tokens > 1 else 0.0 for r in self.requests]
        return SimResult(ttft, itl, self.now, self.work)

    def admit(self) -> None:
        """Reserve a decode place for waiting requests, first come first served, and route each
        admitted prompt to a prefill instance."""
        while self.waiting:
            d = min(range(len(self.decodes)), key=lambda i: self.decodes[i].reserved)
            if self.decodes[d].reserved >= self.shape.max_batch_size:
                return
            r = self.requests[self.waiting.popleft()]
            self.decodes[d].reserved += 1
            r.decode, r.routed_s = d, self.now
            p = self.route(r)
            self.prefill_queues[p].append(r.index)
            self.kick(self.group_of[p])

    def route(self, r: _Request) -> int:
        """The prefill with the longest cached prefix of r, then the fewest queued tokens."""
        ids = self.w.requests[r.index].hash_ids

        def hits(p: int) -> int:
            n = 0
            for h in ids:
                if h not in self.prefill_cached[p]:
                    break
                n += 1
            return n

        def queued(p: int) -> int:
            return sum(self.requests[i].prompt - self.requests[i].done for i in self.prefill_queues[p])

        p = min(range(len(self.prefill_queues)), key=lambda p: (-hits(p), queued(p), p))
        r.cached = r.done = min(hits(p) * self.w.block_tokens, r.prompt - 1)
        return p

    def kick(self, group: int) -> None:
        """If `group`'s cores are free, start its next piece of work."""
        if not self.idle[group]:
            return
        actor = self.next_actor(group)
        if actor is None:
            return
        self.idle[group] = False
        if actor < self.shape.num_prefill:
            seconds = self.forward(actor)
            self.last_side[group] = "prefill"
        else:
            seconds = self.step(actor - self.shape.num_prefill)
            self.last_side[group] = "decode"
        self.push(self.now + seconds, "free", group)

    def next_actor(self, group: int) -> int | None:
        """The group's next actor with work: the other role than the last one first (shared cores
        take turns); of the prefill instances, the one whose next forward's oldest request was
        routed first (their prompts first come first served: kvmesh.runtime.cpu_share), of the
        decode instances each in turn."""
        members = [a for a, g in enumerate(self.group_of) if g == group]
        ready = [a for a in members if self.has_work(a)]
        if not ready:
            return None
        other = [a for a in ready if (a < self.shape.num_prefill) != (self.last_side[group] == "prefill")]
        pool = other or ready
        if pool[0] < self.shape.num_prefill:  # the forward whose oldest request was routed first
            return min(pool, key=lambda p: (self.requests[self.prefill_queues[p][0]].routed_s, p))
        start = self.turn.get((group, "decode"), 0)  # decode instances take turns among themselves
        actor = min(pool, key=lambda a: (a - start) % len(self.group_of))
        self.turn[(group, "decode")] = actor + 1
        return actor

    def has_work(self, actor: int) -> bool:
        if actor < self.shape.num_prefill:
            return bool(self.prefill_queues[actor])
        d = self.decodes[actor - self.shape.num_prefill]
        return bool(d.running) or bool(d.landing and d.landing[0][0] <= self.now)  # a heap: its first lands first

    def forward(self, p: int) -> float:
        """Prefill p's next forward; its finished prompts' first tokens are scheduled. Seconds.

        As the engine computes (kvmesh.prefill_svc.engine, PendingRequests.take): a batch is the
        whole prompts at the queue's head whose prompts fit the chunk together (the first one
        always), and each forward computes a chunk of every prompt of the batch still computing;
        the next batch is taken once this one is done."""
        queue, chunk, tokens, attention, finished = self.prefill_queues[p], self.shape.chunk_tokens, 0, 0.0, []
        if not self.batch[p]:
            self.batch[p] = self.batch_size(queue, chunk)
        batch = [self.requests[i] for i in itertools.islice(queue, self.batch[p])]
        for r in batch:
            n = min(chunk, r.prompt - r.done)
            attention += n * (r.done + n / 2)
            r.done += n
            tokens += n
        if all(r.done >= r.prompt for r in batch):
            finished = [queue.popleft() for _ in batch]
            self.batch[p] = 0
        seconds = self.p.forward_s(tokens, attention)
        self.work["prefill.num_forwards"] += 1
        self.work["prefill.forward_seconds"] += seconds
        self.work["prefill.num_prompt_tokens_computed"] += tokens
        for i in finished:
            r = self.requests[i]
            r.first_token_s = r.last_token_s = self.now + seconds + self.p.first_token_s
            r.tokens = 1
            ids = self.w.requests[i].hash_ids[: r.prompt // self.w.block_tokens]
            self.prefill_cached[p].update(ids)
            if r.answer <= 1:
                self.push(r.first_token_s, "finish", i)
            else:
                heapq.heappush(self.decodes[r.decode].landing, (r.first_token_s, i))
                self.push(r.first_token_s, "land", r.decode)
        return seconds

    def batch_size(self, queue: deque[int], chunk: int) -> int:
        """How many requests at the head of `queue` the next batch takes: those whose prompts fit
        `chunk` tokens together, the first one always (PendingRequests.take's rule)."""
        size, total = 0, 0
        for i in queue:
            total += self.requests[i].prompt
            if size and total > chunk:
                break
            size += 1
        return size

    def step(self, d: int) -> float:
        """Decode d's next step over the requests that have landed; seconds."""
        dec = self.decodes[d]
        while dec.landing and dec.landing[0][0] <= self.now:
            dec.running.append(heapq.heappop(dec.landing)[1])
        context = sum(self.requests[i].prompt + self.requests[i].tokens for i in dec.running)
        seconds = self.p.decode_step_s(len(dec.running), context)
        self.work["decode.num_steps"] += 1
        self.work["decode.step_seconds"] += seconds
        self.work["decode.num_generated_tokens"] += len(dec.running)
        end = self.now + seconds
        still = []
        for i in dec.running:
            r = self.requests[i]
            r.tokens += 1
            r.last_token_s = end
            if r.tokens >= r.answer:
                self.push(end, "finish", i)  # its place frees when the step is done
            else:
                still.append(i)
        dec.running = still
        return seconds

    def done(self, r: _Request) -> None:
        self.decodes[r.decode].reserved -= 1
        self.admit()


def simulate(workload: Workload, shape: MeshShape, profile: Profile, shared_cores: bool | None = None) -> SimResult:
    """Replay `workload` on a mesh of `shape` by `profile` (shared_cores: the profile's when None).

    Raises ValueError for a shape with no instance of a role, a chunk or batch cap < 1."""
    if min(shape.num_prefill, shape.num_decode, shape.chunk_tokens, shape.max_batch_size) < 1:
        raise ValueError(f"a mesh needs >= 1 prefill and decode, chunk and batch cap >= 1: {shape}")
    sim = _Sim(workload, shape, profile, profile.shared_cores if shared_cores is None else shared_cores)
    return sim.run()
