# B=sequences, V=vocab
"""Next-token sampling: greedy, temperature, top-k and top-p (nucleus, Holtzman et al. 2019).

Filtering follows transformers' logits warpers in generate's order: temperature, then
`TopKLogitsWarper` (keeps every token tied with the k-th logit), then `TopPLogitsWarper` (drops
the smallest tokens whose cumulative probability stays <= 1 - top_p, always keeping the top one).
`token_logprobs` reports what a request asks for with SamplingParams.logprobs.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from kvmesh.engine.sampling_params import MIN_TEMPERATURE, SamplingParams, TokenLogprobs

logger = logging.getLogger(__name__)


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> list[int]:
    """Pick one token per row.

    logits [B, V] fp32; params and generators have B entries (generator None = global RNG).
    Greedy rows take the first index of the max; the others apply temperature, top-k, top-p and
    draw with `torch.multinomial` from their own generator. Returns B token ids.
    Raises ValueError when the lengths disagree.
    """
    B = logits.shape[0]
    if len(params) != B or len(generators) != B:
        raise ValueError(
            f"need one SamplingParams and one generator per row: {B} rows, "
            f"{len(params)} params, {len(generators)} generators"
        )
    if logits.device.type != "cpu":  # on the device, then the ids alone cross to the host
        return sample_ids(logits, params, generators).cpu().tolist()
    out = _argmax_rows(logits)  # greedy for every row; sampled rows overwrite below
    rows = [b for b, p in enumerate(params) if not p.greedy]
    if not rows:
        return out
    probs = _filtered_probs(logits[rows], [params[b] for b in rows])  # [b, V]
    for i, b in enumerate(rows):
        out[b] = int(torch.multinomial(probs[i], 1, generator=generators[b]))
    return out


def sample_ids(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> torch.Tensor:
    """`sample` without leaving the logits' device and free of host syncs: [B] int64 token ids
    on logits.device (the caller copies them to the host, the one device-to-host copy of a step).

    Greedy rows as `sample`; sampled rows filter as `sample` does and draw by inverse transform
    (the first token whose cumulative probability exceeds u), u uniform in [0, 1) from the row's
    own CPU generator (None: torch's global CPU RNG), copied to the device: the draw is
    reproducible per seed, whatever the device, though not the same token `torch.multinomial`
    picks on the CPU path. Raises ValueError when the lengths disagree.
    """
    B = logits.shape[0]
    if len(params) != B or len(generators) != B:
        raise ValueError(
            f"need one SamplingParams and one generator per row: {B} rows, {len(params)}, {len(generators)}"
        )
    out = logits.argmax(dim=-1)  # [B] greedy for every row; sampled rows overwrite below
    rows = [b for b, p in enumerate(params) if not p.greedy]
    if not rows:
        return out
    probs = _filtered_probs(logits[rows], [params[b] for b in rows])  # [b, V]
    u = torch.stack([torch.rand((), generator=generators[b], dtype=torch.float64) for b in rows])  # [b] host
    u = u.to(device=logits.device, dtype=probs.dtype)
    cdf = probs.cumsum(dim=-1)  # [b, V]
    drawn = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0].clamp_(max=probs.shape[-1] - 1)
    index = torch.tensor(rows, device=logits.device)
    return out.index_copy_(0, index, drawn)


def token_logprobs(
    logits: torch.Tensor, token_ids: Sequence[int], params: Sequence[SamplingParams]
) -> list[TokenLogprobs]:
    """Each row's sampled token's log probability and its params.logprobs most likely tokens'.

    logits [n, V] (any float dtype, any device; computed in fp32), token_ids [n] the tokens
    sampled from those rows, params [n] their requests' settings (logprobs None counts as 0).
    The distribution is the one the token is drawn from before truncation:
    log_softmax(logits / temperature), with the raw logits when temperature is below
    MIN_TEMPERATURE (greedy), and before top-k and top-p (vLLM's default logprobs, processed by
    temperature only; OpenAI's API leaves it unsaid). Ties among the top tokens keep
    torch.topk's order. One device-to-host copy. Raises ValueError when the lengths disagree.
    """
    n = logits.shape[0]
    if len(token_ids) != n or len(params) != n:
        raise ValueError(f"need one token and one SamplingParams per row: {n} rows, {len(token_ids)}, {len(params)}")
    if n == 0:
        return []
    if logits.device.type == "cpu":
        return _token_logprobs_host(logits, token_ids, params)
    dev = logits.device
    scale = torch.tensor(
        [p.temperature if p.temperature >= MIN_TEMPERATURE else 1.0 for p in params], dtype=torch.float32, device=dev
    )
    lp = torch.log_softmax(logits.float() / scale[:, None], dim=-1)  # [n, V]
    chosen = lp.gather(-1, torch.tensor(list(token_ids), device=dev)[:, None])[:, 0]  # [n]
    k = max(p.logprobs or 0 for p in params)
    if k:
        top = lp.topk(min(k, lp.shape[-1]), dim=-1)  # [n, k] values, indices; most likely first
        host = torch.cat([chosen[:, None], top.values, top.indices.float()], dim=-1).cpu()  # [n, 1 + 2k]
        values, indices = host[:, 1 : 1 + k], host[:, 1 + k :].long()
    else:
        host = chosen[:, None].cpu()
    out = []
    for i, (token, p) in enumerate(zip(token_ids, params)):
        m = p.logprobs or 0
        out.append(
            TokenLogprobs(
                int(token),
                float(host[i, 0]),
                tuple(indices[i, :m].tolist()) if m else (),
                tuple(values[i, :m].tolist()) if m else (),
            )
        )
    return out


def _token_logprobs_host(
    logits: torch.Tensor, token_ids: Sequence[int], params: Sequence[SamplingParams]
) -> list[TokenLogprobs]:
    """token_logprobs on the CPU through numpy, one thread: torch's ops would wake an OpenMP
    team per op, which costs more than the work on cores the other services share (as
    `_argmax_rows`). The same numbers: log_softmax in fp32, top tokens most likely first."""
    scale = np.array([p.temperature if p.temperature >= MIN_TEMPERATURE else 1.0 for p in params], np.float32)
    x = logits.detach().float().numpy() / scale[:, None]  # [n, V]
    peak = x.max(axis=-1, keepdims=True)
    lse = peak + np.log(np.exp(x - peak).sum(axis=-1, keepdims=True))  # [n, 1]
    out = []
    for i, (token, p) in enumerate(zip(token_ids, params)):
        k = min(p.logprobs or 0, x.shape[-1])
        top: tuple[int, ...] = ()
        if k:
            part = np.argpartition(-x[i], k - 1)[:k]
            top = tuple(int(t) for t in part[np.argsort(-x[i, part], kind="stable")])
        out.append(
            TokenLogprobs(
                int(token),
                float(x[i, token] - lse[i, 0]),
                top,
                tuple(float(x[i, t] - lse[i, 0]) for t in top),
            )
        )
    return out


def _argmax_rows(logits: torch.Tensor) -> list[int]:
    """The first index of each row's max ([B, V] -> B ids), as torch.argmax gives it. On the CPU
    through numpy: one thread, where torch splits a [B, 49152] argmax over an OpenMP team whose
    wake-up costs more than the work, and far more on cores the other services share (measured
    on 2 busy cores: 1.1 ms for 2 rows through torch, tens of microseconds through numpy)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return np.argmax(logits.detach().numpy(), axis=-1).tolist()
    return logits.argmax(dim=-1).cpu().tolist()  # one device-to-host copy


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k and top-p over rows [b, V], then softmax -> probabilities [b, V]."""
    dev = logits.device  # every tensor here on the logits' device, no host sync (sample_ids)
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=dev)
    scores = logits / temps[:, None]  # [b, V]
    V = scores.shape[-1]
    ks = [min(p.top_k, V) for p in params]
    if any(ks):
        kmax = max(ks)
        top = scores.topk(kmax, dim=-1).values  # [b, kmax], descending
        kth = top.gather(-1, torch.tensor([[k - 1 if k else kmax - 1] for k in ks], device=dev))  # [b, 1]
        use_k = torch.tensor([[k > 0] for k in ks], device=dev)
        scores = scores.masked_fill(use_k & (scores < kth), float("-inf"))
    top_p = torch.tensor([p.top_p for p in params], dtype=scores.dtype, device=dev)
    if any(p.top_p < 1 for p in params):
        sorted_scores, order = scores.sort(dim=-1)  # ascending, as TopPLogitsWarper
        cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cum <= (1 - top_p)[:, None]
        drop_sorted[:, -1] = False  # always keep the most likely token
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores.softmax(dim=-1)


def verify_drafts(
    logits: torch.Tensor, drafts: Sequence[int], params: SamplingParams, generator: torch.Generator | None
) -> list[int]:
    """Speculative decoding's verification for one sequence: the tokens to keep, 1..k+1 of them.

    logits [k+1, V] fp32: the target's logits after the last accepted token (row 0) and after
    each of the k drafts (row j after draft j-1); drafts [k] token ids from a drafter that
    proposes one token for sure (n-gram lookup: its distribution is one-hot). Greedy keeps drafts
    while each equals the row's argmax, then the first row that disagrees (or the last) gives
    the target's own token: exactly the tokens greedy decoding without drafts gives. Sampling
    follows the speculative-sampling rule (Leviathan et al. 2023, Chen et al. 2023) for a
    one-hot draft: draft x at row j is kept with probability p_j(x) (p_j the row's filtered
    distribution, as `sample` draws from); on a rejection the token is drawn from p_j without x,
    renormalized; after k kept drafts the bonus token is drawn from p_k. The output
    distribution is the target's. Raises ValueError when logits has not len(drafts) + 1 rows.
    """
    k = len(drafts)
    if logits.dim() != 2 or logits.shape[0] != k + 1:
        raise ValueError(f"need {k + 1} rows of logits for {k} drafts, got {tuple(logits.shape)}")
    if params.greedy:
        target = _argmax_rows(logits)  # [k+1]
        out = []
        for j in range(k + 1):
            out.append(target[j])
            if j == k or drafts[j] != target[j]:
                return out
    # on a GPU the rows' probabilities come to the host: what sampled speculation needs
    probs = _filtered_probs(logits, [params] * (k + 1)).cpu()  # [k+1, V]
    out = []
    for j, x in enumerate(drafts):
        p = probs[j]
        if float(torch.rand((), generator=generator)) < float(p[x]):
            out.append(x)
            continue
        residual = p.clone()
        residual[x] = 0
        if float(residual.sum()) <= 0:  # p was all on x: cannot happen after a rejection
            out.append(x)
            continue
        out.append(int(torch.multinomial(residual, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(probs[k], 1, generator=generator)))
    return out
