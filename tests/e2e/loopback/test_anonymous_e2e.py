"""No silent anonymous rollouts, end to end: the openai SDK through HTTPS_PROXY into the real
mitmdump + addon, to the reference policy server.

A harness that sends no polar- key, no proxy credentials, no x-polar-rollout header and no session
header is named by its client address alone: every session from that address would be one
rollout. Each call records that (`rollout_source: client_address`), the proxy log says so once per
address with the fix, the traces are untrainable (`anonymous`) unless
`polar_train_allow=anonymous`, and `polar-mitm summary` shows it.
"""

from __future__ import annotations

import json

import pytest

from polar_mitm.store import read_table
from tests.e2e.loopback.test_fidelity_e2e import cli
from tests.helpers import TESTS
from tests.helpers.clients import openai_client, run_tool_conversation

SCENARIO = TESTS / "scenarios" / "three_turns.json"
WARNING = "carry no rollout id"


@pytest.mark.parametrize("allow", ["", "anonymous"], ids=["default", "allowed"])
def test_an_anonymous_rollout_is_recorded_warned_once_and_untrainable(
    make_policy_server, make_mitm, allow
):
    server = make_policy_server(SCENARIO)
    mitm = make_mitm(server.url, polar_train_allow=allow)
    # Two anonymous sessions from one address (a key that is not polar-..., no session header)
    # and one named rollout beside them.
    for _ in range(2):
        with openai_client(mitm, api_key="sk-not-a-polar-key") as client:
            run_tool_conversation(client, stream=True, turns=1)
    with openai_client(mitm, api_key="polar-named.0") as client:
        run_tool_conversation(client, stream=True, turns=1)
    assert mitm.stop() == 0, mitm.proc.output()

    log = mitm.proc.output()
    assert log.count(WARNING) == 1, log  # once per client address, not once per call
    warning = next(line for line in log.splitlines() if WARNING in line)
    assert "127.0.0.1" in warning and "polar-mitm env --rollout" in warning

    calls = read_table(str(mitm.output), "calls").to_pylist()
    named = {(c["rollout_id"], c["rollout_source"]) for c in calls}
    assert named == {("127.0.0.1", "client_address"), ("named.0", "api_key")}
    traces = read_table(str(mitm.output), "traces").to_pylist()
    by_rollout = {t["rollout_id"]: t for t in traces}
    assert set(by_rollout) == {"127.0.0.1", "named.0"}
    assert by_rollout["named.0"]["trainable"] is True
    anonymous = by_rollout["127.0.0.1"]
    if allow:
        assert anonymous["trainable"] is True, anonymous["untrainable_reason"]
    else:
        assert anonymous["trainable"] is False
        assert anonymous["untrainable_reason"].startswith("anonymous: call ")

    # The summary says which rollout is anonymous, and why it is not trainable.
    shown = cli("summary", str(mitm.output))
    assert shown.returncode == 0, shown.stderr
    assert "1 anonymous rollout(s) (127.0.0.1)" in shown.stdout, shown.stdout
    row = next(line for line in shown.stdout.splitlines() if "127.0.0.1" in line)
    assert ("no: anonymous" in row) is not bool(allow), row
    as_json = json.loads(cli("summary", str(mitm.output), "--json").stdout)
    assert as_json["totals"]["anonymous_rollouts"] == 1
    flags = {r["rollout_id"]: r["anonymous"] for r in as_json["rollouts"]}
    assert flags == {"127.0.0.1": True, "named.0": False}
