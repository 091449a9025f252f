"""Security: the CA key, where the proxy listens, credentials kept off disk and off the upstream,
and hosts outside polar_hosts left alone. (The whole suite's output is grepped for every secret
it used once the session ends: conftest.secret_book.)"""

from __future__ import annotations

import asyncio
import json
import secrets
import stat
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from polar_mitm.cli.app import main
from tests.helpers import ROOT
from tests.helpers.clients import grep_bytes, http_client
from tests.helpers.procs import MITMDUMP, Proc, free_port

from .conftest import reset_server
from .dialects import dialect_rows, row_id
from .harness import Harness, marker, record_of, records


def _key_lines(confdir: Path) -> list[str]:
    """The base64 lines of the CA's private key: none may appear anywhere but in its file."""
    pem = (confdir / "mitmproxy-ca.pem").read_text()
    body = pem.split("PRIVATE KEY-----", 1)[1].split("-----END", 1)[0]
    return [line for line in body.split() if len(line) >= 40]


def _assert_private(confdir: Path) -> None:
    for name in ("mitmproxy-ca.pem", "mitmproxy-ca.p12"):
        mode = stat.S_IMODE((confdir / name).stat().st_mode)
        assert mode == 0o600, f"{name} is {oct(mode)}"


def _mitmdump(tmp_path: Path, confdir: Path, *args: str, upstream: str = "http://127.0.0.1:9"):
    port = free_port()
    argv = [MITMDUMP, "-s", str(ROOT / "addons" / "polar.py"), "--listen-port", str(port),
            "--set", f"confdir={confdir}", "--set", f"polar_output={tmp_path / 'out'}",
            "--set", f"polar_upstream={upstream}", *args]  # fmt: skip
    proc = Proc(argv, tmp_path / f"mitm-{port}.log")
    proc.wait_for(r"polar-mitm: capturing", timeout=60)
    return proc, port


