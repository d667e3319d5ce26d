"""LlamaRunner on a tiny random Llama made by transformers: cache layout, page buffers, errors."""

import numpy as np
import pytest
import torch

from kvmesh.engine.forward import ForwardItem
from kvmesh.engine.llama.runner import LlamaRunner
from tests.unit.tiny_llama import tiny_llama

PAGE = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 2-layer Llama (GQA 4 heads over 2, untied head) saved in Hugging Face layout, and its model."""
    return tiny_llama(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def runner(tiny):
    return LlamaRunner(tiny[0], num_pages=16, page_size=PAGE)


def test_cache_is_page_major_and_page_buffers_are_zero_copy(runner):
    c = runner.config
    assert runner.kv_cache.shape == (16, 2, 2, PAGE, 2, 8)  # [P, L, 2, S, K, D]
    assert runner.kv_cache.is_contiguous()
    assert runner.page_nbytes == c.num_layers * 2 * PAGE * c.num_kv_heads * c.head_dim * 4
    assert runner.page_nbytes == PAGE * c.kv_bytes_per_token(torch.float32)
    buf = runner.page_buffer(3)
    assert buf.dtype == np.uint8 and buf.shape == (runner.page_nbytes,) and buf.flags.writeable
    # bytes written through the buffer (as a UCX receive would) land in page 3 and only there
    before = runner.kv_cache.clone()
    buf[:] = np.frombuffer(np.full(runner.page_nbytes // 4, 1.5, np.float32).tobytes(), np.uint8)
    assert torch.all(runner.kv_cache[3] == 1.5)
    assert torch.equal(runner.kv_cache[4:], before[4:])
    assert torch.equal(runner.kv_cache[:3], before[:3])
    # and K/V a forward writes are visible through the buffer
    runner.forward([ForwardItem([5, 6, 7], 0, [3])])
    page = torch.from_numpy(buf.copy()).view(torch.float32).view(runner.kv_cache.shape[1:])
    assert torch.equal(page, runner.kv_cache[3]) and not torch.all(page == 1.5)


def test_forward_matches_transformers_on_a_mixed_batch(tiny, runner):
    _, hf = tiny
    a, b = [1, 5, 9, 13, 17, 21, 25], [1, 40, 41]
    with torch.inference_mode():
        ref_a, ref_b = hf(torch.tensor([a])).logits[0], hf(torch.tensor([b])).logits[0]
    runner.forward([ForwardItem(a[:6], 0, [7, 2])])  # a's first 6 tokens: a cached prefix
    # one step: a decodes its 7th token from 2 pages; b prefills into 1 page
    logits = runner.forward([ForwardItem(a[6:], 6, [7, 2]), ForwardItem(b, 0, [9])])
    torch.testing.assert_close(logits[0], ref_a[6], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[1], ref_b[2], atol=1e-5, rtol=1e-5)


def test_warmup_runs_and_touches_only_page_0(runner):
    before = runner.kv_cache[1:].clone()
    runner.warmup()
    assert torch.equal(runner.kv_cache[1:], before)


def test_errors_say_what_to_change(tiny, runner):
    with pytest.raises(ValueError, match="at least one ForwardItem"):
        runner.forward([])
    with pytest.raises(ValueError, match="exceed max_position_embeddings"):
        runner.forward([ForwardItem([1], 64, list(range(16)))])
    with pytest.raises(ValueError, match=r"token id 97 is outside the vocabulary \[0, 97\)"):
        runner.forward([ForwardItem([1, 97], 0, [0])])
    with pytest.raises(ValueError, match="cannot hold"):
        runner.forward([ForwardItem([1] * 5, 0, [0])])  # 5 tokens, one page of 4
    with pytest.raises(ValueError, match=r"page_id must be in \[0, 16\)"):
        runner.page_buffer(16)
    with pytest.raises(ValueError, match="num_pages and page_size must be >= 1"):
        LlamaRunner(tiny[0], num_pages=0)


def test_bfloat16_runner_stays_close(tiny):
    _, hf = tiny
    r = LlamaRunner(tiny[0], num_pages=4, page_size=PAGE, dtype=torch.bfloat16)
    assert r.kv_cache.dtype == torch.bfloat16 and r.page_nbytes == r.kv_cache[0].numel() * 2
    assert r.page_buffer(0).nbytes == r.page_nbytes  # numpy has no bf16: bytes still work
    ids = [1, 3, 5, 7, 9]
    logits = r.forward([ForwardItem(ids, 0, [0, 1])])
    assert logits.dtype == torch.float32
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0, -1]
        other = hf(torch.tensor([[*ids[:-1], 10]])).logits[0, -1]  # another last token
    # a tiny random model's logits span only ~0.5: a tolerance must be measured against that
    # spread (bf16 is off by ~0.001 here, 0.2% of it), not an absolute 0.05
    spread = (ref.max() - ref.min()).item()
    tol = 0.02 * spread
    torch.testing.assert_close(logits[0], ref, atol=tol, rtol=0)
    assert logits[0].argmax() == ref.argmax()
    # the runner really ran in bf16 (an fp32 runner matches to ~1e-7) ...
    assert (logits[0] - ref).abs().max().item() > 1e-5
    # ... and the tolerance tells answers apart: another prompt's logits fall far outside it
    assert (other - ref).abs().max().item() > 10 * tol


def test_the_runner_registry_picks_by_architecture_and_names_what_it_serves(tiny, tmp_path):
    import json
    import shutil

    from kvmesh.engine.checkpoint import ModelFiles
    from kvmesh.engine.runners import RUNNERS, create_runner

    assert isinstance(create_runner(tiny[0], num_pages=2, page_size=PAGE), LlamaRunner)
    other = tmp_path / "other"
    shutil.copytree(tiny[0].checkpoint_dir, other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "architectures": ["MambaForCausalLM"]}))
    with pytest.raises(ValueError, match="'MambaForCausalLM'; supported: ") as err:
        create_runner(ModelFiles("other", other), num_pages=2, page_size=PAGE)
    assert all(name in str(err.value) for name in RUNNERS)
