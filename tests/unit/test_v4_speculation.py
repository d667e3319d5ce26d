"""Speculative decoding on DeepSeek-V4: the state rolls back to what the accepted tokens alone
leave, the MTP drafter (its weights, its drafts), and the decode engine's output with drafts
(n-gram and MTP, k = 1..4) equal to its output without, on a tiny random checkpoint in process.

Numbers compared across differently batched forwards use assert_close with tight tolerances,
not torch.equal: a verification step runs k + 1 rows through every matmul and through the MoE,
which groups rows by expert, so a row's GEMMs run at another M (and beside other rows) than in a
one-row step and round differently in the last bits (~1e-7 relative here); the state logic itself
keeps nothing of a rejected row, which the negative controls below show (without the rollback
the state is off by orders of magnitude more).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvmesh.bench.tiny_models import make_tiny_model
from kvmesh.decode_svc.config import DecodeConfig
from kvmesh.engine.deepseek_v4.runner import DeepseekV4Runner
from kvmesh.engine.deepseek_v4.shapes import MTP_PREFIX, mtp_shapes
from kvmesh.engine.deepseek_v4.weights import check_and_take, normalize_names
from kvmesh.engine.forward import ForwardItem
from kvmesh.engine.loader import load_deepseek_v4_config as load_config
from kvmesh.engine.loader import resolve_model
from tests.unit.test_speculative import _generate

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TIGHT = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model("deepseek_v4", tmp_path_factory.mktemp("v4spec"))


@pytest.fixture(scope="module")
def runner(tiny):
    # slots for 64 requests plus 32 verification rows, as decode sizes them by default
    return DeepseekV4Runner(resolve_model(str(tiny)), 64, 16, DecodeConfig(speculative="mtp").num_state_slots)


def test_rejected_drafts_leave_the_state_of_a_run_that_never_saw_them(runner):
    model = runner.model  # over pages and slots of this test's own
    lay = model.layout
    n, blocks = 13, [3, 4, 5]  # the drafts after 13 prompt tokens close CSA windows (4) and the sliding one (8)
    prompt = torch.randint(3, 49152, (n,), generator=torch.Generator().manual_seed(5)).tolist()
    pages, slots = torch.zeros(16, lay.page_floats), torch.zeros(8, lay.slot_floats)
    first = int(model.forward([ForwardItem(prompt, 0, blocks, 0)], pages, slots)[0].argmax())
    # the reference: plain greedy decoding, one token a step, and its slot after each step
    ref_pages, ref_slots = pages.clone(), slots.clone()
    greedy, ref_logits, ref_state = [first], [], []
    for j in range(6):
        logits = model.forward([ForwardItem([greedy[-1]], n + j, blocks, 0)], ref_pages, ref_slots)[0]
        ref_logits.append(logits)
        ref_state.append(ref_slots[0].clone())
        greedy.append(int(logits.argmax()))
    for k, a in [(drafted, a) for drafted in (1, 2, 3, 4) for a in range(drafted)]:
        # k drafts, the first a of them right: rows 0..a are kept, rows a+1..k rejected
        drafts = greedy[1 : 1 + a] + [(greedy[1 + a] + 1 + i) % 49152 for i in range(k - a)]
        got_pages, got_slots = pages.clone(), slots.clone()
        rows = [
            ForwardItem([t], n + j, blocks, j, j - 1 if j else None)  # row j > 0 continues row j-1 in slot j
            for j, t in enumerate([first, *drafts])
        ]
        logits = model.forward(rows, got_pages, got_slots)
        torch.testing.assert_close(logits[: a + 1], torch.stack(ref_logits[: a + 1]), **TIGHT)
        assert [int(x) for x in logits[: a + 1].argmax(dim=-1)] == greedy[1 : a + 2]
        # negative controls: the state after the last row (what one shared slot would hold), and
        # row 0's when a > 0, are far from the reference's
        assert (got_slots[k] - ref_state[a]).abs().max() > 1e-3
        if a:
            assert (got_slots[0] - ref_state[a]).abs().max() > 1e-3
        got_slots[0].copy_(got_slots[a])  # decode keeps the last accepted row's slot
        torch.testing.assert_close(got_slots[0], ref_state[a], **TIGHT)
        # the pages past the accepted length hold rejected rows' K=V and entries: never read,
        # rewritten first, so decoding on gives the reference's logits
        for j in range(a + 1, a + 3):
            logits = model.forward([ForwardItem([greedy[j]], n + j, blocks, 0)], got_pages, got_slots)[0]
            torch.testing.assert_close(logits, ref_logits[j], **TIGHT)
            assert int(logits.argmax()) == greedy[j + 1]


def test_the_loader_maps_deepseeks_mtp_names_and_names_what_is_missing_or_misshapen(tiny):
    cfg = load_config(tiny, "tiny")
    tensors = load_file(tiny / "model.safetensors")
    upstream = {k for k in tensors if k.startswith("mtp.")}
    assert {"mtp.0.e_proj.weight", "mtp.0.attn.wq_a.weight", "mtp.0.ffn.experts.7.w2.weight"} <= upstream
    assert "mtp.0.hc_attn_fn" in upstream and "mtp.0.ffn.gate.bias" in upstream
    names = {k for k in normalize_names({k: tensors[k] for k in upstream}, cfg.n_routed_experts)}
    assert names == set(mtp_shapes(cfg))  # every DeepSeek name lands on one of ours, none left over
    broken = dict(tensors)
    del broken["mtp.0.hnorm.weight"]
    with pytest.raises(ValueError, match=r"lacks multi-token-prediction tensor 'mtp\.0\.hnorm\.weight'"):
        check_and_take(broken, cfg, "tiny")
    broken = dict(tensors)
    broken["mtp.0.e_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"'mtp\.0\.e_proj\.weight' of 'tiny' has shape \(3, 3\), expected \(64, 64\)"):
        check_and_take(broken, cfg, "tiny")


def test_mtp_drafts_in_one_pass_equal_drafts_position_by_position(runner):
    # the first pass runs every pending pair at once (their K=V written before any attends):
    # the same as running them one at a time
    from kvmesh.engine.forward import DraftItem

    torch.manual_seed(0)
    hidden = torch.randn(5, 2, 64)
    tokens = [11, 12, 13, 14, 15]
    together = runner.propose_drafts([DraftItem(20, tokens, hidden, [0, 1, 2], 20, 3)])
    for j in range(4):  # one pending pair at a time, drafting 1, then the last with 3
        runner.propose_drafts([DraftItem(20 + j, tokens[j : j + 1], hidden[j : j + 1], [0, 1, 2], 20, 1)])
    alone = runner.propose_drafts([DraftItem(24, tokens[4:], hidden[4:], [0, 1, 2], 20, 3)])
    assert together == alone and len(together[0]) == 3


def _oracle(truth: list[int]):
    """An n-gram drafter stand-in that knows the plain output: at length L it proposes the next k
    true tokens with draft L % (k + 1) made wrong (none when that is k), so steps accept 0..k."""

    def propose(tokens, k, *args, **kwargs):
        L = len(tokens)
        drafts = list(truth[L : L + k])
        c = L % (k + 1)
        if c < len(drafts):
            drafts[c] = (drafts[c] + 1) % 49152
        return drafts

    return propose


def test_greedy_output_with_drafts_equals_output_without_for_each_k(runner, monkeypatch):
    from kvmesh.engine.speculative import ngram

    prompt = list(range(300, 317))
    plain, _ = _generate(runner, DecodeConfig(num_pages=64), prompt, 12)
    monkeypatch.setattr(ngram, "propose_ngram", _oracle(prompt + plain))
    for method in ("ngram", "mtp"):
        for k in (1, 2, 3, 4):
            config = DecodeConfig(num_pages=64, speculative=method, num_draft_tokens=k, draft_row_cost=0.01)
            got, counts = _generate(runner, config, prompt, 12)
            assert got == plain, (method, k)
            assert counts.drafted > counts.accepted, (method, k, counts)  # drafts were rejected...
            if method == "ngram":  # ...and (the oracle's) accepted, several at a time
                assert counts.accepted >= 2, (k, counts)


def test_mtp_whose_drafts_are_the_targets_argmax_is_accepted_every_time(tiny, tmp_path):
    # both heads' final norms zeroed: every logit is 0, so the target's argmax and the MTP
    # module's draft are both token 0 at every position; the state still moves with every row
    tensors = load_file(tiny / "model.safetensors")
    for name in ("model.norm.weight", MTP_PREFIX + "norm.weight"):
        tensors[name] = torch.zeros_like(tensors[name])  # one of transformers' names, one of DeepSeek's
    for f in tiny.iterdir():
        if f.name != "model.safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    r = DeepseekV4Runner(resolve_model(str(tmp_path)), 32, 16, DecodeConfig(speculative="mtp").num_state_slots)
    prompt = list(range(400, 411))
    plain, _ = _generate(r, DecodeConfig(num_pages=32), prompt, 11)
    assert plain == [0] * 11
    got, counts = _generate(r, DecodeConfig(num_pages=32, speculative="mtp", num_draft_tokens=4), prompt, 11)
    assert got == plain
    # every draft kept, several a step (the governor picks k <= 4 from the acceptance it sees)
    assert counts.drafted == counts.accepted >= 6, counts


def test_decode_measures_what_a_draft_costs_on_deepseek_v4(runner):
    # the start-up measurement runs its rows on scratch slots (V4 rows need one) and times a pass
    # of the MTP module on top: a cost above the floor
    from kvmesh.decode_svc.engine import DecodeEngine

    engine = DecodeEngine(DecodeConfig(num_pages=64, speculative="mtp", num_draft_tokens=2), runner)
    assert engine.calibrate() > 0.05
    engine.pool.check_integrity()


def test_the_mtp_block_computes_what_the_models_own_verified_layer_computes(tmp_path):
    # An MTP module set up to equal a one-layer model (sliding-window attention, top-k MoE):
    # its block holds layer 0's weights, its hc head and norm the model's, e_proj = I and
    # h_proj = 0, and the embedding rows have unit RMS (so enorm leaves them, to 1e-6). Then a
    # first pass over positions 0..n-1 must give the model's logits at each position: the
    # module's attention, window and head against the path tests/unit/test_deepseek_v4_model.py
    # checks against transformers.
    from kvmesh.engine.deepseek_v4.model import DeepseekV4Model
    from kvmesh.engine.deepseek_v4.mtp import DeepseekV4MTP
    from kvmesh.engine.deepseek_v4.shapes import expected_shapes
    from kvmesh.engine.deepseek_v4.state import V4StateLayout
    from kvmesh.engine.forward import DraftItem

    one = make_tiny_model(
        "deepseek_v4", tmp_path, num_hidden_layers=1, layer_types=["sliding_attention"], mlp_layer_types=["moe"]
    )
    cfg = load_config(one, "one")
    w = normalize_names(load_file(one / "model.safetensors"), cfg.n_routed_experts)
    emb = w["model.embed_tokens.weight"]
    w["model.embed_tokens.weight"] = emb * torch.rsqrt(emb.square().mean(-1, keepdim=True))
    H = cfg.hidden_size
    for key in [k for k in w if k.startswith(MTP_PREFIX)]:
        del w[key]
    for key in expected_shapes(cfg):
        if key.startswith("model.layers.0."):
            w[MTP_PREFIX + key[len("model.layers.0.") :]] = w[key]
    w.update(
        {
            MTP_PREFIX + "e_proj.weight": torch.eye(H),
            MTP_PREFIX + "h_proj.weight": torch.zeros(H, H),
            MTP_PREFIX + "enorm.weight": torch.ones(H),
            MTP_PREFIX + "hnorm.weight": torch.ones(H),
            MTP_PREFIX + "norm.weight": w["model.norm.weight"],
            MTP_PREFIX + "hc_head_fn": w["model.hc_head.hc_fn"],
            MTP_PREFIX + "hc_head_base": w["model.hc_head.hc_base"],
            MTP_PREFIX + "hc_head_scale": w["model.hc_head.hc_scale"],
        }
    )
    lay = V4StateLayout.from_config(cfg, 16, mtp=True)
    model = DeepseekV4Model(cfg, w, lay)
    n, blocks = 21, [0, 1]  # past the sliding window of 8
    ids = list(range(500, 500 + n))
    pages, slots = torch.zeros(2, lay.page_floats), torch.zeros(1, lay.slot_floats)
    ref = torch.stack([model.forward([ForwardItem([t], j, blocks, 0)], pages, slots)[0] for j, t in enumerate(ids)])
    mtp = DeepseekV4MTP(model, 2)
    logits, _ = mtp.forward(
        torch.arange(n), torch.tensor(ids), torch.zeros(n, cfg.hc_mult, H), [torch.tensor(blocks)] * n, torch.zeros(n)
    )
    torch.testing.assert_close(logits, ref, **TIGHT)
    # and the drafts are that argmax, each pass continuing the last
    assert mtp.propose([DraftItem(0, ids, torch.zeros(n, cfg.hc_mult, H), blocks, 0, 1)]) == [[int(ref[-1].argmax())]]
