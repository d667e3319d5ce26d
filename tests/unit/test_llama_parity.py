"""Our Llama on the real SmolLM2-135M-Instruct checkpoint against transformers, number for number.

transformers' `LlamaForCausalLM` in fp32 is the reference; logits must agree within 1e-4.
One LlamaRunner and one transformers model are shared by the module (loading takes seconds).
"""

import random

import pytest
import torch

from kvmesh.engine.checkpoint import load_tokenizer
from kvmesh.engine.forward import ForwardItem
from kvmesh.engine.llama.runner import LlamaRunner
from kvmesh.engine.loader import resolve_model

PAGE = 16
ATOL = 1e-4


@pytest.fixture(scope="module")
def files():
    return resolve_model()


@pytest.fixture(scope="module")
def runner(files):
    r = LlamaRunner(files, num_pages=256, page_size=PAGE)
    r.warmup()
    return r


@pytest.fixture(scope="module")
def hf(files):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(files.checkpoint_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(files):
    return load_tokenizer(files)


class Pages:
    """A bump allocator: fresh page ids for each sequence in a test."""

    def __init__(self, start: int = 1):  # page 0 belongs to warmup
        self.next = start

    def take(self, num_tokens: int) -> list[int]:
        n = (num_tokens + PAGE - 1) // PAGE
        self.next += n
        return list(range(self.next - n, self.next))


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, 49152) for _ in range(n - 1)]


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0]  # [n, V]


@pytest.mark.parametrize("n", [1, 15, 16, 17, 40])
def test_prefill_logits_match_transformers(runner, hf, n):
    ids = _prompt(n, seed=n)
    ours = runner.forward([ForwardItem(ids, 0, Pages().take(n))])
    assert ours.shape == (1, runner.config.vocab_size) and ours.dtype == torch.float32
    torch.testing.assert_close(ours[0], _hf_logits(hf, ids)[-1], atol=ATOL, rtol=0)


def test_decode_logits_match_transformers_at_every_position(runner, hf, tokenizer):
    from transformers import DynamicCache

    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three colors of the rainbow, please."}],
        add_generation_prompt=True,
        tokenize=True,
    )
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids) + _prompt(20, seed=7)[1:]
    split = 10  # prefill 10 tokens, then one token a step, in both engines
    full = _hf_logits(hf, ids)[split - 1 :]  # [n - split + 1, V]: every position in one pass
    pages = Pages().take(len(ids))
    ours = [runner.forward([ForwardItem(ids[:split], 0, pages)])[0]]
    with torch.inference_mode():
        cache = DynamicCache(config=hf.config)
        theirs = [hf(torch.tensor([ids[:split]]), cache=cache).logits[0, -1]]
        for pos in range(split, len(ids)):
            ours.append(runner.forward([ForwardItem([ids[pos]], pos, pages)])[0])
            theirs.append(hf(torch.tensor([[ids[pos]]]), cache=cache).logits[0, -1])
    ours, theirs = torch.stack(ours), torch.stack(theirs)
    # step for step against transformers' own KV-cached decode
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)
    # against the full forward: transformers' own decode already sits up to ~7e-5 from it here
    # (one-token matmuls round differently from 40-token ones), so allow that gap on top
    own_gap = (theirs - full).abs().max().item()
    assert (ours - full).abs().max().item() <= ATOL + own_gap, own_gap


@pytest.mark.parametrize("prefix", [32, 20])  # page-aligned, and ending mid-page
def test_prefill_after_cached_prefix_equals_full_prefill(runner, prefix):
    ids = _prompt(50, seed=3)
    alloc = Pages()
    full_pages, split_pages = alloc.take(50), alloc.take(50)
    full = runner.forward([ForwardItem(ids, 0, full_pages)])
    runner.forward([ForwardItem(ids[:prefix], 0, split_pages)])  # the cached prefix
    rest = runner.forward([ForwardItem(ids[prefix:], prefix, split_pages)])
    torch.testing.assert_close(rest, full, atol=ATOL, rtol=0)
    # and both left the same K/V in their pages, so decode can continue from either
    kv = runner.kv_cache
    torch.testing.assert_close(kv[split_pages[:3]], kv[full_pages[:3]], atol=1e-4, rtol=1e-4)
    a = runner.forward([ForwardItem([5], 50, full_pages)])
    b = runner.forward([ForwardItem([5], 50, split_pages)])
    torch.testing.assert_close(b, a, atol=ATOL, rtol=0)


def test_batched_decode_equals_each_sequence_alone(runner):
    lengths = [5, 16, 23, 40]  # different lengths: padded, masked batch attention
    prompts = [_prompt(n, seed=100 + n) for n in lengths]
    alloc = Pages()
    steps = 4
    batch_pages = [alloc.take(n + steps) for n in lengths]
    alone_pages = [alloc.take(n + steps) for n in lengths]
    for p, bp, ap in zip(prompts, batch_pages, alone_pages):
        runner.forward([ForwardItem(p, 0, bp)])
        runner.forward([ForwardItem(p, 0, ap)])
    tokens = [11, 22, 33, 44]
    for step in range(steps):
        batch = runner.forward([ForwardItem([t], n + step, bp) for t, n, bp in zip(tokens, lengths, batch_pages)])
        alone = torch.cat(
            [runner.forward([ForwardItem([t], n + step, ap)]) for t, n, ap in zip(tokens, lengths, alone_pages)]
        )
        torch.testing.assert_close(batch, alone, atol=ATOL, rtol=0)
        tokens = batch.argmax(-1).tolist()


