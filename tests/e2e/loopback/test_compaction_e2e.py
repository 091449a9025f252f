"""`POST /v1/responses/compact` through real mitmdump, with the OpenAI SDK's `responses.compact`
(the client of the older compaction protocol; Codex 0.169 uses `compaction_trigger`, which
tests/e2e/test_long_sessions.py runs with the real binary), to the reference policy server.

A turn with a tool call, the compaction, then a turn from the compacted history: the SDK
validates the `response.compaction` object, the policy reads the summary it wrote, every call
has exactly the server's ids, and the traces carry the compaction lineage.
"""

from __future__ import annotations

import httpx
import pytest

from polar_mitm.control import ControlClient
from polar_mitm.dialects import compaction
from polar_mitm.store import read_table
from tests.e2e.test_harnesses import ask
from tests.helpers import TESTS
from tests.helpers.clients import RUN_SHELL, TOOL_OUTPUTS, openai_client

SCENARIO = TESTS / "scenarios" / "compaction.json"
QUESTION = "How many lines does notes.txt have?"
TOKEN = "compaction-control"
TOOL = {
    "type": "function",
    "name": "run_shell",
    "description": RUN_SHELL["function"]["description"],
    "parameters": RUN_SHELL["function"]["parameters"],
}


def test_the_compact_endpoint_gives_a_policy_summary_and_the_compaction_lineage(
    make_policy_server, make_mitm
):
    server = make_policy_server(SCENARIO)
    mitm = make_mitm(server.url, polar_control_token=TOKEN)
    client = openai_client(mitm, api_key="polar-compact.0")
    common = dict(model="gpt-5", instructions="You are terse.", tools=[TOOL])
    items: list[dict] = [{"role": "user", "content": QUESTION}]
    first = client.responses.create(**common, input=items, store=False)
    call = next(i for i in first.output if i.type == "function_call")
    items += [i.model_dump(exclude_none=True) for i in first.output]
    items.append(
        {
            "type": "function_call_output",
            "call_id": call.call_id,
            "output": TOOL_OUTPUTS["cat notes.txt"],
        }
    )

    compacted = client.responses.compact(
        model="gpt-5", instructions=common["instructions"], input=items
    )
    assert compacted.object == "response.compaction"
    kept = [i.model_dump(exclude_none=True) for i in compacted.output]
    assert [i["type"] for i in kept] == ["message", "compaction"]
    assert kept[0]["role"] == "user" and kept[1]["encrypted_content"].startswith("polar1:")
    assert compacted.usage.output_tokens > 0

    last = client.responses.create(**common, input=kept, store=False)
    assert last.output_text.strip() == "notes.txt has 3 lines."
    ControlClient(TOKEN, proxy=mitm.url).end("compact.0", reward=1.0)
    assert mitm.stop() == 0, mitm.proc.output()

    rows = sorted(read_table(str(mitm.output), "calls").to_pylist(), key=lambda r: r["started_at"])
    assert [(r["path"], r["purpose"], r["status"]) for r in rows] == [
        ("/v1/responses", "main", "completed"),
        ("/v1/responses/compact", "compaction", "completed"),
        ("/v1/responses", "main", "completed"),
    ]
    upstream = [
        u
        for u in httpx.get(server.url + "/_polar/requests", timeout=10).json()
        if u["path"] == "/v1/chat/completions"
    ]
    for row, sent in zip(rows, upstream, strict=True):
        want = ask(server.url, sent["body"]).json()
        assert row["prompt_token_ids"] == want["prompt_token_ids"]
        assert row["output_token_ids"] == want["choices"][0]["token_ids"]
    # what the policy was asked and shown: the instruction last, then the summary it wrote
    assert upstream[1]["body"]["messages"][-1] == {
        "role": "user",
        "content": compaction.INSTRUCTION,
    }
    shown = [m["content"] for m in upstream[2]["body"]["messages"] if m["role"] == "user"]
    assert shown[-1].startswith(compaction.SUMMARY_PREFIX + "[progress 1]")

    traces = read_table(str(mitm.output), "traces").to_pylist()
    chain = {c: t for t in traces for c in t["call_ids"]}
    before, summary, after = (chain[r["call_id"]] for r in rows)
    assert (summary["role"], summary["purpose"]) == ("side", "compaction")
    assert summary["parent_trace_id"] == before["trace_id"]
    assert (after["role"], after["break_reason"]) == ("main", "compaction")
    assert after["parent_trace_id"] == before["trace_id"]
    assert sum(t["num_policy_tokens"] for t in traces) == sum(
        len(r["output_token_ids"]) for r in rows
    )


@pytest.mark.parametrize("content", ["gAAAAABciphertext", None])
def test_a_compaction_item_polar_mitm_did_not_write_is_a_clear_400(
    make_policy_server, make_mitm, content
):
    server = make_policy_server(SCENARIO)
    mitm = make_mitm(server.url)
    client = openai_client(mitm, api_key="polar-foreign.0")
    item = {"type": "compaction", "id": "cmp_x", "encrypted_content": content or ""}
    with pytest.raises(Exception) as e:  # openai.BadRequestError
        client.responses.create(
            model="gpt-5", input=[{"role": "user", "content": "hi"}, item], store=False
        )
    assert getattr(e.value, "status_code", None) == 400 and "did not write" in str(e.value)
    rows = read_table(str(mitm.output), "calls").to_pylist() if mitm.stop() == 0 else []
    assert [r["status"] for r in rows] == ["error"] and "did not write" in rows[0]["error"]
