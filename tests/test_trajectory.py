"""Prefix merging and break reasons with hand-made id sequences, plus property tests."""

from __future__ import annotations

import json
import struct
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from polar_mitm.trajectory import breaks
from polar_mitm.trajectory.breaks import BreakEvidence, classify_break, history_change, request_view
from polar_mitm.trajectory.merge import (
    _SEED,
    BLOCK,
    CallFacts,
    Merger,
)
from polar_mitm.trajectory.rows import TraceMeta, trace_row, untrainable_reasons

EOT = 99  # end-of-turn id in the hand-made sequences


def body(system: str, messages: list[dict], tools: tuple[str, ...] = ("run_shell",)) -> str:
    return json.dumps(
        {
            "model": "m",
            "messages": [{"role": "system", "content": system}, *messages],
            "tools": [{"type": "function", "function": {"name": t}} for t in tools],
        }
    )


def f32(values: list[float]) -> list[float]:
    return list(struct.unpack(f"{len(values)}f", struct.pack(f"{len(values)}f", *values)))


SYSTEM = list(range(1000, 1000 + BLOCK + 44))  # more than one hashed prefix block
USER = [7, 8, 9]


# -- joining ------------------------------------------------------------------------------------


def test_a_tool_loop_is_one_chain_with_mask_and_logprobs():
    m = Merger()
    p1 = SYSTEM + USER
    o1, l1 = [10, 11, EOT], [-0.5, -0.25, -0.125]
    first = m.add(p1, o1, l1)
    assert first.break_reason == "first_call" and first.parent_trace_id is None
    p2 = p1 + o1 + [20, 21, 22]  # a tool result
    o2, l2 = [12, EOT], [-1.0, -2.0]
    second = m.add(p2, o2, l2)
    assert second.attached and second.trace_id == first.trace_id
    assert (second.prefix_len, second.env_tokens, second.policy_tokens) == (len(p1) + 3, 3, 2)
    [chain] = m.chains
    assert chain.tokens.tolist() == p2 + o2
    assert chain.mask.tolist() == [0] * len(p1) + [1] * 3 + [0] * 3 + [1] * 2
    assert chain.logprobs.tolist() == [0.0] * len(p1) + l1 + [0.0] * 3 + l2
    assert chain.call_offsets.tolist() == [0, len(p1) + 3]
    assert chain.output_offsets.tolist() == [len(p1), len(p2)]


def test_a_prompt_equal_to_the_chain_extends_it_with_no_env_tokens():
    m = Merger()
    m.add(SYSTEM, [1, EOT], [0.0, 0.0])
    placed = m.add(SYSTEM + [1, EOT], [2, EOT], [0.0, 0.0])
    assert placed.attached and placed.env_tokens == 0


def test_the_longest_chain_that_is_a_prefix_wins():
    m = Merger()
    long = m.add([1, 2, 3], [4, EOT])
    short = m.add([1, 2], [3])  # same prompt start, new sample: a retry whose chain [1,2,3] ...
    assert short.break_reason == "retry" and short.parent_trace_id == long.trace_id
    # ... is a prefix of the first chain [1,2,3,4,EOT]: both are prefixes of the next prompt
    placed = m.add([1, 2, 3, 4, EOT, 5], [6, EOT])
    assert placed.attached and placed.trace_id == long.trace_id


def test_side_calls_never_join_even_when_they_extend_the_main_chain():
    m = Merger()
    main = m.add(SYSTEM + USER, [10, EOT])
    side = m.add(SYSTEM + USER + [10, EOT, 50, 51], [60, EOT], purpose="compact")
    assert side.break_reason == "side_call" and side.parent_trace_id == main.trace_id
    assert side.prefix_len == len(SYSTEM) + 5
    assert m.chains[1].role == "side"
    # a main call whose prompt extends both: it joins main, not the longer side chain
    nxt = m.add(SYSTEM + USER + [10, EOT, 50, 51, 60, EOT, 70], [71, EOT])
    assert nxt.attached and nxt.trace_id == main.trace_id
    assert len(m.chains) == 2


def test_a_side_call_first_then_the_main_first_call():
    m = Merger()
    side = m.add([5, 6, 7], [8, EOT], purpose="title")
    assert side.break_reason == "side_call" and side.parent_trace_id is None
    main = m.add(SYSTEM + USER, [1, EOT])
    assert main.break_reason == "first_call" and main.parent_trace_id is None
    assert [c.role for c in m.chains] == ["side", "main"]


