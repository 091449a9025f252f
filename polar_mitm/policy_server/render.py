"""vLLM-faithful prompt rendering and scripted-turn tokenization with a Hugging Face tokenizer.

The reference server is only useful if its ``prompt_token_ids`` are the ones vLLM would compute for the
same request, so this module reproduces vLLM's message normalization for a *string-content* chat
template such as Qwen3's (``vllm/entrypoints/chat_utils.py``: ``_parse_chat_message_content`` and
``_postprocess_messages``; tools are ``ChatCompletionToolsParam.model_dump()``):

* text content parts (``text``/``input_text``/``output_text``, ``refusal``, ``thinking``) are joined
  with ``"\\n"``; missing or ``null`` content becomes ``""``;
* an assistant message's ``reasoning`` (or the deprecated ``reasoning_content``, which vLLM renames on
  input) is handed to the template as both ``reasoning`` and ``reasoning_content``;
* assistant ``tool_calls`` with JSON-string ``arguments`` are parsed to objects (invalid JSON -> ``{}``),
  an empty ``tool_calls`` list is dropped;
* every other message key but ``name`` and a tool message's ``tool_call_id`` is dropped;
* each tool becomes ``{"type": "function", "function": {"name", "description", "parameters"}}`` with
  ``null`` for a missing description/parameters, as pydantic's ``model_dump`` writes them.

A scripted turn's output ids are the real tokenization of the assistant turn as the chat template
renders it: the conversation plus the scripted message is rendered without a generation prompt, the
text after the generation-prompt rendering is what the model "wrote", and it is cut right after the
end-of-turn token, so the ids end with ``<|im_end|>`` (vLLM's ``token_ids`` include the EOS the model
sampled; its text does not).

When the full rendering does not start with the prompt rendering (Qwen3 with
``enable_thinking: false`` and a scripted ``reasoning``: the prompt already closed the think block),
the turn is rendered again without its reasoning; if that still does not line up, the text after the
longest common prefix is used and ``Completion.fallback`` says so. Both are logged.

Results are cached (LRU keyed by a hash of the request), so a benchmark can drive the server fast.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .scenario import Turn

log = logging.getLogger(__name__)

_TEXT_PART_KEYS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
# apply_chat_template's own parameters: a chat_template_kwargs key with one of these names would change
# what transformers does rather than reach the template, which vLLM never does.
_RESERVED_TEMPLATE_KWARGS = {
    "conversation",
    "tools",
    "documents",
    "chat_template",
    "add_generation_prompt",
    "continue_final_message",
    "tokenize",
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "return_dict",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
    "sanitize_control_tokens",
}


class RequestError(ValueError):
    """The request cannot be rendered (vLLM answers these with 400 BadRequestError)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where}.content must be a string or a list of parts", param="messages")
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, Mapping):
            raise RequestError(f"{where}.content parts must be objects", param="messages")
        key = _TEXT_PART_KEYS.get(part.get("type", "text"))
        if key is None:
            raise RequestError(
                f"Unsupported chat content part type: {part.get('type')!r} "
                "(the reference policy server renders text only).",
                param="type",
            )
        text = part.get(key)
        if text is None:  # vLLM skips text parts without text
            continue
        texts.append(str(text))
    return "\n".join(texts)


