"""The gateway's path to the first token (its orchestration): the prefix index is asked once
for both roles before Reserve, a decode that holds the prompt is picked and reserved first
(prefill skips its pages), the prefill leg joins the attempt afterwards, Prefill goes out while
Reserve is in flight once decode's KV address is known (under the gateway's transfer id),
small prompts skip the worker thread, and `kvmesh bench` derives the orchestration time
from the Final message.
The instances and the index are test doubles; the pool, the router and the servicer are real."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvmesh.bench.mesh import orchestration_s
from kvmesh.client import make_request
from kvmesh.engine.outcomes import FailureCause
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.gateway.accounting import Stage
from kvmesh.gateway.admission import AdmissionQueue
from kvmesh.gateway.attempt import Attempt
from kvmesh.gateway.failure import RequestFailed
from kvmesh.gateway.pool import InstancePool
from kvmesh.gateway.request_path import INLINE_PROMPT_BYTES, RequestPath, _tokenize_inline
from kvmesh.gateway.requests import GenerateInput
from kvmesh.gateway.router import InstanceLoad
from kvmesh.gateway.sessions import SessionTable
from kvmesh.kvstore.block_hash import hash_blocks
from kvmesh.protos.v1 import decode_pb2, gateway_pb2, prefill_pb2


class Events(list):
    """What happened, in order."""


class SlowIndex:
    """A prefix index whose answer waits until the test lets it go."""

    def __init__(self, events: Events, holds: dict[str, int]) -> None:
        self.events = events
        self.holds = holds
        self.answer = asyncio.Event()

    async def longest_prefix(self, block_hashes, instance_ids):
        self.events.append("index asked")
        await self.answer.wait()
        self.events.append("index answered")
        return {i: self.holds.get(i, 0) for i in instance_ids}

    async def close(self) -> None:
        pass


class FakeDecode:
    """A decode instance whose Reserve answers when the test lets it."""

    def __init__(self, events: Events, kv_address: str = "decode:9", refuse: bool = False, own_id: int = 0) -> None:
        self.events = events
        self.answer = asyncio.Event()
        self.kv_address = kv_address
        self.refuse = refuse
        self.own_id = own_id  # an older decode picks its own transfer id

    async def Reserve(self, request, timeout=None, metadata=None):
        self.events.append("reserve sent")
        await self.answer.wait()
        if self.refuse:
            self.events.append("reserve refused")
            raise _rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "bad")
        self.events.append("reserved")
        # decode reserves under the caller's id (as decode_svc does when one is given)
        return decode_pb2.ReserveResponse(
            kv_address=self.kv_address, transfer_id=self.own_id or request.transfer_id, instance_id="d1"
        )

    async def Release(self, request, timeout=None):
        self.events.append(f"release {request.transfer_id}")
        return decode_pb2.ReleaseResponse(released=True)


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class FakePrefill:
    """Prefill calls as grpc.aio makes them: on their way once made, cancellable."""

    def __init__(self, events: Events) -> None:
        self.events = events
        self.calls: list[asyncio.Task] = []
        self.transfer_ids: list[int] = []
        self.answer = asyncio.Event()
        self.answer.set()  # answers at once unless a test holds it

    def Prefill(self, request, timeout=None, metadata=None):
        self.events.append(f"prefill to {request.decode_kv_address}")
        self.transfer_ids.append(request.transfer_id)

        async def answer():
            await asyncio.sleep(0)
            await self.answer.wait()
            self.events.append("prefilled")
            return prefill_pb2.PrefillResponse(first_token=5, num_cached_tokens=32, instance_id="p2")

        self.calls.append(asyncio.ensure_future(answer()))
        return self.calls[-1]


class Tokenizer:
    def decode(self, ids, **kwargs) -> str:
        return "".join(f"<{i}>" for i in ids)


class Builder:
    tokenizer = Tokenizer()


def _servicer(events: Events, index, decode: FakeDecode | None = None) -> tuple[RequestPath, InstancePool]:
    pool = InstancePool(
        ["p1:1", "p2:1"],
        ["d1:1"],
        page_size=16,
        index=index,  # type: ignore[arg-type]
        cache_threshold=0.3,
        load_weight=0.02,
        rpc_timeout_s=1.0,
    )
    for inst, name in zip(pool.prefills, ("p1", "p2")):
        inst.instance_id = name
    pool._decode_stubs = {"d1:1": decode or FakeDecode(events)}  # type: ignore[dict-item]
    pool._prefill_stubs = {a: FakePrefill(events) for a in ("p1:1", "p2:1")}  # type: ignore[misc]
    admission = AdmissionQueue(lambda: 8, max_queued_requests=8, max_queued_tokens=10_000, max_queue_time_s=5)
    servicer = RequestPath(Builder(), pool, admission, frozenset(), 1.0, 30.0, 20.0, 8.0)  # type: ignore[arg-type]
    return servicer, pool


def _input(num_tokens: int) -> GenerateInput:
    return GenerateInput(
        request_id="r1",
        prompt_token_ids=tuple(range(100, 100 + num_tokens)),
        sampling=SamplingParams(seed=1),
        max_tokens=1,
        stop=(),
        ignore_eos=False,
    )


def test_the_index_is_asked_once_for_both_roles_then_reserve_and_routing_follow_it():
    async def scenario():
        events = Events()
        index = SlowIndex(events, holds={"p2": 3})  # p2 holds the prompt's first 3 blocks
        servicer, pool = _servicer(events, index)
        try:
            run = asyncio.ensure_future(_collect(servicer._attempts(_input(50), None, arrived=0.0, waited=0.0)))
            for _ in range(5):
                await asyncio.sleep(0)
            # the index is asked first (its answer picks decode as well as prefill); nothing is held yet
            assert events == ["index asked"]
            p1, p2 = pool.prefills
            assert pool.decodes[0].in_flight_requests == 0 and p1.in_flight_requests == p2.in_flight_requests == 0
            index.answer.set()
            for _ in range(5):
                await asyncio.sleep(0)
            # routed by the index (p2 holds the prefix); decode's KV address is not known yet
            # (no stats poll answered), so Reserve goes out and Prefill waits for its answer
            assert events[1:] == ["index answered", "reserve sent"]
            assert (p1.in_flight_requests, p2.in_flight_requests) == (0, 1)
            pool._decode_stubs["d1:1"].answer.set()  # type: ignore[attr-defined]
            msgs = await run
            assert events[3:5] == ["reserved", "prefill to decode:9"] and events[5] == "prefilled"
            assert events[6].startswith("release ") and int(events[6].split()[1]) > 0
            # and the Reserve's answer taught the pool where decode takes KV
            assert pool.decodes[0].kv_address == "decode:9"
            final = msgs[-1].final
            assert final.prefill_instance == "p2" and final.decode_instance == "d1"
            # a finished attempt keeps its routed tokens (prompt minus the cached prefix) on p2
            assert p2.total_routed_tokens == 50 - 48 and p2.in_flight_requests == 0
            assert pool.decodes[0].in_flight_requests == 0
        finally:
            await pool.close()

    asyncio.run(scenario())


def test_a_decode_that_holds_the_prompt_is_picked_reserved_first_and_prefill_skips_its_pages():
    """Decode-side prefix reuse at the gateway: the index says d2 holds 2 leading blocks, so d2
    is picked although d1 is less loaded (within the slack), Reserve goes first asking to reuse
    (with the prompt's block hashes), and Prefill pushes after the pages d2 says it holds."""

    class HoldingDecode(FakeDecode):
        def __init__(self, events: Events, held: int) -> None:
            super().__init__(events)
            self.answer.set()
            self.held = held
            self.asked: list[decode_pb2.ReserveRequest] = []

        async def Reserve(self, request, timeout=None, metadata=None):
            self.asked.append(request)
            self.events.append(f"reserve sent reuse={request.reuse_cached}")
            return decode_pb2.ReserveResponse(
                kv_address=self.kv_address,
                transfer_id=request.transfer_id,
                instance_id="d2",
                num_cached_pages=self.held if request.reuse_cached else 0,
            )

    class Index:
        async def longest_prefix(self, block_hashes, instance_ids):
            return {i: 2 if i == "d2" else 0 for i in instance_ids}

        async def close(self) -> None:
            pass

    async def scenario():
        events = Events()
        pool = InstancePool(["p1:1"], ["d1:1", "d2:1"], 16, Index(), 0.3, 0.02, 1.0, decode_hit_slack=2)  # type: ignore[arg-type]
        pool.prefills[0].instance_id = "p1"
        d1, d2 = pool.decodes
        d1.instance_id, d2.instance_id = "d1", "d2"
        d1.kv_address = d2.kv_address = "decode:9"  # known: without the hit, Prefill would go first
        d2.reported_active_requests = 2  # busier than d1, within the slack
        holder = HoldingDecode(events, held=2)
        pool._decode_stubs = {"d1:1": FakeDecode(events), "d2:1": holder}  # type: ignore[dict-item]
        prefill = FakePrefill(events)
        sent: list[prefill_pb2.PrefillRequest] = []
        make = prefill.Prefill
        prefill.Prefill = lambda request, **kw: (sent.append(request), make(request, **kw))[1]  # type: ignore[method-assign]
        pool._prefill_stubs = {"p1:1": prefill}  # type: ignore[dict-item]
        admission = AdmissionQueue(lambda: 8, max_queued_requests=8, max_queued_tokens=10_000, max_queue_time_s=5)
        servicer = RequestPath(Builder(), pool, admission, frozenset(), 1.0, 30.0, 20.0, 8.0)  # type: ignore[arg-type]
        try:
            msgs = await _collect(servicer._attempts(_input(50), None, arrived=0.0, waited=0.0))
            assert events[:2] == ["reserve sent reuse=True", "prefill to decode:9"]
            (reserve,) = holder.asked
            assert len(reserve.block_hashes) == 50 // 16 and all(len(h) == 16 for h in reserve.block_hashes)
            assert sent[0].decode_cached_pages == 2 and list(sent[0].block_hashes) == list(reserve.block_hashes)
            assert msgs[-1].final.kv_transfer.decode_cached_pages == 2
            # past the slack, load wins: d2 three requests busier than d1 is not picked
            d2.reported_active_requests = 3
            assert pool.pick_decode(frozenset(), {"d2": 2}) is d1
        finally:
            await pool.close()

    asyncio.run(scenario())


async def _collect(agen) -> list[gateway_pb2.GenerateResponse]:
    return [msg async for msg in agen]


def test_an_attempt_aborted_before_its_prefill_leg_undoes_only_decode_and_releases_the_reservation():
    class Pool:
        def __init__(self) -> None:
            self.released: list[tuple[str, str, int]] = []

        def spawn(self, coro):
            return asyncio.ensure_future(coro)

        async def release(self, decode, request_id, transfer_id):
            self.released.append((decode.address, request_id, transfer_id))

    class Reserved:
        transfer_id = 11

    async def scenario():
        pool, p, d = Pool(), InstanceLoad("p"), InstanceLoad("d")
        life = Attempt(pool, "r5", None, d)
        assert d.in_flight_requests == 1 and life.prefill is None
        reserve_call = asyncio.get_running_loop().create_future()
        life.reserving(reserve_call)
        life.abort(None)  # e.g. no prefill instance was left to route to
        reserve_call.set_result(Reserved())
        for _ in range(3):
            await asyncio.sleep(0)
        assert pool.released == [("d", "r5", 11)] and life.stage == Stage.ABORTED
        assert d.in_flight_requests == 0 and (p.in_flight_requests, p.total_routed_tokens) == (0, 0)
        # joined later, a prefill leg is counted, and undone by an abort
        late = Attempt(pool, "r6", None, d)
        late.route_prefill(p, queued_tokens=30)
        assert (p.in_flight_requests, p.in_flight_tokens, p.total_routed_tokens) == (1, 30, 30)
        late.abort(None)
        assert (p.in_flight_requests, p.in_flight_tokens, p.total_routed_tokens) == (0, 0, 0)

    asyncio.run(scenario())


def test_pick_decode_refuses_when_no_prefill_instance_is_routable():
    async def scenario():
        pool = InstancePool(["p1:1"], ["d1:1"], 16, None, 0.3, 0.02, 1.0)
        try:
            assert pool.pick_decode().address == "d1:1"
            pool.prefills[0].reachable = False
            try:
                pool.pick_decode()
            except LookupError as exc:
                assert "no healthy prefill instance" in str(exc)
            else:
                raise AssertionError("pick_decode reserved with no prefill to route to")
        finally:
            await pool.close()

    asyncio.run(scenario())


def test_small_prompts_tokenize_on_the_event_loop_and_long_ones_on_a_thread():
    assert _tokenize_inline(make_request("What is the capital of France?"))
    assert _tokenize_inline(make_request(prompt_token_ids=list(range(2048))))
    assert not _tokenize_inline(make_request("x" * (INLINE_PROMPT_BYTES + 1)))
    long_chat = [("system", "s" * 600), ("user", "u" * 600)]
    assert not _tokenize_inline(make_request(messages=long_chat))


def test_orchestration_is_ttft_less_queue_compute_and_the_push_left_in_ttft():
    final = gateway_pb2.Final(
        ttft_s=0.200, queue_s=0.010, prefill_s=0.150, kv_transfer=gateway_pb2.KVTransfer(seconds=0.030)
    )
    assert abs(orchestration_s(final) - 0.010) < 1e-9
    # chunked prefill overlapped most of the push with the compute: only 5 ms of it was left in TTFT
    final.kv_transfer.exposed_seconds = 0.005
    assert abs(orchestration_s(final) - 0.035) < 1e-9


def test_the_index_is_asked_in_growing_stages_and_only_while_an_instance_holds_every_block():
    class Index:
        """Holds, per instance, a set of block hashes; records how many blocks each lookup asks."""

        def __init__(self, holds: dict[str, set[bytes]]) -> None:
            self.holds = holds
            self.asked: list[int] = []

        async def longest_prefix(self, block_hashes, instance_ids):
            self.asked.append(len(block_hashes))
            runs = {}
            for i in instance_ids:
                n = 0
                while n < len(block_hashes) and block_hashes[n] in self.holds[i]:
                    n += 1
                runs[i] = n
            return runs

        async def close(self) -> None:
            pass

    hashes = [bytes([k]) * 16 for k in range(128)]  # a 2K-token prompt's blocks

    async def lookup(holds: dict[str, set[bytes]]) -> tuple[dict[str, int], list[int]]:
        index = Index(holds)
        pool = InstancePool(["a:1", "b:1"], ["d:1"], 16, index, 0.3, 0.02, 1.0)  # type: ignore[arg-type]
        pool.prefills[0].instance_id, pool.prefills[1].instance_id = "a", "b"
        try:
            return await pool.lookup_prefix(hashes), index.asked
        finally:
            await pool.close()

    # nobody holds the prompt: one lookup of its first 8 blocks, not of all 128
    assert asyncio.run(lookup({"a": set(), "b": set()})) == ({"a": 0, "b": 0}, [8])
    # b holds a 10-block prefix (and a stray later block, which does not count): 8, then 32 more
    assert asyncio.run(lookup({"a": set(), "b": set(hashes[:10]) | {hashes[50]}})) == ({"a": 0, "b": 10}, [8, 32])
    # a holds all of it: stages of 8, 32 and the remaining 88, the same answer as one lookup
    assert asyncio.run(lookup({"a": set(hashes), "b": set(hashes[:3])})) == ({"a": 128, "b": 3}, [8, 32, 88])


class FixedIndex:
    async def longest_prefix(self, block_hashes, instance_ids):
        return dict.fromkeys(instance_ids, 0)

    async def close(self) -> None:
        pass


def test_prefill_goes_out_while_reserve_is_in_flight_once_decode_s_kv_address_is_known():
    async def scenario():
        events = Events()
        servicer, pool = _servicer(events, FixedIndex())
        pool.decodes[0].kv_address = "decode:9"  # as its stats poll reported
        try:
            run = asyncio.ensure_future(_collect(servicer._attempts(_input(50), None, arrived=0.0, waited=0.0)))
            for _ in range(10):
                await asyncio.sleep(0)
            # both calls are out, Prefill first (TTFT's path), and neither waited for the other:
            # prefill has even answered while Reserve is still out
            assert events == ["prefill to decode:9", "reserve sent", "prefilled"]
            pool._decode_stubs["d1:1"].answer.set()  # type: ignore[attr-defined]
            msgs = await run
            assert events[3] == "reserved" and msgs[0].delta.token_ids == [5]
        finally:
            await pool.close()

    asyncio.run(scenario())


def test_a_refused_reserve_cancels_the_prefill_sent_beside_it():
    async def scenario():
        events = Events()
        decode = FakeDecode(events, refuse=True)
        servicer, pool = _servicer(events, FixedIndex(), decode)
        pool.decodes[0].kv_address = "decode:9"
        prefill_stubs = [pool._prefill_stubs[a] for a in ("p1:1", "p2:1")]
        for stub in prefill_stubs:
            stub.answer.clear()  # prefill is still computing when decode refuses
        try:
            run = asyncio.ensure_future(_collect(servicer._attempts(_input(50), None, arrived=0.0, waited=0.0)))
            await asyncio.sleep(0)
            decode.answer.set()  # refused before prefill answered
            try:
                await run
            except RequestFailed as failure:
                assert failure.cause == FailureCause.BAD_REQUEST
            else:
                raise AssertionError("a refused Reserve did not fail the attempt")
            calls = [c for stub in prefill_stubs for c in stub.calls]
            assert len(calls) == 1 and calls[0].cancelled()
            assert "prefilled" not in events and pool.decodes[0].in_flight_requests == 0
        finally:
            await pool.close()

    asyncio.run(scenario())


async def _reserve_answers_while_prefill_computes(decode: FakeDecode, events: Events):
    """An attempt with decode's KV address known ("decode:9"): Prefill goes out and is held
    computing while `decode` answers Reserve, then answers. Returns (pool, prefill stubs, the
    attempt's messages); the caller closes the pool."""
    servicer, pool = _servicer(events, FixedIndex(), decode)
    pool.decodes[0].kv_address = "decode:9"  # what the last poll said
    stubs = [pool._prefill_stubs[a] for a in ("p1:1", "p2:1")]
    for stub in stubs:
        stub.answer.clear()  # type: ignore[attr-defined]
    run = asyncio.ensure_future(_collect(servicer._attempts(_input(50), None, arrived=0.0, waited=0.0)))
    await asyncio.sleep(0)
    decode.answer.set()
    for _ in range(5):
        await asyncio.sleep(0)
    for stub in stubs:
        stub.answer.set()  # type: ignore[attr-defined]
    return pool, stubs, await run


def test_prefill_is_sent_again_when_decode_answers_with_another_kv_address():
    async def scenario():
        events = Events()
        decode = FakeDecode(events, kv_address="decode:10")  # restarted: a new KV listener
        pool, stubs, msgs = await _reserve_answers_while_prefill_computes(decode, events)
        try:
            sent = [e for e in events if e.startswith("prefill to")]
            assert sent == ["prefill to decode:9", "prefill to decode:10"]
            calls = [c for stub in stubs for c in stub.calls]  # type: ignore[attr-defined]
            assert calls[0].cancelled() and not calls[1].cancelled()
            assert msgs[0].delta.token_ids == [5] and pool.decodes[0].kv_address == "decode:10"
        finally:
            await pool.close()

    asyncio.run(scenario())


def test_prefill_is_sent_again_under_the_transfer_id_an_older_decode_picked():
    async def scenario():
        events = Events()
        pool, stubs, _ = await _reserve_answers_while_prefill_computes(FakeDecode(events, own_id=7), events)
        try:
            sent = [t for stub in stubs for t in stub.transfer_ids]  # type: ignore[attr-defined]
            assert len(sent) == 2 and sent[0] != 7 and sent[1] == 7
            calls = [c for stub in stubs for c in stub.calls]  # type: ignore[attr-defined]
            assert calls[0].cancelled() and not calls[1].cancelled()
        finally:
            await pool.close()

    asyncio.run(scenario())


def test_the_pull_source_is_the_peer_holding_the_most_beyond_the_chosen_instance():
    async def scenario():
        pool = InstancePool(["a:1", "b:1", "c:1"], ["d:1"], 16, None, 0.3, 0.02, 1.0, pull_min_blocks=4)
        a, b, c = pool.prefills
        a.instance_id, b.instance_id, c.instance_id = "a", "b", "c"
        try:
            # b was chosen (say a is busy); a holds 10 blocks, c 6, b 2: pull from a
            assert pool.pull_source(b, {"a": 10, "b": 2, "c": 6}) == ("a:1", 10)
            # a excluded (it failed this request once) or unreachable: c
            assert pool.pull_source(b, {"a": 10, "b": 2, "c": 6}, frozenset({"a:1"})) == ("c:1", 6)
            a.reachable = False
            assert pool.pull_source(b, {"a": 10, "b": 2, "c": 6}) == ("c:1", 6)
            # fewer than pull_min_blocks beyond the chosen one's: not worth naming
            assert pool.pull_source(b, {"a": 10, "b": 2, "c": 5}) == ("", 0)
            pool.pull_min_blocks = 0  # off
            a.reachable = True
            assert pool.pull_source(b, {"a": 10, "b": 2, "c": 6}) == ("", 0)
        finally:
            await pool.close()

    asyncio.run(scenario())


def test_a_caller_that_leaves_after_the_first_token_aborts_the_attempt_at_once():
    """The request path closes its attempts when its caller closes it (a client gone after the
    first token): the reservation is released then, not when the garbage collector gets to the
    abandoned generator (decode otherwise kept the pages until the reservation expired)."""

    class TokenBuilder(Builder):
        def check_model(self, model: str) -> None:
            pass

        def tokenize(self, prompt, messages, chat, token_ids=(), tools=None):
            return list(token_ids)

        def build(self, request_id, ids, temperature, top_p, top_k, max_tokens, seed, stop, ignore_eos, **options):
            return GenerateInput(request_id, tuple(ids), SamplingParams(seed=1), max_tokens or 16, tuple(stop), True)

    async def scenario():
        events = Events()
        servicer, pool = _servicer(events, FixedIndex())
        servicer.builder = TokenBuilder()  # type: ignore[assignment]
        pool._decode_stubs["d1:1"].answer.set()  # type: ignore[attr-defined]
        request = make_request(prompt_token_ids=list(range(100, 150)), max_tokens=16, request_id="r9")
        stream = servicer.generate(request)
        first = await stream.__anext__()
        assert first.delta.token_ids == [5] and pool.decodes[0].in_flight_requests == 1
        await stream.aclose()  # the client went away after its first token
        # aborted inside the close: nothing counted on decode any more, the Release on its way
        assert pool.decodes[0].in_flight_requests == 0
        for _ in range(3):
            await asyncio.sleep(0)
        assert any(e.startswith("release ") for e in events), events
        await pool.close()

    asyncio.run(scenario())


def test_a_session_s_next_turn_goes_back_to_its_instances_within_the_load_guard():
    """The index knows nothing (the last turn's KV events have not landed): the session's next
    turn, whose prompt extends the last one's, goes back to the prefill that computed it, though
    the other is idler; a stranger's identical prompt, or a far busier instance, goes by load."""

    class EmptyIndex:
        async def longest_prefix(self, block_hashes, instance_ids):
            return {}

        async def close(self) -> None:
            pass

    def routed(pool) -> dict[str, int]:
        return {p.instance_id: p.total_routed_tokens for p in pool.prefills}

    async def scenario():
        events = Events()
        servicer, pool = _servicer(events, EmptyIndex(), FakeDecode(events))
        pool._decode_stubs["d1:1"].answer.set()  # type: ignore[attr-defined]
        servicer.sessions = SessionTable(10)
        session = SessionTable.key("", "conversation-1")
        turn1, turn2 = _input(64), _input(96)  # turn 2's prompt starts with turn 1's
        try:
            before = routed(pool)
            await _collect(servicer._attempts(turn1, None, 0.0, 0.0, "", session))
            first = next(k for k, v in routed(pool).items() if v > before[k])
            other = next(p for p in pool.prefills if p.instance_id != first)
            mine = next(p for p in pool.prefills if p.instance_id == first)
            mine.reported_queued_tokens = 40  # a little busier than the other
            before = routed(pool)
            await _collect(servicer._attempts(turn2, None, 0.0, 0.0, "", session))
            after = routed(pool)
            assert after[first] > before[first] and after[other.instance_id] == before[other.instance_id]
            # without the session the same prompt goes to the idler instance
            before = after
            await _collect(servicer._attempts(turn2, None, 0.0, 0.0, "", SessionTable.key("", "stranger")))
            after = routed(pool)
            assert after[other.instance_id] > before[other.instance_id]
            # far busier: the load guard wins over the session
            mine.reported_queued_tokens = 200_000
            before = after
            await _collect(servicer._attempts(turn2, None, 0.0, 0.0, "", session))
            assert routed(pool)[other.instance_id] > before[other.instance_id]
            # a prompt that does not extend the remembered one (another conversation, same id)
            unrelated = GenerateInput("r2", tuple(range(500, 600)), SamplingParams(seed=1), 1, (), False)
            held: dict[str, int] = {}
            servicer.sessions.add_held(session, hash_blocks(unrelated.prompt_token_ids, 16), held)
            assert held == {}
        finally:
            await pool.close()

    asyncio.run(scenario())


def test_the_session_table_is_bounded_and_keys_ids_by_tenant():
    table = SessionTable(2)
    a, b, c = (SessionTable.key("", s) for s in "abc")
    assert SessionTable.key("tenant-1", "a") != a  # two tenants' ids never meet
    hashes = [bytes([i]) * 16 for i in range(4)]
    for k in (a, b, c):
        table.remember(k, "p1", "d1", hashes)
    assert len(table) == 2
    held: dict[str, int] = {}
    table.add_held(a, hashes, held)
    assert held == {}  # a was the least recently used: dropped
    table.add_held(c, [*hashes, b"\x09" * 16], held)
    assert held == {"p1": 4, "d1": 4}
    with pytest.raises(ValueError, match="at most 256"):
        SessionTable.key("", "x" * 257)
