"""Our DeepSeek-V4 forward against transformers' DeepseekV4ForCausalLM on tiny random checkpoints.

Ties in the Lightning Indexer's top-k (trap: ReLU makes exact 0.0 scores common, and
transformers' topk may order equal scores either way) must not decide any comparison here. The
default tiny config has 8 indexer heads, so an all-zero score needs all 8 ReLUs at zero; every
test with index_topk=4 asserts `model.topk_boundary_ties == 0`, i.e. no query's top-k set was
decided by a tie. `test_logits_topk_covers_all` uses index_topk >= every entry count instead.
"""

import pytest
import torch
from safetensors.torch import load_file
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

from kvmesh.bench.tiny_models import make_tiny_model
from kvmesh.engine.deepseek_v4.model import DeepseekV4Model
from kvmesh.engine.deepseek_v4.state import V4StateLayout
from kvmesh.engine.forward import ForwardItem
from kvmesh.engine.loader import load_deepseek_v4_config as load_config

LENGTHS = [1, 3, 4, 5, 15, 16, 17, 127, 128, 129, 300]


def _load(path):
    cfg = DeepseekV4Config.from_pretrained(path)
    hf = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    lay = V4StateLayout.from_config(cfg, V4StateLayout.default_page_size(cfg))
    model = DeepseekV4Model(cfg, load_file(path / "model.safetensors"), lay)
    model.count_topk_ties = True
    return cfg, hf, lay, model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _load(make_tiny_model("deepseek_v4", tmp_path_factory.mktemp("v4")))


def _state(lay, pages=64, slots=4):
    return torch.zeros(pages, lay.page_floats), torch.zeros(slots, lay.slot_floats)


def _prompt(n, seed):
    return torch.randint(3, 49152, (n,), generator=torch.Generator().manual_seed(seed))


