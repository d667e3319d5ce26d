"""The whole mesh on the real model: gateway, prefill and decode in separate processes,
KV pushed over UCX, prefix index in a real Redis, all over loopback gRPC."""

from __future__ import annotations

import asyncio
import math
import os
import time

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from kvmesh.client import GatewayClient, make_request
from kvmesh.engine.checkpoint import load_tokenizer
from kvmesh.engine.loader import load_config, resolve_model
from tests.conftest import instance_stats
from tests.integration.meshutil import complete, complete_many, log_size, read_log, wait_idle, wait_indexed

PROMPTS = [
    "What is the capital of France?",
    "Write one sentence about the moon.",
    "List three fruits.",
    "How many legs does a spider have?",
    "Translate 'good morning' into Spanish.",
    "Explain what a CPU does in one sentence.",
]


@pytest.fixture(scope="module")
def mesh(observed_mesh):
    """Shared with test_observability (tests/conftest.py): 1 prefill, 1 decode."""
    return observed_mesh


@pytest.fixture(scope="module")
def reference():
    """transformers on the same checkpoint: the numbers every answer is checked against."""
    files = resolve_model(None)
    model = AutoModelForCausalLM.from_pretrained(files.checkpoint_dir, dtype=torch.float32).eval()
    return model, load_tokenizer(files), load_config(files)


def hf_greedy(reference, prompt: str, new_tokens: int) -> list[int]:
    model, tok, _ = reference
    ids = tok.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.inference_mode():
        out = model.generate(**ids, max_new_tokens=new_tokens, do_sample=False)
    return out[0, ids["input_ids"].shape[1] :].tolist()


def test_sixteen_concurrent_equal_sequential_and_share_steps(mesh):
    prompts = [
        f"Give me fact number {i} about {topic}." for i, topic in enumerate(["cats", "dogs", "rivers", "stars"] * 4)
    ]
    sequential = [complete(mesh, p, chat=True, max_tokens=24).token_ids for p in prompts]
    before = instance_stats(mesh.decode_addresses[0], "decode")
    concurrent = complete_many(mesh, [dict(prompt=p, chat=True, max_tokens=24) for p in prompts])
    assert [c.token_ids for c in concurrent] == sequential
    after = instance_stats(mesh.decode_addresses[0], "decode")
    # requests ran in shared steps: a batch above 1 (the largest since start: this runs first),
    # and fewer steps than tokens decoded
    assert after.max_batch_size > 1
    decoded = sum(len(t) - 1 for t in sequential)
    assert after.num_steps - before.num_steps < decoded
    wait_idle(mesh)


def test_greedy_tokens_equal_transformers_generate(mesh, reference):
    # 6 prompts, 32 new tokens each: the mesh's greedy tokens equal transformers' generate.
    # Sent together (one decode batch): batching does not change a request's tokens, as the
    # sixteen-concurrent test above shows against each request alone.
    outs = complete_many(mesh, [dict(prompt=p, chat=True, max_tokens=32) for p in PROMPTS])
    for prompt, got in zip(PROMPTS, outs, strict=True):
        want = hf_greedy(reference, prompt, 32)
        assert got.token_ids == want, (prompt, got.text)
        assert got.final.generated_tokens == len(want)
        assert got.final.finish_reason == ("stop" if len(want) < 32 else "length")
    wait_idle(mesh)


def test_kv_moved_bitwise_over_ucx(mesh, reference):
    _, _, config = reference
    out = complete(mesh, "Tell me about the history of Paris in a few words.", chat=True, max_tokens=4)
    kv = out.final.kv_transfer
    # one page holds page_size tokens of K and V for every layer, fp32
    page_nbytes = 16 * config.num_layers * 2 * config.num_kv_heads * config.head_dim * 4
    assert kv.page_nbytes == page_nbytes
    # the pages decode held already (the chat template's system prompt, from earlier requests) are not pushed
    assert kv.num_pages + kv.decode_cached_pages == math.ceil(out.final.prompt_tokens / 16)
    assert kv.nbytes == kv.num_pages * kv.page_nbytes
    # SHA-256 of the prompt's pages as prefill sent them and as decode found them
    assert len(kv.prefill_digest) == 64 and kv.prefill_digest == kv.decode_digest
    assert out.final.prefill_instance != out.final.decode_instance
    # both ends copied through host buffers (this mesh's --kv-push-path staged), bytes intact
    assert read_log(mesh).count("KV push path: staged") == 2


