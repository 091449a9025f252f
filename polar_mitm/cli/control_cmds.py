"""`polar-mitm status` and `polar-mitm end`: the control plane from a shell.

A quick start, a script or a person ends a rollout with its reward the way a trainer does
(`ControlClient.end`), so its traces are written `completed` and export finds them. `--proxy` is
the proxy's own address (as in `polar-mitm env`: the request goes to the reserved control host
through it); `--control` is a `polar_control_listen` port. The token comes from
`$POLAR_CONTROL_TOKEN` or a file (`--token-file`, `$POLAR_CONTROL_TOKEN_FILE`), never from the
command line, where `ps` would show it.
"""

from __future__ import annotations

import json
import sys
import time

import click

from ..control_client import ControlClient, ControlError, control_token

PROXY = click.option(
    "--proxy",
    metavar="URL",
    default=None,
    help="The proxy, as `polar-mitm env --proxy` names it (e.g. http://127.0.0.1:8080).",
)
CONTROL = click.option(
    "--control",
    metavar="URL",
    default=None,
    help="Or the proxy's control port (polar_control_listen), e.g. http://127.0.0.1:8099.",
)
TOKEN_FILE = click.option(
    "--token-file",
    type=click.Path(dir_okay=False),
    default=None,
    help="A file holding the control token (default: $POLAR_CONTROL_TOKEN, else the file "
    "$POLAR_CONTROL_TOKEN_FILE names).",
)


def _fail(message: str) -> None:
    click.echo(f"error: {' '.join(message.split())}", err=True)
    sys.exit(1)


def client(proxy: str | None, control: str | None, token_file: str | None) -> ControlClient:
    """A ControlClient for `--proxy` or `--control`, or a one-line error."""
    if (proxy is None) == (control is None):
        _fail("give the proxy: --proxy URL (its proxy port) or --control URL (its control port)")
    try:
        token = control_token(token_file)
    except ValueError as e:
        _fail(str(e))
    if not token:
        _fail("no control token: export POLAR_CONTROL_TOKEN (the proxy's), or --token-file FILE")
    address = proxy or control or ""
    if "://" not in address:
        address = "http://" + address
    try:
        return ControlClient(
            token, proxy=address if proxy else None, url=None if proxy else address
        )
    except ValueError as e:
        _fail(f"{'--proxy' if proxy else '--control'}: {e}")
    raise AssertionError  # unreachable: _fail exits


@click.command("status", short_help="Is the proxy up: paused, policy version, calls in flight.")
@PROXY
@CONTROL
@TOKEN_FILE
@click.option(
    "--wait",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="Seconds to keep trying while the proxy is not up yet (it may still be starting).",
)
def status(proxy: str | None, control: str | None, token_file: str | None, wait: float) -> None:
    """Print the proxy's control-plane status as JSON (exit 1 when it cannot be reached).

    With --wait, a proxy that is still starting is asked again until it answers: a script
    starts the proxy in the background, then waits here before sending any traffic.
    """
    ctl = client(proxy, control, token_file)
    deadline = time.monotonic() + wait
    while True:
        try:
            answer = ctl.status()
            break
        except ControlError as e:
            if e.status != 0 or time.monotonic() >= deadline:
                _fail(str(e))
            time.sleep(0.25)
    click.echo(json.dumps(answer, sort_keys=True))


@click.command("end", short_help="End a rollout with its reward (its traces are written).")
@click.argument("rollout")
@click.option("--reward", type=float, default=None, help="The rollout's reward (default: none).")
@click.option(
    "--status",
    "state",
    type=click.Choice(["completed", "error", "incomplete"]),
    default="completed",
    show_default=True,
    help="How the rollout ended (export keeps completed ones unless --all).",
)
@PROXY
@CONTROL
@TOKEN_FILE
def end(
    rollout: str,
    reward: float | None,
    state: str,
    proxy: str | None,
    control: str | None,
    token_file: str | None,
) -> None:
    """End ROLLOUT on the proxy, as a trainer does: its traces are written with the reward.

    Again later: a new revision of its traces with the new reward (readers keep the latest).
    """
    ctl = client(proxy, control, token_file)
    try:
        answer = ctl.end(rollout, reward=reward, status=state)
    except ControlError as e:
        _fail(f"cannot end {rollout}: {e}")
    click.echo(
        f"ended {rollout}: {answer.get('status', state)}, reward {answer.get('reward')}, "
        f"{answer.get('calls', '?')} call(s), {answer.get('traces', '?')} trace(s)"
    )