# -- every break reason ---------------------------------------------------------------------------


def test_sub_agent_by_system_prompt_and_by_tools():
    m = Merger()
    main_req = body("You are the main agent.", [{"role": "user", "content": "fix it"}])
    main = m.add(SYSTEM + USER, [10, EOT], request_json=main_req)
    sub_req = body("You are a search sub-agent.", [{"role": "user", "content": "find x"}])
    sub = m.add(SYSTEM[:5] + [500, 501], [20, EOT], request_json=sub_req)
    assert sub.break_reason == "sub_agent" and sub.parent_trace_id == main.trace_id
    assert sub.prefix_len == 5 and sub.detail["system_changed"] is True
    assert m.chains[-1].role == "sub"
    # a sub-agent's next call extends the sub chain
    assert m.add(SYSTEM[:5] + [500, 501, 20, EOT, 30], [21, EOT]).trace_id == sub.trace_id
    # same system prompt, other tools: a sub-agent too
    tools_req = body("You are the main agent.", [{"role": "user", "content": "x"}], ("read",))
    other = m.add(SYSTEM[:50] + [600], [1, EOT], request_json=tools_req)
    assert other.break_reason == "sub_agent" and other.detail["tools_changed"] is True


def test_a_second_sub_agent_of_the_same_kind_is_a_sub_agent():
    m = Merger()
    m.add(SYSTEM + USER, [10, EOT], request_json=body("main", [{"role": "user", "content": "go"}]))
    sub1 = body("sub", [{"role": "user", "content": "task one"}])
    a = m.add([1, 2, 3, 4, 40], [41, EOT], request_json=sub1)
    m.add([1, 2, 3, 4, 40, 41, EOT, 42], [43, EOT], request_json=sub1)
    sub2 = body("sub", [{"role": "user", "content": "task two"}])
    b = m.add([1, 2, 3, 4, 50], [51, EOT], request_json=sub2)
    assert b.break_reason == "sub_agent" and b.parent_trace_id == a.trace_id


