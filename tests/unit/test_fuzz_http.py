"""The HTTP fuzzer's request builder and verdict (bench/fuzz_http.py), without a mesh."""

from __future__ import annotations

import json
from collections import Counter

from kvmesh.bench.fuzz_http import ENDPOINTS, HTTP_CASES, HttpCase, _dumps, _malformed, build_http_case, is_http_failure
from kvmesh.bench.fuzz_report import Result


def test_a_case_is_built_from_seed_and_index_alone_and_every_api_and_case_comes_up():
    a = [build_http_case(3, i, "M", 1 << 20) for i in range(300)]
    assert a == [build_http_case(3, i, "M", 1 << 20) for i in range(300)]
    assert a != [build_http_case(4, i, "M", 1 << 20) for i in range(300)]
    cases = Counter(part for c in a for part in c.case.split("+"))
    assert set(cases) == set(HTTP_CASES) and {c.path for c in a} == set(ENDPOINTS)
    assert any(c.stream for c in a) and any(c.leave_after_first_chunk for c in a) and any(c.small for c in a)


def test_nan_markers_are_written_as_bare_literals_that_strict_json_refuses():
    raw = _dumps({"temperature": {"__raw__": "NaN"}, "top_p": {"__raw__": "-Infinity"}})
    assert raw == b'{"temperature": NaN, "top_p": -Infinity}'


def test_a_200_is_malformed_when_not_the_apis_shape():
    plain = HttpCase("field", "/v1/chat/completions", {}, b"{}", stream=False, small=True)
    streamed = HttpCase("field", "/v1/chat/completions", {}, b"{}", stream=True, small=True)
    assert not _malformed(plain, json.dumps({"choices": []}), False) and _malformed(plain, "<html>", False)
    ok_stream = 'data: {"x": 1}\n\ndata: [DONE]\n\n'
    assert not _malformed(streamed, ok_stream, True) and _malformed(streamed, "data: {}\n\n", True)
    # what the response is, not what the case meant, decides: a `stream` field set by a case
    assert not _malformed(plain, ok_stream, True)


def test_5xx_malformed_transport_errors_and_small_timeouts_fail_the_run():
    def result(status: str, small: bool = True) -> Result:
        return Result(0, "field", status, "", small, 0.1, "")

    assert [is_http_failure(result(s)) for s in ("http_500", "http_503", "OK_MALFORMED", "transport_error")] == [
        True
    ] * 4
    assert [is_http_failure(result(s)) for s in ("http_200", "http_400", "http_413", "http_429", "left")] == [False] * 5
    assert is_http_failure(result("timeout")) and not is_http_failure(result("timeout", small=False))
