"""Prefill and Decode called directly with bad arguments (what an adversarial peer or a
buggy gateway could send): each gets a clear status and nothing else is lost."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from kvmesh.client import Completion, GatewayClient, make_request
from kvmesh.protos.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from tests.integration.meshutil import complete, running_mesh, wait_idle

PROMPT = [1, 9690, 198, 2683, 359, 253]  # six real token ids of the default model


@pytest.fixture(scope="module")
def mesh():
    # decode speculates (n-gram drafts): its output must be what plain decoding gives, so every
    # test here runs on it, and the exactness test below compares it with transformers
    # (a row cost of 0.1 makes drafting pay whatever the machine's load: the test wants drafts)
    decode_args = ["--speculative", "ngram", "--num-draft-tokens", "4", "--draft-row-cost", "0.1"]
    with running_mesh(1, 1, decode_args=decode_args) as m:
        yield m


def _run(mesh, body):
    async def main():
        async with (
            grpc.aio.insecure_channel(mesh.decode_addresses[0]) as dch,
            grpc.aio.insecure_channel(mesh.prefill_addresses[0]) as pch,
        ):
            return await body(decode_pb2_grpc.DecodeStub(dch), prefill_pb2_grpc.PrefillStub(pch))

    return asyncio.run(main())


async def _reserve_and_push(decode, prefill, max_tokens=8):
    res = await decode.Reserve(
        decode_pb2.ReserveRequest(request_id="t", num_prompt_tokens=len(PROMPT), max_tokens=max_tokens), timeout=10
    )
    pre = await prefill.Prefill(
        prefill_pb2.PrefillRequest(
            request_id="t",
            token_ids=PROMPT,
            sampling=common_pb2.SamplingParams(),
            decode_kv_address=res.kv_address,
            transfer_id=res.transfer_id,
        ),
        timeout=60,
    )
    return res, pre


async def _until(condition, what: str, timeout_s: float = 60.0) -> None:
    """Poll `condition()` until true; fail after timeout_s seconds (a hang guard, not a speed check)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.02)


async def _code(call) -> grpc.StatusCode:
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_bad_generate_is_invalid_argument_and_other_streams_go_on(mesh):
    async def body(decode, prefill):
        async with GatewayClient(mesh.gateway_address) as client:
            # a long answer decoding in the batch while the bad call arrives
            out = Completion()

            async def consume() -> Completion:
                request = make_request("Count slowly from one to fifty.", chat=True, max_tokens=60, ignore_eos=True)
                async for msg in client.stream(request):
                    if msg.HasField("delta"):
                        out.token_ids.extend(msg.delta.token_ids)
                    else:
                        out.final = msg.final
                return out

            victim = asyncio.ensure_future(consume())
            # decoding: a token streamed past prefill's first one
            await _until(lambda: len(out.token_ids) >= 2, "the victim to decode")
            res, pre = await _reserve_and_push(decode, prefill)

            async def bad_generate():
                async for _ in decode.Generate(
                    decode_pb2.DecodeRequest(
                        request_id="t",
                        transfer_id=res.transfer_id,
                        prompt_token_ids=PROMPT,
                        first_token=10**6,
                        sampling=common_pb2.SamplingParams(),
                    )
                ):
                    pass

            code = await _code(bad_generate())
            out = await victim
            return code, out

    code, out = _run(mesh, body)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert out.final.generated_tokens == 60  # the other request never noticed
    wait_idle(mesh)


def test_reserve_beyond_the_context_is_invalid_argument(mesh):
    async def body(decode, prefill):
        return await _code(
            decode.Reserve(decode_pb2.ReserveRequest(request_id="t", num_prompt_tokens=9000, max_tokens=1), timeout=10)
        )

    assert _run(mesh, body) == grpc.StatusCode.INVALID_ARGUMENT
    wait_idle(mesh)


