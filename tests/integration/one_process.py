"""The one-process side of the P/D rule (docs/precision.md, rule 1): a LlamaRunner running the
mesh's kernels in this test process, greedy tokens from it, and fresh page ids for it."""

from __future__ import annotations

import random

from kvmesh.engine.forward import ForwardItem
from kvmesh.engine.llama.runner import LlamaRunner

NEW_TOKENS = 24


class Pages:
    """Fresh page ids of one test module's runner (page 0 is its warm-up's)."""

    def __init__(self) -> None:
        self.next = 1

    def take(self, n: int) -> list[int]:
        self.next += n
        return list(range(self.next - n, self.next))


def greedy(runner: LlamaRunner, new_ids: list[int], computed: int, pages: list[int]) -> list[int]:
    """NEW_TOKENS greedy tokens after `new_ids`, whose first `computed` tokens' K/V `pages` hold already."""
    logits = runner.forward([ForwardItem(new_ids, computed, pages)])
    out = [int(logits[0].argmax())]
    n = computed + len(new_ids)
    for _ in range(NEW_TOKENS - 1):
        logits = runner.forward([ForwardItem([out[-1]], n, pages)])
        out.append(int(logits[0].argmax()))
        n += 1
    return out


def random_prompt(n: int, seed: int) -> list[int]:
    """n token ids: BOS, then ids drawn from `seed`."""
    rng = random.Random(seed)
    return [1] + [rng.randrange(1000, 20000) for _ in range(n - 1)]


def prefix_hit_matches(mesh, runner: LlamaRunner, pages: Pages, page_size: int) -> None:
    """A 50-token prompt through the mesh (3 full pages prefill keeps) and the one process, then
    one sharing its first 48 tokens: prefill must compute only what follows, and the mesh's
    greedy tokens equal the one process's over the same cached pages."""
    from tests.integration.meshutil import complete, wait_idle

    first = random_prompt(50, seed=1)
    complete(mesh, b"", prompt_token_ids=first, max_tokens=NEW_TOKENS, ignore_eos=True)
    first_pages = pages.take((50 + NEW_TOKENS) // page_size + 1)
    greedy(runner, first, 0, first_pages)
    second = first[:48] + random_prompt(20, seed=2)[1:]
    answer = complete(mesh, b"", prompt_token_ids=second, max_tokens=NEW_TOKENS, ignore_eos=True)
    assert answer.final.cached_tokens == 48  # prefill computed only what follows its 3 pages
    tail = first_pages[:3] + pages.take((len(second) - 48 + NEW_TOKENS) // page_size + 1)
    assert answer.token_ids == greedy(runner, second[48:], 48, tail)
    wait_idle(mesh)