def test_mixed_prefill_and_decode_batch_equals_separate_steps(runner):
    alloc = Pages()
    a, b, c = _prompt(30, seed=1), _prompt(12, seed=2), _prompt(45, seed=3)
    pa, pb, pc = alloc.take(31), alloc.take(12), alloc.take(45)
    qa, qc = alloc.take(31), alloc.take(45)
    runner.forward([ForwardItem(a, 0, pa)])
    runner.forward([ForwardItem(a, 0, qa)])
    runner.forward([ForwardItem(c[:20], 0, pc)])
    runner.forward([ForwardItem(c[:20], 0, qc)])
    # one step: a decodes, b prefills from scratch, c prefills after its 20 cached tokens
    mixed = runner.forward([ForwardItem([7], 30, pa), ForwardItem(b, 0, pb), ForwardItem(c[20:], 20, pc)])
    separate = torch.cat(
        [
            runner.forward([ForwardItem([7], 30, qa)]),
            runner.forward([ForwardItem(b, 0, alloc.take(12))]),
            runner.forward([ForwardItem(c[20:], 20, qc)]),
        ]
    )
    torch.testing.assert_close(mixed, separate, atol=ATOL, rtol=0)


def _greedy(runner, prompt: list[int], max_new: int, eos: tuple[int, ...]) -> list[int]:
    pages = Pages().take(len(prompt) + max_new)
    out: list[int] = []
    logits = runner.forward([ForwardItem(prompt, 0, pages)])
    while True:
        tok = int(logits[0].argmax())
        out.append(tok)
        if tok in eos or len(out) == max_new:
            return out
        logits = runner.forward([ForwardItem([tok], len(prompt) + len(out) - 1, pages)])


@pytest.mark.parametrize(
    "question",
    [
        "What is the capital of France?",
        "Write a short poem about autumn leaves.",
        "Explain what a CPU cache is in two sentences.",
    ],
)
def test_greedy_generation_matches_transformers_generate(runner, hf, tokenizer, question):
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
    )
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    eos = runner.config.eos_token_ids
    assert eos == (2,)  # <|im_end|>: both loops stop on the same token
    with torch.inference_mode():
        ref = hf.generate(
            torch.tensor([ids]), do_sample=False, max_new_tokens=32, eos_token_id=list(eos), pad_token_id=eos[0]
        )[0, len(ids) :].tolist()
    ours = _greedy(runner, ids, 32, eos)
    assert ours == ref, (tokenizer.decode(ours), tokenizer.decode(ref))


def test_small_steps_use_the_gguf_blocks_and_agree_with_fp32_weights(files, runner):
    # the default checkpoint keeps its GGUF blocks: decode steps of <= 64 sequences compute from them
    from kvmesh.engine.llama.model import QUANTIZED_MAX_BATCH

    assert runner.model.q_lm_head is not None
    assert all(x is not None for w in runner.model.layers for x in (w.q_qkv, w.q_o, w.q_gate_up, w.q_down))
    fp32_only = LlamaRunner(files, num_pages=16, page_size=PAGE, gguf_blocks=False)
    assert fp32_only.model.q_lm_head is None
    ids = _prompt(30, seed=11)
    prefill = [r.forward([ForwardItem(ids, 0, [1, 2, 3])]) for r in (runner, fp32_only)]
    assert torch.equal(*prefill)  # prefill keeps the fp32 weights: bit for bit the same
    for rows in (1, 2, 16, QUANTIZED_MAX_BATCH):  # decode batches (one sequence, repeated)
        batch = [ForwardItem([ids[rows % 30]], 30, [1, 2, 3])] * rows
        torch.testing.assert_close(runner.forward(batch), fp32_only.forward(batch), atol=ATOL, rtol=0)