@pytest.mark.parametrize("address", ["garbage", "127.0.0.1:0", "127.0.0.1:99999", ":123"])
def test_malformed_kv_address_is_invalid_argument(mesh, address):
    async def body(decode, prefill):
        return await _code(
            prefill.Prefill(
                prefill_pb2.PrefillRequest(
                    request_id="t",
                    token_ids=PROMPT,
                    sampling=common_pb2.SamplingParams(),
                    decode_kv_address=address,
                    transfer_id=1,
                ),
                timeout=30,
            )
        )

    assert _run(mesh, body) == grpc.StatusCode.INVALID_ARGUMENT
    wait_idle(mesh)


LONG = PROMPT * 6  # 36 tokens: two full 16-token blocks


@pytest.mark.parametrize(
    "fields, needle",
    [
        (dict(block_hashes=[b"\x01" * 16]), "one 16-byte hash per full block of the prompt (2 of 16 tokens), got 1"),
        (dict(block_hashes=[b"\x01" * 16, b"\x02" * 15]), "got 2"),
        (dict(block_hashes=[b"\x01" * 16] * 3), "got 3"),
        (dict(pull_from="no-port", pull_blocks=1), "pull_from (a peer prefill's gRPC address)"),
        (dict(pull_from="127.0.0.1:1", pull_blocks=3), "pull_blocks must be in [0, 2], got 3"),
        (dict(pull_blocks=-1), "pull_blocks must be in [0, 2], got -1"),
        (dict(decode_cached_pages=3), "decode_cached_pages must be in [0, 2]"),
    ],
)
def test_prefill_fields_that_do_not_fit_the_prompt_are_invalid_argument(mesh, fields, needle):
    # the gateway's block hashes, the peer to pull from and the pages decode holds travel with
    # Prefill; a caller's that cannot be the prompt's (wrong count, size or range, an address
    # without a port) are refused before anything is computed, pulled or cached
    async def body(decode, prefill):
        try:
            await prefill.Prefill(
                prefill_pb2.PrefillRequest(
                    request_id="t", token_ids=LONG, sampling=common_pb2.SamplingParams(), **fields
                ),
                timeout=30,
            )
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details()
        return grpc.StatusCode.OK, ""

    code, details = _run(mesh, body)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and needle in details, details
    wait_idle(mesh)