def test_a_long_prompt_is_pushed_chunk_by_chunk_and_lands_whole(mesh, reference):
    # 1,224 prompt tokens, chunked prefill of 512 (the default): the pages of each chunk are
    # pushed while the next computes, in 4 parts; decode finds every page as prefill sent it
    # and answers as transformers does on the whole prompt
    prompt = "Summarise this list of numbers: " + ", ".join(str(i) for i in range(1, 260))
    since = log_size(mesh)
    out = complete(mesh, prompt, chat=True, max_tokens=4)
    assert out.final.prompt_tokens > 1100
    kv = out.final.kv_transfer
    assert len(kv.prefill_digest) == 64 and kv.prefill_digest == kv.decode_digest
    assert kv.nbytes == (math.ceil(out.final.prompt_tokens / 16) - kv.decode_cached_pages) * kv.page_nbytes
    assert 0 < kv.exposed_seconds and 0 < kv.seconds
    assert f"[{out.final.request_id}] prefilled" in read_log(mesh, since)
    parts = read_log(mesh, since).split(f"[{out.final.request_id}] prefilled", 1)[1].split(" parts", 1)[0]
    assert int(parts.rsplit(" ", 1)[1]) >= 3, parts
    assert out.token_ids == hf_greedy(reference, prompt, 4)


def test_a_conversation_s_next_turn_pushes_only_the_pages_decode_lacks(mesh, reference):
    """Decode-side prefix reuse: decode keeps a finished request's full blocks (its prompt's and
    its answer's), publishes them to the index, and the next turn (the conversation so far and a
    new question) is reserved there first and pushed only from where decode's pages end."""
    model, tok, _ = reference
    messages = [{"role": "user", "content": "Name a few rivers of Europe."}]
    turn1 = list(tok.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])
    first = complete(mesh, b"", prompt_token_ids=turn1, max_tokens=48, ignore_eos=True)
    answer = first.token_ids
    assert len(answer) == 48
    # decode caches the blocks whose KV it holds: the prompt, then the answer but its last token
    kv_tokens = turn1 + answer[:-1]
    held = wait_indexed(mesh, mesh.decode_addresses[0], "decode", kv_tokens, resolve_model(None).name)
    turn2 = turn1 + answer + tok.encode(" Which of them is the longest?")
    second = complete(mesh, b"", prompt_token_ids=turn2, max_tokens=8)
    kv = second.final.kv_transfer
    # every block decode holds is reused (short of the last prompt token's), the rest pushed
    assert kv.decode_cached_pages == min(held, (len(turn2) - 1) // 16) >= 4
    assert kv.num_pages == math.ceil(len(turn2) / 16) - kv.decode_cached_pages
    assert kv.nbytes == kv.num_pages * kv.page_nbytes
    # what the push wrote is what prefill sent, and the answer is transformers' on the whole prompt
    assert len(kv.prefill_digest) == 64 and kv.prefill_digest == kv.decode_digest
    with torch.inference_mode():
        want = model.generate(torch.tensor([turn2]), max_new_tokens=8, do_sample=False)[0, len(turn2) :].tolist()
    assert second.token_ids == want
    wait_idle(mesh)


def _status(mesh, prompt=b"", **kwargs) -> tuple[grpc.StatusCode, str, float]:
    start = time.monotonic()
    try:
        complete(mesh, prompt, **kwargs)
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details(), time.monotonic() - start
    return grpc.StatusCode.OK, "", time.monotonic() - start


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(prompt=b""), "prompt is empty"),
        (dict(prompt="   "), "prompt is empty"),
        (dict(prompt=b"caf\xc3 ok \xff"), "not valid UTF-8"),
        (dict(prompt="hello " * 9000), "context"),
        (dict(prompt="hi", max_tokens=0), "max_tokens must be in"),
        (dict(prompt="hi", max_tokens=-3), "max_tokens must be in"),
        (dict(prompt="hi", max_tokens=100000), "max_tokens must be in"),
        (dict(prompt="hi", temperature=-0.5), "temperature must be >= 0"),
        (dict(prompt="hi", top_p=0.0), "top_p must be in (0, 1]"),
        (dict(prompt="hi", top_p=1.5), "top_p must be in (0, 1]"),
        (dict(prompt="hi", top_k=-1), "top_k must be >= 0"),
        # an unknown model is NOT_FOUND (HTTP 404): tests/integration/test_http_api.py
    ],
)
def test_bad_input_is_invalid_argument_and_mesh_keeps_serving(mesh, kwargs, needle):
    code, details, _ = _status(mesh, **kwargs)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert needle in details
    # the mesh still answers, and nothing leaked
    assert complete(mesh, "Say hi.", chat=True, max_tokens=3).final.generated_tokens >= 1
    wait_idle(mesh)


