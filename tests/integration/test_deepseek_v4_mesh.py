"""DeepSeek-V4 through the whole mesh: a tiny random checkpoint (made here with transformers,
SmolLM2's tokenizer), prefill and decode in separate processes, the V4 state (pages of
sliding-window K=V, compressed entries, indexer keys, and the request's state slot) pushed over
UCX, Redis index, gRPC on loopback. transformers' `generate` on the same checkpoint is the
reference for every token.

Ties in the indexer's top-k cannot decide these comparisons: the tiny config has 8 indexer
heads, and tests/unit/test_deepseek_v4_model.py shows the same prompts' shapes tie-free
(`topk_boundary_ties == 0`); a tie would show here as a token mismatch, not a pass.
"""

from __future__ import annotations

import asyncio
import math

import grpc
import pytest
import torch
from transformers import AutoTokenizer, DeepseekV4ForCausalLM

from kvmesh.bench.tiny_models import make_tiny_model
from kvmesh.client import GatewayClient, make_request
from kvmesh.engine.deepseek_v4.state import V4StateLayout
from kvmesh.engine.loader import load_deepseek_v4_config as load_v4_config
from kvmesh.engine.loader import resolve_model
from kvmesh.redis_server import free_port
from tests.conftest import instance_stats
from tests.integration.meshutil import complete, complete_many, running_mesh, wait_idle, wait_indexed

WORDS = (
    "the lighthouse keeper walked along the cliff and counted every ship that passed "
    "through the narrow channel before the storm "
).split()


def _text(n_words: int) -> str:
    return " ".join(WORDS[i % len(WORDS)] for i in range(n_words))


PROMPTS = [_text(3), _text(30), _text(110), _text(260)]  # ~4, ~35, ~125, ~290 tokens


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model("deepseek_v4", tmp_path_factory.mktemp("v4mesh"))


@pytest.fixture(scope="module")
def mesh(tiny):
    # decode runs 2 expert-parallel ranks (attention data-parallel, routed experts split over
    # the ranks, dispatch and combine over gloo) and speculates with the checkpoint's MTP module,
    # on rank 0 (random weights: drafts are mostly
    # rejected, which exercises the state rollback on every step that drafts): every test here
    # compares its output with transformers' or with plain decoding, token for token. Up to 4
    # drafts a step, as the governor picks: 3 at first, fewer as they are rejected, then one
    # every 8 steps (a fixed row cost, so the machine's load cannot change that)
    # every service's /metrics on, and a gateway that sheds a request with an SLO no instance can
    # meet (requests without one, as all but the last test's, are not affected): the dashboard's
    # MoE, speculation and shed panels get their data from this mesh (the last test)
    ports = {kind: free_port() for kind in ("gateway", "prefill", "decode")}
    decode_args = ["--speculative", "mtp", "--num-draft-tokens", "4", "--draft-row-cost", "0.35", "--ep", "2"]
    with running_mesh(
        1,
        1,
        model=str(tiny),
        prefill_args=["--metrics-port", str(ports["prefill"])],
        decode_args=[*decode_args, "--metrics-port", str(ports["decode"])],
        gateway_args=["--metrics-port", str(ports["gateway"]), "--slo-miss", "shed"],
    ) as m:
        m.metrics_targets = [f"127.0.0.1:{p}" for p in ports.values()]
        yield m


@pytest.fixture(scope="module")
def reference(tiny):
    model = DeepseekV4ForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny)


def hf_greedy(reference, prompt: str, new_tokens: int) -> list[int]:
    model, tok = reference
    ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return out[0, ids.shape[1] :].tolist()


