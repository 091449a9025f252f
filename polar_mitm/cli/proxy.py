"""`polar-mitm addon` and `polar-mitm proxy`: the capture proxy from an install.

mitmdump takes its scripts by path (`-s FILE`), so an install needs a way to name the addon that
does not depend on the current directory or a checkout: `polar-mitm addon` prints the path of the
script shipped in the package, and `polar-mitm proxy` runs mitmdump with it and with polar-mitm's
own settings spelled as flags. Whatever mitmdump takes passes through unchanged (`--set
name=value`, and any other argument), so nothing of mitmdump is hidden behind the command. The
CLI must not import the proxy's modules (tests/test_layout.py): the script's path is computed,
not imported.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from urllib.parse import urlsplit

import click

from ..certs import CONFDIR_VARIABLE, default_confdir
from ..control_client import TOKEN_FILE_VARIABLE

# polar_mitm/addons/script/addon.py, relative to this file (polar_mitm/cli/proxy.py)
ADDON = Path(__file__).resolve().parent.parent / "addons" / "script" / "addon.py"


def addon_path() -> Path:
    return ADDON


@click.command("addon", short_help="Print the addon's path, for mitmdump -s.")
def addon() -> None:
    """Print the path of the mitmdump script shipped in the package:

    \b
        mitmdump -s "$(polar-mitm addon)" --set polar_upstream=http://127.0.0.1:8000
    """
    if not ADDON.is_file():  # pragma: no cover - a broken install
        raise click.ClickException(f"the addon script is missing from the install: {ADDON}")
    click.echo(str(ADDON))


def _fail(message: str) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(1)


def check_upstream(url: str) -> str:
    """The policy server's base URL, or a one-line error before mitmdump starts."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        _fail(f"--upstream must be an http(s)://HOST:PORT URL, got {url!r}")
    try:
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError:
        _fail(f"--upstream has a bad port: {url!r}")
    return url


def mitmdump_binary() -> str:
    """The mitmdump of the environment polar-mitm runs in (a venv's bin, pipx's, a container's),
    before any other on PATH: it must be the one that can import this package."""
    beside = Path(sys.executable).parent / "mitmdump"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("mitmdump")
    if found is None:
        _fail("mitmdump is not installed beside polar-mitm (pip install polar-mitm brings it)")
    return str(found)


def mitmdump_argv(
    upstream: str | None,
    output: str,
    listen_host: str,
    listen_port: int,
    confdir: str | None,
    tokenizer: str | None,
    sets: tuple[str, ...],
    passthrough: tuple[str, ...],
) -> list[str]:
    """The mitmdump command line: the addon, polar-mitm's flags as `--set`s (paths made
    absolute: the proxy must not depend on the directory it starts in), then the user's own
    `--set`s and arguments, which mitmdump applies last (they win)."""
    for item in sets:
        if "=" not in item:
            _fail(f"--set takes NAME=VALUE, got {item!r}")
    named = {item.partition("=")[0] for item in sets}
    if upstream is None and "polar_upstream" not in named:
        _fail("give --upstream URL: the policy server (vLLM or SGLang) the calls go to")
    argv = [mitmdump_binary(), "-s", str(ADDON)]
    argv += ["--listen-host", listen_host, "--listen-port", str(listen_port)]
    options = {
        "confdir": str(Path(confdir).expanduser().resolve()) if confdir else str(default_confdir()),
        "polar_output": output if "://" in output else str(Path(output).expanduser().resolve()),
    }
    if upstream is not None:
        options["polar_upstream"] = check_upstream(upstream)
    if tokenizer:
        options["polar_tokenizer"] = tokenizer
    for name, value in options.items():
        argv += ["--set", f"{name}={value}"]
    for item in sets:
        argv += ["--set", item]
    return argv + list(passthrough)


@click.command(
    "proxy",
    short_help="Run the capture proxy (mitmdump with the addon).",
    context_settings={"ignore_unknown_options": True},
)
@click.option(
    "--upstream", metavar="URL", help="The policy server (polar_upstream), e.g. http://vllm:8000."
)
@click.option(
    "--output",
    default="polar-data",
    show_default=True,
    help="Where the journal and Parquet shards go (polar_output): a folder or an s3:// URI.",
)
@click.option("--listen-host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option(
    "--listen-port", default=8080, show_default=True, type=click.IntRange(1, 65535), help="Port."
)
@click.option(
    "--confdir",
    type=click.Path(file_okay=False),
    default=None,
    help=f"The CA folder (default: ${CONFDIR_VARIABLE}, else the user's config folder: "
    "the one `polar-mitm env` and `polar-mitm certs` use).",
)
@click.option("--tokenizer", default=None, help="The policy tokenizer (polar_tokenizer).")
@click.option(
    "--control-token-file",
    type=click.Path(dir_okay=False),
    default=None,
    help="A file holding the control token (default: $POLAR_CONTROL_TOKEN, else the file "
    "$POLAR_CONTROL_TOKEN_FILE names). Never put the token on the command line.",
)
@click.option(
    "--set",
    "sets",
    multiple=True,
    metavar="NAME=VALUE",
    help="Any mitmdump / polar-mitm option, passed through (repeatable; mitmdump --options).",
)
@click.option("--dry-run", is_flag=True, help="Print the mitmdump command instead of running it.")
@click.argument("passthrough", nargs=-1, type=click.UNPROCESSED, metavar="[MITMDUMP ARGS]...")
def proxy(
    upstream: str | None,
    output: str,
    listen_host: str,
    listen_port: int,
    confdir: str | None,
    tokenizer: str | None,
    control_token_file: str | None,
    sets: tuple[str, ...],
    dry_run: bool,
    passthrough: tuple[str, ...],
) -> None:
    """Run mitmdump with the polar-mitm addon: harnesses' LLM calls go to --upstream, captured.

    \b
        polar-mitm proxy --upstream http://127.0.0.1:8000 --output ./polar-data
        polar-mitm proxy --upstream http://vllm:8000 --set polar_rollout_idle=300 -q

    It becomes mitmdump (the same process: signals reach it, and SIGTERM or Ctrl-C write the
    last shards). Every option is in the options reference (`mitmdump --options`).
    """
    argv = mitmdump_argv(
        upstream, output, listen_host, listen_port, confdir, tokenizer, sets, passthrough
    )
    if control_token_file is not None:
        path = Path(control_token_file).expanduser().resolve()
        if not path.is_file():
            _fail(f"--control-token-file: no such file {path}")
        os.environ[TOKEN_FILE_VARIABLE] = str(path)  # the proxy reads it; ps never shows it
    if dry_run:
        click.echo(" ".join(_quote(a) for a in argv))
        return
    sys.stdout.flush()
    os.execv(argv[0], argv)


def _quote(arg: str) -> str:
    import shlex

    return shlex.quote(arg)
