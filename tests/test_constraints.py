"""Grammar-constrained sampling, without a server (upstream/constraints.py; the real vLLM's
figures are tests/vllm/test_constrained.py): which request forms vLLM samples under a grammar,
from which output token, what `polar_harness_constraints=drop` leaves out, and how the span
reaches traces, the summary and the exports. Its one test on a real mitmdump (a bad option value):
tests/e2e/loopback/test_constraints_e2e.py."""

from __future__ import annotations

import pyarrow as pa
import pytest

from polar_mitm.cli.summary import summarize
from polar_mitm.core.record import CallRecord
from polar_mitm.export.base import ExportOptions, Record
from polar_mitm.export.verl import arrays
from polar_mitm.trajectory.merge import CallFacts, Merger
from polar_mitm.trajectory.rows import TraceMeta, trace_row
from polar_mitm.trajectory.traceview import segments
from polar_mitm.upstream.constraints import (
    DROP,
    PASS,
    ThinkMarkers,
    constrained_from,
    constraint_reasons,
    note_constraints,
    upstream_chat,
)

TOOL = {"type": "function", "function": {"name": "run_shell", "parameters": {}}}
STRICT = {"type": "function", "function": {"name": "run_shell", "parameters": {}, "strict": True}}
THINK, END, TURN, EOS = 151667, 151668, 151644, 151645
MARKERS = ThinkMarkers(THINK, END, TURN)
OPEN_PROMPT = [TURN, 872, 198, 1, 2, EOS, TURN, 77091, 198]  # ...<|im_start|>assistant\n
CLOSED_PROMPT = [*OPEN_PROMPT, THINK, 271, END, 271]  # enable_thinking: false


