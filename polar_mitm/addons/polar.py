"""`polar_addons()`: the addons of `mitmdump -s addons/polar.py`, wired together in the order their
hooks must run."""

from __future__ import annotations

from ..control import ControlState
from ..metrics import MetricsAddon
from ..tokenizer_record import TokenizerRecordAddon
from ..tokens.fidelity import FidelityStage
from .capture import CaptureAddon
from .constraints import ConstraintsAddon
from .control import ControlAddon
from .exact_prefix import ExactPrefixAddon
from .fidelity import FidelityAddon
from .identity import RolloutIdentityAddon
from .pipeline import CallPipeline
from .retokenize import RetokenizeAddon
from .setup import ProxySetup
from .store import StoreAddon
from .tokenizer import TokenizerAddon
from .trajectory import TrajectoryAddon
from .warmup import WarmUpAddon


def polar_addons() -> list[object]:
    """The addons of `mitmdump -s addons/polar.py`, wired together. A finished call goes through
    one `CallPipeline` (its steps, in order: addons/pipeline.py): the control state stamps it,
    the trajectories merge it, the fidelity checks run, then the store and the metrics get it."""
    identity = RolloutIdentityAddon()
    tokenizer = TokenizerAddon()
    retokenize = RetokenizeAddon(tokenizer)
    exact = ExactPrefixAddon(tokenizer)
    store = StoreAddon()
    state = ControlState()
    trajectory = TrajectoryAddon(store, state, exact)
    metrics = MetricsAddon(state, trajectory.rollouts, store)
    pipeline = CallPipeline(
        control=state, rollouts=trajectory.rollouts, checks=FidelityStage(), final=[store, metrics]
    )
    fidelity = FidelityAddon(tokenizer, pipeline)
    constraints = ConstraintsAddon(tokenizer)  # what goes upstream of parallel_tool_calls=false
    warmup = WarmUpAddon()  # its running() warms the proxy before it says it is capturing
    capture = CaptureAddon(
        identity,
        sinks=[pipeline],
        retokenize=retokenize,
        control=state,
        tokenizer=tokenizer,
        exact=exact,
        metrics=metrics.metrics,
        constraints=constraints,
        warmup=warmup,
    )
    control = ControlAddon(
        state, trajectory.rollouts, settle=pipeline.checks.drain, metrics=metrics
    )
    # Order matters at shutdown: `done` runs in list order, so the capture finishes its in-flight
    # calls, then pending retokenizations and fidelity checks drain, the trajectories write the
    # open rollouts, and only then does the store close.
    return [
        ProxySetup(),
        identity,
        tokenizer,
        constraints,
        exact,
        control,
        warmup,
        capture,
        retokenize,
        fidelity,
        trajectory,
        store,
        metrics,
        TokenizerRecordAddon(tokenizer, store),  # after the store has started
    ]
