"""A `previous_response_id` chain through a running gateway's Responses API: per turn, the
prompt's tokens, those prefill reused (`input_tokens_details.cached_tokens`), the answer's and
the seconds, printed as a table (docs/http-api.md's figures).

    kvmesh up &
    python -P -m kvmesh.bench.responses_chain --base-url http://127.0.0.1:8000/v1
"""

from __future__ import annotations

import argparse
import time

TURNS = (
    "I am planning a trip to Norway in June. What should I pack?",
    "How cold does it get at night in the fjords?",
    "Which city should I fly into?",
    "How many days do I need for Bergen?",
    "Summarize the plan in one sentence.",
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the gateway's OpenAI HTTP API")
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--max-output-tokens", type=int, default=48)
    args = parser.parse_args(argv)

    import openai  # a test dependency: the bench runs from the checkout's venv

    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=300)
    previous = None
    print("turn  input_tokens  cached_tokens  output_tokens  seconds")
    for turn, text in enumerate(TURNS, start=1):
        start = time.perf_counter()
        r = client.responses.create(
            model="", input=text, previous_response_id=previous, max_output_tokens=args.max_output_tokens, temperature=0
        )
        u = r.usage
        assert u is not None, r
        cached = u.input_tokens_details.cached_tokens
        print(
            f"{turn:>4}  {u.input_tokens:>12}  {cached:>13}  {u.output_tokens:>13}  {time.perf_counter() - start:>7.2f}"
        )
        previous = r.id


if __name__ == "__main__":
    main()
