"""`FidelityAddon`: the options and the lifetime of the fidelity checks (`polar_fidelity`), one
step of the call's pipeline (`addons/pipeline.py`)."""

from __future__ import annotations

from mitmproxy import ctx

from ..tokens.fidelity import MODES as FIDELITY_MODES
from ..tokens.fidelity import describe as describe_fidelity
from .options import _errors, log
from .pipeline import CallPipeline
from .tokenizer import TokenizerAddon


class FidelityAddon:
    """`polar_fidelity`: how the pipeline checks each finished call against the policy
    tokenizer (see tokens/fidelity.py), and the drain of the checks in flight at shutdown."""

    def __init__(self, tokenizer: TokenizerAddon, pipeline: CallPipeline) -> None:
        self.tokenizer = tokenizer
        self.pipeline = pipeline
        self.stage = pipeline.checks

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
        self.pipeline.configure_checks(mode, self.tokenizer.tokenizer)

    def running(self) -> None:
        log.info("polar-mitm: %s", describe_fidelity(self.stage.mode, self.stage.tokenizer))

    async def done(self) -> None:
        # Runs after the capture and the no-ids fallback have handed over their last records
        # and before the trajectories write the open rollouts (addon order).
        await self.stage.drain()
        self.stage.close()
