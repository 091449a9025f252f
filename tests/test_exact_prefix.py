"""Exact-prefix mode's chains and prompts, with the real Qwen3 tokenizer and chat template."""

from __future__ import annotations

import json
from array import array

import pytest

from polar_mitm.assets import qwen3_tokenizer_dir
from polar_mitm.output_parsers import family
from polar_mitm.tokens.tokenizer import load_tokenizer
from polar_mitm.trajectory.exact_prefix import MAX_CHAINS, ExactPrefix, Lookup, message_key
from polar_mitm.trajectory.ids_json import ids_text
from tests.helpers.clients import RUN_SHELL

SYSTEM = {"role": "system", "content": "You are a coding agent."}
USER = {"role": "user", "content": "List the files."}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "run_shell", "arguments": '{"cmd": "ls", "timeout": 5}'},
}
REPLY = {"role": "assistant", "content": None, "reasoning": "\nList them.\n", "tool_calls": [CALL]}


@pytest.fixture(scope="module")
def book_factory():
    tok = load_tokenizer(str(qwen3_tokenizer_dir()))
    return lambda: ExactPrefix(tok, family("qwen3"))


def render(book: ExactPrefix, messages: list[dict], generation: bool = True) -> list[int]:
    return book.chat_prompt_ids(
        {"messages": messages, "tools": [RUN_SHELL], "add_generation_prompt": generation}
    )


def first_turn(book: ExactPrefix) -> tuple[Lookup, list[int], list[int]]:
    """The first call of a rollout: its prompt and the ids the policy sampled (the template's
    rendering of REPLY, through <|im_end|>), remembered as the rollout's chain."""
    chat = {"messages": [SYSTEM, USER], "tools": [RUN_SHELL]}
    lookup = book.plan((), chat, 40960)
    assert lookup.reason == "no_chain"
    prompt = render(book, [SYSTEM, USER])
    full = render(book, [SYSTEM, USER, REPLY], generation=False)
    output = full[len(prompt) :]
    output = output[: output.index(151645) + 1]
    book.remember("r.0", lookup, REPLY, prompt, output, "call-1")
    return lookup, prompt, output


def test_message_keys_ignore_what_a_harness_changes_on_the_way_back():
    same = [
        REPLY,
        {**REPLY, "reasoning": None},  # reasoning dropped
        {**REPLY, "content": "  "},  # whitespace around the text
        {
            **REPLY,
            "tool_calls": [  # another id, the arguments in another order and spacing
                {
                    **CALL,
                    "id": "x",
                    "function": {"name": "run_shell", "arguments": '{"timeout":5,"cmd":"ls"}'},
                }
            ],
        },
    ]
    assert len({message_key(m) for m in same}) == 1
    other = {
        **REPLY,
        "tool_calls": [{**CALL, "function": {"name": "run_shell", "arguments": "{}"}}],
    }
    assert message_key(other) != message_key(REPLY)
    assert message_key({"role": "tool", "content": "a "}) != message_key(
        {"role": "tool", "content": "a"}
    )


@pytest.mark.parametrize(
    "tail",
    [
        [{"role": "tool", "tool_call_id": "call_1", "content": "notes.txt"}],
        [
            {"role": "tool", "tool_call_id": "call_1", "content": "notes.txt"},
            {"role": "tool", "tool_call_id": "call_2", "content": "3 notes.txt"},
        ],
    ],
)
def test_a_tool_turn_continues_with_exactly_the_template_tokens(book_factory, tail):
    book = book_factory()
    _, prompt, output = first_turn(book)
    messages = [SYSTEM, USER, REPLY, *tail]
    lookup = book.plan(book.chains("r.0"), {"messages": messages, "tools": [RUN_SHELL]}, 40960)
    assert lookup.plan is not None, lookup.reason
    assert lookup.plan.chain_tokens == len(prompt) + len(output)
    # no drift here: the whole prompt is what the template renders for the same messages
    assert lookup.plan.prompt_ids.tolist() == render(book, messages)
    assert lookup.plan.sampling == {"max_tokens": 40960 - len(lookup.plan.prompt_ids)}
    assert lookup.plan.reasoning_open is None and lookup.plan.parse_tools