def _pages_for(lay, n, first=3):
    return list(range(first, first + -(-n // lay.page_size)))


@pytest.mark.parametrize("length", LENGTHS)
def test_prefill_logits_match_full_forward(tiny, length):
    # one prefill of the whole prompt vs transformers' full forward (same mode: no cache)
    cfg, hf, lay, model = tiny
    ids = _prompt(length, length)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0, -1]
    pages, slots = _state(lay)
    model.topk_boundary_ties = 0
    out = model.forward([ForwardItem(ids.tolist(), 0, _pages_for(lay, length), 1)], pages, slots)[0]
    assert model.topk_boundary_ties == 0
    assert (out - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("length", LENGTHS)
def test_decode_logits_match_transformers_cache(tiny, length):
    # prefill all but the last few tokens, then one token a step; transformers runs the same
    # way on its own cache (DeepseekV4CSACache / HCACache), step for step
    cfg, hf, lay, model = tiny
    ids = _prompt(length + 6, 1000 + length)
    pages, slots = _state(lay)
    blocks = _pages_for(lay, length + 6)
    model.topk_boundary_ties = 0
    ours = [model.forward([ForwardItem(ids[:length].tolist(), 0, blocks, 2)], pages, slots)[0]]
    with torch.no_grad():
        out = hf(ids[None, :length], use_cache=True)
        cache, theirs = out.cache, [out.logits[0, -1]]
        for t in range(length, length + 6):
            ours.append(model.forward([ForwardItem([int(ids[t])], t, blocks, 2)], pages, slots)[0])
            out = hf(ids[None, t : t + 1], cache=cache, use_cache=True)
            cache = out.cache
            theirs.append(out.logits[0, -1])
    assert model.topk_boundary_ties == 0
    for step, (a, b) in enumerate(zip(ours, theirs)):
        assert (a - b).abs().max().item() <= 1e-4, f"step {step}"


def test_logits_topk_covers_all(tmp_path):
    # index_topk above every entry count: the indexer selects everything, ties cannot matter
    cfg, hf, lay, model = _load(make_tiny_model("deepseek_v4", tmp_path, seed=3, index_topk=128))
    ids = _prompt(300, 7)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0, -1]
    pages, slots = _state(lay)
    out = model.forward([ForwardItem(ids.tolist(), 0, _pages_for(lay, 300), 0)], pages, slots)[0]
    assert (out - ref).abs().max().item() <= 1e-4


def test_batched_steps_equal_single_runs(tiny):
    # a mixed batch (prefills of different lengths, then decodes together) gives each sequence
    # the logits it gets alone
    cfg, hf, lay, model = tiny
    prompts = [_prompt(n, 50 + n) for n in (5, 17, 40, 129)]
    alone = []
    for p in prompts:
        pages, slots = _state(lay)
        blocks = _pages_for(lay, len(p) + 3)
        row = [model.forward([ForwardItem(p.tolist(), 0, blocks, 0)], pages, slots)[0]]
        for t in range(3):
            row.append(model.forward([ForwardItem([7 + t], len(p) + t, blocks, 0)], pages, slots)[0])
        alone.append(row)
    pages, slots = _state(lay, pages=128)
    tables = [_pages_for(lay, len(p) + 3, first=3 + 20 * b) for b, p in enumerate(prompts)]
    first = model.forward([ForwardItem(p.tolist(), 0, tables[b], b) for b, p in enumerate(prompts)], pages, slots)
    steps = [first] + [
        model.forward([ForwardItem([7 + t], len(p) + t, tables[b], b) for b, p in enumerate(prompts)], pages, slots)
        for t in range(3)
    ]
    for b in range(len(prompts)):
        for t in range(4):
            torch.testing.assert_close(steps[t][b], alone[b][t], atol=1e-5, rtol=0)


def test_prefix_hit_resumes_from_cached_pages(tiny):
    # run A over 48 tokens (3 full pages), then B shares A's first 32 tokens: B reuses A's first
    # two pages, starts its slot from page 2's end overlap and computes only its own tail;
    # B's logits equal a run of B without the cache
    cfg, hf, lay, model = tiny
    S = lay.page_size
    a = _prompt(3 * S, 11)
    b = torch.cat([a[: 2 * S], _prompt(21, 12)])
    pages, slots = _state(lay)
    model.forward([ForwardItem(a.tolist(), 0, [3, 4, 5], 0)], pages, slots)
    lay.restore_slot(pages, 4, slots, 1)
    hit = model.forward([ForwardItem(b[2 * S :].tolist(), 2 * S, [3, 4, 9, 10], 1)], pages, slots)[0]
    fresh_pages, fresh_slots = _state(lay)
    cold = model.forward([ForwardItem(b.tolist(), 0, [3, 4, 5, 6], 1)], fresh_pages, fresh_slots)[0]
    torch.testing.assert_close(hit, cold, atol=1e-5, rtol=0)
    with torch.no_grad():
        assert (hit - hf(b[None]).logits[0, -1]).abs().max().item() <= 1e-4


def test_bad_checkpoints_name_what_is_wrong(tiny):
    cfg, hf, lay, model = tiny
    good = {k: v.clone() for k, v in hf.state_dict().items() if "rotary_emb" not in k}
    DeepseekV4Model(cfg, dict(good), lay)  # transformers' own names load as they are
    missing = dict(good)
    del missing["model.layers.1.self_attn.compressor.indexer.q_b_proj.weight"]
    with pytest.raises(ValueError, match="lacks tensor 'model.layers.1.self_attn.compressor.indexer.q_b_proj.weight'"):
        DeepseekV4Model(cfg, missing, lay)
    bad = dict(good)
    bad["model.layers.2.self_attn.sinks"] = torch.zeros(5)
    with pytest.raises(ValueError, match=r"'model.layers.2.self_attn.sinks'.*\(5,\).*\(4,\)"):
        DeepseekV4Model(cfg, bad, lay)
    extra = dict(good, **{"model.layers.0.self_attn.surprise": torch.zeros(1)})
    with pytest.raises(ValueError, match="surprise"):
        DeepseekV4Model(cfg, extra, lay)


def test_unknown_layer_type_fails_at_load(tmp_path):
    path = make_tiny_model("deepseek_v4", tmp_path)
    text = (path / "config.json").read_text()
    (path / "config.json").write_text(text.replace('"heavily_compressed_attention",', '"dense_attention",', 1))
    with pytest.raises(ValueError, match=r"layer_types.*dense_attention"):
        load_config(path, "tiny")


def test_layout_rejects_page_size_off_the_windows(tiny):
    cfg = tiny[0]
    with pytest.raises(ValueError, match="multiple of every compress rate"):
        V4StateLayout.from_config(cfg, 24)  # HCA rate 16 does not divide 24
    assert V4StateLayout.default_page_size(cfg) == 16
    assert V4StateLayout.default_page_size(DeepseekV4Config()) == 128  # V4-Flash: HCA rate 128


def test_the_kernel_backend_is_chosen_by_name_and_triton_agrees_with_torch(tiny, triton_device, monkeypatch):
    # the model calls the backend's kernels (never picks its own), and the Triton backend
    # (Triton's interpreter on CPU here) gives the torch backend's logits
    from dataclasses import replace

    from kvmesh.kernels.backend import BACKENDS, create_kernel_backend

    cfg, _, lay, loaded = tiny
    weights = loaded.w  # the checkpoint's tensors, as the first model took them
    calls = {"moe": 0, "indexer": 0}
    torch_kernels = create_kernel_backend("torch")

    def counted(name, fn):
        def run(*args):
            calls[name] += 1
            return fn(*args)

        return run

    counting = replace(
        torch_kernels,
        moe_experts=counted("moe", torch_kernels.moe_experts),
        indexer_scores=counted("indexer", torch_kernels.indexer_scores),
    )
    ids = _prompt(40, 7).tolist()
    logits = {}
    for name, kernels in (("torch", counting), ("triton", create_kernel_backend("triton"))):
        model = DeepseekV4Model(cfg, dict(weights), lay, kernels=kernels)
        pages, slots = _state(lay)
        logits[name] = model.forward([ForwardItem(ids, 0, _pages_for(lay, 40), 0)], pages, slots)[0]
    # every MoE layer once; the CSA layers score entries for the prompt's queries
    assert calls["moe"] == cfg.num_hidden_layers and calls["indexer"] > 0
    torch.testing.assert_close(logits["triton"], logits["torch"], atol=1e-4, rtol=1e-4)
    assert sorted(BACKENDS) == ["torch", "triton"]
    if triton_device == "cpu":  # the interpreter runs the Triton kernels themselves
        from kvmesh.kernels.indexer import indexer_scores_triton
        from kvmesh.kernels.moe import moe_experts_triton

        triton_kernels = create_kernel_backend("triton")
        assert triton_kernels.moe_experts is moe_experts_triton
        assert triton_kernels.indexer_scores is indexer_scores_triton
    if not torch.cuda.is_available():
        monkeypatch.delenv("TRITON_INTERPRET")
        with pytest.raises(ValueError, match="needs a CUDA GPU"):
            create_kernel_backend("triton")
    with pytest.raises(ValueError, match=r"must be one of \['torch', 'triton'\], got 'cuda'"):
        create_kernel_backend("cuda")