def test_greedy_64_tokens_equal_transformers_generate(mesh, reference):
    # four prompt lengths crossing CSA (4), HCA (16) and sliding (8) windows and page ends;
    # decode drafts with MTP, so equal tokens mean rejected drafts left no trace in the state
    lengths = []
    for prompt in PROMPTS:
        got = complete(mesh, prompt, chat=False, max_tokens=64, ignore_eos=True)
        assert got.token_ids == hf_greedy(reference, prompt, 64), prompt[:40]
        assert got.final.prefill_instance != got.final.decode_instance
        # MTP drafted on several steps of every request (k = 3, 2, 1 and probes every 8 steps)
        assert got.final.drafted_tokens >= 8 and got.final.drafted_tokens >= got.final.accepted_tokens
        lengths.append(got.final.prompt_tokens)
    assert len(set(lengths)) == 4 and max(lengths) > 256, lengths
    wait_idle(mesh)


def test_prefix_cache_hit_continues_exactly(mesh, reference):
    # the second prompt shares the first's first ~120 tokens: prefill reuses those pages
    # (compressed entries, indexer keys, end-of-page overlap) and computes only the rest
    first = _text(100) + " and then the rain came"
    second = _text(100) + " while the gulls circled over the harbour wall"
    complete(mesh, first, chat=False, max_tokens=2, ignore_eos=True)
    got = complete(mesh, second, chat=False, max_tokens=64, ignore_eos=True)
    assert got.final.cached_tokens >= 96, got.final.cached_tokens
    assert got.final.cached_tokens % 16 == 0
    assert got.token_ids == hf_greedy(reference, second, 64)
    wait_idle(mesh)


def test_state_moved_bitwise_pages_plus_slot(mesh, tiny):
    cfg = load_v4_config(tiny, "tiny")
    layout = V4StateLayout.from_config(cfg, 16, mtp=True)  # the slot carries the last hidden streams
    out = complete(mesh, PROMPTS[2], chat=False, max_tokens=4, ignore_eos=True)
    kv = out.final.kv_transfer
    assert kv.page_nbytes == layout.page_floats * 4
    # pages decode held already (a prompt sharing this one's start ran before) are not pushed
    assert kv.num_pages + kv.decode_cached_pages == math.ceil(out.final.prompt_tokens / 16)
    # the pages, then the request's state slot (open windows, CSA overlap)
    assert kv.nbytes == kv.num_pages * kv.page_nbytes + layout.slot_floats * 4
    assert len(kv.prefill_digest) == 64 and kv.prefill_digest == kv.decode_digest
    wait_idle(mesh)


def test_a_conversation_s_next_turn_reuses_decode_s_pages_exactly(mesh, reference, tiny):
    """Decode-side prefix reuse on V4 (2 EP ranks, MTP drafts): the next turn of a conversation
    finds the first turn's prompt and answer in decode's pages (sliding-window K=V, compressed
    entries, indexer keys written by decode's own steps for the answer), prefill pushes only the
    pages after them and its state slot, and the tokens equal transformers' on the whole prompt."""
    model, tok = reference
    turn1 = tok.encode(_text(40) + " and what did the keeper see", add_special_tokens=False)
    first = complete(mesh, b"", prompt_token_ids=turn1, max_tokens=48, ignore_eos=True)
    held = wait_indexed(
        mesh, mesh.decode_addresses[0], "decode", turn1 + first.token_ids[:-1], resolve_model(str(tiny)).name
    )
    turn2 = turn1 + first.token_ids + tok.encode(" and after the storm", add_special_tokens=False)
    got = complete(mesh, b"", prompt_token_ids=turn2, max_tokens=24, ignore_eos=True)
    kv = got.final.kv_transfer
    assert kv.decode_cached_pages == min(held, (len(turn2) - 1) // 16) >= 4
    assert kv.num_pages == math.ceil(len(turn2) / 16) - kv.decode_cached_pages
    assert len(kv.prefill_digest) == 64 and kv.prefill_digest == kv.decode_digest
    with torch.inference_mode():
        ids = torch.tensor([turn2])
        want = model.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False)[0, len(turn2) :].tolist()
    assert got.token_ids == want
    wait_idle(mesh)


