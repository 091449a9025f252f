"""`polar-mitm`: set up harness containers, run the reference policy server, inspect shards."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from .certs import DEFAULT_CONFDIR, ensure_ca, env_lines

console = Console()


def fail(message: str) -> None:
    """One clear line on stderr and a non-zero exit: what a user meets instead of a traceback."""
    click.echo(f"error: {message}", err=True)
    sys.exit(1)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="polar-mitm")
def main() -> None:
    """Capture token-exact RL training data from unmodified coding-agent harnesses."""


@main.command()
@click.option(
    "--confdir",
    type=click.Path(file_okay=False),
    default=str(DEFAULT_CONFDIR),
    show_default=True,
    help="mitmproxy confdir holding the CA.",
)
def certs(confdir: str) -> None:
    """Create the proxy's CA (once) and print the certificate path harnesses must trust."""
    click.echo(ensure_ca(confdir))


@main.command()
@click.option(
    "--proxy",
    required=True,
    help="The proxy as harness containers reach it, e.g. http://10.0.0.5:8080.",
)
@click.option(
    "--rollout",
    default=None,
    help="Rollout id (GRPO: <group>.<sample>) put in the proxy URL's credentials.",
)
@click.option(
    "--confdir",
    type=click.Path(file_okay=False),
    default=str(DEFAULT_CONFDIR),
    show_default=True,
    help="mitmproxy confdir holding the CA.",
)
def env(proxy: str, rollout: str | None, confdir: str) -> None:
    """Print the `export` lines a harness container needs to go through the proxy.

    Source them (`eval "$(polar-mitm env --proxy http://HOST:8080 --rollout task.0)"`) or pass
    them to the container. The CA file must be readable inside the container at the same path
    (mount the confdir), or copy it and change the paths.
    """
    try:
        lines = env_lines(proxy, ensure_ca(confdir), rollout)
    except ValueError as e:
        fail(str(e))
    click.echo("\n".join(lines))


@main.command()
@click.argument("directory", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def summary(directory: str, as_json: bool) -> None:
    """Per-rollout figures of the calls captured under DIRECTORY (polar_output)."""
    from .store import read_table
    from .summary import summarize_calls

    if "://" not in directory and not Path(directory).exists():
        fail(f"{directory} does not exist")
    try:
        calls = read_table(directory, "calls")
    except (OSError, ValueError) as e:
        fail(f"cannot read shards under {directory}: {e}")
    rollouts = summarize_calls(calls)
    if as_json:
        click.echo(json.dumps([r.as_dict() for r in rollouts], indent=2))
        return
    if not rollouts:
        fail(f"no captured calls under {directory}")
    table = Table(title=f"polar-mitm capture: {directory}")
    for name in (
        "rollout",
        "group",
        "calls",
        "prompt tokens",
        "sampled tokens",
        "errors",
        "retokenized",
        "dialects",
    ):
        numeric = "tokens" in name or name in ("calls", "errors", "retokenized")
        table.add_column(name, justify="right" if numeric else "left", no_wrap=not numeric)
    for r in rollouts:
        table.add_row(
            r.rollout_id,
            r.group_id or "-",
            str(r.calls),
            str(r.prompt_tokens),
            str(r.output_tokens),
            str(r.errors),
            str(r.retokenized),
            ",".join(r.dialects),
        )
    table.add_section()
    table.add_row(
        "total",
        "",
        str(sum(r.calls for r in rollouts)),
        str(sum(r.prompt_tokens for r in rollouts)),
        str(sum(r.output_tokens for r in rollouts)),
        str(sum(r.errors for r in rollouts)),
        str(sum(r.retokenized for r in rollouts)),
        "",
    )
    console.print(table)


@main.command()
@click.argument("directory", type=click.Path())
@click.option(
    "--journal",
    type=click.Path(file_okay=False),
    default=None,
    help="Journal dir (default: DIRECTORY/_journal).",
)
def recover(directory: str, journal: str | None) -> None:
    """Turn a journal left by a crashed proxy into shards (nothing is written twice).

    The proxy does this itself at start-up; use this when it will not be restarted.
    """
    from .store import recover as recover_journal

    try:
        report = recover_journal(directory, journal_dir=journal)
    except (OSError, ValueError, RuntimeError) as e:
        fail(f"cannot recover {directory}: {e}")
    click.echo(str(report))


def _register_optional() -> None:
    """Commands whose modules are written separately (and may import heavy libraries lazily)."""
    try:
        from .policy_server.cli import policy_server
    except ImportError:  # pragma: no cover - during development only
        return
    main.add_command(policy_server)


_register_optional()
main.add_command(__import__("polar_mitm.fidelity_report", fromlist=["fidelity"]).fidelity)

if __name__ == "__main__":
    main()
