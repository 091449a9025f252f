"""The CLI's pure parts on hand-made rows: token pieces, trace segments, summaries, export
layouts, reward files. (tests/e2e/loopback/test_cli_e2e.py runs the commands on a real session.)"""

from __future__ import annotations

import datetime as dt
import json
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from polar_mitm.assets import qwen3_tokenizer_dir, qwen_tiktoken_file
from polar_mitm.cli.rewards import RewardFileError, parse_rewards, plan
from polar_mitm.cli.summary import summarize
from polar_mitm.cli.token_text import resolve, token_pieces
from polar_mitm.export import FORMATS, ExportOptions, build_records, select
from polar_mitm.export.nemo_gym import result
from polar_mitm.export.slime import sample
from polar_mitm.export.verl import arrays
from polar_mitm.store import CALLS_SCHEMA, TRACES_SCHEMA
from polar_mitm.trajectory.traceview import (
    TraceShapeError,
    main_trace,
    mask_runs,
    pick_trace,
    segments,
)

TEXT = "<|im_start|>user\nünïcödé ✓ — 日本語 🎉 done\n<think>\n"


@pytest.mark.parametrize("spec", ["hf", "tiktoken"])
def test_token_pieces_join_to_the_text_and_split_no_character(spec):
    tok, _ = resolve(
        str(qwen3_tokenizer_dir()) if spec == "hf" else f"tiktoken:{qwen_tiktoken_file()}"
    )
    text = TEXT if spec == "hf" else TEXT.replace("<|im_start|>", "").replace("<think>", "")
    ids = tok.encode(text)
    pieces = token_pieces(tok, ids)
    assert len(pieces) == len(ids) and "".join(pieces) == text == tok.decode(ids)
    assert "\ufffd" not in "".join(pieces)
    # 🎉 is two tokens here: the first gets nothing, the second the whole character
    k = pieces.index("🎉")
    assert pieces[k - 1] == "" and len(tok.decode([ids[k]]).encode()) < 4


@dataclass
class ToyImpl:
    """A tokenizer without a byte view: token 1..3 are the three UTF-8 bytes of ✓."""

    vocab: dict[int, bytes] = field(
        default_factory=lambda: {0: b"a", 1: b"\xe2", 2: b"\x9c", 3: b"\x93", 4: b" b"}
    )

    def decode(self, ids: list[int]) -> str:
        return b"".join(self.vocab[i] for i in ids).decode("utf-8", errors="replace")


@dataclass
class ToyTokenizer:
    impl: ToyImpl = field(default_factory=ToyImpl)
    kind: str = "hf"
    lock: Any = field(default_factory=threading.Lock)

    def decode(self, ids: list[int]) -> str:
        return self.impl.decode(ids)


def test_token_pieces_by_decode_merge_partial_characters():
    pieces = token_pieces(ToyTokenizer(), [0, 1, 2, 3, 4])
    assert pieces == ["a", "", "", "✓", " b"]


def trace(mask: list[int], offsets: list[int], **kw: Any) -> dict[str, Any]:
    n = len(mask)
    row = {
        "trace_id": kw.pop("trace_id", "t1"),
        "rollout_id": kw.pop("rollout_id", "r.0"),
        "group_id": kw.pop("group_id", "r"),
        "sample_index": 0,
        "role": "main",
        "input_ids": list(range(100, 100 + n)),
        "loss_mask": mask,
        "logprobs": [-0.5 if m else 0.0 for m in mask],
        "call_offsets": offsets,
        "call_ids": [f"c{i}" for i in range(len(offsets))],
        "reward": 1.0,
        "status": "completed",
        "trainable": True,
        "created_at": dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
        "num_policy_tokens": sum(mask),
        "num_env_tokens": n - sum(mask),
    }
    row.update(kw)
    return row


