"""The real harnesses (whatever tests/e2e/harnesses.py pins) through real mitmdump + addon to
the real vLLM, on the harness e2e scenario: each finishes its task, every call's ids are the
ones the engine sampled, the main agent is one chain, and the engine's re-scoring of each trace
agrees with the recorded logprobs on every token not sampled under a grammar; the tokens that
were (Codex's `parallel_tool_calls: false`) are all flagged (checks.py).
"""

from __future__ import annotations

import pytest

from ..e2e.harnesses import FILE_NAME, FINAL_TEXT, HARNESSES
from ..e2e.test_harnesses import (
    CAP_REFUSED,
    HANDS_BACK_WHITESPACE,
    ONE_CALL,
    ROLLOUTS,
    file_text,
    is_llm_request,
    run_through_proxy,
)
from .checks import check_exact, check_rescoring


@pytest.mark.slow
@pytest.mark.parametrize("name", list(HARNESSES))
def test_harness_on_real_vllm(
    name, vllm, recorder, harness_bin, netns, tmp_path, confdir, make_mitm
):
    rollout, _ = ROLLOUTS[name]
    result, seen, _ = run_through_proxy(
        name,
        harness_bin,
        netns,
        tmp_path,
        confdir,
        lambda *_: recorder,
        make_mitm,
        timeout=300.0,
        end_by="shutdown",
    )
    log = f"rc={result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
    assert result.returncode == 0, log
    assert FINAL_TEXT in result.stdout, log
    assert (result.workdir / FILE_NAME).read_text() == file_text(name), log

    llm = [e for e in seen.wire if is_llm_request(e)]
    assert len(seen.calls) == len(llm) >= (1 if name in ONE_CALL else 2)
    assert all(r["status"] == "completed" for r in seen.calls), [r["error"] for r in seen.calls]
    check_exact(seen.calls, recorder)
    # a cap above max_model_len (Claude Code's 128000; 40960 here) is refused, then resent
    refused = [e for e in recorder.chats() if e.status == 400]
    assert all(CAP_REFUSED.search(e.raw.decode()) for e in refused), [e.raw for e in refused]
    if name == "claude":
        assert refused, "Claude Code's max_tokens=128000 should be refused at 40960"

    mains = [t for t in seen.traces if t["rollout_id"] == rollout and t["role"] == "main"]
    main_calls = [r["call_id"] for r in seen.calls if r["purpose"] == "main"]
    if name in HANDS_BACK_WHITESPACE:
        # Qwen Code and OpenCode send the "\n\n" vLLM streams before a tool call back as
        # content; Qwen3's template renders it with one more newline than the policy sampled,
        # so each tool turn is a main chain of its own (`rerender`; polar_exact_prefix keeps
        # one chain: tests/e2e/test_harness_lineage.py).
        assert [t["break_reason"] for t in mains] == ["first_call"] + ["rerender"] * (
            len(mains) - 1
        ), [(t["role"], t["break_reason"]) for t in seen.traces]
        assert [c for t in mains for c in t["call_ids"]] == main_calls
    else:
        assert len(mains) == 1, [(t["role"], t["break_reason"]) for t in seen.traces]
        assert mains[0]["call_ids"] == main_calls
    for trace in seen.traces:
        scored = check_rescoring(recorder.url, trace)
        print(name, trace["role"], scored)
