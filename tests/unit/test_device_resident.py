"""The engine on a GPU, proven without one: SmolLM2 (the real checkpoint, its real sizes) and the
tiny DeepSeek-V4 (with its MTP module) built on device `cuda` under PyTorch's FakeTensorMode, a
prefill chunk, decode steps, speculative verification rows and MTP drafting traced op by op.

Every weight and page must sit on `cuda`, every op that reads a device tensor must leave its
result there, and the one device-to-host copy of a step is the sampled ids ([B] int64); no
`.item()` anywhere. A planted `.cpu()` shows the check catches one. Also: `--device` is resolved
in one place and refused at start when torch sees no CUDA device.
"""

import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode, unset_fake_temporarily

from kvmesh.bench.tiny_models import make_tiny_model
from kvmesh.engine.cuda_graphs import DecodeGraphs
from kvmesh.engine.deepseek_v4 import runner as v4_runner
from kvmesh.engine.device import DeviceUnavailableError, resolve_device, weight_dtype
from kvmesh.engine.forward import DraftItem, ForwardItem
from kvmesh.engine.llama import runner as llama_runner
from kvmesh.engine.loader import resolve_model
from kvmesh.engine.runners import create_runner
from kvmesh.engine.sampler import sample_ids
from kvmesh.engine.sampling_params import SamplingParams
from tests.unit.fake_cuda import Recorder, load_fake_cuda_guard, tensors_of

CUDA = torch.device("cuda", 0)
PAGE = 16


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    """A FakeTensorMode in which `cuda` tensors work on this CPU-only torch; the checkpoint is
    read outside it (safetensors hands real storages, which fake mode cannot take)."""
    load_fake_cuda_guard(tmp_path_factory.mktemp("fake_cuda"))
    read = llama_runner.load_checkpoint_tensors

    def read_for_real(path):
        with unset_fake_temporarily():
            return read(path)

    with unset_fake_temporarily():  # transformers writes the tiny checkpoint for real
        v4 = resolve_model(str(make_tiny_model("deepseek_v4", tmp_path_factory.mktemp("v4"), mtp=True)))
    with pytest.MonkeyPatch.context() as mp:
        for module in (llama_runner, v4_runner):
            mp.setattr(module, "load_checkpoint_tensors", read_for_real)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            yield mode, v4


@pytest.fixture(scope="module")
def smollm2(fake):
    return create_runner(resolve_model(None), 32, PAGE, 0, "torch", CUDA, "bfloat16")


@pytest.fixture(scope="module")
def v4(fake):
    return create_runner(fake[1], 16, PAGE, 8, "torch", CUDA)


def _traced(step):
    """Run step() under a Recorder; its Trace."""
    with Recorder() as rec:
        step()
    return rec.trace


def test_weights_pages_and_tables_live_on_the_device(smollm2):
    tensors = tensors_of(smollm2)
    assert len(tensors) > 3 * smollm2.config.num_layers  # weights, pages and RoPE tables were found
    assert [tuple(t.shape) for t in tensors if t.device != CUDA] == []
    assert smollm2.kv_cache.device == CUDA and smollm2.kv_cache.dtype == weight_dtype(CUDA) == torch.bfloat16
    assert smollm2.model.embed.dtype == torch.bfloat16
    assert smollm2.model.q_lm_head is None and smollm2.model._step is None  # no CPU block kernels
    page = smollm2.page_buffer(3)  # what the KV push sends: the device bytes themselves
    assert isinstance(page, torch.Tensor) and page.device == CUDA and page.numel() == smollm2.page_nbytes


def test_a_prefill_chunk_and_its_first_token_stay_on_the_device(smollm2):
    prompt = list(range(100, 140))  # 40 tokens, 3 pages
    ids = []

    def step():
        logits = smollm2.forward([ForwardItem(prompt, 0, [0, 1, 2])])
        ids.append(sample_ids(logits, [SamplingParams()], [None]).to(device="cpu"))

    trace = _traced(step)
    assert trace.violations() == []
    assert trace.to_host_copies() == [("aten._to_copy.default", (1,), torch.int64)]
    assert "aten.index_copy_.default" in trace.names()  # the K/V landed in the device pages