def _normalize_tool_call(call: Any) -> Any:
    call = copy.deepcopy(call)
    function = call.get("function") if isinstance(call, dict) else None
    if isinstance(function, dict):
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                function["arguments"] = json.loads(arguments)
            except json.JSONDecodeError:
                function["arguments"] = {}
        elif not isinstance(arguments, dict | list):
            function["arguments"] = {}
    return call


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """vLLM's conversation for a string-content template (see the module docstring)."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list", param="messages")
    conversation = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise RequestError(f"{where} must be an object with a string 'role'", param="messages")
        role = message["role"]
        out: dict[str, Any] = {
            "role": role,
            "content": _content_text(message.get("content"), where),
        }
        if role == "assistant":
            tool_calls = message.get("tool_calls")
            if isinstance(tool_calls, list) and tool_calls:
                out["tool_calls"] = [_normalize_tool_call(c) for c in tool_calls]
            reasoning = message.get("reasoning")
            if reasoning is None:
                reasoning = message.get("reasoning_content")
            if reasoning is not None:
                out["reasoning"] = out["reasoning_content"] = str(reasoning)
        elif role == "tool" and "tool_call_id" in message:
            out["tool_call_id"] = message["tool_call_id"]
        if isinstance(message.get("name"), str):
            out["name"] = message["name"]
        conversation.append(out)
    return conversation


def normalize_tools(tools: Any) -> list[dict[str, Any]] | None:
    """``[tool.model_dump() for tool in request.tools]`` as vLLM hands tools to the template."""
    if tools is None:
        return None
    if not isinstance(tools, list) or not tools:
        raise RequestError(
            "`tools` must not be an empty array. Either provide at least one tool or omit the field entirely.",
            param="tools",
        )
    out = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or tool.get("type", "function") != "function":
            raise RequestError(f"tools[{i}] must be a function tool", param="tools")
        if not isinstance(function.get("name"), str):
            raise RequestError(f"tools[{i}].function.name must be a string", param="tools")
        fn: dict[str, Any] = {
            "name": function["name"],
            "description": function.get("description"),
            "parameters": function.get("parameters"),
        }
        for optional in ("strict", "defer_loading"):
            if function.get(optional) is not None:
                fn[optional] = function[optional]
        entry: dict[str, Any] = {"type": "function", "function": fn}
        if tool.get("defer_loading") is not None:
            entry["defer_loading"] = tool["defer_loading"]
        out.append(entry)
    return out


def template_kwargs(chat_template_kwargs: Any, reasoning_effort: Any = None) -> dict[str, Any]:
    """The extra template variables vLLM passes: the request's ``chat_template_kwargs`` (minus
    ``apply_chat_template``'s own parameter names) and ``enable_thinking`` derived from
    ``reasoning_effort`` when the request did not set it (newer vLLM)."""
    if chat_template_kwargs is None:
        kwargs: dict[str, Any] = {}
    elif isinstance(chat_template_kwargs, Mapping):
        kwargs = {
            k: v for k, v in chat_template_kwargs.items() if k not in _RESERVED_TEMPLATE_KWARGS
        }
    else:
        raise RequestError("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    if reasoning_effort is not None and "enable_thinking" not in kwargs:
        kwargs["enable_thinking"] = reasoning_effort != "none"
    return kwargs


@dataclass(frozen=True)
class RenderInput:
    """Everything that determines a prompt: normalized, so equal inputs hash equally."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    kwargs: dict[str, Any]
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @property
    def key(self) -> str:
        blob = json.dumps(
            [
                self.messages,
                self.tools,
                self.kwargs,
                self.add_generation_prompt,
                self.continue_final_message,
            ],
            sort_keys=True,
            ensure_ascii=False,
            default=str,
        )
        return hashlib.sha256(blob.encode()).hexdigest()


@dataclass(frozen=True)
class Prompt:
    ids: tuple[int, ...]
    text: str


@dataclass(frozen=True)
class Completion:
    """What the model "samples" for a scripted turn.

    ``pieces[i]`` is the text token ``i`` adds to the detokenized output (special tokens skipped,
    ``""`` while a multi-byte character is incomplete), so ``"".join(pieces)`` is vLLM's output text.
    ``token_strs[i]`` is the token's own decoded string, as vLLM reports it in ``logprobs.content``.
    """

    ids: tuple[int, ...]
    pieces: tuple[str, ...]
    token_strs: tuple[str, ...]
    fallback: bool = False