def test_eight_concurrent_equal_alone(mesh):
    # different lengths decoded in shared steps give what each gets alone
    prompts = [_text(5 + 17 * i) + f" number {i}" for i in range(8)]
    alone = [complete(mesh, p, chat=False, max_tokens=24, ignore_eos=True).token_ids for p in prompts]
    together = complete_many(mesh, [dict(prompt=p, chat=False, max_tokens=24, ignore_eos=True) for p in prompts])
    assert [c.token_ids for c in together] == alone
    wait_idle(mesh)


def test_expert_token_counts_follow_the_traffic_and_kvmesh_eplb_stats_records_them(mesh, tiny, tmp_path, capsys):
    """EPLB's input: every MoE layer (hash-routed too) counts each token's k experts, on prefill
    for the prompt tokens it computed and on decode for each step's token."""
    import json

    import numpy as np

    from kvmesh.cli import main
    from kvmesh.engine.ep.eplb import counts_from_stats

    def counts(address: str, kind: str) -> np.ndarray:
        s = instance_stats(address, kind)
        return counts_from_stats(s.num_experts, s.expert_tokens)

    wait_idle(mesh)
    (p,), (d,) = mesh.prefill_addresses, mesh.decode_addresses
    before_p, before_d = counts(p, "prefill"), counts(d, "decode")
    out = complete(mesh, _text(40) + " a prompt counted by expert", chat=False, max_tokens=9, ignore_eos=True)
    after_p, after_d = counts(p, "prefill"), counts(d, "decode")
    k = load_v4_config(tiny, "tiny").num_experts_per_tok  # hash-MoE table rows are as wide
    assert after_p.shape == (4, 8)  # the tiny config: 4 MoE layers of 8 routed experts
    computed = out.final.prompt_tokens - out.final.cached_tokens
    assert (after_p - before_p).sum(axis=1).tolist() == [computed * k] * 4
    # the first token came from prefill; decode's steps computed one row a step plus one a draft
    # (rejected drafts route through the experts too: real load), its MTP module is not counted
    rows = (9 - 1) - out.final.accepted_tokens + out.final.drafted_tokens
    assert (after_d - before_d).sum(axis=1).tolist() == [rows * k] * 4
    # the command adds the instances' counts up and writes the file `kvmesh eplb plan` reads
    stats_file = tmp_path / "stats.json"
    assert main(["eplb", "stats", "--instance", p, "--instance", d, "--ranks", "4", "-o", str(stats_file)]) == 0
    assert json.loads(stats_file.read_text())["layers"] == (after_p + after_d).tolist()
    out_text = capsys.readouterr().out
    assert "balancedness at 4 ranks" in out_text
    # decode runs 2 EP ranks: its stats carry each rank's rows and the placement in use (experts
    # in order, one replica each), and every routed row went to exactly one rank
    s = instance_stats(d, "decode")
    ranks = np.asarray(list(s.ep_rank_tokens)).reshape(-1, s.ep_ranks)
    phy2log = np.asarray(list(s.ep_phy2log)).reshape(-1, s.ep_slots_per_layer)
    assert s.ep_ranks == 2 and phy2log.tolist() == [list(range(8))] * 4
    assert ranks.sum(axis=1).tolist() == counts(d, "decode").sum(axis=1).tolist()
    # the command prints each layer's balancedness measured on the ranks next to the planner's
    # prediction for that placement; with one replica each they are the same numbers
    assert f"{d}: expert-parallel over 2 ranks" in out_text
    table = out_text.split("expert-parallel over 2 ranks")[1].splitlines()[2:6]
    for row in table:
        _, measured, predicted = row.split()[:3]
        assert measured == predicted, row
    assert main(["eplb", "plan", "--ranks", "4", "--redundant", "4", str(stats_file)]) == 0
    wait_idle(mesh)