def test_a_drifting_harness_and_a_new_user_turn_keep_the_sampled_tokens(book_factory):
    book = book_factory()
    _, prompt, output = first_turn(book)
    drifted = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {**CALL, "function": {"name": "run_shell", "arguments": '{"timeout": 5, "cmd": "ls"}'}}
        ],
    }
    messages = [
        SYSTEM,
        USER,
        drifted,
        {"role": "tool", "content": "notes.txt"},
        {"role": "user", "content": "More?"},
    ]
    lookup = book.plan(book.chains("r.0"), {"messages": messages, "tools": [RUN_SHELL]}, None)
    assert lookup.reason == "max_model_len_unknown"  # no cap, no known context: chat path
    chat = {"messages": messages, "tools": [RUN_SHELL], "max_tokens": 64, "temperature": 0.7}
    lookup = book.plan(book.chains("r.0"), chat, None)
    plan = lookup.plan
    assert plan is not None and plan.sampling == {"max_tokens": 64, "temperature": 0.7}
    sent = plan.prompt_ids.tolist()
    assert sent[: len(prompt) + len(output)] == prompt + output
    chat_ids = render(book, messages)
    assert chat_ids != sent  # chat mode re-renders the turn (reasoning, key order)
    new = sent[len(prompt) + len(output) :]
    assert chat_ids[-len(new) :] == new  # the new messages render the same either way


def test_why_a_call_goes_the_chat_way(book_factory):
    book = book_factory()
    first_turn(book)
    tool = {"role": "tool", "content": "notes.txt"}
    base = [SYSTEM, USER, REPLY, tool]

    def reason(chat: dict, max_len: int | None = 40960) -> str | None:
        return book.plan(book.chains("r.0"), {"tools": [RUN_SHELL], **chat}, max_len).reason

    assert reason({"messages": [SYSTEM, {"role": "user", "content": "other task"}]}) == "no_chain"
    assert reason({"messages": base, "tools": None}) == "no_chain"  # other tools: other prompt
    assert reason({"messages": [*base, {"role": "assistant", "content": "injected"}, USER]}) == (
        "new_assistant_turn"
    )
    assert reason({"messages": base, "tool_choice": "required"}) == "forced_tool_choice"
    assert reason({"messages": base, "response_format": {"type": "json_object"}}).startswith(
        "chat_only_field"
    )
    assert reason({"messages": base}, max_len=100) == "context_full"
    assert reason({"messages": base, "max_tokens": 10**6}) is None  # clamped to the room left
    assert reason({"messages": [SYSTEM, USER, {"bad": 1}]}).startswith("unrenderable")


def test_a_cut_off_output_is_not_continued(book_factory):
    book = book_factory()
    chat = {"messages": [SYSTEM, USER], "tools": [RUN_SHELL]}
    lookup = book.plan((), chat, 40960)
    book.remember("r.1", lookup, {"role": "assistant", "content": "Partial"}, [1, 2], [3, 4], "c1")
    messages = [SYSTEM, USER, {"role": "assistant", "content": "Partial"}, USER]
    got = book.plan(book.chains("r.1"), {"messages": messages, "tools": [RUN_SHELL]}, 40960)
    assert got.reason == "chain_not_closed"