class _LRU:
    """A small thread-safe LRU: rendering runs in worker threads."""

    def __init__(self, size: int):
        self._size = size
        self._data: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get_or_make(self, key: Hashable, make: Callable[[], Any]) -> Any:
        with self._lock:
            if key in self._data:
                self._data.move_to_end(key)
                return self._data[key]
        value = make()
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self._size:
                self._data.popitem(last=False)
        return value

    def clear(self) -> None:
        with self._lock:
            self._data.clear()


def _turn_key(turn: Turn) -> str:
    return json.dumps(
        [turn.reasoning, turn.content, [(c.name, c.arguments) for c in turn.tool_calls]],
        sort_keys=True,
        ensure_ascii=False,
        default=str,
    )


class Renderer:
    """Renders prompts and scripted completions with one tokenizer; safe to call from threads."""

    def __init__(self, tokenizer_dir: str | Path | None = None, cache_size: int = 2048):
        from transformers import AutoTokenizer

        if tokenizer_dir is None:
            from polar_mitm.assets import qwen3_tokenizer_dir

            tokenizer_dir = qwen3_tokenizer_dir()
        self.tokenizer_dir = Path(tokenizer_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.tokenizer_dir))
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"tokenizer in {self.tokenizer_dir} has no chat template")
        eos = self.tokenizer.eos_token_id
        if eos is None:
            raise ValueError(f"tokenizer in {self.tokenizer_dir} has no eos token")
        self.eos_token_id: int = eos
        vocab = self.tokenizer.get_vocab()
        self.think_start_id: int | None = vocab.get("<think>")
        self.think_end_id: int | None = vocab.get("</think>")
        self.turn_start_id: int | None = vocab.get("<|im_start|>")
        self.max_model_len: int = _max_model_len(self.tokenizer)
        self._prompts = _LRU(cache_size)
        self._completions = _LRU(cache_size)
        self._token_strs: dict[int, str] = {}
        # Fast tokenizers are not safe to drive from several threads at once (transformers may
        # reconfigure truncation/padding on the shared Rust object: "Already borrowed").
        self._lock = threading.RLock()

    # -- prompts -----------------------------------------------------------------------------

    def _apply(
        self, inp: RenderInput, messages: list[dict[str, Any]], *, generation: bool, tokenize: bool
    ):
        try:
            with self._lock:
                return self.tokenizer.apply_chat_template(
                    messages,
                    tools=inp.tools or None,
                    add_generation_prompt=generation,
                    continue_final_message=inp.continue_final_message and not generation,
                    tokenize=tokenize,
                    **inp.kwargs,
                )
        except Exception as e:  # jinja TemplateError and friends: vLLM answers 400
            raise RequestError(f"chat template failed: {e}") from e

    def prompt(self, inp: RenderInput) -> Prompt:
        """``apply_chat_template(..., add_generation_prompt=True, tokenize=True)["input_ids"]``."""

        def make() -> Prompt:
            text = self._apply(
                inp, inp.messages, generation=inp.add_generation_prompt, tokenize=False
            )
            encoded = self._apply(
                inp, inp.messages, generation=inp.add_generation_prompt, tokenize=True
            )
            ids = encoded["input_ids"] if isinstance(encoded, Mapping) else encoded
            return Prompt(ids=tuple(int(i) for i in ids), text=text)

        return self._prompts.get_or_make(inp.key, make)

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        with self._lock:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int]) -> str:
        with self._lock:
            return self.tokenizer.decode(list(ids))

    def token_names(self, ids: Sequence[int]) -> list[str]:
        """The vocabulary entries of ``ids`` (``/tokenize``'s ``token_strs``)."""
        with self._lock:
            return list(self.tokenizer.convert_ids_to_tokens(list(ids)))

    # -- scripted completions ----------------------------------------------------------------

    def completion(self, inp: RenderInput, turn: Turn) -> Completion:
        """The token ids the model "samples" for ``turn`` after this prompt (cached)."""
        return self._completions.get_or_make(
            (inp.key, _turn_key(turn)), lambda: self._make_completion(inp, turn)
        )

    def _assistant_message(self, turn: Turn, with_reasoning: bool) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": turn.content}
        if with_reasoning and turn.reasoning is not None:
            message["reasoning_content"] = turn.reasoning
        if turn.tool_calls:
            message["tool_calls"] = [
                {"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in turn.tool_calls
            ]
        return message

    def _make_completion(self, inp: RenderInput, turn: Turn) -> Completion:
        prompt_text = self.prompt(inp).text
        fallback = False
        text = None
        attempts = [True, False] if turn.reasoning is not None else [True]
        for with_reasoning in attempts:
            full = self._apply(
                inp,
                [*inp.messages, self._assistant_message(turn, with_reasoning)],
                generation=False,
                tokenize=False,
            )
            if full.startswith(prompt_text):
                text = full[len(prompt_text) :]
                if not with_reasoning:
                    log.warning(
                        "scripted reasoning dropped: the prompt already closed the think block"
                    )
                break
        if text is None:
            common = _common_prefix_len(prompt_text, full)
            text = full[common:]
            fallback = True
            log.warning(
                "chat template does not render the scripted turn as a continuation of the prompt; "
                "using the rendered text after the common prefix (%d chars)",
                common,
            )
        ids = self.encode_text(text, add_special_tokens=False)
        if self.eos_token_id in ids:
            ids = ids[: ids.index(self.eos_token_id) + 1]
        else:
            ids.append(self.eos_token_id)
        return Completion(
            ids=tuple(ids),
            pieces=tuple(self._pieces(ids)),
            token_strs=tuple(self.token_str(i) for i in ids),
            fallback=fallback,
        )

    def _pieces(self, ids: Sequence[int]) -> list[str]:
        """Per-token detokenized deltas, as vLLM's incremental detokenizer produces them."""
        backend = getattr(self.tokenizer, "_tokenizer", None)
        try:
            from tokenizers.decoders import DecodeStream
        except ImportError:  # pragma: no cover - old tokenizers
            DecodeStream = None  # noqa: N806
        if backend is not None and DecodeStream is not None:
            stream = DecodeStream(skip_special_tokens=True)
            with self._lock:
                return [stream.step(backend, i) or "" for i in ids]
        pieces, previous = [], ""
        for n in range(1, len(ids) + 1):
            with self._lock:
                text = self.tokenizer.decode(list(ids[:n]), skip_special_tokens=True)
            if text.endswith("\ufffd"):
                pieces.append("")
                continue
            pieces.append(text[len(previous) :])
            previous = text
        return pieces

    def token_str(self, token_id: int) -> str:
        """A token's decoded string (vLLM's ``Logprob.decoded_token``), cached per id."""
        value = self._token_strs.get(token_id)
        if value is None:
            with self._lock:
                value = self.tokenizer.decode([token_id])
                self._token_strs[token_id] = value
        return value

    def reasoning_open_at_end(self, prompt_ids: Sequence[int]) -> bool | None:
        """Whether the generation prompt itself left a think block open (``True``), closed
        (``False``: e.g. Qwen3 with ``enable_thinking: false``) or never opened it (``None``).

        Only the last turn is inspected: vLLM versions that scanned the whole prompt mistook a
        previous assistant turn's ``</think>`` for "reasoning already ended" (vllm PR #32490).
        """
        for token in reversed(prompt_ids):
            if token == self.think_end_id:
                return False
            if token == self.think_start_id:
                return True
            if token == self.turn_start_id:
                return None
        return None

    def clear_caches(self) -> None:
        self._prompts.clear()
        self._completions.clear()


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _max_model_len(tokenizer: Any) -> int:
    value = getattr(tokenizer, "model_max_length", None)
    if isinstance(value, int) and 0 < value < 10**8:
        return value
    return 40960
