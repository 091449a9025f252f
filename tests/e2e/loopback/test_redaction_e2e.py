"""Secrets never reach disk: every credential a harness sends, grepped in the whole output.

The calls go through a real mitmdump; the proxy is killed with the rows still only in the journal
(so the journal's own bytes are searched), then restarted so recovery writes the shards, whose
decoded values are searched too — and so is everything the proxy printed.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from polar_mitm.store import read_table
from tests.e2e.loopback.test_capture_e2e import SCENARIO
from tests.helpers.clients import grep_bytes, http_client

SECRETS = {
    "authorization": "sk-live-AUTHsecret0123456789",
    "x-api-key": "sk-ant-XAPIsecret0123456789",
    "api-key": "azure-APIKEYsecret0123456789",
    "cookie": "COOKIEsecret0123456789",
    "proxy_password": "PROXYPWsecret0123456789",
    "control": "CONTROLsecret0123456789",
    "body_api_key": "BODYKEYsecret0123456789",
    "body_password": "BODYPWsecret0123456789",
}


def test_no_secret_reaches_the_journal_the_shards_or_the_log(
    tmp_path: Path, make_mitm, make_policy_server
) -> None:
    server = make_policy_server(SCENARIO)
    output = tmp_path / "data"
    options = {"polar_output": output, "polar_flush_rows": 10_000, "polar_flush_seconds": 3600}
    mitm = make_mitm(server.url, **options)
    mitm.proc.wait_for("polar-mitm: writing to")
    headers = {
        "authorization": f"Bearer {SECRETS['authorization']}",
        "x-api-key": SECRETS["x-api-key"],
        "api-key": SECRETS["api-key"],
        "cookie": f"session={SECRETS['cookie']}; theme=dark",
        "x-polar-control-token": SECRETS["control"],
    }
    body = {
        "model": "gpt-4.1-mini",
        "messages": [{"role": "user", "content": "say something harmless"}],
        "metadata": {"api_key": SECRETS["body_api_key"], "note": "kept"},
        "user": {"password": SECRETS["body_password"]},
    }
    with http_client(mitm, user="redact.0", password=SECRETS["proxy_password"]) as client:
        for stream in (False, True):
            r = client.post(
                "https://api.openai.com/v1/chat/completions",
                json={**body, "stream": stream},
                headers=headers,
            )
            assert r.status_code == 200, r.text
    os.kill(mitm.proc.popen.pid, signal.SIGKILL)  # rows only in the journal now
    mitm.proc.stop()
    journal = output / "_journal"
    assert list(journal.glob("seg-*.log"))
    assert grep_bytes(journal, ["redact.0", "say something harmless"]) != {}  # not vacuous
    assert grep_bytes(journal, list(SECRETS.values())) == {}

    again = make_mitm(server.url, **options)
    again.proc.wait_for("polar-mitm: writing to")
    assert again.stop() == 0
    rows = read_table(output, "calls").to_pylist()
    assert len(rows) == 2 and {r["rollout_id"] for r in rows} == {"redact.0"}
    assert {r["rollout_source"] for r in rows} == {"proxy_auth"}
    for row in rows:
        stored_headers = json.loads(row["headers_json"])
        for name in ("authorization", "x-api-key", "api-key", "cookie", "x-polar-control-token"):
            assert stored_headers[name] == "[redacted]"
        request = json.loads(row["request_json"])
        assert request["metadata"] == {"api_key": "[redacted]", "note": "kept"}
        assert request["messages"][0]["content"] == "say something harmless"
    found = grep_bytes(output, list(SECRETS.values()))
    assert found == {}, found
    for proc in (mitm.proc, again.proc):
        log = proc.output()
        assert not [s for s in SECRETS.values() if s in log], log