def test_segments_of_a_three_call_trace():
    t = trace([0, 0, 0, 1, 1, 0, 1, 1, 1, 0, 0], [0, 5, 9])  # the last call sampled nothing
    segs = segments(t)
    assert [(s.start, s.gen_start, s.end) for s in segs] == [(0, 3, 5), (5, 6, 9), (9, 11, 11)]
    assert [s.call_id for s in segs] == ["c0", "c1", "c2"]
    assert [(s.env_tokens, s.sampled_tokens) for s in segs] == [(3, 2), (1, 3), (2, 0)]
    assert mask_runs(t["loss_mask"]) == [(0, 0, 3), (1, 3, 5), (0, 5, 6), (1, 6, 9), (0, 9, 11)]


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"logprobs": [0.0]}, "differ in length"),
        ({"call_offsets": [0, 4, 2]}, "out of order"),
        ({"call_offsets": [1]}, "out of order"),
        ({"loss_mask": [0, 1, 0, 1, 0]}, "sampled tokens before its prompt ends"),
    ],
)
def test_segments_refuse_inconsistent_rows(change, needle):
    t = trace([0, 0, 1, 1, 0], [0])
    t.update(change)
    with pytest.raises(TraceShapeError, match=needle):
        segments(t)


def test_the_main_trace_is_the_root_main_chain():
    root = trace([0, 1], [0], trace_id="root")
    sub = trace([0, 1, 1, 1], [0], trace_id="sub", role="sub", parent_trace_id="root")
    post = trace([0, 1, 1], [0], trace_id="post", parent_trace_id="root")
    assert main_trace([sub, post, root])["trace_id"] == "root"
    assert main_trace([sub, post])["trace_id"] == "post"  # no root: the biggest main
    assert main_trace([sub])["trace_id"] == "sub"
    assert pick_trace([root, sub, post], "su")["trace_id"] == "sub"
    with pytest.raises(LookupError, match="matches several"):
        pick_trace([root, trace([0, 1], [0], trace_id="rook")], "roo")


def test_summary_of_an_open_rollout_and_a_group():
    calls = pa.Table.from_pylist(
        [
            {
                "call_id": f"c{i}",
                "rollout_id": rid,
                "group_id": "g",
                "started_at": dt.datetime(2026, 1, 1, 0, 0, i, tzinfo=dt.UTC),
                "prompt_token_ids": [1] * (10 + i),
                "output_token_ids": [2] * 3,
                "status": "completed",
                "dialect": "openai_chat",
                "fidelity_flags": ["retokenized"] if i == 2 else [],
                "ids_source": "retokenized" if i == 2 else "upstream",
            }
            for i, rid in enumerate(["g.0", "g.1", "g.2"])
        ],
        schema=CALLS_SCHEMA,
    )
    rows = [
        trace([0, 1, 1, 1], [0], trace_id="a", rollout_id="g.0", group_id="g", reward=1.0),
        trace([0, 1, 1, 1], [0], trace_id="b", rollout_id="g.1", group_id="g", reward=0.0),
    ]
    s = summarize(calls, pa.Table.from_pylist(rows, schema=TRACES_SCHEMA))
    by_id = {r.rollout_id: r for r in s.rollouts}
    assert by_id["g.2"].status is None and by_id["g.2"].traces == 0  # open: no traces yet
    assert by_id["g.2"].fidelity_flags == {"retokenized": 1} and by_id["g.2"].retokenized == 1
    assert (by_id["g.0"].policy_tokens, by_id["g.0"].env_tokens) == (3, 1)
    [g] = s.groups
    assert (g.rewarded, g.reward_mean, g.reward_std, g.statuses) == (
        2,
        0.5,
        0.5,
        {"completed": 2, "open": 1},
    )
    assert s.totals["prompt_tokens"] == 10 + 11 + 12 and s.totals["fidelity_flags"] == {
        "retokenized": 1
    }