def _listeners(port: int) -> list[str]:
    """Local addresses listening on `port` (from /proc/net/tcp and tcp6), as hex."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, state = fields[1], fields[3]
            if state == "0A" and int(address.rsplit(":", 1)[1], 16) == port:
                found.append(address.rsplit(":", 1)[0])
    return found


def test_ca_key_is_private_and_never_printed(tmp_path, ledger):
    with ledger.fault("security:ca-key"):
        confdir = tmp_path / "fresh-certs"
        result = CliRunner().invoke(main, ["certs", "--confdir", str(confdir)])
        assert result.exit_code == 0, result.output
        _assert_private(confdir)
        lines = _key_lines(confdir)
        assert lines and not any(line in result.output for line in lines)
        env = CliRunner().invoke(main, ["env", "--proxy", "127.0.0.1:8080", "--confdir",
                                        str(confdir)])  # fmt: skip
        assert env.exit_code == 0 and not any(line in env.output for line in lines)
        # mitmdump making its own CA in an empty confdir: the same modes, nothing printed
        second = tmp_path / "mitm-certs"
        proc, _ = _mitmdump(tmp_path, second)
        assert proc.stop() == 0
        _assert_private(second)
        lines = _key_lines(second)
        assert not any(line in proc.output() for line in lines)
        outside = {p for p in grep_bytes(tmp_path, lines[:3]).get(lines[0], [])}
        assert outside == {str(second / "mitmproxy-ca.pem")}


def test_listens_on_loopback_unless_told(tmp_path, confdir, ledger):
    with ledger.fault("security:loopback"):
        proc, port = _mitmdump(tmp_path, confdir)  # no --listen-host
        try:
            assert _listeners(port) == ["0100007F"], _listeners(port)  # 127.0.0.1 only
        finally:
            proc.stop()
        assert "without proxy authentication" not in proc.output()


@pytest.mark.parametrize(
    ("args", "warns"),
    [
        (("--listen-host", "0.0.0.0"), True),
        (("--listen-host", "0.0.0.0", "--set", "proxyauth=user:secret-pw"), False),
        (("--listen-host", "127.0.0.2"), False),  # all of 127.0.0.0/8 is loopback
    ],
    ids=["wide", "wide-with-auth", "other-loopback"],
)
def test_warns_when_listening_wide_without_auth(tmp_path, confdir, args, warns, ledger):
    with ledger.fault(f"security:bind-warning-{'wide' if warns else 'quiet'}"):
        proc, _ = _mitmdump(tmp_path, confdir, *args)
        proc.stop()
        out = proc.output()
        assert ("without proxy authentication" in out) is warns, out
        assert "secret-pw" not in out


@pytest.mark.parametrize("row", dialect_rows(), ids=row_id)
def test_credentials_stay_off_disk_and_off_the_upstream(
    row, fault_server, make_mitm, secret_book, ledger
):
    """API keys, Authorization, x-api-key, cookies and proxy credentials: not in the records, the
    journal, the shards, the proxy's most verbose log (flow_detail=4), nor sent to the server."""
    reset_server(fault_server)
    mitm = make_mitm(fault_server.url, flow_detail=4)
    bearer, x_key = secret_book.new("sk-live"), secret_book.new("sk-ant-api03")
    cookie, proxy_pw = secret_book.new("cookie"), secret_book.new("proxy-pw")
    # a polar- key names the rollout (stored): the key itself is the secret
    polar_key = secret_book.add(f"polar-rollout-{secrets.token_hex(8)}")
    body_key = secret_book.new("sk-in-body")
    texts = [marker("sec-headers"), marker("sec-proxy"), marker("sec-polar")]
    query_key = secret_book.new("sk-in-query")
    if row.key_param:  # a key in the URL's query (Google's `?key=`) is a secret too
        texts.append(marker("sec-query"))
    with ledger.fault(f"{row.name}:credentials"):
        with Harness(mitm, row, api_key=bearer) as h:
            extra = {"cookie": f"session={cookie}", "x-api-key": x_key}
            metadata = {row.metadata_field: {"api_key": body_key}}
            assert h.call(texts[0], True, headers=extra, **metadata).done
            # a body the dialect refuses, holding the key: the record keeps the body, scrubbed
            r = h.client.post(row.url, content=f'{{"messages": "{bearer}'.encode(),
                              headers=row.headers(bearer))  # fmt: skip
            assert r.status_code == 400
        with Harness(mitm, row, api_key=x_key, proxy_user="sec.1", proxy_password=proxy_pw) as h:
            assert h.call(texts[1], False).done
        with Harness(mitm, row, api_key=polar_key) as h:
            assert h.call(texts[2], False).done
        if row.key_param:
            with Harness(mitm, row) as h:
                assert h.call(texts[3], True, params={row.key_param: query_key}).done
        log = httpx.get(fault_server.url + "/_polar/requests", timeout=10).json()
        log = [r for r in log if r["path"] == "/v1/chat/completions"]
        assert len(log) == len(texts)  # the refused body never left the proxy
        upstream = json.dumps(log)
        for secret in (bearer, x_key, cookie, proxy_pw, polar_key, query_key):
            assert secret not in upstream, f"{secret} was sent to the policy server"
        rows = records(mitm)
        ledger.account(rows, texts)
        assert len(rows) == len(texts) + 1
        rec = record_of(rows, texts[0])
        headers = json.loads(rec["headers_json"])
        key_headers = {name for name, value in row.headers("k-1").items() if "k-1" in value}
        sent = {"cookie", "x-api-key"} | key_headers
        assert {name: headers[name] for name in sent} == dict.fromkeys(sent, "[redacted]")
        assert json.loads(rec["request_json"])[row.metadata_field]["api_key"] == "[redacted]"
        assert record_of(rows, texts[1])["rollout_id"] == "sec.1"
        assert record_of(rows, texts[2])["rollout_source"] == "api_key"
        found = grep_bytes(mitm.output, secret_book.values)
        found.update(grep_bytes(mitm.proc.log_path.parent, secret_book.values))
        assert found == {}, found


