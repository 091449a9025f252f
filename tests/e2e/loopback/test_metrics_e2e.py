"""Prometheus ``/metrics`` on the control port of a real proxy during a real session (reference
policy server with the Qwen3 tokenizer, mitmdump with the addon, the openai SDK through
HTTPS_PROXY), parsed with prometheus_client's own parser and checked against the calls table the
proxy wrote; and `polar-mitm top` on that proxy in a real terminal (tmux)."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from polar_mitm.assets import qwen3_tokenizer_dir
from polar_mitm.cli.fidelity_report import harness_of
from polar_mitm.control import ControlAPI, ControlServer, ControlState
from polar_mitm.core.record_facts import checked_with_tokenizer
from polar_mitm.store import read_table
from tests.helpers import TESTS
from tests.helpers.clients import http_client, openai_client, run_tool_conversation
from tests.helpers.procs import BIN, free_port, start_mitm, start_policy_server

SCENARIO = TESTS / "scenarios" / "three_turns.json"
TOKEN = "metrics-ctl-token-5e1f"
POLAR = str(BIN / "polar-mitm")


def get(url: str, token: str | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def scrape(url: str) -> dict[str, dict[tuple, float]]:
    """sample name -> {sorted label items: value}, by prometheus_client's parser."""
    status, text = get(f"{url}/metrics", TOKEN)
    assert status == 200, text
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def total(m: dict, name: str) -> float:
    return sum(m.get(name, {}).values())


def by(m: dict, name: str, *keys: str) -> Counter:
    out: Counter = Counter()
    for labels, v in m.get(name, {}).items():
        d = dict(labels)
        out[tuple(d[k] for k in keys)] += v
    return out


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], capture_output=True, text=True, check=True).stdout


def test_metrics_match_the_calls_table_and_top_shows_them(tmp_path: Path, confdir: Path):
    if shutil.which("tmux") is None:
        pytest.fail("tmux is not installed (scripts/test.sh installs it)")
    server = start_policy_server(tmp_path, SCENARIO)
    control_port = free_port()
    mitm = start_mitm(
        tmp_path,
        confdir,
        server.url,
        polar_control_token=TOKEN,
        polar_control_listen=str(control_port),
        polar_tokenizer=str(qwen3_tokenizer_dir()),
        polar_flush_seconds="0.5",
    )
    url = f"http://127.0.0.1:{control_port}"
    try:
        run_tool_conversation(openai_client(mitm, api_key="polar-met.0"), stream=True)
        run_tool_conversation(openai_client(mitm, api_key="polar-met.1"), stream=False)
        with http_client(mitm) as client:  # a request the dialect refuses: an error call
            bad = client.post(
                "https://api.openai.com/v1/chat/completions",
                json={"model": "gpt-4.1"},
                headers={"authorization": "Bearer polar-bad.0"},
            )
        assert bad.status_code == 400

        # the counters land when each record is final (after its fidelity check)
        deadline = time.monotonic() + 60
        m = scrape(url)
        while time.monotonic() < deadline and (
            total(m, "polar_calls_total") < 7
            or total(m, "polar_journal_lag_records") > 0
            or total(m, "polar_shard_flushes_total") < 1  # counted just after the lag falls
        ):
            time.sleep(0.2)
            m = scrape(url)
        assert total(m, "polar_calls_total") == 7, m
        assert total(m, "polar_rollouts_open") == 3  # met.0, met.1, bad.0: none ended yet
        assert total(m, "polar_calls_in_flight") == 0 and total(m, "polar_calls_waiting") == 0
        assert total(m, "polar_journal_lag_records") == 0
        assert total(m, "polar_shard_flushes_total") >= 1
        assert total(m, "polar_upstream_errors_total") == 0

        # the token: wrong or missing is refused, like the rest of the control plane
        assert get(f"{url}/metrics", "wrong")[0] == 401
        assert get(f"{url}/metrics")[0] == 401
        assert get(f"{url}/metrics", TOKEN)[0] == 200

        screen = top_screen(tmp_path, url)
        for line in screen.splitlines():
            if "openai_chat" in line and "completed" in line:
                assert line.split()[-1] == "6", screen
                break
        else:
            raise AssertionError(screen)
        assert "openai-python" in screen and url in screen
    finally:
        assert mitm.stop() == 0, mitm.proc.output()
        server.stop()

    calls = read_table(str(mitm.output), "calls").to_pylist()
    assert len(calls) == 7
    want = Counter(
        (c["dialect"], harness_of(c["headers_json"]), c["status"], c["route"]) for c in calls
    )
    assert by(m, "polar_calls_total", "dialect", "harness", "status", "route") == want
    sampled, prompted = Counter(), Counter()
    for c in calls:
        sampled[(c["dialect"],)] += len(c["output_token_ids"] or [])
        prompted[(c["dialect"],)] += len(c["prompt_token_ids"] or [])
    assert +by(m, "polar_tokens_sampled_total", "dialect") == +sampled
    assert +by(m, "polar_tokens_prompted_total", "dialect") == +prompted
    assert total(m, "polar_time_to_first_byte_seconds_count") == sum(
        c["first_byte_at"] is not None for c in calls
    )
    reached = [c for c in calls if c["status"] == "completed"]
    assert total(m, "polar_added_latency_seconds_count") == len(reached) == 6
    assert total(m, "polar_durable_hold_seconds_count") == len(reached), m  # each completed reply
    checked = [c for c in calls if checked_with_tokenizer(c["fidelity_json"])]
    assert total(m, "polar_fidelity_checked_calls_total") == len(checked) == 6
    flags = Counter((f,) for c in calls for f in c["fidelity_flags"])
    assert +by(m, "polar_fidelity_flags_total", "flag") == +flags


