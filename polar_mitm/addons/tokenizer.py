"""`TokenizerAddon`: loads the policy tokenizer (`polar_tokenizer`) and warms it at start-up."""

from __future__ import annotations

from mitmproxy import ctx

from ..tokens.tokenizer import PolicyTokenizer, TokenizerError, load_tokenizer
from .options import _errors, log


class TokenizerAddon:
    def __init__(self) -> None:
        self.tokenizer: PolicyTokenizer | None = None

    def load(self, loader) -> None:
        loader.add_option(
            "polar_tokenizer",
            str,
            "",
            "Policy tokenizer for fidelity checks and count_tokens: a local Hugging Face tokenizer "
            "dir (with its chat template), tiktoken:<encoding name or .tiktoken file>, or "
            "gguf:<model.gguf> (the tokenizer and chat template inside a GGUF model file).",
        )

    def configure(self, updated: set[str]) -> None:
        if "polar_tokenizer" not in updated:
            return
        spec = ctx.options.polar_tokenizer
        if not spec:
            self.tokenizer = None
            return
        try:
            tokenizer = load_tokenizer(spec)
        except TokenizerError as e:
            _errors.fail(f"polar_tokenizer: {e}")
            return
        try:
            tokenizer.warm()  # at load, before anything shares it (and before "capturing")
        except Exception as e:  # a template that cannot render a plain turn is no reason to stop
            log.warning("polar_tokenizer: warm-up render failed: %s", e)
        self.tokenizer = tokenizer