def test_hosts_outside_polar_hosts_are_never_rewritten(fault_server, make_mitm, tmp_path, ledger):
    """An LLM-shaped request (path, JSON body, a polar- key) to a host that is not in polar_hosts
    goes to that host byte for byte, headers included, and leaves no record."""
    from tests.helpers.tls_echo import start_tls_echo

    echo = start_tls_echo(tmp_path)
    mitm = make_mitm(fault_server.url, ssl_insecure="true")
    body = json.dumps(
        {
            "model": "gpt-4.1-mini",
            "stream": True,
            "messages": [{"role": "user", "content": "not for polar"}],
        }
    ).encode()
    headers = {"authorization": "Bearer polar-elsewhere.1", "x-api-key": "polar-elsewhere.2",
               "content-type": "application/json"}  # fmt: skip
    with ledger.fault("security:other-hosts"):
        try:
            with http_client(mitm) as c:
                for host in ("127.0.0.1", "localhost"):
                    for path in ("/v1/chat/completions", "/v1/responses", "/v1/messages?beta=true"):
                        r = c.post(f"https://{host}:{echo.port}{path}", content=body,
                                   headers=headers)  # fmt: skip
                        assert r.status_code == 200 and r.content == body, (host, path)
        finally:
            echo.stop()
        assert len(echo.seen_paths) == 6
        for seen in echo.seen_headers:
            assert seen["authorization"] == headers["authorization"]
            assert seen["x-api-key"] == headers["x-api-key"]
        assert records(mitm) == []


def test_control_plane_refuses_without_the_token(fault_server, make_mitm, secret_book, ledger):
    """Every near miss of the token is a 401 that changes nothing; the token reaches no file."""
    token = secret_book.new("ctl")
    mitm = make_mitm(fault_server.url, polar_control_token=token)
    misses = [
        {},
        {"authorization": "Bearer"},
        {"authorization": f"Bearer {token[:-1]}"},
        {"authorization": f"Bearer {token}x"},
        {"authorization": f"Bearer {token.upper()}"},
        {"authorization": f"Basic {token}"},
        {"x-polar-control-token": token[1:]},
        {"authorization": ("Bearer \u00e9" + token[1:]).encode()},  # not ASCII
    ]
    with ledger.fault("security:control-token"), http_client(mitm) as client:
        for headers in misses:
            r = client.post(
                "http://polar.control/v1/policy", json={"version": "evil"}, headers=headers
            )
            assert r.status_code == 401, (headers, r.text)
        ok = client.get(
            "http://polar.control/v1/policy", headers={"authorization": f"Bearer {token}"}
        )
        assert ok.status_code == 200 and ok.json()["policy_version"] is None
    assert records(mitm) == []


def test_control_token_is_compared_in_constant_time(monkeypatch):
    """The token check goes through hmac.compare_digest whatever the length of the guess (a
    plain == or an early length check would leak the token's length and prefix by timing)."""
    import hmac

    from polar_mitm import control
    from polar_mitm.trajectory.rollouts import Rollouts

    seen: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        seen.append((a, b))
        return real(a, b)

    monkeypatch.setattr(control.hmac, "compare_digest", spy)
    api = control.ControlAPI(control.ControlState(), Rollouts(lambda rows: None, proxy_id="p"))
    api.token = "the-real-token"
    for guess in ("", "t", "the-real-toke", "the-real-token-and-more", "the-real-token"):
        status, _ = asyncio.run(
            api.handle("GET", "/v1/status", {"authorization": f"Bearer {guess}"}, b"")
        )
        assert status == (200 if guess == "the-real-token" else 401)
    assert seen == [(g.encode(), b"the-real-token") for g in
                    ("", "t", "the-real-toke", "the-real-token-and-more", "the-real-token")]  # fmt: skip