def test_select_leaves_out_untrainable_and_unfinished():
    rows = [
        trace([0, 1], [0], trace_id="ok"),
        trace([0, 1], [0], trace_id="bad", trainable=False, untrainable_reason="call_error: x"),
        trace([0, 1], [0], trace_id="open", status="incomplete"),
        trace([0, 1], [0], trace_id="side", role="side"),
    ]
    kept, skipped = select(rows)
    assert [t["trace_id"] for t in kept] == ["ok", "side"]
    assert skipped == {"untrainable (call_error)": 1, "status incomplete": 1}
    kept, _ = select(rows, include_all=True, roles=["side"])
    assert [t["trace_id"] for t in kept] == ["side"]


def test_verl_pads_prompts_left_and_responses_right():
    long_prompt = trace([0, 0, 0, 1, 1, 0, 1], [0, 5], trace_id="a", group_id="g")
    short = trace([0, 1, 1, 1], [0], trace_id="b", group_id="g", reward=0.0)
    records = build_records([long_prompt, short], {})
    z = arrays(records, ExportOptions(pad_id=7))
    assert z["prompts"].tolist() == [[100, 101, 102], [7, 7, 100]]
    assert z["responses"].tolist() == [[103, 104, 105, 106], [101, 102, 103, 7]]
    assert z["response_mask"].tolist() == [[1, 1, 0, 1], [1, 1, 1, 0]]
    assert z["attention_mask"].tolist() == [[1] * 7, [0, 0, 1, 1, 1, 1, 0]]
    assert z["position_ids"].tolist() == [list(range(7)), [0, 0, 0, 1, 2, 3, 3]]
    assert z["rm_scores"].tolist() == [[0, 0, 0, 1.0], [0, 0, 0, 0]]
    assert z["rollout_log_probs"][0].tolist() == [-0.5, -0.5, 0.0, -0.5]
    assert z["uid"].tolist() == ["g", "g"]


def test_slime_and_nemo_gym_records_of_a_two_call_trace():
    t = trace([0, 0, 1, 1, 0, 1], [0, 4], status="completed")
    [record] = build_records([t], {"c1": {"finish_reason": "length", "model_served": "m"}})
    s = sample(record, ExportOptions())
    assert (s["response_length"], s["loss_mask"], s["status"]) == (4, [1, 1, 0, 1], "truncated")
    g = result(record, ExportOptions())
    out = g["response"]["output"]
    assert [o["prompt_token_ids"] for o in out] == [[100, 101], [100, 101, 102, 103, 104]]
    assert [o["generation_token_ids"] for o in out] == [[102, 103], [105]]
    assert g["response"]["model"] == "m" and g["reward"] == 1.0
    json.dumps(g, allow_nan=False)


def test_every_format_is_registered():
    assert sorted(FORMATS) == ["jsonl", "nemo-gym", "parquet", "slime", "verl"]
    assert all(f.summary and f.suffix.startswith(".") for f in FORMATS.values())


def test_reward_files_and_the_join_plan():
    assert parse_rewards(" rollout_id , reward \nA.0, 1\nB.1,-0.5\n", "f.csv") == {
        "A.0": 1.0,
        "B.1": -0.5,
    }
    assert parse_rewards("\ufeffrollout_id,reward\nA.0,2\n", "bom.csv") == {"A.0": 2.0}
    assert parse_rewards(
        '{"rollout_id": "A.0", "reward": 1}\n{"rollout_id": "A.0", "reward": 1.0}\n', "f"
    ) == {"A.0": 1.0}
    for bad in ('{"rollout_id": "A.0", "reward": true}', '["A.0", 1]', "rollout_id,reward\n,1\n"):
        with pytest.raises(RewardFileError):
            parse_rewards(bad, "f")
    rows = [trace([0, 1], [0], trace_id="x", rollout_id="A.0", reward=None, revision=2)]
    p = plan(rows, {"A.0": 0.5, "Z.9": 1.0})
    [new] = p.rows
    assert (new["reward"], new["revision"], new["trace_id"]) == (0.5, 3, "x")
    assert rows[0]["reward"] is None  # the read row is not changed in place
    assert p.unknown == ["Z.9"] and p.rollouts == {"A.0"}
    assert np.isfinite(new["reward"])
