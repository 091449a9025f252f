from __future__ import annotations

import base64

from mitmproxy.http import Headers

from polar_mitm.call.identity import proxy_user, resolve, split_group


def basic(user: str, password: str = "x") -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def test_split_group():
    assert split_group("django-11099.3") == ("django-11099", 3)
    assert split_group("a.b.12") == ("a.b", 12)
    assert split_group("plain") == (None, None)
    assert split_group("v1.x") == (None, None)
    assert split_group(".3") == (None, None)


def test_proxy_user():
    assert proxy_user(basic("task.1")) == "task.1"
    assert proxy_user("Basic !!!") is None
    assert proxy_user("Bearer abc") is None
    assert proxy_user(None) is None


def test_precedence():
    h = Headers(authorization="Bearer polar-key.1", x_polar_rollout="hdr.2", session_id="s")
    assert resolve(h, "10.0.0.1", "proxy.0").source == "proxy_auth"
    assert resolve(h, "10.0.0.1", None).rollout_id == "key.1"
    h = Headers(authorization="Bearer sk-abc", x_polar_rollout="hdr.2")
    assert resolve(h, "10.0.0.1", None).rollout_id == "hdr.2"
    h = Headers(x_claude_code_session_id="abc-123")
    r = resolve(h, "10.0.0.1", None)
    assert (r.rollout_id, r.source, r.session_id) == ("10.0.0.1-abc-123", "session", "abc-123")
    # nothing but the client address: anonymous, told apart from a session by its source
    r = resolve(Headers(), "10.0.0.1", None)
    assert (r.rollout_id, r.source, r.session_id) == ("10.0.0.1", "client_address", None)
    # OpenCode's session headers name a session too
    r = resolve(Headers(x_session_affinity="ses_1"), "10.0.0.1", None)
    assert (r.rollout_id, r.source) == ("10.0.0.1-ses_1", "session")
    # an id with characters we cannot keep safely falls through to the next rule
    assert resolve(Headers(x_polar_rollout="bad id\n"), "10.0.0.1", "ok.1").rollout_id == "ok.1"
    assert resolve(Headers(x_polar_rollout="bad id"), "h", None).source == "client_address"
    assert resolve(Headers(x_polar_rollout="bad id", session_id="s"), "h", None).source == "session"
