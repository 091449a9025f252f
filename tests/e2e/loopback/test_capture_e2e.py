"""The capture path end to end: openai SDK -> HTTPS_PROXY -> real mitmdump + addon -> policy server.

Everything here is a real process on loopback: the reference policy server (vLLM wire format,
real Qwen3 tokenizer and chat template) and mitmdump with addons/polar.py.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from transformers import AutoTokenizer

from polar_mitm.assets import qwen3_tokenizer_dir
from polar_mitm.store import read_table
from tests.helpers import ROOT, TESTS
from tests.helpers.clients import (
    RUN_SHELL,
    grep_bytes,
    http_client,
    openai_client,
    run_tool_conversation,
)
from tests.helpers.procs import MITMDUMP, Proc, free_port
from tests.helpers.upstreams import direct_ids, expected_prompt_ids
from tests.helpers.waits import wait_until

SCENARIO = TESTS / "scenarios" / "three_turns.json"


@pytest.fixture(scope="module")
def qwen3():
    return AutoTokenizer.from_pretrained(str(qwen3_tokenizer_dir()))


def calls_of(mitm) -> list[dict]:
    assert mitm.stop() == 0, mitm.proc.output()
    rows = read_table(str(mitm.output), "calls").to_pylist()
    return sorted(rows, key=lambda r: r["started_at"])


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_three_turn_tool_conversation(make_policy_server, make_mitm, qwen3, stream, upstream_kind):
    server = make_policy_server(SCENARIO, kind=upstream_kind)
    mitm = make_mitm(server.url, polar_upstream_kind=upstream_kind)
    client = openai_client(mitm, api_key="polar-conv.1")
    sent, replies = run_tool_conversation(client, stream=stream)

    assert [r["finish_reason"] for r in replies] == ["tool_calls", "tool_calls", "stop"]
    assert json.loads(replies[0]["tool_calls"][0]["function"]["arguments"]) == {
        "cmd": "cat notes.txt"
    }
    assert replies[0]["tool_calls"][0]["function"]["name"] == "run_shell"
    # vLLM keeps the "\n\n" the template puts after </think> in the content
    assert replies[2]["content"] == "\n\nnotes.txt has 3 lines: alpha, beta and gamma."
    assert replies[0]["reasoning"].strip() == "I should look at the file first."

    calls = calls_of(mitm)
    assert len(calls) == 3
    for messages, row in zip(sent, calls, strict=True):
        assert (
            row["rollout_id"] == "conv.1" and row["group_id"] == "conv" and row["sample_index"] == 1
        )
        assert row["status"] == "completed" and row["stream"] is stream
        assert row["model_requested"] == "gpt-4.1-mini" and row["model_served"] == "Qwen/Qwen3-4B"
        expected_prompt = expected_prompt_ids(qwen3, upstream_kind, messages, [RUN_SHELL])
        assert row["prompt_token_ids"] == expected_prompt
        truth = direct_ids(server.url, upstream_kind, messages, [RUN_SHELL])
        assert row["prompt_token_ids"] == truth.prompt_ids
        assert row["output_token_ids"] == truth.output_ids
        assert row["output_logprobs"] == pytest.approx(truth.logprobs, abs=1e-6)
        assert len(row["output_logprobs"]) == len(row["output_token_ids"]) > 0
        assert row["output_token_ids"][-1] == qwen3.convert_tokens_to_ids("<|im_end|>")
        assert row["count_check"] == "ok" and row["ids_source"] == "upstream"
        assert row["trainable"] is True
        assert row["usage_completion_tokens"] == len(row["output_token_ids"])
        assert (
            row["first_byte_at"] >= row["started_at"] and row["finished_at"] >= row["first_byte_at"]
        )
    assert grep_bytes(mitm.output, ["polar-conv.1"]) == {}


def test_streaming_is_live(make_policy_server, make_mitm, upstream_kind):
    """vLLM: the server holds its last chunk until the client has read the first one: a proxy
    that buffered the reply would deadlock here (until the server's 30 s hold timeout).

    SGLang cannot stream with token flags, so the proxy asks for the whole reply and the server
    holds all of it. Then the client must have nothing while the server still holds the reply
    (the proxy invents no content), the release must find the reply still held, and the harness's
    synthesized stream must follow it. That the bytes are not kept behind the record's work
    (retokenizing, sinks) is shown without timing in test_exchange.py."""
    server = make_policy_server(SCENARIO, kind=upstream_kind)
    mitm = make_mitm(server.url, polar_upstream_kind=upstream_kind)
    first_chunk = threading.Event()
    result: dict = {}

    def read_stream() -> None:
        body = {
            "model": "m",
            "stream": True,
            "messages": [{"role": "user", "content": "HOLD please"}],
        }
        with (
            http_client(mitm) as client,
            client.stream(
                "POST",
                "https://api.openai.com/v1/chat/completions",
                json=body,
                headers={"authorization": "Bearer polar-live.0"},
            ) as r,
        ):
            text = []
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    first_chunk.set()
                    delta = json.loads(line[6:])["choices"][0]["delta"]
                    text.append(delta.get("content") or "")
            result["text"] = "".join(text)
            result["done_at"] = time.monotonic()

    reader = threading.Thread(target=read_stream)
    reader.start()
    if upstream_kind == "sglang":
        wait_for_upstream_request(server.url)
        assert not first_chunk.is_set(), "the client got content before the upstream replied"
        released_at = time.monotonic()
        r = httpx.post(server.url + "/_polar/release?wait=20", timeout=30)
        assert r.json()["released"] == 1, "the server was not holding the reply"
        assert first_chunk.wait(20), "the synthesized stream did not follow the upstream reply"
    else:
        assert first_chunk.wait(20), (
            "the first chunk did not reach the client before the last was sent"
        )
        released_at = time.monotonic()
        httpx.post(server.url + "/_polar/release", timeout=10).raise_for_status()
    reader.join(30)
    assert result["text"].strip() == "one two three four five six seven eight nine ten"
    assert result["done_at"] >= released_at
    [row] = calls_of(mitm)
    assert row["status"] == "completed" and row["stream"] is True
    assert row["ids_source"] == "upstream" and row["trainable"] is True


def wait_for_upstream_request(server_url: str) -> dict:
    """Block until the policy server has received a chat request (a handshake, not a sleep)."""

    def chats() -> list[dict]:
        log = httpx.get(server_url + "/_polar/requests", timeout=10).json()
        return [e for e in log if e["path"] == "/v1/chat/completions"]

    return wait_until(chats, "the proxy to send the chat request upstream")[-1]


def test_rollout_identity_sources(make_policy_server, make_mitm):
    server = make_policy_server(SCENARIO)
    mitm = make_mitm(server.url)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    url = "https://api.openai.com/v1/chat/completions"
    with http_client(
        mitm, user="django-11099.3", password="s3cret-proxy-pw"
    ) as c:  # rule 1 beats rule 2
        c.post(url, json=body, headers={"authorization": "Bearer polar-other.1"}).raise_for_status()
    with http_client(mitm) as c:
        c.post(url, json=body, headers={"authorization": "Bearer polar-keyed.7"}).raise_for_status()
        c.post(url, json=body, headers={"x-api-key": "polar-anthro"}).raise_for_status()
        c.post(
            url,
            json=body,
            headers={"authorization": "Bearer sk-real-looking-key-123", "x-polar-rollout": "hdr.2"},
        ).raise_for_status()
        c.post(
            url,
            json=body,
            headers={"authorization": "Bearer sk-real-looking-key-123", "session-id": "sess-42"},
        ).raise_for_status()
    rows = calls_of(mitm)
    got = [(r["rollout_id"], r["rollout_source"], r["group_id"], r["sample_index"]) for r in rows]
    assert got == [
        ("django-11099.3", "proxy_auth", "django-11099", 3),
        ("keyed.7", "api_key", "keyed", 7),
        ("anthro", "api_key", None, None),
        ("hdr.2", "header", "hdr", 2),
        ("127.0.0.1-sess-42", "session", None, None),
    ]
    assert rows[-1]["session_id"] == "sess-42"
    assert (
        grep_bytes(
            mitm.output,
            [
                "s3cret-proxy-pw",
                "sk-real-looking-key-123",
                "polar-other.1",
                "polar-keyed.7",
                "polar-anthro",
            ],
        )
        == {}
    )


def test_other_traffic_passes_byte_for_byte(make_policy_server, make_mitm, tmp_path):
    from tests.helpers.tls_echo import start_tls_echo

    server = make_policy_server(SCENARIO)
    echo = start_tls_echo(tmp_path)
    mitm = make_mitm(server.url, ssl_insecure="true")
    payload = bytes(range(256)) * 400
    try:
        with http_client(mitm) as c:
            # An LLM-looking path on a host outside polar_hosts is never rewritten.
            r = c.post(
                f"https://127.0.0.1:{echo.port}/v1/chat/completions",
                content=payload,
                headers={"content-type": "application/octet-stream"},
            )
            assert r.status_code == 200 and r.content == payload
            r = c.get(f"https://127.0.0.1:{echo.port}/blob?size=100000")
            assert r.content == echo.blob(100000)
            # Another path on a captured host is answered locally (polar_other_paths=answer).
            r = c.get("https://api.openai.com/v1/files")
            assert r.status_code == 404 and "polar-mitm" in r.json()["error"]["message"]
    finally:
        echo.stop()
    assert echo.seen_paths == ["/v1/chat/completions", "/blob?size=100000"]
    assert calls_of(mitm) == []


def test_the_proxy_warms_up_before_it_says_it_is_capturing(make_policy_server, make_mitm):
    """The warm-up (addons/warmup.py) runs its request through the proxy before the line scripts
    wait for, and leaves no record; only the proxy's own request is routed to the gateway."""
    server = make_policy_server(SCENARIO)
    mitm = make_mitm(server.url, polar_tokenizer=str(qwen3_tokenizer_dir()))
    log = mitm.proc.output()
    assert "polar-mitm: warmed up in" in log and "(the gateway answered 404)" in log, log
    assert log.index("polar-mitm: warmed up in") < log.index("polar-mitm: capturing"), log
    with http_client(mitm) as c:
        # without the proxy's nonce a request to the warm-up host is not routed anywhere local
        assert c.get("https://polar.warmup/").status_code == 502
    run_tool_conversation(openai_client(mitm, api_key="polar-warm.0"), stream=True, turns=1)
    assert mitm.stop() == 0
    assert [c["rollout_id"] for c in calls_of(mitm)] == ["warm.0"]
    cold = make_mitm(server.url, polar_warmup="false")
    assert "warmed up" not in cold.proc.output()


def test_bad_input_and_unreachable_upstream(make_policy_server, make_mitm):
    server = make_policy_server(SCENARIO)
    mitm = make_mitm(server.url)
    url = "https://api.openai.com/v1/chat/completions"
    with http_client(mitm) as c:
        r = c.post(
            url,
            content=b'{"model": "m", "messages": [',
            headers={"authorization": "Bearer polar-bad.0"},
        )
        assert r.status_code == 400
        err = r.json()["error"]
        assert "not valid JSON" in err["message"] and err["type"] == "invalid_request_error"
        r = c.post(
            url,
            json={"model": "m", "messages": "hi"},
            headers={"authorization": "Bearer polar-bad.0"},
        )
        assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
        r = c.post(
            url,
            json={"model": "m", "messages": [{"role": "user", "content": "ok?"}]},
            headers={"authorization": "Bearer polar-bad.0"},
        )
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    rows = calls_of(mitm)
    assert [r["status"] for r in rows] == ["error", "error", "completed"]
    assert rows[0]["http_status"] == 400 and "not valid JSON" in rows[0]["error"]
    assert rows[0]["trainable"] is False

    dead = f"http://127.0.0.1:{free_port()}"
    mitm2 = make_mitm(dead)
    with http_client(mitm2) as c:
        for stream in (False, True):
            r = c.post(
                url,
                json={
                    "model": "m",
                    "stream": stream,
                    "messages": [{"role": "user", "content": "x"}],
                },
            )
            assert r.status_code == 502
            assert dead in r.json()["error"]["message"]
        r = c.get(f"{mitm2.url}/")  # the proxy itself still answers
    rows = calls_of(mitm2)
    assert [r["status"] for r in rows] == ["error", "error"]
    assert all(dead in r["error"] for r in rows)


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({}, "polar_upstream: required"),
        ({"polar_upstream": "not a url"}, "polar_upstream:"),
        (
            {"polar_upstream": "http://127.0.0.1:9", "polar_upstream_kind": "tgi"},
            "polar_upstream_kind: unknown kind 'tgi'",
        ),
        (
            {"polar_upstream": "http://127.0.0.1:9", "polar_tokenizer": "/nonexistent/tok"},
            "polar_tokenizer:",
        ),
        (
            {"polar_upstream": "http://127.0.0.1:9", "polar_upstream_stream": "chunked"},
            "polar_upstream_stream: 'chunked' is not 'relay' or 'buffer'",
        ),
        (
            {"polar_upstream": "http://127.0.0.1:9", "polar_stream_interval": "0"},
            "polar_stream_interval: 0 is not a whole number of tokens >= 1",
        ),
    ],
    ids=["missing", "invalid", "kind", "tokenizer", "stream", "interval"],
)
def test_startup_option_errors(tmp_path, confdir, options, needle):
    args = [
        MITMDUMP,
        "-s",
        str(ROOT / "addons" / "polar.py"),
        "--listen-host",
        "127.0.0.1",
        "--listen-port",
        str(free_port()),
        "--set",
        f"confdir={confdir}",
        "--set",
        f"polar_output={tmp_path / 'out'}",
    ]
    for key, value in options.items():
        args += ["--set", f"{key}={value}"]
    proc = Proc(args, tmp_path / "mitm.log")
    proc.popen.wait(60)
    out = proc.output()
    assert proc.popen.returncode != 0
    assert needle in out, out
    assert "Traceback" not in out, out