def test_a_longer_chain_replaces_the_one_it_extends_and_chains_are_bounded(book_factory):
    book = book_factory()
    lookup, prompt, output = first_turn(book)
    messages = [SYSTEM, USER, REPLY, {"role": "tool", "content": "x"}]
    second = book.plan(book.chains("r.0"), {"messages": messages, "tools": [RUN_SHELL]}, 40960)
    assert second.plan is not None
    book.remember(
        "r.0",
        second,
        {"role": "assistant", "content": "Done."},
        second.plan.prompt_ids,
        [9, 151645],
        "call-2",
    )
    [chain] = book.chains("r.0")
    assert chain.last_call_id == "call-2" and chain.tokens.tolist()[-2:] == [9, 151645]
    # the request's text of the ids is the ids; the next call's starts with this chain's, kept
    assert json.loads(second.plan.prompt_json) == second.plan.prompt_ids.tolist()
    third = book.plan(
        book.chains("r.0"),
        {"messages": [*messages, {"role": "assistant", "content": "Done."}, USER]},
        40960,
    )
    assert third.reason == "no_chain"  # other tools: another prompt altogether
    third = book.plan(
        book.chains("r.0"),
        {
            "messages": [*messages, {"role": "assistant", "content": "Done."}, USER],
            "tools": [RUN_SHELL],
        },
        40960,
    )
    assert third.plan is not None and third.plan.chain_tokens == len(chain.tokens)
    assert json.loads(third.plan.prompt_json) == third.plan.prompt_ids.tolist()
    # kept when call-2 was remembered (its prompt as sent, then its output), not rewritten
    assert book.texts.of("call-2", array("i")) == ids_text(chain.tokens)
    for i in range(MAX_CHAINS + 5):  # side calls: one chain each, the oldest dropped
        side = book.plan((), {"messages": [{"role": "user", "content": f"title {i}"}]}, 40960)
        book.remember("r.0", side, {"role": "assistant", "content": "t"}, [1], [151645], f"s{i}")
    assert len(book.chains("r.0")) == MAX_CHAINS
    book.forget("r.0")
    assert book.chains("r.0") == [] and book.texts.size == 0  # the texts go with the chains


def test_compare_notes_what_chat_mode_would_have_sent(book_factory):
    from polar_mitm.core.record import CallRecord

    book = book_factory()
    messages = [SYSTEM, USER]
    ids = render(book, messages)
    record = CallRecord(rollout_id="r", prompt_token_ids=ids)
    book.compare(record, {"messages": messages, "tools": [RUN_SHELL]}, {"path": "token_in"})
    note = json.loads(record.fidelity_json)["exact_prefix"]
    assert note == {
        "path": "token_in",
        "chat_prompt_tokens": len(ids),
        "first_diff": None,
        "drift_tokens": 0,
    }
    record = CallRecord(rollout_id="r", prompt_token_ids=ids[:-3] + [1, 2, 3, 4])
    book.compare(record, {"messages": messages, "tools": [RUN_SHELL]}, {"path": "token_in"})
    note = json.loads(record.fidelity_json)["exact_prefix"]
    assert note["first_diff"] == len(ids) - 3 and note["drift_tokens"] == 4


def test_drain_as_a_compare_finishes_does_not_spin_the_loop(book_factory):
    """`drain` (at shutdown) entered in the loop turn in which a compare's task finished: the
    task is still in `_pending` until its done callback runs a turn later, and a gather of done
    tasks completes without yielding (Python 3.12), so `while _pending: await gather(...)` spun
    for good (tests/test_fidelity.py has the stall this was in)."""
    import asyncio

    from polar_mitm.core.record import CallRecord

    book = book_factory()
    messages = [SYSTEM, USER]
    ids = render(book, messages)
    delivered = []

    async def scenario() -> None:
        record = CallRecord(rollout_id="r", prompt_token_ids=ids)
        chat = {"messages": messages, "tools": [RUN_SHELL]}
        book.submit(record, chat, {"path": "token_in"}, lambda: delivered.append(record))
        (task,) = book._pending
        while not task.done():
            await asyncio.sleep(0)
        assert task in book._pending  # its done callback has not run yet
        await asyncio.wait_for(book.drain(), 2)

    asyncio.run(scenario())
    book.close()
    assert len(delivered) == 1
