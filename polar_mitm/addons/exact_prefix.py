"""`ExactPrefixAddon`: exact-prefix mode (`polar_exact_prefix`): chains' exact tokens as prompts."""

from __future__ import annotations

from mitmproxy import ctx

from ..output_parsers import FAMILIES, family
from ..trajectory.exact_prefix import ExactPrefix
from .options import _errors, log
from .tokenizer import TokenizerAddon


class ExactPrefixAddon:
    """`polar_exact_prefix`: a call that extends one of its rollout's chains is sent to the
    server's token-in endpoint with the chain's exact tokens as its prompt (trajectory/exact_prefix.py)."""

    def __init__(self, tokenizer: TokenizerAddon) -> None:
        self.tokenizer = tokenizer
        self.book: ExactPrefix | None = None

    def load(self, loader) -> None:
        loader.add_option(
            "polar_exact_prefix",
            bool,
            False,
            "Exact-prefix mode: a call that extends one of its rollout's chains gets the chain's "
            "exact tokens (as sampled) plus only its new messages rendered with polar_tokenizer's "
            "chat template as its prompt, sent to the server's token-in endpoint (vLLM "
            "/v1/completions, SGLang /generate); the raw reply is parsed back into the harness's "
            "dialect with polar_output_parser. Other calls go the chat way. Needs polar_tokenizer "
            "with a chat template.",
        )
        loader.add_option(
            "polar_exact_compare",
            bool,
            False,
            "Exact-prefix mode: for every token-in call, also render and tokenize the whole "
            "conversation as chat mode would have sent it (in a worker, before the record is "
            "stored) and note where the prompt sent differs (fidelity_json.exact_prefix "
            "first_diff / drift_tokens, summed by polar-mitm fidelity). O(conversation) per call: "
            "a quarter of a second of CPU at 80k tokens.",
        )
        loader.add_option(
            "polar_token_in",
            str,
            "completions",
            "Exact-prefix mode, vLLM only: the token-in route. 'completions': /v1/completions "
            "(the server detokenizes). 'generate': vLLM >= 0.32's /inference/v1/generate with "
            "detokenize false (the server must run with --enable-scale-out), never streamed "
            "upstream (a harness's stream is sent when the reply is complete); the proxy decodes "
            "the sampled ids as /v1/completions would, which spares the server's detokenizer "
            "(its cost grows with the prompt). A call with stop strings still goes to "
            "/v1/completions.",
        )
        loader.add_option(
            "polar_output_parser",
            str,
            "qwen3",
            "Exact-prefix mode: the policy's output format, to turn raw generated text into "
            f"reasoning, content and tool calls ({', '.join(FAMILIES)}).",
        )

    def configure(self, updated: set[str]) -> None:
        if self.book is not None and "polar_exact_compare" in updated:
            self.book.compare_calls = ctx.options.polar_exact_compare
        if (
            not {
                "polar_exact_prefix",
                "polar_output_parser",
                "polar_tokenizer",
                "polar_token_in",
                "polar_upstream_kind",
            }
            & updated
        ):
            return
        if self.book is not None:
            self.book.close()
        self.book = None
        opts = ctx.options
        try:
            parser = family(opts.polar_output_parser)
        except ValueError as e:
            _errors.fail(f"polar_output_parser: {e}")
            return
        route = token_in_route(opts)
        if route is None or not opts.polar_exact_prefix:
            return
        tok = self.tokenizer.tokenizer
        if tok is None or not tok.has_chat_template:
            _errors.fail(
                "polar_exact_prefix: needs polar_tokenizer set to a tokenizer with a chat template "
                "(a Hugging Face tokenizer dir or gguf:FILE), to render new messages as the server "
                "would"
            )
            return
        self.book = ExactPrefix(tok, parser, compare_calls=opts.polar_exact_compare)
        self.book.token_in = route

    def running(self) -> None:
        if self.book is not None:
            log.info(
                "polar-mitm: exact-prefix mode on (chains rendered with %s, output parser %s)",
                self.book.tokenizer.spec,
                self.book.family.name,
            )
            if self.book.token_in == "generate":
                log.info(
                    "polar-mitm: polar_token_in=generate: token-in calls go to vLLM's "
                    "/inference/v1/generate (the server needs --enable-scale-out)"
                )

    def done(self) -> None:
        if self.book is not None:
            self.book.close()

    def rollout_written(self, rollout_id: str) -> None:
        if self.book is not None:
            self.book.forget(rollout_id)

    async def drain(self) -> None:
        if self.book is not None:
            await self.book.drain()


def token_in_route(opts) -> str | None:
    """polar_token_in, checked (None after a start-up error)."""
    route = opts.polar_token_in
    if route not in ("completions", "generate"):
        _errors.fail(f"polar_token_in: {route!r} is not 'completions' or 'generate'")
        return None
    kind = getattr(opts, "polar_upstream_kind", "vllm")
    if route == "generate" and kind != "vllm" and opts.polar_exact_prefix:
        _errors.fail(
            f"polar_token_in=generate: vLLM's /inference/v1/generate needs polar_upstream_kind="
            f"vllm (it is {kind!r}); use polar_token_in=completions"
        )
        return None
    return route