def test_decode_steps_with_sampling_and_speculation_rows_stay_on_the_device(smollm2):
    greedy, sampled = SamplingParams(), SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=5)

    def decode():
        items = [ForwardItem([7], 40, [0, 1, 2]), ForwardItem([9], 20, [3, 4])]
        logits = smollm2.forward(items)
        sample_ids(logits, [greedy, sampled], [None, torch.Generator().manual_seed(5)]).to(device="cpu")

    def verify():  # two requests with 3 and 1 drafts: k + 1 one-token rows each (kvmesh.engine.speculative.verify)
        rows = [ForwardItem([t], 40 + j, [0, 1, 2, 5]) for j, t in enumerate([7, 8, 9, 10])]
        rows += [ForwardItem([t], 20 + j, [3, 4]) for j, t in enumerate([11, 12])]
        logits = smollm2.forward(rows)
        logits.argmax(dim=-1).to(device="cpu")  # greedy verification reads the target's ids

    for step in (decode, verify):
        trace = _traced(step)
        assert trace.violations() == [], step.__name__
        assert "kvmesh.paged_decode_attention.default" in trace.names()  # the Triton op, not a gather
        (copy,) = trace.to_host_copies()
        assert copy[2] == torch.int64 and len(copy[1]) == 1


def test_a_cuda_graph_bucket_step_is_free_of_host_syncs(smollm2):
    # what torch.cuda.graph captures (kvmesh.engine.cuda_graphs): the padded fixed-shape step, its inputs
    # copied host-to-device first; capture itself needs a real GPU, so the bucket runs uncaptured
    smollm2.decode_graphs = DecodeGraphs(smollm2, 4, capture=False)
    try:

        def step():
            logits = smollm2.forward([ForwardItem([7], 40, [0, 1, 2]), ForwardItem([9], 20, [3, 4])])
            assert logits.shape == (2, smollm2.config.vocab_size)  # rows 2..3 of bucket 4 were padding
            logits.argmax(dim=-1).to(device="cpu")

        trace = _traced(step)
    finally:
        smollm2.decode_graphs = None
    assert trace.violations() == [] and len(trace.to_host_copies()) == 1
    assert "kvmesh.paged_decode_attention.default" in trace.names()


def test_a_planted_host_copy_is_caught(smollm2):
    def step():
        logits = smollm2.forward([ForwardItem([7], 40, [0, 1, 2])])
        logits.sum().cpu()  # the kind of line that stalls a GPU step
        logits.argmax(dim=-1).to(device="cpu")

    violations = _traced(step).violations()
    assert len(violations) == 1 and "device to host" in violations[0]
    with Recorder() as rec:
        with pytest.raises(DataDependentOutputException):  # a fake tensor has no value to give
            smollm2.forward([ForwardItem([7], 40, [0, 1, 2])]).max().item()
    assert any("_local_scalar_dense" in v for v in rec.trace.violations())


def test_deepseek_v4_weights_pages_and_slots_live_on_the_device(v4):
    tensors = tensors_of(v4)
    assert len(tensors) > 20 and [tuple(t.shape) for t in tensors if t.device != CUDA] == []
    assert v4.pages.device == v4.slots.device == CUDA and v4.has_mtp
    assert v4.model.kernels.moe_experts is torch.ops.kvmesh.moe_experts  # the Triton kernels' op
    (slot,) = v4.state_buffers(2)
    assert isinstance(slot, torch.Tensor) and slot.device == CUDA and slot.numel() == v4.state_nbytes


