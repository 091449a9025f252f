"""polar_mitm/core/fastjson.py: msgspec where it gives the stdlib's value, the stdlib where it does not."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from polar_mitm.core import fastjson

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(JSON)
def test_the_same_values_as_the_stdlib(value) -> None:
    text = json.dumps(value, ensure_ascii=False)
    assert fastjson.loads(text) == json.loads(text)
    assert fastjson.loads(text.encode()) == json.loads(text)
    assert json.loads(fastjson.dumps(value)) == value
    assert json.loads(fastjson.dumps_bytes(value)) == value


def test_what_msgspec_refuses_is_the_stdlibs() -> None:
    assert fastjson.loads("[1e400, 18446744073709551616, -9223372036854775809]") == [
        math.inf,
        2**64,
        -(2**63) - 1,
    ]  # orjson, tried first, made the big ones floats
    assert math.isnan(fastjson.loads("NaN"))
    assert fastjson.loads('"\\ud800"') == "\ud800"  # callers then refuse it, as before
    deep = "[" * 500 + "]" * 500
    with pytest.raises(RecursionError):  # the stdlib's error, which the callers turn into a 400
        fastjson.loads("[" * 100_000 + "]" * 100_000)
    assert fastjson.loads(deep) == json.loads(deep)
    with pytest.raises(json.JSONDecodeError, match="Expecting property name"):
        fastjson.loads("{")
    assert fastjson.dumps({1: 2**70}) == '{"1":1180591620717411303424}'
    assert fastjson.dumps_bytes("\ud800") == b'"\\ud800"'  # ASCII: never invalid UTF-8
    assert fastjson.dumps({"a": "é\n"}) == '{"a":"é\\n"}'  # compact, non-ASCII kept


IDS = st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=50)
ODD_ID = st.one_of(
    st.integers(2**31, 2**80),
    st.integers(-(2**80), -(2**31) - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.booleans(),
    st.none(),
    st.text(max_size=3),
)


@settings(max_examples=200, deadline=None)
@given(IDS, st.lists(ODD_ID, max_size=2), st.booleans())
def test_loads_ids_reads_a_long_id_list_into_int32_and_nothing_else(ids, odd, spaced) -> None:
    """A top-level id list long enough for the int32 path comes back as an array of the same
    values; with any value that is not a 32-bit integer, or nested, it is `loads`'s."""
    from array import array

    value = ids * (fastjson.IDS_MIN_CHARS // (2 * len(ids)) + 1) + odd  # each id 2+ chars
    doc = {"id": "chatcmpl-1", "choices": [{"delta": {"content": ""}}], "prompt_token_ids": value}
    text = json.dumps(doc, separators=(", ", ": ") if spaced else (",", ":"))
    assert len(text) >= fastjson.IDS_MIN_CHARS
    got = fastjson.loads_ids(text)
    assert got == json.loads(text) or got["prompt_token_ids"].tolist() == value
    assert isinstance(got["prompt_token_ids"], array) is (not odd)
    assert got["choices"] == doc["choices"]
    nested = {"choices": [{"prompt_token_ids": value}]}
    assert fastjson.loads_ids(json.dumps(nested)) == json.loads(json.dumps(nested))
    with pytest.raises(ValueError):
        fastjson.loads_ids(text[:-2] + ",]}")


def test_an_upstream_body_with_prompt_ids_and_escapes_is_checked_for_lone_surrogates():
    """The surrogate check of a long upstream body looks past the ids array loads_ids makes (it
    once raised on the array: a polar-mitm internal error for a valid reply the fuzz found)."""
    from array import array

    from polar_mitm.call.failures import json_value

    ids = list(range(3000))
    valid = json.dumps({"prompt_token_ids": ids, "text": "\ud83d\ude00 ok"})
    value = json_value(valid, "body")
    assert isinstance(value["prompt_token_ids"], array) and list(value["prompt_token_ids"]) == ids
    assert value["text"] == "\U0001f600 ok"
    lone = json.dumps({"prompt_token_ids": ids, "text": "\ud800"})
    with pytest.raises(ValueError, match="lone surrogate"):
        json_value(lone, "body")


@pytest.mark.parametrize(
    ("text", "lone"),
    [
        ('{"a": "\\ud83d\\ude00"}', False),  # a pair: an emoji
        ('{"a": "\\\\ud800"}', False),  # an escaped backslash, then the letters
        ('{"a": ["x", {"b": "\\ud800"}]}', True),  # nested in a list and a dict
        ('{"\\udc00": 1}', True),  # in a key
        ('{"a": "\\uDFFF x"}', True),  # upper-case escape
        ('{"a": "plain"}', False),
    ],
)
def test_lone_surrogates_walks_strings_and_keys(text, lone):
    assert fastjson.lone_surrogates(text, json.loads(text)) is lone


@pytest.mark.parametrize(
    ("text", "lone"),
    [
        ('{"a": "\\ud83d\\ude00"}', False),
        ('{"a": "\\\\ud800"}', False),
        ('{"a": ["x", {"b": "\\ud800"}]}', True),
        ('{"\\udc00": 1}', True),
        ('{"a": "\\uDFFF x"}', True),
        ('{"a": "\\ud800\\u0041"}', True),  # a high surrogate before a non-surrogate
        ('{"a": "\\ud800\\ud800"}', True),  # two high ones
        ('{"a": "plain"}', False),
    ],
)
@pytest.mark.parametrize("ids_key", [None, "prompt_token_ids"])
def test_decode_says_whether_a_value_holds_a_lone_surrogate(text, lone, ids_key, monkeypatch):
    """`decode` answers as the walk does, and walks only what the stdlib decoded: msgspec
    refuses every lone surrogate, so a value it decoded is clean (long ids path included)."""
    if ids_key:  # long enough for loads_ids' own path, the ids at the top level
        text = text[:-1] + ', "prompt_token_ids": [' + ",".join(["7"] * 3000) + "]}"
    walked = []
    walk = fastjson.lone_surrogates
    monkeypatch.setattr(fastjson, "lone_surrogates", lambda t, v: walked.append(t) or walk(t, v))
    value, found = fastjson.decode(text, ids_key)
    assert found is lone is walk(text, json.loads(text))
    assert bool(walked) is lone  # only the stdlib's values (all the lone ones here) are walked
