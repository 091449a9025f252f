"""A rollout whose harness finished with zero captured calls is an error, named loudly.

The failure every harness-RL system reports first: a harness that never went through the capture
(the proxy variables not honoured, a base URL that points past the proxy, ``NO_PROXY`` covering
the model's host) still runs, still edits its workspace, and may even pass the verifier: scored
as usual, the rollout is a sample with nothing in it to train on, and the flat reward curve is
the first anyone hears of it. A runner asks the proxy how many calls it captured for the
rollout before it scores anything, and fails the rollout with the likely cause when none were.
Standard library only (plus the control client): this runs inside NeMo Gym's venv.
"""

from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import urlsplit

from ..control import ControlClient, ControlError

# Where harnesses read a base URL from (their own config files aside): set to anything but a
# host the proxy captures, the calls go past it.
BASE_URL_VARIABLES = (
    "OPENAI_BASE_URL",
    "OPENAI_API_BASE",
    "ANTHROPIC_BASE_URL",
    "GOOGLE_GEMINI_BASE_URL",
    "OPENROUTER_BASE_URL",
)
PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")


def captured_calls(control: ControlClient, rollout_id: str) -> int | None:
    """How many calls the proxy captured for `rollout_id` (0: none, the control plane has no
    such rollout); None when the control plane could not say (unreachable, refused): that is
    reported as the control plane's own error, not as an empty rollout."""
    try:
        summary = control.rollout(rollout_id)
    except ControlError as e:
        return 0 if e.status == 404 else None
    return int(summary.get("calls") or 0)


def likely_causes(env: Mapping[str, str]) -> list[str]:
    """What in the harness's environment would send its calls past the proxy, likeliest first;
    when nothing there does, the harness ignored the variables or its config names a host."""
    causes = []
    if not any(env.get(name) for name in PROXY_VARIABLES):
        causes.append("HTTPS_PROXY is not set in its environment (the proxy variables are missing)")
    no_proxy = env.get("NO_PROXY") or env.get("no_proxy") or ""
    wide = [e.strip() for e in no_proxy.split(",") if e.strip() in ("*", ".com", "com")]
    if wide:
        causes.append(f"NO_PROXY={no_proxy!r} exempts every host ({', '.join(wide)})")
    for name in BASE_URL_VARIABLES:
        url = env.get(name)
        if url and urlsplit(url).scheme != "https":
            causes.append(f"{name}={url} is not an https URL the proxy captures (a bypass)")
    if not causes:
        causes.append(
            "the harness did not honour HTTPS_PROXY and the CA variables, or its config names a "
            "base URL that bypasses the proxy, or NO_PROXY covers the model's host"
        )
    return causes


def empty_rollout_error(harness: str, rollout_id: str, env: Mapping[str, str]) -> str:
    """The one-line error of a rollout that captured nothing, naming the likely cause."""
    return (
        f"rollout {rollout_id}: {harness} finished with zero captured calls, so there is nothing "
        f"to train on; likely cause: {'; '.join(likely_causes(env))} (docs/harnesses.md, "
        '"A rollout that captured nothing")'
    )