def test_fused_batched_decode_equals_the_torch_path_and_each_sequence_alone(runner, monkeypatch):
    # a decode step of B sequences runs as one numba call (kvmesh.engine.llama.step); the torch ops
    # path (same block matmuls, torch RMSNorm, RoPE, gathers and SDPA) is its reference here
    import kvmesh.engine.llama.model as llama

    # ragged contexts: the new token of the 16-token one opens page 2, the 15-token one's fills
    # page 1's last slot, the 40-token one reads three pages, the 1030-token one's keys are three
    # attention jobs (SPLIT_TOKENS: 512, 512 and 7) merged; pages are scattered and interleaved
    lengths = [5, 15, 16, 40, 1, 1030]
    free = list(range(1, 256))
    random.Random(0).shuffle(free)
    tables = [[free.pop() for _ in range((n + 1 + PAGE - 1) // PAGE)] for n in lengths]
    prompts = [_prompt(n, seed=200 + n) for n in lengths]
    for p, pages in zip(prompts, tables):
        runner.forward([ForwardItem(p, 0, pages)])
    items = [ForwardItem([100 + b], n, pages) for b, (n, pages) in enumerate(zip(lengths, tables))]
    kv_before = runner.kv_cache.clone()

    def torch_op_called(*args, **kwargs):
        raise AssertionError("a fused decode step ran a torch op per layer")

    with monkeypatch.context() as m:  # the fused step must not go through the torch ops
        m.setattr(llama, "paged_attention", torch_op_called)
        m.setattr(llama, "rms_norm", torch_op_called)
        fused = runner.forward(items)
    kv_fused = runner.kv_cache.clone()
    runner.kv_cache.copy_(kv_before)
    with monkeypatch.context() as m:
        m.setattr(runner.model, "_step", None)  # no stacked step arguments: the torch ops path
        ref = runner.forward(items)
    assert fused.shape == ref.shape == (len(lengths), runner.config.vocab_size)
    torch.testing.assert_close(fused, ref, atol=ATOL, rtol=0)
    # both wrote each new token's K and V in the same slot (and nothing else)
    torch.testing.assert_close(kv_fused, runner.kv_cache, atol=ATOL, rtol=1e-4)
    assert torch.equal(kv_fused != kv_before, runner.kv_cache != kv_before)
    # each sequence alone (a batch of one, the same numba call) gets the same bits
    runner.kv_cache.copy_(kv_before)
    alone = torch.cat([runner.forward([it]) for it in items])
    assert torch.equal(alone, fused)
    # in another order too: a sequence's numbers depend on its own row only
    runner.kv_cache.copy_(kv_before)
    order = [3, 0, 5, 4, 2, 1]
    shuffled = runner.forward([items[i] for i in order])
    assert torch.equal(shuffled, fused[order])


def test_fused_decode_keeps_decoding_like_the_torch_path(runner, monkeypatch):
    # greedy steps from both paths, fed their own tokens, stay together over pages' boundaries
    lengths = [14, 30, 3]
    steps = 6
    alloc = Pages()
    prompts = [_prompt(n, seed=300 + n) for n in lengths]
    fused_pages = [alloc.take(n + steps) for n in lengths]
    torch_pages = [alloc.take(n + steps) for n in lengths]
    for p, fp, tp in zip(prompts, fused_pages, torch_pages):
        runner.forward([ForwardItem(p, 0, fp)])
        runner.forward([ForwardItem(p, 0, tp)])
    tokens = [9, 99, 999]
    for step in range(steps):
        fused = runner.forward([ForwardItem([t], n + step, p) for t, n, p in zip(tokens, lengths, fused_pages)])
        with monkeypatch.context() as m:
            m.setattr(runner.model, "_step", None)
            ref = runner.forward([ForwardItem([t], n + step, p) for t, n, p in zip(tokens, lengths, torch_pages)])
        torch.testing.assert_close(fused, ref, atol=ATOL, rtol=0)
        assert fused.argmax(-1).tolist() == ref.argmax(-1).tolist()
        tokens = fused.argmax(-1).tolist()


def test_past_its_block_rows_bound_a_decode_step_is_the_dense_path_bit_for_bit(files):
    # in bf16 where torch runs on AMX tiles, decode steps of more than AMX_BF16_MAX_BATCH sequences
    # take the dense GEMMs; here the bound is set to 2 so that 3 rows are past it on any CPU
    blocks = LlamaRunner(files, num_pages=16, page_size=PAGE, dtype=torch.bfloat16)
    dense = LlamaRunner(files, num_pages=16, page_size=PAGE, dtype=torch.bfloat16, gguf_blocks=False)
    blocks.model.max_block_rows = 2
    ids = _prompt(30, seed=12)
    for r in (blocks, dense):
        r.forward([ForwardItem(ids, 0, [1, 2, 3])])
    past = [ForwardItem([ids[5]], 30, [1, 2, 3])] * 3
    assert torch.equal(blocks.forward(past), dense.forward(past))
    within = past[:2]  # the blocks: 4-bit weights, not the same bits
    assert not torch.equal(blocks.forward(within), dense.forward(within))


def test_the_block_rows_bound_is_lower_only_in_bf16_with_amx_tiles(monkeypatch):
    import kvmesh.engine.llama.model as llama

    monkeypatch.setattr(llama, "_amx_tiles", lambda: True)
    assert llama.block_rows_bound(torch.bfloat16) == llama.AMX_BF16_MAX_BATCH < llama.QUANTIZED_MAX_BATCH
    assert llama.block_rows_bound(torch.float32) == llama.QUANTIZED_MAX_BATCH
    assert llama.block_rows_bound(torch.bfloat16, "meta") == llama.QUANTIZED_MAX_BATCH
    monkeypatch.setattr(llama, "_amx_tiles", lambda: False)
    assert llama.block_rows_bound(torch.bfloat16) == llama.QUANTIZED_MAX_BATCH