def test_decode_ran_expert_parallel_with_mtp_drafts(mesh):
    # every comparison above went through 2 expert-parallel ranks with MTP speculation: the
    # decode service said so at start, each rank holding half of the routed experts
    with open(mesh.log_path, encoding="utf-8") as f:
        log = f.read()
    started = [line for line in log.splitlines() if "expert-parallel decode: 2 ranks over gloo" in line]
    assert len(started) == 1, log[-3000:]
    held = started[0].split("routed experts held per rank: ")[1]
    a, b = (float(x) for x in held.strip(" MB[]").split(","))
    assert a == b > 0


def test_n_choices_fork_the_state_slot_and_logprobs_are_transformers_on_v4(mesh, reference):
    """n = 3 on V4 (2 EP ranks, MTP drafts): choices 1 and 2 share the prompt's full pages and
    start from copies of its partial page and of its state slot (open windows, CSA overlap), so
    each gives transformers' greedy tokens; every token's logprob, prefill's first and decode's
    (drafted or not), is transformers' log-softmax at its position within 1e-4."""
    model, tok = reference
    prompt = PROMPTS[1]
    ids = tok.encode(prompt, add_special_tokens=False)
    assert len(ids) % 16, "the prompt must end inside a page (its partial page is copied)"
    got = complete(mesh, prompt, chat=False, max_tokens=24, ignore_eos=True, n=3, logprobs=2)
    want = hf_greedy(reference, prompt, 24)
    assert [c.token_ids for c in got.choices] == [want] * 3
    with torch.inference_mode():
        logits = model(torch.tensor([ids + want[:-1]])).logits[0, len(ids) - 1 :]
    ref = torch.log_softmax(logits.float(), dim=-1)
    for c in got.choices:
        assert [lp.token_id for lp in c.logprobs] == want
        assert max(abs(lp.logprob - float(ref[i, t])) for i, (t, lp) in enumerate(zip(want, c.logprobs))) < 1e-4
    assert got.final.drafted_tokens > 0  # MTP drafted for the choices too
    wait_idle(mesh)


def test_prometheus_gets_the_moe_speculation_and_shed_panels_data_from_this_mesh(mesh, tmp_path):
    """The dashboard queries the observed mesh cannot answer (tests/integration/prometheus.py,
    NEEDS_A_FEATURE) answer here: expert balancedness (MoE), speculative acceptance (MTP); and the
    shed share is above 0 (a request whose 1 ms TTFT target no instance is predicted to meet)."""
    from tests.integration.prometheus import NEEDS_A_FEATURE, has_data, prometheus, scrapes, values
    from tests.unit.test_dashboards import _generator

    targets = mesh.metrics_targets
    with prometheus(targets, tmp_path) as url:
        scrapes(url, targets, 1, timeout_s=120)

        async def traffic() -> None:
            async with GatewayClient(mesh.gateway_address) as client:
                for prompt in PROMPTS[:2]:  # routed tokens, drafts verified
                    await client.complete(make_request(prompt, max_tokens=8, ignore_eos=True), timeout_s=120)
                # shed once the gateway predicts (the profiles come with the stats polls)
                for _ in range(20):
                    request = make_request(PROMPTS[0], max_tokens=2)
                    request.slo_ttft_ms = 1
                    try:
                        await client.complete(request, timeout_s=120)
                    except grpc.aio.AioRpcError as exc:
                        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                        return
                raise AssertionError("nothing was shed in 20 requests")

        asyncio.run(traffic())
        wait_idle(mesh)
        scrapes(url, targets, 2)
        queries = _generator().queries()
        needed = [e for e in queries if any(part in e for part in NEEDS_A_FEATURE)]
        assert len(needed) == len(NEEDS_A_FEATURE)
        assert [e for e in needed if not has_data(url, e)] == []
        # and the shed share (0 on a mesh that sheds nothing) is above 0
        (shed,) = [e for e in queries if 'outcome="shed"' in e]
        assert values(url, shed)[0] > 0
