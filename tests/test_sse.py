"""The incremental SSE parser survives any chunk boundaries and any line-ending style."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from polar_mitm.core.sse import SSEParser, encode

texts = st.text(
    alphabet=st.characters(blacklist_characters="\r\n", blacklist_categories=["Cs"]), max_size=40
)


@settings(max_examples=300)
@given(
    events=st.lists(
        st.tuples(texts, st.none() | st.text(alphabet="abcdefgh._", min_size=1, max_size=10)),
        max_size=8,
    ),
    newline=st.sampled_from(["\n", "\r\n", "\r"]),
    cuts=st.lists(st.integers(min_value=0, max_value=4000), max_size=12),
)
def test_any_boundaries(events, newline, cuts):
    stream = b"".join(encode(data, event) for data, event in events).replace(
        b"\n", newline.encode()
    )
    parser = SSEParser()
    got = []
    points = sorted({c % (len(stream) + 1) for c in cuts} | {0, len(stream)})
    for a, b in zip(points, points[1:], strict=False):
        got += parser.feed(stream[a:b])
    assert [(e.data, e.event) for e in got] == [(d, e) for d, e in events]


def test_multiline_data_comments_and_ids():
    parser = SSEParser()
    raw = b": keep-alive\n\nid: 7\nevent: message_start\ndata: a\ndata:b\n\ndata: [DONE]\n\npartial"
    events = parser.feed(raw)
    assert [(e.data, e.event, e.id) for e in events] == [
        ("a\nb", "message_start", "7"),
        ("[DONE]", None, None),
    ]
    assert parser.pending == len(b"partial")