def test_env_command(confdir):
    from click.testing import CliRunner

    from polar_mitm.cli.app import main

    result = CliRunner().invoke(
        main,
        [
            "env",
            "--proxy",
            "http://10.0.0.5:8080",
            "--rollout",
            "task.3",
            "--confdir",
            str(confdir),
        ],
    )
    assert result.exit_code == 0, result.output
    lines = dict(line.removeprefix("export ").split("=", 1) for line in result.output.splitlines())
    assert lines["HTTPS_PROXY"] == "http://task.3:polar@10.0.0.5:8080"
    assert lines["HTTP_PROXY"] == lines["HTTPS_PROXY"]
    for name in (
        "NODE_EXTRA_CA_CERTS",
        "SSL_CERT_FILE",
        "REQUESTS_CA_BUNDLE",
        "CODEX_CA_CERTIFICATE",
    ):
        assert lines[name] == str(confdir / "mitmproxy-ca-cert.pem")
    assert "127.0.0.1" in lines["NO_PROXY"]
    bad = CliRunner().invoke(main, ["env", "--proxy", "nohost", "--confdir", str(confdir)])
    assert bad.exit_code != 0 and "error:" in bad.output


def test_call_in_flight_at_shutdown_leaves_a_record(make_policy_server, make_mitm):
    """SIGINT while a stream is mid-way: the call is still recorded (not completed), and the
    shards written at shutdown hold it."""
    server = make_policy_server(SCENARIO, "--token-rate", "5")
    mitm = make_mitm(server.url)
    got_chunk = threading.Event()

    def stream() -> None:
        body = {
            "model": "m",
            "stream": True,
            "messages": [{"role": "user", "content": "slow please"}],
        }
        try:
            with (
                http_client(mitm) as c,
                c.stream(
                    "POST",
                    "https://api.openai.com/v1/chat/completions",
                    json=body,
                    headers={"x-api-key": "polar-shut.0"},
                ) as r,
            ):
                for line in r.iter_lines():
                    if line.startswith("data: {") and json.loads(line[6:])["choices"][0][
                        "delta"
                    ].get("content"):
                        got_chunk.set()
        except httpx.HTTPError:
            pass

    t = threading.Thread(target=stream)
    t.start()
    assert got_chunk.wait(30)
    [row] = calls_of(mitm)
    t.join(10)
    assert row["rollout_id"] == "shut.0"
    assert row["status"] in ("incomplete", "client_aborted")
    assert 0 < len(row["output_token_ids"]) < 40