def test_compaction_replaces_history_with_a_summary():
    m = Merger()
    history = [
        {"role": "user", "content": "fix the bug"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "1", "function": {"name": "run_shell", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "1", "content": "out"},
    ]
    main = m.add(SYSTEM + [1, 2, 3, 4, 5], [6, EOT], request_json=body("S", history))
    summary = [{"role": "user", "content": "Summary of the conversation so far: ..."}]
    post = m.add(SYSTEM + [77, 78], [9, EOT], request_json=body("S", summary))
    assert post.break_reason == "compaction" and post.parent_trace_id == main.trace_id
    assert post.prefix_len == len(SYSTEM) and post.detail["history"] == "compacted"
    assert m.chains[-1].role == "main"


def test_truncation_drops_old_messages_without_a_summary():
    m = Merger()
    msgs = [{"role": "user", "content": f"m{i}"} for i in range(5)]
    main = m.add(SYSTEM + [1, 2, 3, 4, 5], [6, EOT], request_json=body("S", msgs))
    kept = [msgs[0], *msgs[3:], {"role": "assistant", "content": "new"}]
    placed = m.add(SYSTEM + [1, 4, 5, 6, EOT], [7, EOT], request_json=body("S", kept))
    assert placed.break_reason == "truncation" and placed.parent_trace_id == main.trace_id


def test_rerender_when_every_message_is_kept_but_tokens_differ():
    m = Merger()
    msgs = [{"role": "user", "content": "hi"}]
    main = m.add(SYSTEM + USER, [30, 31, 32, EOT], request_json=body("S", msgs))
    # the template dropped the reasoning (30, 31) of the earlier turn when re-rendering it
    again = [*msgs, {"role": "assistant", "content": "c"}, {"role": "user", "content": "more"}]
    placed = m.add(SYSTEM + USER + [32, EOT, 40], [41, EOT], request_json=body("S", again))
    assert placed.break_reason == "rerender" and placed.parent_trace_id == main.trace_id
    assert placed.prefix_len == len(SYSTEM) + 3
    assert placed.detail["diverged_in"] == "policy" and placed.detail["history"] == "kept"
    # the new chain's whole prompt is context: its shared tokens were trained in the parent
    assert m.chains[-1].mask.tolist() == [0] * (len(SYSTEM) + 6) + [1, 1]


def test_rerender_from_tokens_alone_when_there_is_no_request_json():
    m = Merger()
    m.add(SYSTEM + USER, [30, 31, EOT])
    placed = m.add(SYSTEM + USER + [31, EOT, 40], [41, EOT])
    assert placed.break_reason == "rerender" and placed.detail["history"] is None


def test_other_when_an_earlier_message_was_edited():
    m = Merger()
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    m.add(SYSTEM + [1, 2], [3, EOT], request_json=body("S", msgs))
    edited = [{"role": "user", "content": "A!"}, msgs[1], {"role": "user", "content": "c"}]
    placed = m.add(SYSTEM + [5, 2, 3, EOT, 6], [7, EOT], request_json=body("S", edited))
    assert placed.break_reason == "other" and placed.detail["history"] == "edited"


def test_retry_of_an_earlier_prompt():
    m = Merger()
    first = m.add(SYSTEM + USER, [1, 2, EOT])
    placed = m.add(SYSTEM + USER, [3, EOT])
    assert placed.break_reason == "retry" and placed.parent_trace_id == first.trace_id
    assert placed.prefix_len == len(SYSTEM) + 3


@pytest.mark.parametrize("prompt", [USER, SYSTEM + USER], ids=["short", "hashed-blocks"])
def test_a_repeated_prompt_costs_one_comparison_and_names_the_newest_chain(monkeypatch, prompt):
    """A rollout that sends one prompt again and again (retries, samples) gets a chain per call;
    the newest is the parent, found without comparing the prompt against every older chain."""
    from polar_mitm.trajectory import merge as trajectory

    m = Merger()
    placed = [m.add(prompt, [i, EOT]) for i in range(1, 41)]
    assert len(m.chains) == 40
    assert all(
        p.parent_trace_id == q.trace_id for p, q in zip(placed[1:], placed[:-1], strict=True)
    )
    compared = []
    real = trajectory._lcp
    monkeypatch.setattr(trajectory, "_lcp", lambda *a: compared.append(1) or real(*a))
    last = m.add(prompt, [77, EOT])
    assert last.break_reason == "retry" and last.parent_trace_id == placed[-1].trace_id
    assert last.prefix_len == len(prompt)
    assert len(compared) <= 2, f"{len(compared)} chains compared for one call"


def test_a_break_parses_only_its_own_request_once_the_parent_was_parsed(monkeypatch):
    """Break evidence compares this call's request with its parent's last one; each request
    body (often megabytes) is parsed once, and the new chain keeps its parsed view."""
    from polar_mitm.trajectory import merge as trajectory

    parsed = []
    real = trajectory.request_view
    monkeypatch.setattr(trajectory, "request_view", lambda j: parsed.append(j) or real(j))
    m = Merger()
    requests = [body("sys", [{"role": "user", "content": f"try {i}"}]) for i in range(4)]
    m.add(SYSTEM + USER, [1, EOT], request_json=requests[0])
    assert parsed == []  # a first call has nothing to compare with
    m.add(SYSTEM + USER, [2, EOT], request_json=requests[1])
    assert sorted(parsed) == sorted(requests[:2])
    for i in (2, 3):
        parsed.clear()
        placed = m.add(SYSTEM + USER, [i + 1, EOT], request_json=requests[i])
        assert placed.break_reason == "retry"
        assert parsed == [requests[i]]


def test_classify_break_order():
    e = BreakEvidence(prompt_len=10, lcp=4, parent_len=8, system_changed=True, history="kept")
    assert classify_break(e) == "sub_agent"
    assert classify_break(BreakEvidence(purpose="title", has_chains=False)) == "side_call"
    assert classify_break(BreakEvidence(has_chains=False)) == "first_call"
    assert classify_break(BreakEvidence(prompt_len=5, lcp=5, parent_len=9)) == "retry"
    assert (
        classify_break(BreakEvidence(prompt_len=9, lcp=5, parent_len=9, diverged_in="env"))
        == "other"
    )
    assert set(breaks.REASONS) >= {
        "first_call",
        "side_call",
        "sub_agent",
        "compaction",
        "rerender",
        "truncation",
        "other",
    }


def test_history_change_cases():
    assert history_change(["a", "b"], ["a", "b", "c"]) == "kept"
    assert history_change(["a", "b", "c", "d"], ["a", "d", "e"]) == "truncated"
    assert history_change(["a", "b", "c", "d"], ["s"]) == "compacted"
    assert history_change(["u1", "a1", "t1", "u2", "a2"], ["u1", "u2", "s"]) == "compacted"
    assert history_change(["a", "b"], ["x", "b"]) == "edited"


def test_request_view_is_dialect_neutral():
    chat = request_view(
        body("sys", [{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    )
    anthropic = request_view(
        json.dumps(
            {
                "system": [{"type": "text", "text": "sys", "cache_control": {"type": "ephemeral"}}],
                "tools": [{"name": "run_shell", "input_schema": {}}],
                "messages": [{"role": "user", "content": "hi"}],
            }
        )
    )
    responses = request_view(
        json.dumps(
            {
                "instructions": "sys",
                "input": [
                    {
                        "type": "additional_tools",
                        "tools": [{"type": "function", "name": "run_shell"}],
                    },
                    {"role": "user", "content": "hi"},
                ],
            }
        )
    )
    assert chat == anthropic == responses
    assert chat.system == "sys" and chat.tools == ("run_shell",) and len(chat.messages) == 1
    assert request_view("not json") is None and request_view(None) is None
    # cache markers moving between calls do not change a message's fingerprint
    a = {
        "role": "user",
        "content": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}],
    }
    assert breaks.fingerprint(a) == breaks.fingerprint({"role": "user", "content": "x"})


# -- the prefix index ---------------------------------------------------------------------------


def test_a_hash_collision_falls_back_to_comparing_every_chain():
    m = Merger()
    real = m.add(SYSTEM + USER, [1, EOT])
    decoy = m.add([5] * (BLOCK + 10), [2, EOT], purpose="side")
    prompt = array("i", SYSTEM + [42, 43])
    first_block = hash((_SEED, prompt[:BLOCK].tobytes()))
    m._blocks_all[first_block] = [m.chains[1]]  # pretend the decoy's first block collides
    placed = m.add(prompt, [3, EOT], purpose="title")
    assert placed.parent_trace_id == real.trace_id != decoy.trace_id
    assert placed.prefix_len == len(SYSTEM)


def test_bad_ids_are_a_value_error():
    with pytest.raises(ValueError, match="int32"):
        Merger().add([1, 2**40], [1])


# -- rows and trainability ----------------------------------------------------------------------


def test_trace_row_and_untrainable_reasons():
    m = Merger()
    ok = CallFacts("c1", policy_version="v1", policy_version_end="v1")
    m.add(SYSTEM, [1, EOT], [-0.5, -0.5], facts=ok)
    flagged = CallFacts(
        "c2",
        policy_version="v1",
        policy_version_end="v2",
        flags=("count_mismatch",),
        trainable=False,
    )
    m.add(SYSTEM + [1, EOT, 5], [2, EOT], [-1.0, -1.0], facts=flagged)
    [chain] = m.chains
    calls = [ok, flagged, CallFacts("c3", status="error", error="boom")]
    reasons = untrainable_reasons(chain.calls, calls)
    assert [r.split(":")[0] for r in reasons] == ["policy_mixed", "call_error", "call_untrainable"]
    assert "flagged count_mismatch" in reasons[2]
    # the rollout-level conditions can be waived; a call the capture path rejected cannot
    waived = untrainable_reasons(chain.calls, calls, frozenset({"policy_mixed", "call_error"}))
    assert [r.split(":")[0] for r in waived] == ["call_untrainable"]
    assert (
        untrainable_reasons(
            [ok],
            [ok, CallFacts("c4", status="error", policy_version="v1", policy_version_end="v1")],
            frozenset({"call_error"}),
        )
        == []
    )
    missing = untrainable_reasons([ok], [ok], unmerged=[("c5", "no token ids (ids_source=none)")])
    assert missing[0].startswith("ids_missing: call c5")
    assert untrainable_reasons([ok], [ok], unmerged=[("c6", "status client_aborted")]) == []
    retok = CallFacts("c7", ids_source="retokenized", flags=("retokenized",), trainable=False)
    assert "ids_source=retokenized" in untrainable_reasons([retok], [retok])[0]
    trusted = CallFacts("c8", ids_source="retokenized", flags=("retokenized",), trainable=True)
    assert untrainable_reasons([trusted], [trusted]) == []  # polar_trust_retokenized vouched
    row = trace_row(chain, TraceMeta("r.1", "r", 1, reward=0.5), reasons)
    assert row["input_ids"].tolist() == SYSTEM + [1, EOT, 5, 2, EOT]
    assert row["loss_mask"].tolist() == [0] * len(SYSTEM) + [1, 1, 0, 1, 1]
    assert row["num_policy_tokens"] == 4 and row["num_env_tokens"] == len(SYSTEM) + 1
    assert row["policy_versions"] == ["v1", "v2"] and row["call_ids"] == ["c1", "c2"]
    assert row["fidelity_flags"] == ["count_mismatch"]
    assert row["trainable"] is False and "policy_mixed" in row["untrainable_reason"]


# -- properties ---------------------------------------------------------------------------------

ids = st.integers(min_value=0, max_value=60)  # a small alphabet: many partial matches


@st.composite
def agent_runs(draw):
    """Independent chains (distinct first tokens), each a list of (env, output, logprobs) steps,
    and an interleaving of their calls that keeps each chain's order."""
    n_chains = draw(st.integers(1, 4))
    runs = []
    for c in range(n_chains):
        steps = []
        for s in range(draw(st.integers(1, 5))):
            env = draw(st.lists(ids, min_size=0 if s else 1, max_size=BLOCK))
            if s == 0:
                env = [10_000 + c, *env]
            out = draw(st.lists(ids, min_size=0, max_size=40)) + [EOT]
            lps = [-(i + 1) / 8 for i in range(len(out))]
            steps.append((env, out, lps))
        runs.append(steps)
    order = draw(st.permutations([c for c, steps in enumerate(runs) for _ in steps]))
    return runs, order


@settings(max_examples=150, deadline=None)
@given(agent_runs())
def test_merging_reproduces_chains_built_by_extension(data):
    runs, order = data
    m = Merger()
    built: dict[int, list[int]] = {}
    mask: dict[int, list[int]] = {}
    lps: dict[int, list[float]] = {}
    progress = dict.fromkeys(range(len(runs)), 0)
    trace_of: dict[int, str] = {}
    for c in order:
        env, out, lp = runs[c][progress[c]]
        progress[c] += 1
        prompt = built.get(c, []) + env
        placed = m.add(prompt, out, lp)
        if c in trace_of:
            assert placed.attached and placed.trace_id == trace_of[c]
        else:
            trace_of[c] = placed.trace_id
        built[c] = prompt + out
        mask[c] = mask.get(c, []) + [0] * len(env) + [1] * len(out)
        lps[c] = lps.get(c, []) + [0.0] * len(env) + f32(lp)
    assert len(m.chains) == len(runs)
    chains = {ch.trace_id: ch for ch in m.chains}
    sampled = sum(len(out) for steps in runs for _, out, _ in steps)
    assert sum(sum(ch.mask) for ch in m.chains) == sampled
    for c, trace_id in trace_of.items():
        ch = chains[trace_id]
        assert ch.tokens.tolist() == built[c]
        assert ch.mask.tolist() == mask[c]
        assert ch.logprobs.tolist() == lps[c]


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_a_break_finds_the_parent_with_the_longest_common_prefix(data):
    """Calls that fork from anywhere: the parent and its prefix length are the brute-force best."""
    m = Merger()
    m.add(data.draw(st.lists(ids, min_size=1, max_size=3 * BLOCK)), [EOT])
    for _ in range(data.draw(st.integers(1, 6))):
        source = data.draw(st.sampled_from(m.chains))
        cut = data.draw(st.integers(0, len(source)))
        prompt = source.tokens.tolist()[:cut] + data.draw(st.lists(ids, max_size=BLOCK))
        joinable = [ch for ch in m.chains if ch.role != "side"]
        extends = [ch for ch in joinable if prompt[: len(ch)] == ch.tokens.tolist()]

        def lcp(ch, prompt=prompt):
            t = ch.tokens.tolist()
            n = 0
            while n < min(len(t), len(prompt)) and t[n] == prompt[n]:
                n += 1
            return n

        best = max(lcp(ch) for ch in joinable)
        longest = max((len(ch) for ch in extends), default=None)
        placed = m.add(prompt, [EOT])
        if extends:
            assert placed.attached and placed.prefix_len == longest
        else:
            assert not placed.attached and placed.prefix_len == best
            parent = next(ch for ch in m.chains if ch.trace_id == placed.parent_trace_id)
            assert lcp(parent) == best
