"""The token-in request exact-prefix mode sends to vLLM, and the reference server's answer to it
in vLLM 0.32/0.33's shapes (`vllm/entrypoints/openai/completion/serving.py`): with `logprobs: 0`
and `return_tokens_as_token_ids` the sampled ids come back as `"token_id:N"` names, and the
prompt's ids never come back (no `return_token_ids`), in a stream or a whole reply."""

from __future__ import annotations

import json

from polar_reference.render import Renderer

from polar_mitm.assets import qwen3_tokenizer_dir
from polar_mitm.tokens.conversation import render_input
from polar_mitm.upstream import UPSTREAMS, TokenTally

from .test_sglang import TOOL_TURN, _serve


def _events(text: str) -> list[dict]:
    data = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_the_proxy_asks_for_sampled_ids_without_the_prompt_echo():
    vllm = UPSTREAMS["vllm"]("http://x")
    body = vllm.token_in_body([1, 2, 3], {"max_tokens": 9}, model="m", stream=True)
    assert body["logprobs"] == 0 and body["return_tokens_as_token_ids"] is True
    assert "return_token_ids" not in body and body["prompt"] == [1, 2, 3]
    assert body["stream_options"] == {"include_usage": True} and body["max_tokens"] == 9


def test_reference_completions_answer_as_vllm_does():
    renderer = Renderer(qwen3_tokenizer_dir())
    prompt = list(renderer.prompt(render_input(TOOL_TURN)).ids)
    vllm = UPSTREAMS["vllm"]("http://x")
    sent = vllm.token_in_body(prompt, {"max_tokens": 64}, model=None, stream=True)
    whole = vllm.token_in_body(prompt, {"max_tokens": 64}, model=None, stream=False)
    echo = {**sent, "return_token_ids": True}
    echo.pop("return_tokens_as_token_ids")
    (s1, streamed), (s2, reply), (s3, echoed) = _serve("vllm", raw=True)(
        ("POST", "/v1/completions", sent),
        ("POST", "/v1/completions", whole),
        ("POST", "/v1/completions", echo),
    )
    assert s1 == s2 == s3 == 200
    chunks = _events(streamed)
    *tokens, usage = chunks
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens"] == len(prompt)
    for chunk in tokens:
        [choice] = chunk["choices"]
        # set on every chunk by vLLM (exclude_unset keeps them): null without return_token_ids
        assert choice["prompt_token_ids"] is None and choice["token_ids"] is None
        lp = choice["logprobs"]
        assert all(t.startswith("token_id:") for t in lp["tokens"])
        assert lp["top_logprobs"] == [
            {t: v} for t, v in zip(lp["tokens"], lp["token_logprobs"], strict=True)
        ]
    # the names' lengths advance the offsets, across chunks too
    offsets = [o for c in tokens for o in c["choices"][0]["logprobs"]["text_offset"]]
    names = [t for c in tokens for t in c["choices"][0]["logprobs"]["tokens"]]
    assert offsets == [sum(len(n) for n in names[:i]) for i in range(len(names))]
    tally = TokenTally()
    for chunk in chunks:
        vllm.take_text(chunk, tally)
    # the same ids the echoing request gets as token_ids (what the proxy asked for before)
    echo_ids = [i for c in _events(echoed)[:-1] for i in c["choices"][0]["token_ids"]]
    assert tally.output_ids == echo_ids and len(tally.logprobs) == len(echo_ids)
    assert _events(echoed)[0]["choices"][0]["prompt_token_ids"] == prompt
    assert tally.finish_reason == "stop" and tally.prompt_ids is None
    whole_reply = json.loads(reply)
    [choice] = whole_reply["choices"]
    assert choice["prompt_token_ids"] is None and choice["token_ids"] is None
    whole_tally = TokenTally()
    vllm.take_text(whole_reply, whole_tally)
    assert whole_tally.output_ids == echo_ids and whole_tally.logprobs == tally.logprobs


def test_the_reference_server_decodes_only_what_a_prompt_adds():
    """`Renderer.decode_prompt` reuses the text of an earlier prompt up to its last special
    token; whatever the split, the text is the whole prompt decoded at once (here with
    multi-byte characters cut between ids in the new part). Sessions that share a long system
    prompt, taking turns (the long load's eight), each find their own earlier prompt: a later
    call decodes only the ids its prompt adds."""
    renderer = Renderer(qwen3_tokenizer_dir())
    decoded: list[int] = []
    whole = renderer.decode

    def counting(ids):
        decoded.append(len(ids))
        return whole(ids)

    renderer.decode = counting  # type: ignore[method-assign]
    system = "You are an agent. 日本語のテキスト ✓ " * 60
    first = [{"role": "system", "content": system}, {"role": "user", "content": "go 🙂"}]
    start = list(renderer.prompt(render_input({"messages": first})).ids)
    sessions = [list(start) for _ in range(8)]  # each a token-in chain: earlier ids, then more
    emoji = renderer.encode_text("🙂🙂", add_special_tokens=False)
    for turn in range(4):
        for n, prompt in enumerate(sessions):
            before = len(prompt)
            prompt += renderer.encode_text(
                f"reply {turn} ✓<|im_end|>\n<|im_start|>user\nsession {n} turn {turn}: "
                "🙂 naïve café 漢字<|im_end|>\n<|im_start|>assistant\n",
                add_special_tokens=False,
            )
            for ids in (prompt, prompt + emoji[:1]):  # the second ends inside a character
                decoded.clear()
                assert renderer.decode_prompt(ids) == whole(ids)
                if turn:  # only the new turn (and what follows the last special token)
                    assert 0 < sum(decoded) <= len(ids) - before + 2, (n, turn)


def test_the_reference_server_refuses_ids_that_are_no_tokens():
    """Out of the vocabulary or not an int: a 400 naming the range, on either kind's endpoint
    (vLLM's body is read as an int32 array, SGLang's as a list)."""
    vocab = len(Renderer(qwen3_tokenizer_dir()).tokenizer)
    [(s1, r1), (s2, r2)] = _serve("vllm")(
        ("POST", "/v1/completions", {"prompt": [1, vocab], "max_tokens": 4}),
        ("POST", "/v1/completions", {"prompt": [1, -2], "max_tokens": 4}),
    )
    [(s3, r3), (s4, r4)] = _serve("sglang")(
        ("POST", "/generate", {"input_ids": [1, True], "sampling_params": {}}),
        ("POST", "/generate", {"input_ids": [1, vocab], "sampling_params": {}}),
    )
    assert s1 == s2 == s3 == s4 == 400
    for reply in (r1, r2, r3, r4):
        assert f"must be integers in [0, {vocab})" in json.dumps(reply)
