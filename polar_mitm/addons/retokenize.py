"""`RetokenizeAddon`: the no-ids fallback built on the policy tokenizer (`polar_trust_retokenized`)."""

from __future__ import annotations

from mitmproxy import ctx

from ..tokens.retokenize import Retokenizer
from .tokenizer import TokenizerAddon


class RetokenizeAddon:
    """The fallback for servers that return no token ids: ids recomputed with polar_tokenizer,
    checked against the server's usage and flagged (see tokens/retokenize.py)."""

    def __init__(self, tokenizer: TokenizerAddon) -> None:
        self.tokenizer = tokenizer
        self.retokenizer: Retokenizer | None = None

    def load(self, loader) -> None:
        loader.add_option(
            "polar_trust_retokenized",
            bool,
            False,
            "Mark records whose ids were recomputed with polar_tokenizer (the server returned "
            "none) trainable when both token counts match the server's usage. Off: such records "
            "are kept but never trainable, since retokenized text need not be what was sampled.",
        )

    def configure(self, updated: set[str]) -> None:
        if not {"polar_tokenizer", "polar_trust_retokenized"} & updated:
            return
        tok = self.tokenizer.tokenizer
        self.retokenizer = (
            Retokenizer(tok, trust=ctx.options.polar_trust_retokenized) if tok is not None else None
        )

    def describe(self) -> str:
        """One phrase for the start-up line."""
        r = self.retokenizer
        if r is None:
            return "no-ids fallback off (no polar_tokenizer)"
        if not r.available:
            return f"no-ids fallback off ({r.tokenizer.spec} has no chat template)"
        trust = ", trusted" if r.trust else ""
        return f"no-ids fallback: retokenize with {r.tokenizer.spec}{trust}"

    async def drain(self) -> None:
        if self.retokenizer is not None:
            await self.retokenizer.drain()

    async def done(self) -> None:
        # Runs before StoreAddon.done (addon order): records still being retokenized must reach
        # the store before it closes.
        await self.drain()
