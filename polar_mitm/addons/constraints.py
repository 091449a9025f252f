"""`ConstraintsAddon`: what the proxy sends upstream of a constraint that only serves the harness
(`polar_harness_constraints`), and where a grammar starts in an output (docs/constrained.md)."""

from __future__ import annotations

from mitmproxy import ctx

from ..upstream.constraints import DROP, MODES, ThinkMarkers
from .options import _errors
from .tokenizer import TokenizerAddon


class ConstraintsAddon:
    def __init__(self, tokenizer: TokenizerAddon) -> None:
        self.tokenizer = tokenizer
        self.mode = DROP
        self.markers: ThinkMarkers | None = None

    def load(self, loader) -> None:
        loader.add_option(
            "polar_harness_constraints",
            str,
            DROP,
            "What to send upstream of a harness's parallel_tool_calls=false, which vLLM enforces "
            "with a grammar whose logprobs are not the policy's: 'drop' leaves it out (the policy "
            "samples from its own distribution; a reply with several tool calls reaches the "
            "harness as it is), 'pass' sends it (those tokens are recorded as constrained: "
            "constrained_by / constrained_from, flag constrained_sampling). tool_choice "
            "required or named, strict tools and response_format are always sent and recorded.",
        )

    def configure(self, updated: set[str]) -> None:
        if "polar_harness_constraints" in updated:
            mode = ctx.options.polar_harness_constraints.strip().lower()
            if mode not in MODES:
                _errors.fail(
                    f"polar_harness_constraints: {ctx.options.polar_harness_constraints!r} is "
                    f"not one of {', '.join(MODES)}"
                )
                return
            self.mode = mode
        if "polar_tokenizer" in updated:
            tok = self.tokenizer.tokenizer
            self.markers = ThinkMarkers.of(tok.specials) if tok is not None else None
