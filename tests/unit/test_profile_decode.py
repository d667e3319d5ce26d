"""kvmesh.bench.profile_decode on a tiny random Llama: every part is timed, the hook comes off after,
and the weight bytes are counted from the weights themselves. No timing is asserted."""

import pytest

import kvmesh.engine.llama.model as llama
from kvmesh.bench.profile_decode import MATMULS, PARTS, REST, format_profile, profile, weight_bytes_per_token
from kvmesh.engine.llama.runner import LlamaRunner
from tests.unit.tiny_llama import tiny_llama


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    """The tiny Llama of tests/unit/tiny_llama.py."""
    return LlamaRunner(tiny_llama(tmp_path_factory.mktemp("ckpt"))[0], num_pages=8, page_size=4)


def test_profile_times_every_part_and_removes_its_hook(runner):
    hooked = {n: getattr(llama, n) for n in ("_mm", "_lm_head", "rms_norm", "paged_attention")}
    p = profile(runner, prompt=[1, 5, 9], steps=4, repeats=2)
    assert set(p.ms) == {*PARTS, REST}
    # the tiny model has no GGUF blocks: every part runs as torch ops and each was timed
    assert all(p.ms[name] > 0 for name in PARTS), p.ms
    assert p.matmul_ms == sum(p.ms[name] for name in MATMULS)
    assert p.step_ms > 0 and p.plain_step_ms > 0
    # the hook is gone: the module's functions and the model's forward are the originals again
    assert {n: getattr(llama, n) for n in hooked} == hooked
    assert "forward" not in vars(runner.model) and runner.model.step_cycles.size == 0
    table = format_profile(p)
    assert all(name in table for name in (*PARTS, REST)) and "GB/s" in table


def test_weight_bytes_count_each_fp32_weight_once(runner):
    c = runner.config
    H, I, D = c.hidden_size, c.intermediate_size, c.head_dim
    per_layer = H * (c.num_heads + 2 * c.num_kv_heads) * D + c.num_heads * D * H + 3 * H * I + 2 * H
    expected = 4 * (
        c.num_layers * per_layer + c.vocab_size * H + H + H
    )  # layers, lm_head, final norm, one embedding row
    assert weight_bytes_per_token(runner.model, quantized=False) == expected
    assert weight_bytes_per_token(runner.model, quantized=True) == expected  # no blocks: fp32 either way


def test_profile_of_a_batch_decodes_every_sequence_together(runner):
    from kvmesh.bench.profile_decode import pages_needed

    # two sequences of 3 + 2 tokens in pages of 4: two pages each, inside the runner's 8
    assert pages_needed([1, 5, 9], 2, runner.page_size, batch=2) == 4
    p = profile(runner, prompt=[1, 5, 9], steps=2, repeats=1, batch=2)
    assert p.batch == 2 and set(p.ms) == {*PARTS, REST}
    assert "part of a decode step (B=2)" in format_profile(p)
    with pytest.raises(ValueError, match="batch"):
        profile(runner, prompt=[1, 5, 9], steps=2, repeats=1, batch=0)