def test_deepseek_v4_prefill_decode_verification_and_drafting_stay_on_the_device(v4):
    prompt = list(range(300, 340))  # 40 tokens: windows close, compressed entries and the indexer run

    def prefill():
        logits = v4.forward([ForwardItem(prompt, 0, [0, 1, 2], 0)])
        sample_ids(logits, [SamplingParams()], [None]).to(device="cpu")

    def decode():
        logits = v4.forward([ForwardItem([7], 40, [0, 1, 2], 0), ForwardItem([9], 12, [3], 1)])
        sample_ids(logits, [SamplingParams(), SamplingParams()], [None, None]).to(device="cpu")

    def verify():  # 2 drafts: rows continue the previous row's state in scratch slots 5 and 6
        rows = [ForwardItem([7], 41, [0, 1, 2], 0), ForwardItem([8], 42, [0, 1, 2], 5, 0)]
        rows.append(ForwardItem([9], 43, [0, 1, 2], 6, 5))
        v4.forward(rows).argmax(dim=-1).to(device="cpu")

    for step in (prefill, decode, verify):
        trace = _traced(step)
        assert trace.violations() == [], step.__name__
        assert "kvmesh.moe_experts.default" in trace.names(), step.__name__
        ((_, shape, dtype),) = trace.to_host_copies()
        assert dtype == torch.int64 and len(shape) == 1
    assert "kvmesh.indexer_scores.default" in _traced(prefill).names()  # the CSA layers' indexer, as an op

    hidden = v4.slot_hidden(0)[None]  # [1, N, H]
    drafts = DraftItem(first_position=43, tokens=[9], hidden=hidden, block_ids=[0, 1, 2], window_start=0, k=3)
    with Recorder() as rec, pytest.raises(DataDependentOutputException):
        v4.propose_drafts([drafts])  # the first pass's ids must come to the host, and fake ones cannot
    # only that: the pass ran on the device, and its one device-to-host copy is the draft ids
    assert rec.trace.violations() == [] and [c[1:] for c in rec.trace.to_host_copies()] == [((1,), torch.int64)]


def test_device_is_resolved_in_one_place_and_cuda_without_a_device_is_refused():
    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")
        for spec in ("cuda", "cuda:1"):
            with pytest.raises(DeviceUnavailableError, match=f"--device {spec}: .* sees no CUDA device"):
                resolve_device(spec)
    for bad in ("gpu", "cuda:x", "cpu:0", ""):
        with pytest.raises(ValueError, match=r"--device must be one of auto\|cpu\|cuda\[:N\]"):
            resolve_device(bad)


@pytest.mark.parametrize("service", ["prefill", "decode"])
def test_a_service_asked_for_a_gpu_it_lacks_exits_at_once_naming_the_flag(service):
    # cuda:99 exists on no machine: a CPU-only one says it sees no CUDA device, a GPU one that
    # cuda:99 does not exist; either way the service stops before its model loads or a port opens
    proc = subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", "serve", service, "--device", "cuda:99", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith("error: --device cuda:99: torch "), proc.stderr[-2000:]
    assert "serving on" not in proc.stderr + proc.stdout and "loaded" not in proc.stderr


def test_logprobs_and_a_prompt_s_every_position_cost_one_host_copy_on_the_device(smollm2):
    from kvmesh.engine.sampler import token_logprobs

    def step():
        logits = smollm2.forward_all([ForwardItem(list(range(100, 120)), 0, [0, 1])])  # [20, V]
        assert tuple(logits.shape) == (20, smollm2.config.vocab_size)
        # the fake host copy holds no values: reading them is where the test stops
        with pytest.raises(DataDependentOutputException):
            token_logprobs(logits[:2], [7, 9], [SamplingParams(logprobs=3)] * 2)

    trace = _traced(step)
    assert trace.violations() == []
    (copy,) = trace.to_host_copies()  # chosen logprob, top values and top ids: one [2, 7] copy
    assert copy[1] == (2, 7) and copy[2] == torch.float32
