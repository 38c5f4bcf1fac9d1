"""The server's body checks (freetoken/serve/request_body.py): the nesting scan against a plain reference on every
kind of JSON text, the depth and surrogate refusals, the field a refusal names."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from freetoken.serve.errors import APIError
from freetoken.serve.request_body import MAX_DEPTH, decode_json, lone_surrogate_path, nesting_depth


def _depth_reference(text: str) -> int:
    depth = best = 0
    inside = escaped = False
    for ch in text:
        if inside:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                inside = False
        elif ch == '"':
            inside = True
        elif ch in "[{":
            depth += 1
            best = max(best, depth)
        elif ch in "]}":
            depth -= 1
    return best


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.text(alphabet='ab"\\[]{}\n é'),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(alphabet='k"\\[{', max_size=3),
                                                                                 inner, max_size=3), max_leaves=20)


@settings(max_examples=300, derandomize=True, deadline=None)
@given(_json, st.booleans())
def test_nesting_depth_matches_a_plain_scan(value, ascii_only):
    text = json.dumps(value, ensure_ascii=ascii_only)
    assert nesting_depth(text.encode()) == _depth_reference(text)


@pytest.mark.parametrize("text,depth", [("", 0), ("1", 0), ("[]", 1), ('["[[[", {"a": [1]}]', 3), ('"\\\\"', 0),
                                        ('["\\\\", ["x"]]', 2), ('["\\"[[", []]', 2), ("[" * 300 + "]" * 300, 300)])
def test_nesting_depth_cases(text, depth):
    assert nesting_depth(text.encode()) == depth


def test_decode_refuses_deep_nesting_before_parsing():
    ok = "[" * MAX_DEPTH + "]" * MAX_DEPTH
    assert decode_json(ok.encode()) is not None
    with pytest.raises(APIError, match=f"{MAX_DEPTH + 1} deep") as e:
        decode_json(("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1)).encode())
    assert e.value.status == 400
    with pytest.raises(APIError, match="100000 deep"):  # a body Python's decoder would recurse through and fail on
        decode_json(b"[" * 100_000)


def test_decode_names_the_field_with_a_lone_surrogate():
    raw = b'{"messages": [{"role": "user", "content": "ok"}, {"role": "user", "content": "a\\udc00"}]}'
    with pytest.raises(APIError, match="lone surrogate") as e:
        decode_json(raw)
    assert e.value.status == 400 and e.value.param == "messages.1.content"
    assert decode_json(b'{"t": "\\ud83d\\ude00"}') == {"t": "\U0001f600"}  # a pair is a character
    assert lone_surrogate_path({"a": ["x", {"\ud800": 1}]}) == "a.1.\\ud800"


def test_decode_reports_bad_json_with_its_place():
    with pytest.raises(APIError, match=r"not valid JSON \(line 1, column 2\)"):
        decode_json(b"{x")
