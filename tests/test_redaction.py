"""`redacted_json` writes a request once and copies it only when a credential-named key is in it:
it must give exactly what blanking every such key first and then writing would give."""

from __future__ import annotations

import json

from hypothesis import example, given, settings
from hypothesis import strategies as st

from polar_mitm.core.redaction import REDACTED, redact_obj, redacted_json

# Keys: credential names in any case and spelling the pattern allows, near misses, and ordinary
# names; strings: text that looks like a credential key inside JSON text.
KEYS = st.sampled_from(
    [
        "api_key",
        "API-KEY",
        "apikey",
        "Authorization",
        "password",
        "Credentials",
        "session-token",
        "api_keys",
        "my_password",
        "content",
        "role",
        "tool_calls",
        "",
        'quote"key',
        "ключ",
    ]
)
TEXT = st.sampled_from(
    [
        '{"api_key":"sk-1"}',
        ',"password":',
        '\\",\\"secret\\":',
        "plain",
        "",
        "é ünïcode",
        "keys sk/1 and sk-1 in a tool result",
    ]
) | st.text(max_size=12)
JSON = st.recursive(
    # finite floats: NaN and Infinity are not JSON, and msgspec (polar_mitm/core/fastjson.py) writes
    # them as null where the stdlib writes NaN
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS, inner, max_size=4),
    max_leaves=25,
)


def reference(obj: object, secrets: list[str]) -> str:
    text = json.dumps(redact_obj(obj), ensure_ascii=False, separators=(",", ":"))
    for secret in secrets:
        text = text.replace(secret, REDACTED)
    return text


@settings(max_examples=400, deadline=None)
@given(JSON, st.lists(st.sampled_from(["sk-1", "hunter22", "secret-value"]), max_size=2))
def test_redacted_json_equals_redacting_first(obj: object, secrets: list[str]) -> None:
    # the same JSON value (msgspec spells a float 1e16 where the stdlib writes 1e+16)
    assert json.loads(redacted_json(obj, secrets)) == json.loads(reference(obj, secrets))


@settings(max_examples=300, deadline=None)
@example({"content": "keys sk/1 and sk-1 in a tool result"}, ["sk/1"], "slashes")
@example({"content": "keys sk/1 and sk-1 in a tool result"}, ["sk-1"], "ascii")
@given(
    JSON,
    st.lists(st.sampled_from(["sk-1", "hunter22", "sk/1", "Bearer sk-1"]), max_size=2),
    st.sampled_from(["ascii", "indent", "slashes"]),
)
def test_the_text_kept_as_sent_hides_no_secret(obj: object, secrets: list[str], how: str) -> None:
    """With the text it was decoded from, `redacted_json` keeps that text (no key to blank) and
    still finds every secret, however the encoder escaped it (``\\u0073``, ``\\/``)."""
    if how == "ascii":
        # every non-ASCII character a \u escape, and "k" too (no JSON literal holds a "k")
        text = json.dumps(obj).replace("k", "\\u006b")
    elif how == "indent":
        text = json.dumps(obj, ensure_ascii=False, indent=1)
    else:  # "/" only occurs inside strings, so this is still the same JSON
        text = json.dumps(obj, ensure_ascii=False).replace("/", "\\/")
    kept = redacted_json(obj, secrets, text)
    assert json.loads(kept) == json.loads(reference(obj, secrets))


def test_a_request_without_credential_keys_is_stored_as_sent() -> None:
    text = '{ "messages": [ {"role": "user", "content": "caf\\u00e9 /tmp"} ] }'
    obj = json.loads(text)
    assert redacted_json(obj, [], text) == text
    # an escape of a character outside printable ASCII cannot spell a secret's: kept as sent
    assert redacted_json(obj, ["sk-1"], text) == text
    emoji = text.replace("\\u00e9", "\\ud83d\\ude00 \\u001b")
    assert redacted_json(json.loads(emoji), ["sk-1"], emoji) == emoji
    ascii_escape = text.replace("\\u00e9", "\\u0065")  # "e" written as an escape
    assert redacted_json(json.loads(ascii_escape), ["sk-1"], ascii_escape) != ascii_escape
    assert redacted_json(obj, ["sk/1"], text.replace("\\u00e9", "e")) != text  # "/" may be "\\/"
    assert redacted_json(obj, ["sk-1"], text.replace("\\u00e9", "e")) == text.replace(
        "\\u00e9", "e"
    )


def test_credential_keys_are_blanked_at_any_depth() -> None:
    body = {"messages": [{"role": "user", "content": "hi", "extra": {"Api-Key": "sk-1"}}]}
    text = redacted_json(body)
    assert "sk-1" not in text and json.loads(text)["messages"][0]["extra"]["Api-Key"] == REDACTED


def test_key_lookalikes_inside_strings_are_left_alone() -> None:
    body = {"content": 'config: {"api_key": "x"}, "password":'}
    assert json.loads(redacted_json(body)) == body
