"""What the reference server "samples" for a request: prompt ids, output ids, logprobs, finish reason.

Kind-neutral: the same :class:`Sample` feeds the vLLM wire today and an SGLang wire later. Building it
is the expensive part of a request (chat template + tokenization), so the server runs :func:`sample`
in a worker thread and the renderer caches the tokenizer work.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from .render import Renderer, RequestError
from .scenario import Scenario, Turn
from .wire import ChatCall

_MASK64 = (1 << 64) - 1


def fake_logprob(position: int, token_id: int) -> float:
    """A deterministic pseudo-random logprob in [-4, 0) for the token sampled at ``position``.

    splitmix64 of (position, token id), rounded to float32 like vLLM's tensors, so the same request
    always gets the same numbers and a float32 column stores them exactly.
    """
    x = ((position << 32) ^ token_id) & _MASK64
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    x ^= x >> 31
    u = (x >> 11) / float(1 << 53)  # [0, 1)
    value = struct.unpack("f", struct.pack("f", -4.0 * (1.0 - u)))[0]
    return value if value < 0.0 else -1e-7  # float32 rounding must not reach 0


@dataclass(frozen=True)
class Sample:
    """One generated choice. ``ids`` include the EOS token when ``finish_reason == "stop"``.

    ``finish_override`` is the scenario's ``finish_reason`` knob: the wire reports it instead of what
    it would have computed (``stop``/``length``/``tool_calls``).
    """

    prompt_ids: tuple[int, ...]
    ids: tuple[int, ...]
    pieces: tuple[str, ...]
    token_strs: tuple[str, ...]
    logprobs: tuple[float, ...]
    finish_reason: str
    stop_reason: int | str | None
    finish_override: str | None
    reasoning_open: bool | None
    think_ids: tuple[int | None, int | None]
    turn: Turn
    script: str

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def _system_and_first_user(messages: list[dict]) -> tuple[str, str]:
    system = "\n".join(m["content"] for m in messages if m["role"] in ("system", "developer"))
    first_user = next((m["content"] for m in messages if m["role"] == "user"), "")
    return system, first_user


def _tool_names(call: ChatCall) -> list[str]:
    return [t["function"]["name"] for t in call.render.tools or ()]


def pick_turn(scenario: Scenario, call: ChatCall) -> tuple[str, Turn]:
    """The scripted turn for this request (stateless: turn index = assistant messages so far)."""
    messages = call.render.messages
    system, first_user = _system_and_first_user(messages)
    assistant_turns = sum(1 for m in messages if m["role"] == "assistant")
    users = [m["content"] for m in messages if m["role"] == "user"]
    last_user = users[-1] if users else ""
    every = "\n".join(str(m.get("content") or "") for m in messages)
    try:
        script, turn = scenario.turn(
            system, first_user, _tool_names(call), assistant_turns, last_user, every
        )
    except LookupError as e:
        raise RequestError(str(e)) from None
    return script.name, turn


def token_limit(
    n_prompt: int,
    max_tokens: int | None,
    max_model_len: int,
    limits: str = "0.33",
    param: str = "max_tokens",
) -> int:
    """How many tokens a request may generate; raises :class:`RequestError` for the length limits
    the imitated server refuses. ``limits`` is the server's way (``versions.VLLM_LIMITS`` or
    ``sglang``), ``param`` the cap's request name (vLLM names ``max_completion_tokens`` when set).

    * vLLM 0.33 (``vllm/renderers/params.py`` ``TokenizeParams.__post_init__`` and
      ``_token_len_check``, ``serve/utils/api_utils.py`` ``get_max_tokens``): a cap above
      ``max_model_len`` is refused before the prompt is looked at; a prompt above it is refused; a
      cap that only does not fit beside the prompt is clamped to what is left, silently.
    * vLLM 0.10: ``prompt >= max_model_len`` and ``prompt + max_tokens > max_model_len`` refused.
    * SGLang 0.5.23 (``managers/tokenizer_manager.py`` ``_validate_one_request``): the same two
      refusals, in SGLang's words.
    """
    if limits == "0.33":
        return _limit_vllm_033(n_prompt, max_tokens, max_model_len, param)
    if limits == "sglang":
        return _limit_sglang(n_prompt, max_tokens, max_model_len)
    if n_prompt >= max_model_len:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{n_prompt} input tokens. Please reduce the length of the input messages. "
            f"(parameter=input_tokens, value={n_prompt})",
            param="input_tokens",
        )
    limit = max_model_len - n_prompt
    if max_tokens is not None:
        _at_least_one(max_tokens)
        if max_tokens > limit:
            raise RequestError(
                f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's "
                f"maximum context length is {max_model_len} tokens and your request has {n_prompt} input "
                f"tokens ({max_tokens} > {max_model_len} - {n_prompt}). "
                f"(parameter=max_tokens, value={max_tokens})",
                param="max_tokens",
            )
        limit = max_tokens
    return limit


def prompt_too_long_033(n_prompt: int, max_model_len: int, qualifier: str = "") -> RequestError:
    """vLLM 0.33's refusal of a prompt longer than the whole context (``_token_len_check``)."""
    return RequestError(
        f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
        f"contains {qualifier}{n_prompt} input tokens, which exceeds this limit even without any "
        f"output tokens. Please reduce the length of the input prompt. "
        f"(parameter=input_tokens, value={n_prompt})",
        param="input_tokens",
    )


