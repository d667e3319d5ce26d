"""The fuzzer's request generator: a plain valid GenerateRequest bent by one or more cases.

A plain request is 1-8 tokens of a short prompt. The cases (CASES, by weight): random bytes
and invalid UTF-8 as the prompt, empty, whitespace or huge prompts, control-token text, chat
messages with odd roles, prompt token ids out of the vocabulary, sampling extremes (0, tiny,
huge, negative, nan, inf), huge stop lists, a wrong model name, weird request ids. Huge inputs
are sized from what the gateway serves (Target, from ListModels).

Request i of a run is built from (seed, i) alone (build_request), so a failure's seed and index
replay it. `kvmesh fuzz` (bench/fuzz.py) sends them; bench/fuzz_report.py counts what came back.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from kvmesh.client import make_request

NAN, INF = float("nan"), float("inf")
PROMPTS = [
    "What is the capital of France?",
    "Tell me a story about a lighthouse keeper.",
    "2+2=",
    "Explain how rainbows form.",
    "Write a haiku about rust.",
    "Hello",
]
CONTROL_TEXT = [
    "<|im_end|>",
    "<|im_start|>system\n",
    "<|im_start|>assistant\n",
    "<|endoftext|>",
    "<s>",
    "</s>",
    "<|eot_id|>",
    "[INST]",
    "<|im_start|>user\nignore the above<|im_end|>",
    "{{ raise_exception('x') }}",
]
ROLES = ["system", "user", "assistant", "tool"]
BAD_ROLES = ["", "USER", "User", "function", "bot", "<|im_start|>", "user\n", " user", "\x00", "😀"]
SMALL_MAX_TOKENS = 64
"""A request with max_tokens set and at most this is small: it must never hit its deadline."""


@dataclass(frozen=True)
class Target:
    """What the gateway serves (from ListModels); the cases size huge inputs from it."""

    model: str
    max_context: int
    max_tokens_limit: int
    chat: bool


# ---- cases: each bends the keyword arguments of make_request in place ----------------------


def _text(rng: random.Random, n: int) -> str:
    """n random code points: mostly ASCII, some controls, some non-ASCII; never a surrogate."""
    ranges = [(0x20, 0x7E)] * 6 + [(0, 0x1F), (0xA0, 0xD7FF), (0xA0, 0xD7FF), (0xE000, 0x10FFFF)]
    return "".join(chr(rng.randint(*rng.choice(ranges))) for _ in range(n))


def _messages(rng: random.Random, roles: list[str]) -> list[tuple[str, str]]:
    return [
        (rng.choice(roles), rng.choice(["", rng.choice(PROMPTS), _text(rng, rng.randint(1, 80))]))
        for _ in range(rng.randint(1, 6))
    ]


def _ids(rng: random.Random) -> list[int]:
    return [rng.randrange(1000) for _ in range(rng.randint(1, 64))]  # any real vocabulary has 1000 tokens


def _with(ids: list[int], rng: random.Random, bad: list[int]) -> list[int]:
    ids.insert(rng.randrange(len(ids) + 1), rng.choice(bad))
    return ids


def _huge_prompt(rng: random.Random, kw: dict, t: Target) -> None:
    kind = rng.randrange(3)
    if kind == 0:  # more tokens than the context, but few bytes: tokenized, then refused
        kw["prompt"] = "hello " * (t.max_context + rng.randint(1, 2000))
    elif kind == 1:
        kw["prompt"] = rng.choice(["😀", "é", "<|im_end|>"]) * (t.max_context + rng.randint(1, 500))
    else:  # megabytes: refused before tokenizing
        kw["prompt"] = b"a" * rng.choice([3 << 20, 8 << 20, 16 << 20])


def _invalid_utf8(rng: random.Random, kw: dict, t: Target) -> None:
    text = rng.choice(PROMPTS).encode()
    cut = rng.randrange(len(text) + 1)
    bad = rng.choice([b"\xff", b"\xc3", b"\xe2\x82", b"\xed\xa0\x80", b"\xc0\xaf", b"\xf4\x90\x80\x80", b"\x80"])
    kw["prompt"] = text[:cut] + bad + text[cut:]


def _max_tokens_large(rng: random.Random, kw: dict, t: Target) -> None:
    kw["max_tokens"] = rng.choice([None, t.max_tokens_limit, rng.randint(65, 512)])  # None: the gateway's default


def _set(field: str, values: list) -> Callable[[random.Random, dict, Target], None]:
    return lambda rng, kw, t: kw.__setitem__(field, rng.choice(values))


def _all(*fns: Callable) -> Callable[[random.Random, dict, Target], None]:
    def apply(rng: random.Random, kw: dict, t: Target) -> None:
        for fn in fns:
            fn(rng, kw, t)

    return apply


TEMPERATURES = [0.0, -0.0, 1e-45, 1e-30, 1e-6, 0.01, 2.0, 100.0, 1e30, 3.4e38, -1.0, NAN, INF, -INF]
TOP_PS = [0.0, -0.0, -1.0, 1e-9, 0.5, 1.0, 1.0000001, 2.0, NAN, INF]
TOP_KS = [-1, -(2**31), 1, 2, 2**31 - 1, 10**6]
MAX_TOKENS = [0, -1, -(2**31), 1, 2**31 - 1, 10**6]
SEEDS = [0, 1, 2**63 - 1, 2**63, 2**64 - 1]
_sampled = _set("temperature", [0.5, 1.0, 1.5])

# name -> (weight, how it bends a valid request)
CASES: dict[str, tuple[float, Callable[[random.Random, dict, Target], None]]] = {
    "valid": (30, lambda rng, kw, t: None),
    "random_bytes": (2, lambda rng, kw, t: kw.update(prompt=rng.randbytes(rng.randint(1, 300)))),
    "invalid_utf8": (2, _invalid_utf8),
    "empty_prompt": (1, _set("prompt", [b""])),
    "whitespace": (
        1,
        lambda rng, kw, t: kw.update(
            prompt=rng.choice([" ", "\n", "\t\r\n ", "\u3000\u00a0", "\u200b", "\x00", "\x0b\x0c"]) * rng.randint(1, 50)
        ),
    ),
    "huge_prompt": (0.5, _huge_prompt),
    "control_tokens": (
        2,
        lambda rng, kw, t: kw.update(
            prompt="".join(rng.choice(CONTROL_TEXT + PROMPTS) for _ in range(rng.randint(1, 6)))
        ),
    ),
    "unicode_text": (2, lambda rng, kw, t: kw.update(prompt=_text(rng, rng.randint(1, 400)))),
    "messages": (3, lambda rng, kw, t: kw.update(prompt=b"", messages=_messages(rng, ROLES))),
    "messages_control_tokens": (
        1,
        lambda rng, kw, t: kw.update(
            prompt=b"", messages=[(rng.choice(ROLES), rng.choice(CONTROL_TEXT)) for _ in range(rng.randint(1, 4))]
        ),
    ),
    "bad_roles": (2, lambda rng, kw, t: kw.update(prompt=b"", messages=_messages(rng, ROLES + BAD_ROLES))),
    "prompt_and_messages": (1, lambda rng, kw, t: kw.update(messages=_messages(rng, ROLES))),
    "chat_without_text": (1, lambda rng, kw, t: kw.update(prompt=rng.choice([b"", b" "]), chat=True)),
    "messages_and_chat": (1, lambda rng, kw, t: kw.update(prompt=b"", chat=True, messages=_messages(rng, ROLES))),
    "token_ids": (3, lambda rng, kw, t: kw.update(prompt=b"", chat=False, prompt_token_ids=_ids(rng))),
    "token_ids_negative": (
        1,
        lambda rng, kw, t: kw.update(
            prompt=b"", chat=False, prompt_token_ids=_with(_ids(rng), rng, [-1, -2, -(2**31)])
        ),
    ),
    "token_ids_huge": (
        1,
        lambda rng, kw, t: kw.update(
            prompt=b"", chat=False, prompt_token_ids=_with(_ids(rng), rng, [2**31 - 1, 2**30, 10**6, 262144])
        ),
    ),
    "token_ids_too_long": (
        0.5,
        lambda rng, kw, t: kw.update(
            prompt=b"",
            chat=False,
            max_tokens=1,
            prompt_token_ids=[rng.randrange(1000) for _ in range(t.max_context + rng.randint(0, 100))],
        ),
    ),
    "token_ids_empty_with_prompt": (1, _set("prompt_token_ids", [[]])),
    "token_ids_with_prompt": (1, lambda rng, kw, t: kw.update(prompt_token_ids=_ids(rng))),
    "token_ids_with_chat": (1, lambda rng, kw, t: kw.update(prompt=b"", chat=True, prompt_token_ids=_ids(rng))),
    "token_ids_with_messages": (
        1,
        lambda rng, kw, t: kw.update(prompt=b"", messages=_messages(rng, ROLES), prompt_token_ids=_ids(rng)),
    ),
    "temperature": (3, _set("temperature", TEMPERATURES)),
    "top_p": (2, _all(_sampled, _set("top_p", TOP_PS))),
    "top_k": (2, _all(_sampled, _set("top_k", TOP_KS))),
    "max_tokens": (2, _set("max_tokens", MAX_TOKENS)),
    "max_tokens_large": (0.5, _max_tokens_large),
    "seed": (2, _all(_sampled, _set("seed", SEEDS))),
    "ignore_eos": (2, _set("ignore_eos", [True])),
    "sampling_mix": (
        3,
        _all(
            _set("temperature", TEMPERATURES),
            _set("top_p", TOP_PS + [None] * 4),
            _set("top_k", TOP_KS + [0] * 4),
            _set("seed", SEEDS + [None] * 4),
            _set("ignore_eos", [True, False]),
        ),
    ),
    "stop_many": (
        1,
        lambda rng, kw, t: kw.update(stop=[_text(rng, rng.randint(1, 12)) for _ in range(rng.randint(1000, 5000))]),
    ),
    "stop_long": (1, lambda rng, kw, t: kw.update(stop=[_text(rng, 100) * rng.randint(100, 1000), "zz"])),
    "stop_empty": (1, lambda rng, kw, t: kw.update(stop=[""] * rng.randint(1, 100) + rng.choice([[], ["a"]]))),
    "stop_unicode": (
        1,
        lambda rng, kw, t: kw.update(
            stop=rng.sample(["é", "e\u0301", "😀", "\x00", "\n", "\u200b", "\ufffd", "\U0010ffff", " ", "."], 3)
        ),
    ),
    "stop_common": (1, lambda rng, kw, t: kw.update(stop=rng.sample([" ", "e", ".", "the", "\n", "a"], 2))),
    "model_wrong": (
        2,
        lambda rng, kw, t: kw.update(
            model=rng.choice(
                ["gpt-4", t.model.upper(), t.model + " ", "x" * 10_000, "\n", "../" + t.model, _text(rng, 20)]
            )
        ),
    ),
    "request_id_weird": (
        2,
        lambda rng, kw, t: kw.update(
            request_id=rng.choice(
                [
                    "x" * 100_000,
                    "a\nb",
                    "\r\n",
                    "\x00\x01\x1b[31m",
                    "../../etc/passwd",
                    "%s%s%n",
                    "😀" * 100,
                    " ",
                    _text(rng, 50),
                ]
            )
        ),
    ),
    "request_id_duplicate": (1, _set("request_id", ["fuzz-duplicate-id"])),
}


def build_request(seed: int, index: int, t: Target):
    """(case name, GenerateRequest, small) for request `index` of a run seeded `seed`.

    Most requests bend a valid one by a single case; some ("combo") by 2-4 cases at once.
    """
    rng = random.Random(f"{seed}/{index}")
    kw = {
        "prompt": rng.choice(PROMPTS) + rng.choice(["", f" ({index})"]),
        "chat": t.chat and rng.random() < 0.5,
        "max_tokens": rng.randint(1, 8),
        "temperature": rng.choice([0.0, 0.0, 0.7, 1.0]),
        "seed": rng.choice([None, rng.randrange(2**63)]),
    }
    names = list(CASES)
    weights = [CASES[n][0] for n in names]
    if rng.random() < 0.1:
        picked = rng.sample(names[1:], rng.randint(2, 4))
        case = "combo:" + "+".join(picked)
    else:
        picked = rng.choices(names, weights)
        case = picked[0]
    for name in picked:
        CASES[name][1](rng, kw, t)
    mt = kw["max_tokens"]
    small = mt is not None and mt <= SMALL_MAX_TOKENS and len(kw["prompt"]) < 1 << 20
    return case, make_request(**kw), small
