"""API keys (gateway/auth.py) and the admission queue's per-key bounds (gateway/admission.py)."""

from __future__ import annotations

import asyncio
import hashlib

import pytest

from kvmesh.gateway.admission import AdmissionQueue, OverloadedError
from kvmesh.gateway.auth import ApiKeys
from kvmesh.kvstore.block_hash import hash_blocks, tenant_root


def test_keys_from_a_file_and_the_variable_are_named_by_position_never_shown(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# team a\nsk-alpha\n\n  sk-beta  \n")
    keys = ApiKeys.load(str(f), "sk-gamma, ,sk-delta")
    assert len(keys) == 4
    # the variable's keys come first, then the file's, in order
    assert keys.identify("Bearer sk-gamma") == "key-1" and keys.identify("bearer  sk-beta") == "key-4"
    with pytest.raises(PermissionError, match="Authorization: Bearer") as missing:
        keys.identify(None)
    with pytest.raises(PermissionError) as wrong:
        keys.identify("Bearer sk-alphA")
    with pytest.raises(PermissionError):
        keys.identify("Basic sk-alpha")
    # what a caller sent is never repeated back (errors end up in logs)
    assert "sk-" not in str(missing.value) + str(wrong.value)


def test_without_keys_the_gateway_is_open_and_a_key_with_whitespace_is_refused():
    assert ApiKeys(()).identify(None) == "" and ApiKeys(()).identify("Bearer anything") == ""
    with pytest.raises(ValueError, match="whitespace"):
        ApiKeys(["two words"])


def test_a_key_past_its_request_bound_is_refused_at_once_while_other_keys_go_on():
    async def scenario():
        q = AdmissionQueue(lambda: 8, 10, 1000, 30, max_requests_per_key=2)
        await q.admit(5, "key-1")
        await q.admit(5, "key-1")
        with pytest.raises(OverloadedError, match="API key key-1 has 2 requests in flight") as err:
            await q.admit(5, "key-1")
        assert err.value.retry_after_s >= 1
        await q.admit(5, "key-2")  # another key is not held back by key-1
        assert q.keys["key-1"].requests == 2 and q.keys["key-2"].requests == 1 and q.num_admitted == 3
        q.done("key-1", 5)
        await q.admit(5, "key-1")  # one ended: room again
        for key in ("key-1", "key-1", "key-2"):
            q.done(key, 5)
        assert q.keys == {} and q.num_admitted == 0

    asyncio.run(scenario())


def test_a_key_s_prompt_tokens_count_until_prefilled_and_a_refused_or_cancelled_wait_gives_them_back():
    async def scenario():
        capacity = [1]
        q = AdmissionQueue(lambda: capacity[0], 10, 1000, 30, max_queued_tokens_per_key=100)
        await q.admit(60, "key-1")  # admitted, its prompt not yet computed
        with pytest.raises(OverloadedError, match="60 prompt tokens waiting for prefill"):
            await q.admit(50, "key-1")
        q.prefilled("key-1", 60)  # prefill computed it: the tokens no longer count
        waiter = asyncio.ensure_future(q.admit(90, "key-1"))  # queued (no decode slot free)
        await asyncio.sleep(0)
        assert q.num_queued == 1 and q.keys["key-1"].queued_tokens == 90
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        assert q.keys["key-1"].queued_tokens == 0 and q.keys["key-1"].requests == 1 and q.num_queued == 0
        q.done("key-1", 0)
        assert q.keys == {} and q.num_admitted == 0

    asyncio.run(scenario())


def test_each_key_is_a_cache_tenant_unless_it_names_a_namespace_it_shares(tmp_path):
    f = tmp_path / "keys"
    f.write_text("sk-alpha team-a\nsk-beta\nsk-gamma team-a  # no: a comment is a line of its own\n")
    with pytest.raises(ValueError, match="line 3: expected '<key> \\[<namespace>\\]"):
        ApiKeys.load(str(f))
    f.write_text("sk-alpha team-a\nsk-beta\n# A's teammate\nsk-gamma team-a\n")
    keys = ApiKeys.load(str(f), "sk-delta")
    tenants = [keys.tenant_of(keys.identify(f"Bearer {k}")) for k in ("sk-alpha", "sk-beta", "sk-gamma", "sk-delta")]
    assert tenants[0] == tenants[2] == "ns:team-a"
    assert tenants[1] == "key:" + hashlib.sha256(b"sk-beta").hexdigest() and len(set(tenants)) == 3
    assert ApiKeys(()).tenant_of(ApiKeys(()).identify(None)) == ""  # an open gateway: one shared cache
    with pytest.raises(ValueError, match=r"namespace must match"):
        ApiKeys(["sk-x"], {"sk-x": "team/../a"})


def test_a_tenant_s_block_hashes_chain_from_its_own_root():
    tokens = list(range(40))
    plain, a, a2, b = (hash_blocks(tokens, 16, tenant_root(t)) for t in ("", "ns:team-a", "ns:team-a", "key:00"))
    assert tenant_root("") is None and plain == hash_blocks(tokens, 16)  # no keys: today's hashes
    assert a == a2 and len(a) == len(b) == len(plain) == 2
    assert not {*a} & {*b} and not {*a} & {*plain}  # the first block's hash covers the tenant already


def test_the_key_file_gives_each_key_a_priority_a_weight_and_an_slo(tmp_path):
    f = tmp_path / "keys"
    f.write_text("sk-gold team priority=10 weight=3 slo_ttft_ms=500\nsk-bulk priority=-1\nsk-plain\n")
    keys = ApiKeys.load(str(f), "sk-env")
    assert keys.slo_ms_of(keys.identify("Bearer sk-gold")) == (500.0, 0.0)
    assert keys.slo_ms_of(keys.identify("Bearer sk-bulk")) == keys.slo_ms_of("") == (0.0, 0.0)
    assert keys.class_of(keys.identify("Bearer sk-gold")) == (10, 3.0)
    assert keys.class_of(keys.identify("Bearer sk-bulk")) == (-1, 1.0)
    assert keys.class_of(keys.identify("Bearer sk-plain")) == keys.class_of(keys.identify("Bearer sk-env")) == (0, 1.0)
    assert keys.tenant_of(keys.identify("Bearer sk-gold")) == "ns:team"
    assert ApiKeys(()).class_of("") == (0, 1.0)
    for line in (
        "sk-x priority=high",
        "sk-x weight=0",
        "sk-x a b",
        "sk-x colour=red",
        "sk-x priority=5000",
        "sk-x slo_ttft_ms=soon",
        "sk-x slo_itl_ms=-1",
    ):
        f.write_text(line + "\n")
        with pytest.raises(ValueError, match="line 1"):
            ApiKeys.load(str(f))


async def _flood(q: AdmissionQueue, plan: list[tuple[str, int, float]]) -> list[asyncio.Task]:
    """Queue one request per (key, priority, weight) in order; each task's result is its key."""

    async def one(key: str, priority: int, weight: float) -> str:
        await q.admit(1, key, priority, weight)
        return key

    tasks = [asyncio.ensure_future(one(*p)) for p in plan]
    await asyncio.sleep(0)
    return tasks


async def _grant_in_turn(q: AdmissionQueue, capacity: list[int], tasks: list[asyncio.Task], n: int) -> list[str]:
    """Open one decode slot at a time, n times: the keys in the order they were admitted."""
    order = []
    for _ in range(n):
        capacity[0] += 1
        q.pump()
        done, _ = await asyncio.wait([t for t in tasks if not t.done()], return_when=asyncio.FIRST_COMPLETED)
        order += [t.result() for t in done]
        for t in done:
            tasks.remove(t)
    return order


def test_within_a_band_keys_share_by_weight_whatever_order_they_queued_in():
    async def scenario():
        capacity = [0]
        q = AdmissionQueue(lambda: capacity[0], 200, 10_000, 60)
        # key-a queues all of its 60 first, then key-b its 60: FIFO would serve a's first
        tasks = await _flood(q, [("key-a", 0, 1.0)] * 60 + [("key-b", 0, 1.0)] * 60)
        order = await _grant_in_turn(q, capacity, tasks, 40)
        a, b = order.count("key-a"), order.count("key-b")
        assert abs(a - b) <= 0.1 * 40, order  # equal weights: within 10% of an even share
        # weights 3 : 1 share the band 3 : 1
        tasks2 = await _flood(q, [("key-c", 0, 3.0)] * 60 + [("key-d", 0, 1.0)] * 60)
        for t in tasks:
            t.cancel()
        order = await _grant_in_turn(q, capacity, tasks2, 40)
        assert abs(order.count("key-c") - 30) <= 3, order
        for t in tasks2:
            t.cancel()
        await asyncio.gather(*tasks, *tasks2, return_exceptions=True)

    asyncio.run(scenario())


def test_a_higher_band_goes_first_and_a_full_queue_sheds_the_lowest_band_with_retry_after():
    async def scenario():
        capacity = [0]
        q = AdmissionQueue(lambda: capacity[0], 4, 10_000, 60)
        low = await _flood(q, [("key-low", 0, 1.0)] * 3)
        mid = await _flood(q, [("key-mid", 5, 1.0)])
        assert q.num_queued == 4  # full
        # a high request sheds the newest low one; so does the next; the low band goes first
        high = await _flood(q, [("key-high", 9, 1.0)] * 2)
        await asyncio.wait(low[1:], timeout=10)  # the newest two of the lowest band
        shed = [t for t in low if t.done()]
        assert shed == low[1:]
        for t in shed:
            with pytest.raises(OverloadedError, match="higher-priority") as err:
                t.result()
            assert err.value.retry_after_s >= 1
        # a low request finds no one below it: refused at once
        with pytest.raises(OverloadedError, match="queue is full"):
            await q.admit(1, "key-low", 0, 1.0)
        # granted by band: high, high, mid, then the last low
        order = await _grant_in_turn(q, capacity, [*high, *mid, low[0]], 4)
        assert order == ["key-high", "key-high", "key-mid", "key-low"]
        assert q.num_queued == 0 and q.queued_tokens == 0

    asyncio.run(scenario())