def top_screen(tmp_path: Path, url: str) -> str:
    """`polar-mitm top` in a real terminal: the screen once it shows the session's calls."""
    name = f"polar-top-{os.getpid()}"
    socket = str(tmp_path / "tmux.sock")
    cmd = f"env COLUMNS= LINES= POLAR_CONTROL_TOKEN={TOKEN} {POLAR} top --control {url} --interval 0.5"
    tmux("-S", socket, "new-session", "-d", "-s", name, "-x", "200", "-y", "40", cmd)
    try:
        deadline = time.monotonic() + 60
        screen = ""
        while time.monotonic() < deadline:
            screen = tmux("-S", socket, "capture-pane", "-p", "-t", name)
            if "openai_chat" in screen and "calls/s" in screen:
                time.sleep(1.2)  # a second frame: rates from two scrapes
                return tmux("-S", socket, "capture-pane", "-p", "-t", name)
            time.sleep(0.2)
        raise AssertionError(f"top never showed the calls:\n{screen}")
    finally:
        subprocess.run(["tmux", "-S", socket, "kill-server"], capture_output=True)


class _Exposition:
    """Stands in for MetricsAddon in the server-only checks below."""

    def __init__(self, public: bool) -> None:
        self.public = public
        self.metrics = self

    def exposition(self) -> bytes:
        return b"# HELP polar_up up\n# TYPE polar_up gauge\npolar_up 1.0\n"


@pytest.mark.parametrize(
    ("token", "public", "sent", "status"),
    [
        ("", False, None, 403),  # no control token configured: the control plane is off
        ("t0k", False, None, 401),
        ("t0k", False, "t0k", 200),
        ("", True, None, 200),  # polar_metrics_public: figures without a token
    ],
)
def test_metrics_endpoint_authorization(token, public, sent, status):
    async def main() -> tuple[int, int]:
        api = ControlAPI(ControlState(), rollouts=None)  # type: ignore[arg-type]
        api.token = token
        server = ControlServer(api, _Exposition(public))
        base = await server.start("127.0.0.1", 0)
        try:
            got = await asyncio.to_thread(get, f"{base}/metrics", sent)
            control = await asyncio.to_thread(get, f"{base}/v1/status", sent) if public else (0,)
        finally:
            await server.stop()
        return got[0], control[0]

    got, control = asyncio.run(main())
    assert got == status
    if public:
        assert control == 403  # public metrics open nothing else
