"""`FidelityAddon`: token fidelity checks of every call (`polar_fidelity`), between the merge and the store."""

from __future__ import annotations

from typing import Any

from mitmproxy import ctx

from ..call.record import (
    CallRecord,
)
from ..tokens.fidelity import MODES as FIDELITY_MODES
from ..tokens.fidelity import FidelityStage
from ..tokens.fidelity import describe as describe_fidelity
from .options import _errors, log
from .tokenizer import TokenizerAddon


class FidelityAddon:
    """`polar_fidelity`: each finished call is merged into its rollout, checked against the
    policy tokenizer off the event loop, then stored (see tokens/fidelity.py)."""

    def __init__(self, tokenizer: TokenizerAddon, stage: FidelityStage) -> None:
        self.tokenizer = tokenizer
        self.stage = stage

    def load(self, loader) -> None:
        loader.add_option(
            "polar_fidelity",
            str,
            "check",
            "Token fidelity checks of each call against polar_tokenizer, after the harness has "
            "its reply: off; check (flag bpe_resplit, template_rerender, reasoning_dropped, "
            "tool_args_reserialized, special_tokens, count_mismatch in fidelity_flags, with "
            "positions in fidelity_json); strict (also mark every trace of a rollout with a "
            "drift not trainable).",
        )

    def configure(self, updated: set[str]) -> None:
        if not {"polar_fidelity", "polar_tokenizer"} & updated:
            return
        mode = ctx.options.polar_fidelity.strip().lower()
        if mode not in FIDELITY_MODES:
            _errors.fail(
                f"polar_fidelity: {ctx.options.polar_fidelity!r} is not one of "
                f"{', '.join(FIDELITY_MODES)}"
            )
            return
        self.stage.configure(mode, self.tokenizer.tokenizer)

    def running(self) -> None:
        log.info("polar-mitm: %s", describe_fidelity(self.stage.mode, self.stage.tokenizer))

    def call_finished(self, record: CallRecord) -> Any:
        return self.stage.call_finished(record)  # the store's receipt, after the checks

    async def done(self) -> None:
        # Runs after the capture and the no-ids fallback have handed over their last records
        # and before the trajectories write the open rollouts (addon order).
        await self.stage.drain()
        self.stage.close()