def test_cancelled_stream_frees_pages(mesh):
    decode = mesh.decode_addresses[0]
    steps_before = instance_stats(decode, "decode").num_steps

    async def cancel_after_three() -> tuple[int, int]:
        async with GatewayClient(mesh.gateway_address) as client:
            call = client.stub.Generate(
                make_request("Count from one to one thousand.", chat=True, max_tokens=400, ignore_eos=True)
            )
            seen, running = 0, -1
            async for _msg in call:
                seen += 1
                if seen == 3:
                    running = (await asyncio.to_thread(instance_stats, decode, "decode")).num_active_requests
                    call.cancel()
                    break
            return seen, running

    seen, running = asyncio.run(cancel_after_three())
    assert seen == 3
    assert running == 1  # the stream was decoding when it was cancelled
    # decode dropped the request and freed its pages; prefill holds no reference
    wait_idle(mesh)
    # ... and it stopped there: run to its end the request takes 399 decode steps
    # (the first token is prefill's); decode runs no step without a request
    steps = instance_stats(decode, "decode").num_steps - steps_before
    assert steps < 399, steps


def test_stop_string_and_sampling(mesh):
    out = complete(mesh, "What is the capital of France?", chat=True, max_tokens=32, stop=["Paris"])
    assert "Paris" not in out.text and out.final.finish_reason == "stop"
    a = complete(mesh, "Write a word.", chat=True, max_tokens=8, temperature=1.0, top_p=0.9, seed=7)
    b = complete(mesh, "Write a word.", chat=True, max_tokens=8, temperature=1.0, top_p=0.9, seed=7)
    assert a.token_ids == b.token_ids  # same seed, same sample, across prefill and decode
    # ... and it is a sample: greedy answers this prompt otherwise
    greedy = complete(mesh, "Write a word.", chat=True, max_tokens=8)
    assert a.token_ids != greedy.token_ids, (a.text, greedy.text)
    wait_idle(mesh)


def hf_logprobs(reference, prompt_ids: list[int], answer: list[int], temperature: float = 0.0) -> torch.Tensor:
    """transformers' log_softmax (of logits / temperature when sampling) at each answer token's
    position, from one forward over the prompt and the answer: [len(answer), V] fp32."""
    model, _, _ = reference
    with torch.inference_mode():
        logits = model(torch.tensor([prompt_ids + answer[:-1]])).logits[0, len(prompt_ids) - 1 :]
    return torch.log_softmax(logits.float() / (temperature or 1.0), dim=-1)


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (0.8, 11)])
def test_logprobs_of_the_first_and_later_tokens_equal_transformers_log_softmax(mesh, reference, temperature, seed):
    # the first token's logprobs come from prefill, the rest from decode: both equal transformers'
    # log-softmax at the same position within 1e-4, the top alternatives too (most likely first)
    _, tok, _ = reference
    prompt_ids = list(
        tok.apply_chat_template([{"role": "user", "content": "Name three colours."}], add_generation_prompt=True)[
            "input_ids"
        ]
    )
    out = complete(
        mesh, b"", prompt_token_ids=prompt_ids, max_tokens=12, temperature=temperature, seed=seed, logprobs=5
    )
    assert len(out.logprobs) == len(out.token_ids) >= 2
    want = hf_logprobs(reference, prompt_ids, out.token_ids, temperature)
    for i, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        assert lp.token_id == token
        assert abs(lp.logprob - float(want[i, token])) < 1e-4, (i, lp.logprob, float(want[i, token]))
        top = want[i].topk(5)
        assert list(lp.top_token_ids) == top.indices.tolist(), i
        assert max(abs(a - b) for a, b in zip(lp.top_logprobs, top.values.tolist())) < 1e-4, i
    if temperature == 0.0:  # greedy: the token is the most likely one
        assert [lp.top_token_ids[0] for lp in out.logprobs] == out.token_ids
    # without the field no logprobs travel
    assert not complete(mesh, b"", prompt_token_ids=prompt_ids, max_tokens=3).logprobs