def _at_least_one(max_tokens: int) -> None:
    if max_tokens < 1:  # vllm/sampling_params.py SamplingParams._verify_args
        raise RequestError(
            f"max_tokens must be at least 1, got {max_tokens}. "
            f"(parameter=max_tokens, value={max_tokens})",
            param="max_tokens",
        )


def _limit_vllm_033(n_prompt: int, max_tokens: int | None, max_model_len: int, param: str) -> int:
    if max_tokens is not None and max_tokens > max_model_len:
        raise RequestError(
            f"{param}={max_tokens} cannot be greater than max_model_len={max_model_len}. "
            f"Please request fewer output tokens. (parameter={param}, value={max_tokens})",
            param=param,
        )
    if n_prompt > max_model_len:
        raise prompt_too_long_033(n_prompt, max_model_len)
    limit = max_model_len - n_prompt
    if max_tokens is not None:
        limit = min(limit, max_tokens)
    _at_least_one(limit)  # a prompt of exactly max_model_len leaves 0
    return limit


def _limit_sglang(n_prompt: int, max_tokens: int | None, max_model_len: int) -> int:
    if n_prompt >= max_model_len:
        raise RequestError(
            f"The input ({n_prompt} tokens) is longer than the model's context length "
            f"({max_model_len} tokens)."
        )
    limit = max_model_len - n_prompt
    if max_tokens is not None:
        if max_tokens + n_prompt > max_model_len:
            raise RequestError(
                f"Requested token count exceeds the model's maximum context length of "
                f"{max_model_len} tokens. You requested a total of {max_tokens + n_prompt} tokens: "
                f"{n_prompt} tokens from the input messages and {max_tokens} tokens for the "
                f"completion. Please reduce the number of tokens in the input messages or the "
                f"completion to fit within the limit."
            )
        limit = max_tokens
    return limit


def sample(
    renderer: Renderer,
    scenario: Scenario,
    call: ChatCall,
    max_model_len: int,
    limits: str = "0.33",
) -> Sample:
    """Render the prompt, pick the scripted turn, tokenize it and apply the length limits.

    Raises :class:`RequestError` for requests the imitated server refuses (see
    :func:`token_limit`; ``limits`` says whose rules).
    """
    if limits == "0.33":  # the cap is checked before the prompt is rendered
        token_limit(0, call.max_tokens, max_model_len, limits, call.max_tokens_param)
    at_least = renderer.min_prompt_tokens(call.render)
    if at_least > max_model_len or (at_least == max_model_len and limits != "0.33"):
        # far too long: say so without tokenizing it (20 MB: 30 s)
        if limits == "0.33":
            raise prompt_too_long_033(at_least, max_model_len, "at least ")
        if limits == "sglang":
            token_limit(at_least, None, max_model_len, limits)
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"at least {at_least} input tokens. Please reduce the length of the input messages. "
            f"(parameter=input_tokens, value={at_least})",
            param="input_tokens",
        )
    prompt = renderer.prompt(call.render)
    n_prompt = len(prompt.ids)
    limit = token_limit(n_prompt, call.max_tokens, max_model_len, limits, call.max_tokens_param)
    script, turn = pick_turn(scenario, call)
    completion = renderer.completion(call.render, turn)
    n = min(len(completion.ids), limit)
    finish = "stop" if n == len(completion.ids) else "length"
    ids = completion.ids[:n]
    return Sample(
        prompt_ids=prompt.ids,
        ids=ids,
        pieces=completion.pieces[:n],
        token_strs=completion.token_strs[:n],
        logprobs=tuple(fake_logprob(i, t) for i, t in enumerate(ids)),
        finish_reason=finish,
        stop_reason=None,
        finish_override=turn.finish_reason,
        reasoning_open=renderer.reasoning_open_at_end(prompt.ids),
        think_ids=(renderer.think_start_id, renderer.think_end_id),
        turn=turn,
        script=script,
    )
