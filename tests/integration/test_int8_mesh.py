"""A mesh in `--quantization int8` (W4A8 matmuls in prefill and decode; fp32 pages): the P/D
split adds no error. Greedy tokens through the mesh equal one process running the same kernels
(a LlamaRunner with int8 activations in this test), token for token, on fresh prompts and on a
prefix hit; and they are not fp32's, so the mesh did take int8 activations (docs/precision.md,
rule 1).

"The same kernels" includes prefill's thread count: oneDNN's fp32 GEMMs round differently with 1
and 2 threads, and an activation's int8 rounding turns such an ulp into a different token where
fp32 decode does not. So prefill runs one torch thread here as in the one process (under xdist
each worker already does, tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from kvmesh.engine.llama.runner import LlamaRunner
from kvmesh.engine.loader import resolve_model
from tests.integration.meshutil import complete, running_mesh, wait_idle
from tests.integration.one_process import NEW_TOKENS, Pages, greedy, prefix_hit_matches, random_prompt

PAGE = 16
LENGTHS = (7, 33, 70)


@pytest.fixture(scope="module")
def mesh():
    args = ["--torch-threads", "1", "--quantization", "int8"]
    with running_mesh(1, 1, prefill_args=args, decode_args=args) as m:
        yield m


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """The one process computes with prefill's one torch thread."""


def _runner(int8: bool) -> LlamaRunner:
    runner = LlamaRunner(resolve_model(), num_pages=48, page_size=PAGE, dtype=torch.float32)
    runner.warmup()
    if int8:
        runner.use_int8_activations()
    return runner


@pytest.fixture(scope="module")
def one_process():
    """The same kernels in one process: W4A8 prefill, then W4A8 decode steps."""
    return _runner(int8=True), Pages()


def test_greedy_tokens_through_the_mesh_equal_one_process_with_int8_activations(mesh, one_process):
    runner, pages = one_process
    fp32, fp32_pages = _runner(int8=False), Pages()
    differs = 0
    for length in LENGTHS:
        prompt = random_prompt(length, seed=length)
        answer = complete(mesh, b"", prompt_token_ids=prompt, max_tokens=NEW_TOKENS, ignore_eos=True)
        expected = greedy(runner, prompt, 0, pages.take((length + NEW_TOKENS) // PAGE + 1))
        assert answer.token_ids == expected, length
        differs += expected != greedy(fp32, prompt, 0, fp32_pages.take((length + NEW_TOKENS) // PAGE + 1))
    assert differs, "int8 activations gave fp32's tokens on every prompt: the test cannot tell them apart"
    wait_idle(mesh)


def test_a_prefix_hit_decodes_as_one_process_over_the_same_cached_pages(mesh, one_process):
    runner, pages = one_process
    prefix_hit_matches(mesh, runner, pages, PAGE)
