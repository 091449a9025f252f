"""`load_tokenizer` lets go of the Qwen tokenizer's Python copy of its vocabulary and merges."""

from __future__ import annotations

from transformers import AutoTokenizer

from polar_mitm.assets import qwen3_tokenizer_dir
from polar_mitm.tokens.tokenizer import load_tokenizer


def test_qwen_build_inputs_are_dropped_and_nothing_changes():
    tok = load_tokenizer(str(qwen3_tokenizer_dir()))
    assert tok.impl._vocab is None and tok.impl._merges is None
    full = AutoTokenizer.from_pretrained(str(qwen3_tokenizer_dir()))
    assert isinstance(full._vocab, dict) and len(full._vocab) > 150_000
    messages = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "caf\u00e9: fix the tests <tool_call>"},
    ]
    tools = [{"type": "function", "function": {"name": "run", "parameters": {"type": "object"}}}]
    text = tok.render(messages, tools, {})
    assert text == full.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False
    )
    ids = tok.encode(text)
    assert ids == full.backend_tokenizer.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids) == text
    assert tok.impl.get_vocab() == full.get_vocab()
    assert tok.specials == {t.content: i for i, t in full.added_tokens_decoder.items()}