def test_n_choices_are_prefilled_and_pushed_once_and_each_is_reproducible_alone(mesh, reference):
    _, tok, _ = reference
    prompt_ids = list(
        tok.apply_chat_template([{"role": "user", "content": "Tell me a colour."}], add_generation_prompt=True)[
            "input_ids"
        ]
    )
    # greedy: every choice is the one greedy answer, with the same logprobs
    single = complete(mesh, b"", prompt_token_ids=prompt_ids, max_tokens=10, logprobs=1)
    greedy = complete(mesh, b"", prompt_token_ids=prompt_ids, max_tokens=10, n=3, logprobs=1)
    assert [c.token_ids for c in greedy.choices] == [single.token_ids] * 3
    for c in greedy.choices:
        assert [lp.logprob for lp in c.logprobs] == pytest.approx([lp.logprob for lp in single.logprobs], abs=1e-4)
    f = greedy.final
    assert (
        f.generated_tokens == 3 * len(single.token_ids)
        and list(f.choice_generated_tokens) == [len(single.token_ids)] * 3
    )
    # the prompt went over once: the pages one request pushes, not three times as many
    assert f.kv_transfer.num_pages + f.kv_transfer.decode_cached_pages == math.ceil(len(prompt_ids) / 16)
    # sampled with a seed: choice i is the request alone with seed + i (prefill drew its first
    # token, decode the rest), and the choices differ from each other
    sampled = complete(mesh, b"", prompt_token_ids=prompt_ids, max_tokens=12, n=3, temperature=1.0, seed=40)
    alone = [
        complete(mesh, b"", prompt_token_ids=prompt_ids, max_tokens=12, temperature=1.0, seed=40 + i).token_ids
        for i in range(3)
    ]
    assert [c.token_ids for c in sampled.choices] == alone
    assert len({tuple(t) for t in alone}) > 1
    wait_idle(mesh)


def test_a_cancel_of_n_choices_mid_stream_ends_them_all_and_frees_every_page(mesh):
    async def run() -> tuple[int, set[int]]:
        seen: set[int] = set()
        deltas = 0
        async with GatewayClient(mesh.gateway_address) as client:
            request = make_request("Count to a thousand.", chat=True, max_tokens=1500, ignore_eos=True, n=3)
            async for msg in client.stream(request, timeout_s=120):
                if msg.HasField("delta"):
                    seen.add(msg.delta.index)
                    deltas += 1
                if len(seen) == 3 and deltas >= 12:
                    break  # leaving the stream cancels the call
        return deltas, seen

    deltas, seen = asyncio.run(run())
    assert seen == {0, 1, 2} and deltas >= 12
    wait_idle(mesh)  # decode ended all three choices and freed their pages, prefill its own