@pytest.mark.parametrize(
    ("body", "reasons"),
    [
        ({"tools": [TOOL]}, []),
        ({"tools": [TOOL], "parallel_tool_calls": True}, []),
        ({"tools": [TOOL], "parallel_tool_calls": False}, ["parallel_tool_calls=false"]),
        ({"tools": [TOOL], "tool_choice": "required"}, ["tool_choice=required"]),
        (
            {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            ["tool_choice=named"],
        ),
        ({"tools": [STRICT]}, ["strict_tools"]),
        ({"tools": [TOOL], "tool_choice": "none", "parallel_tool_calls": False}, []),
        ({"parallel_tool_calls": False}, []),  # no tools: nothing to constrain
        ({"response_format": {"type": "json_object"}}, ["response_format=json_object"]),
        ({"response_format": {"type": "text"}}, []),
        ({"structured_outputs": {"regex": "a+"}}, ["structured_outputs"]),
        (
            {"tools": [STRICT], "tool_choice": "required", "parallel_tool_calls": False},
            ["parallel_tool_calls=false", "tool_choice=required", "strict_tools"],
        ),
    ],
)
def test_which_requests_are_constrained(body, reasons):
    assert constraint_reasons(body) == reasons


def test_drop_leaves_out_only_parallel_tool_calls_false():
    notes: list[str] = []
    chat = {"tools": [TOOL], "parallel_tool_calls": False, "tool_choice": "required"}
    assert upstream_chat(chat, PASS, notes) is chat and notes == []
    sent = upstream_chat(chat, DROP, notes)
    assert sent == {"tools": [TOOL], "tool_choice": "required"} and "parallel_tool_calls" in chat
    assert len(notes) == 1 and "not sent upstream" in notes[0]
    same = {"tools": [TOOL], "parallel_tool_calls": True}
    assert upstream_chat(same, DROP, notes) is same and len(notes) == 1


@pytest.mark.parametrize(
    ("prompt", "output", "markers", "split", "start"),
    [
        (OPEN_PROMPT, [THINK, 5, 6, END, 271, 7, 8, EOS], MARKERS, True, 4),  # after </think>
        (CLOSED_PROMPT, [7, 8, EOS], MARKERS, True, 0),  # the prompt ended the reasoning
        (CLOSED_PROMPT, [7, 8, EOS], MARKERS, False, 0),
        (OPEN_PROMPT, [THINK, 5, 6, 7, EOS], MARKERS, True, None),  # never ended: never applied
        (OPEN_PROMPT, [THINK, 5, END], MARKERS, True, None),  # nothing after the end
        (OPEN_PROMPT, [THINK, 5, END, 7], None, True, 0),  # no tokenizer: all of it
        (OPEN_PROMPT, [7, 8, EOS], MARKERS, False, 0),  # no reasoning parser: all of it
        # an earlier turn's </think> is before this turn's start: not an ended reasoning
        (
            [*OPEN_PROMPT[:3], THINK, 1, END, 2, EOS, TURN, 77091, 198],
            [THINK, END, 9],
            MARKERS,
            True,
            2,
        ),
        (OPEN_PROMPT, [], MARKERS, True, None),
    ],
)
def test_where_the_grammar_starts(prompt, output, markers, split, start):
    assert constrained_from(prompt, output, markers, split) == start


def test_the_record_and_the_trace_carry_the_span():
    rec = CallRecord(rollout_id="r.0", status="completed")
    rec.prompt_token_ids = OPEN_PROMPT
    rec.output_token_ids = [THINK, 5, END, 271, 7, 8, EOS]
    note_constraints(rec, {"tools": [TOOL], "parallel_tool_calls": False}, MARKERS, True, 1)
    assert rec.constrained_by == ["parallel_tool_calls=false"] and rec.constrained_from == 3
    plain = CallRecord(rollout_id="r.0", status="completed")
    note_constraints(plain, {"tools": [TOOL]}, MARKERS, True, 1)
    assert plain.constrained_by == [] and plain.constrained_from is None

    m = Merger()
    first = CallFacts(call_id="a", constrained_from=rec.constrained_from)
    m.add(OPEN_PROMPT, rec.output_token_ids, [-1.0] * 7, facts=first)
    second_prompt = [*OPEN_PROMPT, *rec.output_token_ids, 40, 41]
    m.add(second_prompt, [7, EOS], [-1.0, -1.0], facts=CallFacts(call_id="b"))
    [chain] = m.chains
    row = trace_row(chain, TraceMeta("r.0"), [])
    start = len(OPEN_PROMPT) + 3
    assert row["constrained_spans"] == [start, len(OPEN_PROMPT) + 7]
    assert all(row["loss_mask"][i] == 1 for i in range(start, len(OPEN_PROMPT) + 7))

    # the verl export's constrained_mask marks those response tokens, nothing else
    trace = {**row, "input_ids": list(row["input_ids"]), "loss_mask": list(row["loss_mask"])}
    trace["logprobs"] = list(row["logprobs"])
    data = arrays([Record(trace, segments(trace), [], 0, 0)], ExportOptions())
    p = len(OPEN_PROMPT)
    assert data["constrained_mask"][0].tolist()[: len(trace["input_ids"]) - p] == [
        1 if start <= i < p + 7 else 0 for i in range(p, len(trace["input_ids"]))
    ]
    meta = Record(trace, segments(trace), [], 0, 0).metadata()
    assert meta["constrained_spans"] == [start, p + 7]


def test_the_summary_counts_grammar_tokens():
    calls = pa.table(
        {
            "call_id": ["a", "b"],
            "rollout_id": ["r.0", "r.0"],
            "group_id": ["r", "r"],
            "sample_index": [0, 0],
            "started_at": pa.array([1, 2], pa.timestamp("us", tz="UTC")),
            "status": ["completed", "completed"],
            "prompt_token_ids": [[1, 2], [1, 2, 3]],
            "output_token_ids": [[4, 5, 6, 7], [8]],
            "constrained_from": pa.array([1, None], pa.int32()),
        }
    )
    s = summarize(calls, None)
    assert s.rollouts[0].constrained_tokens == 3 and s.totals["constrained_tokens"] == 3
