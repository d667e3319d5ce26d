"""API keys (gateway/auth.py) and the admission queue's per-key bounds (gateway/admission.py)."""

from __future__ import annotations

import asyncio
import hashlib

import pytest

from gateway.admission import AdmissionQueue, OverloadedError
from gateway.auth import ApiKeys
from kvstore.block_hash import hash_blocks, tenant_root


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
    with pytest.raises(ValueError, match="line 3: expected '<key>' or '<key> <namespace>'"):
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