def test_prompt_logprobs_are_transformers_log_softmax_over_the_whole_prompt_even_when_cached(mesh, reference):
    # asked for, the prompt is computed whole (its cached blocks are not reused): each token's
    # logprob given the ones before it equals transformers' within 1e-4, with its top tokens
    model, tok, _ = reference
    # over 512 tokens: two chunks, each position's logits from its own chunk's forward
    prompt_ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 54, add_special_tokens=False)
    assert len(prompt_ids) > 512
    complete(mesh, b"", prompt_token_ids=prompt_ids, max_tokens=1)  # now cached on prefill
    got = complete(mesh, b"", prompt_token_ids=prompt_ids, max_tokens=3, prompt_logprobs=3, logprobs=0)
    assert got.final.cached_tokens == 0  # computed whole
    assert [lp.token_id for lp in got.prompt_logprobs] == prompt_ids
    assert math.isnan(got.prompt_logprobs[0].logprob) and not got.prompt_logprobs[0].top_token_ids
    with torch.inference_mode():
        want = torch.log_softmax(model(torch.tensor([prompt_ids + got.token_ids[:-1]])).logits[0].float(), dim=-1)
    for i in range(1, len(prompt_ids)):
        lp = got.prompt_logprobs[i]
        assert abs(lp.logprob - float(want[i - 1, prompt_ids[i]])) < 1e-4, i
        assert list(lp.top_token_ids) == want[i - 1].topk(3).indices.tolist(), i
    # the answer's own logprobs go on from there, the first token's from the prompt's last row
    n = len(prompt_ids)
    assert abs(got.logprobs[0].logprob - float(want[n - 1, got.token_ids[0]])) < 1e-4
    wait_idle(mesh)


def test_tools_over_grpc_render_in_the_prompt_and_a_call_grammar_makes_the_call(mesh):
    import json

    import jsonschema

    from kvmesh.gateway.tools import call_schema, parse_tools

    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
    schema = call_schema(parse_tools({"tools": [weather], "tool_choice": "required"}))
    assert schema is not None
    plain = complete(mesh, "", messages=[("user", "What is the weather in Paris?")], max_tokens=4)
    got = complete(
        mesh, "", messages=[("user", "What is the weather in Paris?")], max_tokens=60, tools=[weather],
        grammar=("json_schema", schema),
    )  # fmt: skip
    calls = json.loads(got.text)
    jsonschema.validate(calls, json.loads(schema))
    assert calls[0]["name"] == "get_weather" and got.final.finish_reason == "stop"
    # the tools are in the prompt: it is longer than the same chat without them
    assert got.final.prompt_tokens > plain.final.prompt_tokens + 20
    with pytest.raises(grpc.aio.AioRpcError) as err:
        complete(mesh, "", messages=[("user", "Hi")], max_tokens=2, tools=[{"type": "function"}])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tools" in err.value.details()
    wait_idle(mesh)


def test_a_gateway_without_redis_routes_by_load_and_prediction_and_says_so(mesh, tmp_path):
    """No Redis: no prefix index and no registry, but the instances' profiles come with their stats,
    so a request with an SLO is still predicted and routed; the answer is the mesh's own."""
    import subprocess
    import sys

    from kvmesh.launcher import PARENT_PID_ENV
    from kvmesh.redis_server import free_port
    from kvmesh.runtime.service import wait_for_health

    port, log = free_port(), tmp_path / "gateway.log"
    cmd = [sys.executable, "-m", "kvmesh.cli", "serve", "gateway", "--port", str(port), "--slo-ttft-ms", "60000",
           *[a for p in mesh.prefill_addresses for a in ("--prefill", p)],
           *[a for d in mesh.decode_addresses for a in ("--decode", d)]]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "KVMESH_REDIS_URL")}
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, env={**env, PARENT_PID_ENV: str(os.getpid())}, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        asyncio.run(wait_for_health(f"127.0.0.1:{port}", 120))
        assert "no Redis: routing by load and latency prediction alone" in log.read_text()
        want = complete(mesh, "Name three colours.", max_tokens=6, ignore_eos=True).token_ids
        # the instances have served before (this shared mesh's earlier tests, or these): once this
        # gateway's first stats poll brings their profiles, its requests are predicted
        deadline = time.monotonic() + 60
        while True:
            got = complete(mesh, "Name three colours.", address=f"127.0.0.1:{port}", max_tokens=6, ignore_eos=True)
            assert got.token_ids == want
            if got.final.predicted_ttft_s > 0:
                break
            assert time.monotonic() < deadline, "a gateway without Redis never predicted"
        assert got.final.predicted_itl_s > 0
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    wait_idle(mesh)
