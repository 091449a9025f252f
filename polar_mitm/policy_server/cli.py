"""``policy-server``: run the reference policy server from the command line.

The main ``polar-mitm`` group adds this command (``from polar_mitm.policy_server.cli import
policy_server``); ``python -m polar_mitm.policy_server`` runs it directly. Once listening it prints
exactly one line, ``policy-server listening on http://HOST:PORT``, to stdout and flushes, so a test or
script can start it with ``--port 0`` and read the address.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from pathlib import Path

import click

from .scenario import ScenarioError, demo_scenario_path, load_scenario
from .vllm_wire import REASONING_FIELDS
from .wire import WIRE_KINDS


async def _serve(config, host: str, port: int) -> None:
    from .server import PolicyServer

    server = PolicyServer(config)
    url = await server.start(host, port)
    click.echo(f"policy-server listening on {url}")
    sys.stdout.flush()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # pragma: no cover - non-Unix
            pass
    try:
        await stop.wait()
    finally:
        await server.stop()


@click.command("policy-server")
@click.option(
    "--scenario",
    "scenario_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Scenario JSON file (default: the bundled demo scenario).",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option(
    "--port",
    default=8000,
    show_default=True,
    type=click.IntRange(0, 65535),
    help="Port; 0 picks a free one.",
)
@click.option(
    "--tokenizer",
    "tokenizer_dir",
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    default=None,
    help="Hugging Face tokenizer directory with a chat template (default: the bundled Qwen3 tokenizer).",
)
@click.option("--model", default=None, help="Served model name (default: the scenario's model).")
@click.option(
    "--token-rate",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="Tokens per second per stream; 0 sends as fast as possible.",
)
@click.option(
    "--chunk-tokens",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Tokens per stream chunk.",
)
@click.option(
    "--reasoning-field",
    type=click.Choice(REASONING_FIELDS),
    default="reasoning",
    show_default=True,
    help="Name of the reasoning field in replies: current vLLM 'reasoning', older 'reasoning_content', or both.",
)
@click.option(
    "--kind",
    type=click.Choice(sorted(WIRE_KINDS)),
    default="vllm",
    show_default=True,
    help="Wire format.",
)
@click.option(
    "--max-model-len",
    type=click.IntRange(min=1),
    default=None,
    help="Context length (default: the tokenizer's).",
)
@click.option(
    "--ignore-token-flags",
    is_flag=True,
    help="Ignore the token-id request flags (return_token_ids, return_prompt_token_ids, "
    "return_meta_info), like a server that predates them or a plain OpenAI-compatible one.",
)
@click.option(
    "--log-level", default="WARNING", show_default=True, help="Python logging level (to stderr)."
)
def policy_server(
    scenario_path: Path | None,
    host: str,
    port: int,
    tokenizer_dir: Path | None,
    model: str | None,
    token_rate: float,
    chunk_tokens: int,
    reasoning_field: str,
    kind: str,
    max_model_len: int | None,
    ignore_token_flags: bool,
    log_level: str,
) -> None:
    """Serve scripted coding-agent turns in vLLM's or SGLang's chat-completions wire format."""
    from .server import ServerConfig

    logging.basicConfig(
        level=log_level.upper(), stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        scenario = load_scenario(scenario_path or demo_scenario_path())
    except ScenarioError as e:
        raise click.ClickException(str(e)) from None
    config = ServerConfig(
        scenario=scenario,
        model=model,
        tokenizer_dir=tokenizer_dir,
        token_rate=token_rate,
        chunk_tokens=chunk_tokens,
        reasoning_field=reasoning_field,
        kind=kind,
        max_model_len=max_model_len,
        ignore_token_flags=ignore_token_flags,
    )
    try:
        asyncio.run(_serve(config, host, port))
    except OSError as e:
        raise click.ClickException(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    except KeyboardInterrupt:  # pragma: no cover
        pass
