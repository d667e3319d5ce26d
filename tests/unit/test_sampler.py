"""Sampler: greedy, top-k, top-p, seeds and parameter validation."""

import pytest
import torch

from kvmesh.engine.sampler import sample, token_logprobs
from kvmesh.engine.sampling_params import SamplingParams

V = 50


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """The request's own generator, as the engines make it: seeded, or None (global RNG)."""
    return None if params.seed is None else torch.Generator().manual_seed(params.seed)


def _logits(rows: int = 4) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(0)) * 3


def test_greedy_picks_argmax_and_the_first_of_ties():
    logits = _logits()
    logits[2, 7] = logits[2, 9] = 100.0  # a tie: the lower index wins, as torch.argmax
    greedy = [SamplingParams()] * 4
    assert sample(logits, greedy, [None] * 4) == logits.argmax(-1).tolist()
    assert sample(logits, greedy, [None] * 4)[2] == 7


def test_top_k_1_equals_greedy_at_any_temperature():
    logits = _logits()
    params = [SamplingParams(temperature=5.0, top_k=1, seed=s) for s in range(4)]
    gens = [make_generator(p) for p in params]
    assert sample(logits, params, gens) == logits.argmax(-1).tolist()


def test_same_seed_same_samples_and_different_seeds_differ():
    logits = _logits(1).expand(3, V).contiguous()
    params = [SamplingParams(temperature=1.5, seed=s) for s in (11, 11, 12)]

    def draw(n=30):
        gens = [make_generator(p) for p in params]
        return [sample(logits, params, gens) for _ in range(n)]

    runs = draw()
    assert runs == draw()  # reproducible from the seed
    a, b, c = zip(*runs)
    assert a == b  # rows with the same seed draw the same sequence
    assert a != c
    # and they really sample: not the greedy token every time (sampling silently off would be)
    greedy = int(logits[0].argmax())
    assert a != (greedy,) * len(a) and len(set(a)) > 1, a


def test_tiny_top_p_keeps_only_the_most_likely_token():
    logits = _logits()
    params = [SamplingParams(temperature=1.0, top_p=1e-6, seed=s) for s in range(4)]
    gens = [make_generator(p) for p in params]
    for _ in range(5):
        assert sample(logits, params, gens) == logits.argmax(-1).tolist()


def test_top_k_draws_only_from_the_k_best():
    logits = _logits(1)
    best3 = set(logits[0].topk(3).indices.tolist())
    p = SamplingParams(temperature=10.0, top_k=3, seed=0)
    gen = make_generator(p)
    seen = {sample(logits, [p], [gen])[0] for _ in range(200)}
    assert seen == best3  # a hot temperature reaches all three, and nothing else


def test_top_p_nucleus_matches_transformers_rule():
    # probabilities 0.5, 0.3, 0.15, 0.05: top_p=0.75 keeps {0, 1}; the tail 0.05 + 0.15 = 0.2
    # stays under 1 - 0.75 and goes
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = SamplingParams(temperature=1.0, top_p=0.75, seed=1)
    gen = make_generator(p)
    seen = {sample(logits, [p], [gen])[0] for _ in range(200)}
    assert seen == {0, 1}


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 0.9), (1.3, 10, 1.0), (1.0, 8, 0.6)])
def test_filter_keeps_the_same_tokens_as_transformers_warpers(temperature, top_k, top_p):
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    from kvmesh.engine.sampler import _filtered_probs

    logits = _logits()
    hf = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        hf = TopKLogitsWarper(top_k)(None, hf)
    if top_p < 1:
        hf = TopPLogitsWarper(top_p)(None, hf)
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)] * 4
    ours = _filtered_probs(logits, params)
    assert torch.equal(ours > 0, torch.isfinite(hf))
    torch.testing.assert_close(ours, hf.softmax(-1))


def test_mixed_batch_keeps_greedy_rows_greedy():
    logits = _logits()
    params = [
        SamplingParams(),
        SamplingParams(temperature=1.0, seed=3),
        SamplingParams(),
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=4),
    ]
    gens = [make_generator(p) for p in params]
    out = sample(logits, params, gens)
    argmax = logits.argmax(-1).tolist()
    assert out[0] == argmax[0] and out[2] == argmax[2]
    assert out[3] in logits[3].topk(5).indices.tolist()


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(temperature=-1), "temperature must be >= 0, got -1"),
        (dict(temperature=float("nan")), "temperature must be >= 0"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
        (dict(top_k=-2), "top_k must be an integer >= 0"),
        (dict(top_k=2.5), "top_k must be an integer >= 0"),
        (dict(seed=-1), "seed must be None or an integer"),
        (dict(logprobs=21), r"logprobs must be None or an integer in \[0, 20\], got 21"),
        (dict(logprobs=-1), "logprobs must be None or an integer"),
    ],
)
def test_validation_says_what_to_change(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sample_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="one SamplingParams and one generator per row"):
        sample(_logits(2), [SamplingParams()], [None, None])


def test_temperatures_too_small_for_fp32_sample_as_greedy():
    # the fuzz run found it: logits / 1.4e-45 overflow to inf and the softmax to NaN, and
    # torch.multinomial then failed the whole batch; such rows are greedy (vLLM's 1e-5)
    logits = torch.tensor([[1.0, 3.0, 2.0], [0.5, 0.1, 0.2]])
    tiny = SamplingParams(temperature=1.4e-45)
    assert tiny.greedy
    gen = torch.Generator().manual_seed(0)
    assert sample(logits, [tiny, SamplingParams(temperature=1.0)], [gen, gen])[0] == 1


def test_token_logprobs_are_the_sampled_distribution_s_before_truncation():
    # greedy rows: log_softmax of the raw logits; sampled rows: of logits / temperature, before
    # top-k and top-p (the filtered distribution would give -inf outside the kept tokens)
    logits = _logits(3)
    params = [
        SamplingParams(logprobs=3),
        SamplingParams(temperature=0.5, top_k=2, top_p=0.5, logprobs=0),
        SamplingParams(temperature=2.0, logprobs=None),
    ]
    tokens = [int(logits[0].argmax()), 11, int(logits[2].argmin())]
    got = token_logprobs(logits, tokens, params)
    want = [
        torch.log_softmax(logits[0], -1),
        torch.log_softmax(logits[1] / 0.5, -1),
        torch.log_softmax(logits[2] / 2.0, -1),
    ]
    for g, w, t in zip(got, want, tokens):
        assert g.token_id == t and g.logprob == pytest.approx(float(w[t]), abs=1e-6)
    assert got[0].top_token_ids == tuple(want[0].topk(3).indices.tolist())
    assert got[0].top_logprobs == pytest.approx(want[0].topk(3).values.tolist(), abs=1e-6)
    assert got[0].top_token_ids[0] == tokens[0]  # greedy: the token is the most likely one
    assert got[1].top_token_ids == () and got[2].top_token_ids == ()  # 0 and None: no alternatives
    assert token_logprobs(logits[:0], [], []) == []
    with pytest.raises(ValueError, match="one token and one SamplingParams per row"):
        token_logprobs(logits, tokens[:2], params)