def test_release_while_generate_waits_keeps_pages_until_no_push_can_land(mesh):
    async def body(decode, prefill):
        res = await decode.Reserve(
            decode_pb2.ReserveRequest(request_id="a", num_prompt_tokens=len(PROMPT), max_tokens=8), timeout=10
        )
        request = decode_pb2.DecodeRequest(
            request_id="a",
            transfer_id=res.transfer_id,
            prompt_token_ids=PROMPT,
            first_token=5,
            sampling=common_pb2.SamplingParams(),
            kv_timeout_s=30,
        )
        # a transfer is claimed by one Generate only: of two calls, one waits for the push and
        # the other is refused NOT_FOUND at once, which shows the first is now waiting
        calls = [asyncio.ensure_future(_code(decode.Generate(request).read())) for _ in range(2)]
        done, pending = await asyncio.wait(calls, timeout=30, return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1 and len(pending) == 1, "expected one Generate refused and one waiting"
        assert done.pop().result() == grpc.StatusCode.NOT_FOUND
        waiting = pending.pop()
        await decode.Release(decode_pb2.ReleaseRequest(request_id="a", transfer_id=res.transfer_id), timeout=10)
        # a late push for the released transfer is refused, never written into pages
        late = await _code(
            prefill.Prefill(
                prefill_pb2.PrefillRequest(
                    request_id="a",
                    token_ids=PROMPT,
                    sampling=common_pb2.SamplingParams(),
                    decode_kv_address=res.kv_address,
                    transfer_id=res.transfer_id,
                ),
                timeout=30,
            )
        )
        return await waiting, late

    generate_code, late_code = _run(mesh, body)
    assert generate_code == grpc.StatusCode.CANCELLED
    assert late_code == grpc.StatusCode.UNAVAILABLE
    wait_idle(mesh)
    assert "Paris" in complete(mesh, "What is the capital of France?", chat=True, max_tokens=16).text


def test_reserve_under_the_callers_transfer_id_and_a_prefill_sent_before_it(mesh):
    """The gateway picks the transfer id so Prefill can go out with Reserve: decode reserves
    under that id, refuses one in use, and a push that beat its Reserve lands once it comes;
    a push for a refused Reserve fails at once (not after the receiver's wait)."""

    async def body(decode, prefill):
        stats = await decode.GetStats(common_pb2.StatsRequest(), timeout=10)
        assert stats.kv_address  # the gateway learns where to push from the stats poll
        tid = 0x5EED_0001

        def reserve(request_id: str, transfer_id: int, max_tokens: int = 4):
            return decode.Reserve(
                decode_pb2.ReserveRequest(
                    request_id=request_id, num_prompt_tokens=len(PROMPT), max_tokens=max_tokens, transfer_id=transfer_id
                ),
                timeout=10,
            )

        def prefill_call(request_id: str, transfer_id: int):
            return prefill.Prefill(
                prefill_pb2.PrefillRequest(
                    request_id=request_id,
                    token_ids=PROMPT,
                    sampling=common_pb2.SamplingParams(),
                    decode_kv_address=stats.kv_address,
                    transfer_id=transfer_id,
                ),
                timeout=30,
            )

        early = asyncio.ensure_future(prefill_call("early", tid))  # before its Reserve
        res = await reserve("early", tid)
        assert res.transfer_id == tid and res.kv_address == stats.kv_address
        in_use = await _code(reserve("other", tid))
        pre = await early
        tokens = []
        async for msg in decode.Generate(
            decode_pb2.DecodeRequest(
                request_id="early",
                transfer_id=tid,
                prompt_token_ids=PROMPT,
                first_token=pre.first_token,
                sampling=common_pb2.SamplingParams(),
                kv_timeout_s=30,
            )
        ):
            tokens.extend(msg.token_ids)
        # a Reserve refused (past the context) makes its early push fail at once
        refused_tid = 0x5EED_0002
        late = asyncio.ensure_future(_code(prefill_call("refused", refused_tid)))
        refused = await _code(reserve("refused", refused_tid, max_tokens=100_000))
        return in_use, len(tokens), refused, await asyncio.wait_for(late, 30)

    in_use, num_tokens, refused, late = _run(mesh, body)
    assert in_use == grpc.StatusCode.INVALID_ARGUMENT
    assert num_tokens == 3  # max_tokens 4: the first token came from prefill
    assert refused == grpc.StatusCode.INVALID_ARGUMENT and late == grpc.StatusCode.UNAVAILABLE
    wait_idle(mesh)


def test_unknown_chat_role_and_oversized_prompt_are_invalid_argument(mesh):
    for prompt, kwargs in (
        (b"", dict(messages=[("", "hi")])),
        (b"", dict(messages=[("wizard", "hi")])),
        (b"a" * 3_000_000, {}),
    ):
        try:
            complete(mesh, prompt, **kwargs, max_tokens=2)
            raise AssertionError(f"accepted {list(kwargs)}")
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, exc
    wait_idle(mesh)


def test_speculative_decoding_through_the_mesh_gives_transformers_greedy_tokens(mesh):
    """With n-gram drafts on decode: the same tokens as transformers' greedy generate, and on a
    prompt that quotes its input most of them come from kept drafts (fewer steps); each token's
    logprob, a kept draft's too, is transformers' log-softmax at its position within 1e-4."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvmesh.engine.checkpoint import load_tokenizer
    from kvmesh.engine.loader import resolve_model

    files = resolve_model(None)
    model = AutoModelForCausalLM.from_pretrained(files.checkpoint_dir, dtype=torch.float32).eval()
    tok = load_tokenizer(files)
    quote = "Lighthouses guide ships past rocks at night with a bright rotating beam. " * 2
    prompts = [f"Repeat exactly: {quote}", "Name a famous painter."]
    for prompt in prompts:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        with torch.inference_mode():
            ref = model.generate(**ids, max_new_tokens=32, do_sample=False)[0, ids["input_ids"].shape[1] :].tolist()
        got = complete(mesh, prompt, chat=True, max_tokens=32, logprobs=2)
        assert got.token_ids == ref[: len(got.token_ids)] and len(got.token_ids) == len(ref), prompt
        prompt_ids = ids["input_ids"][0].tolist()
        with torch.inference_mode():
            logits = model(torch.tensor([prompt_ids + ref[:-1]])).logits[0, len(prompt_ids) - 1 :]
        want = torch.log_softmax(logits.float(), dim=-1)
        assert [lp.token_id for lp in got.logprobs] == ref
        assert max(abs(lp.logprob - float(want[i, t])) for i, (t, lp) in enumerate(zip(ref, got.logprobs))) < 1e-4
        assert [list(lp.top_token_ids) for lp in got.logprobs] == want.topk(2).indices.tolist()
        if prompt.startswith("Repeat"):
            f = got.final
            assert f.accepted_tokens > 0 and f.drafted_tokens >= f.accepted_tokens, f
    wait_idle(mesh)


def test_bad_push_blocks_and_reserve_hashes_are_refused_and_hold_nothing(mesh):
    async def body(decode, prefill):
        got = []
        for request in (
            prefill_pb2.PushBlocksRequest(request_id="t", block_hashes=[b"\x01" * 15], kv_address="127.0.0.1:1",
                                          transfer_id=5, page_size=16),
            prefill_pb2.PushBlocksRequest(request_id="t", block_hashes=[b"\x01" * 16], kv_address="nowhere",
                                          transfer_id=5, page_size=16),
            prefill_pb2.PushBlocksRequest(request_id="t", block_hashes=[b"\x01" * 16], kv_address="127.0.0.1:1",
                                          transfer_id=5, page_size=32),
        ):  # fmt: skip
            try:
                await prefill.PushBlocks(request, timeout=30)
                got.append(("OK", ""))
            except grpc.aio.AioRpcError as exc:
                got.append((exc.code().name, exc.details()))
        # blocks nobody holds: answered with 0 blocks, nothing pushed (the puller computes them)
        none = await prefill.PushBlocks(
            prefill_pb2.PushBlocksRequest(
                request_id="t", block_hashes=[b"\x07" * 16], kv_address="127.0.0.1:1", transfer_id=5, page_size=16
            ),
            timeout=30,
        )
        try:
            await decode.Reserve(
                decode_pb2.ReserveRequest(
                    request_id="t", num_prompt_tokens=len(LONG), max_tokens=2, page_size=16,
                    block_hashes=[b"\x01" * 16], reuse_cached=True,
                ),
                timeout=30,
            )  # fmt: skip
            got.append(("OK", ""))
        except grpc.aio.AioRpcError as exc:
            got.append((exc.code().name, exc.details()))
        return got, none

    got, none = _run(mesh, body)
    assert [code for code, _ in got] == ["INVALID_ARGUMENT", "INVALID_ARGUMENT", "FAILED_PRECONDITION",
                                         "INVALID_ARGUMENT"], got  # fmt: skip
    assert "16 bytes" in got[0][1] and "nowhere" in got[1][1] and "page" in got[2][1]
    assert "one 16-byte hash per full block of the prompt (2 of 16 tokens), got 1" in got[3][1]
    assert none.num_blocks == 0 and none.nbytes == 0
    wait_idle(mesh)


def test_structured_output_with_speculation_checks_each_draft_against_the_mask(mesh):
    """n-gram drafts of a quoted JSON object: drafts are proposed and kept, and every kept one
    passed the grammar's mask at its row, so the answer validates against the schema."""
    import json

    import jsonschema

    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 30}, "legs": {"enum": [2, 4, 6, 8]}},
        "required": ["name", "legs"],
        "additionalProperties": False,
    }
    quote = '{"name": "spider", "legs": 8}'
    prompt = f"Repeat exactly, twice: {quote} {quote}"
    got = complete(mesh, prompt, chat=True, max_tokens=40, grammar=("json_schema", json.dumps(schema)))
    jsonschema.validate(json.loads(got.text), schema)
    assert got.final.finish_reason == "stop" and got.final.drafted_tokens > 0, got.final
    # a schema the instances cannot compile: INVALID_ARGUMENT, and the mesh goes on
    with pytest.raises(grpc.aio.AioRpcError) as err:
        complete(mesh, prompt, chat=True, max_tokens=4, grammar=("json_schema", '{"type": "nonsense"}'))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "grammar" in err.value.details()
    wait_idle(mesh)
