"""`polar-mitm`: set up harness containers, run the reference policy server, inspect shards.

Over 500 lines because it is the whole command surface in one place: the click commands, their
options and help texts (which are the user's documentation, `polar-mitm --help`), and nothing
else; each command's logic is in its own module beside it (`tables`, `show`, `summary`,
`rewards`, `report_html`, `fidelity_report`, `captured`) or in `export/`.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.text import Text

from ..certs import CONFDIR_VARIABLE, ensure_ca, env_lines, existing_ca
from ..export import FORMATS

console = Console()
NEMO_GYM = "nemo-gym"


def fail(message: str) -> None:
    """One clear line on stderr and a non-zero exit: what a user meets instead of a traceback."""
    click.echo(f"error: {' '.join(message.split())}", err=True)  # one line, whatever it quotes
    sys.exit(1)


class LazyGroup(click.Group):
    """A group whose heavier commands are imported only when used (`top` and `sql` pull in their
    own stacks: time on every `polar-mitm summary` otherwise).
    ``lazy`` maps a command name to ``"module:attribute"``."""

    lazy: dict[str, str] = {}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.lazy and cmd_name not in self.commands:
            import importlib

            module, _, attr = self.lazy[cmd_name].partition(":")
            try:
                self.add_command(getattr(importlib.import_module(module), attr), cmd_name)
            except ImportError:  # pragma: no cover - during development only
                return None
        return super().get_command(ctx, cmd_name)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="polar-mitm")
def main() -> None:
    """Capture token-exact RL training data from unmodified coding-agent harnesses."""


CONFDIR_HELP = (
    f"The proxy's CA folder (mitmproxy confdir). Default: ${CONFDIR_VARIABLE}, else the user's "
    "config folder ($XDG_CONFIG_HOME/polar-mitm or ~/.config/polar-mitm), the proxy's default too."
)


@main.command()
@click.option("--confdir", type=click.Path(file_okay=False), default=None, help=CONFDIR_HELP)
def certs(confdir: str | None) -> None:
    """Create the proxy's CA (once) and print the certificate path harnesses must trust."""
    try:
        click.echo(ensure_ca(confdir))
    except OSError as e:
        fail(f"cannot create the CA in {confdir}: {e}")


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
    default=None,
    help=CONFDIR_HELP + " A folder given here must already hold the CA.",
)
def env(proxy: str, rollout: str | None, confdir: str | None) -> None:
    """Print the `export` lines a harness container needs to go through the proxy.

    Source them (`eval "$(polar-mitm env --proxy http://HOST:8080 --rollout task.0)"`) or pass
    them to the container. The CA file must be readable inside the container at the same path
    (mount the confdir), or copy it and change the paths.
    """
    try:
        ca = existing_ca(confdir) if confdir else ensure_ca()
        lines = env_lines(proxy, ca, rollout)
    except (OSError, ValueError) as e:
        fail(str(e))
    click.echo("\n".join(lines))


DIRECTORY = click.argument("directory", metavar="DIR", type=click.Path())


@contextlib.contextmanager
def _user_errors() -> Iterator[None]:
    """Problems with the user's data or files as one line and exit 1, never a traceback."""
    from ..trajectory.traceview import TraceShapeError
    from .captured import DataError
    from .rewards import RewardFileError
    from .token_text import TokenizerError

    try:
        yield
    except (DataError, RewardFileError, TokenizerError, TraceShapeError) as e:
        fail(str(e))


def _echo_json(value: object) -> None:
    click.echo(json.dumps(value, indent=2, default=str))


PLAIN = click.option(
    "--plain",
    is_flag=True,
    help="Tab-separated lines (a header, one line per row) instead of a table.",
)


@main.command(short_help="Rollouts and GRPO groups: calls, tokens, rewards.")
@DIRECTORY
@click.option("--json", "as_json", is_flag=True, help="Print JSON (rollouts, groups, totals).")
@PLAIN
@click.option(
    "--groups", "groups_only", is_flag=True, help="Only the GRPO groups (with --plain: their TSV)."
)
def summary(directory: str, as_json: bool, plain: bool, groups_only: bool) -> None:
    """Per rollout and per GRPO group: calls, traces, tokens, breaks, flags, status, reward.

    DIR is the proxy's polar_output. Prompt / sampled tokens are the calls' id lists (calls/);
    policy / environment tokens are the traces' loss masks (traces/, written when a rollout
    ends). --json prints {"rollouts": [...], "groups": [...], "totals": {...}}; --plain the
    rollouts (--groups: the groups) as tab-separated lines. Piped, the tables come at their
    full width; on a terminal columns are left out rather than ids cut (--json has them all).
    """
    from . import captured, chaintree
    from .listing import emit, terminal_width
    from .summary import summarize
    from .tables import anonymous_note, group_listing, rollout_listing, totals_line

    with _user_errors():
        calls = captured.read(directory, "calls", captured.CALL_FIGURES, required=False)
        traces = captured.read(directory, "traces", captured.TRACE_FIGURES, required=False)
        if calls.num_rows == 0 and traces.num_rows == 0:
            captured.read(directory, "calls")  # raises the "no shards" error
    result = summarize(calls, traces)
    trees = _trees(traces)
    if as_json:
        _echo_json({**result.as_dict(), "trees": {r: chaintree.tree_lines(t) for r, t in trees}})
        return
    listings = [] if groups_only else [rollout_listing(result, directory)]
    if result.groups and (groups_only or not plain):
        listings.append(group_listing(result))
    emit(listings, plain, console)
    if plain or groups_only:
        return
    note = anonymous_note(result)
    if note:
        console.print(note, style="yellow", markup=False, highlight=False)
    for rollout_id, rows in trees:  # long sessions: how their chains hang together
        if len(rows) > 1:
            console.print(chaintree.tree(rollout_id, rows))
    # last, where eyes land; one line, never folded (a pipe's grep / tail -1 finds it whole)
    piped = terminal_width(console) is None
    console.print(totals_line(result), markup=False, highlight=False, soft_wrap=piped)


def _trees(traces: Any) -> list[tuple[str, list[dict[str, Any]]]]:
    """Each rollout's trace rows (`captured.read` keeps the latest revision), in written order."""
    by_rollout: dict[str, list[dict[str, Any]]] = {}
    for row in traces.to_pylist():
        by_rollout.setdefault(row["rollout_id"], []).append(row)
    return list(by_rollout.items())


@main.command(short_help="The calls table: tokens, latency, errors.")
@DIRECTORY
@click.option("--rollout", "-r", default=None, help="Only this rollout's calls.")
@click.option(
    "--json", "as_json", is_flag=True, help="Print JSON lines: one object per call, per line."
)
@PLAIN
def calls(directory: str, rollout: str | None, as_json: bool, plain: bool) -> None:
    """The calls table: dialect, model, tokens, latency, time to first byte, status, error.

    One row per captured LLM call under DIR (the proxy's polar_output), in order of start.
    Latency is finished - started, ttfb the first byte the harness got - started (ms).
    Call ids are whole; a terminal too narrow for every column gets fewer columns.
    """
    from . import captured
    from .listing import emit
    from .summary import call_rows
    from .tables import calls_listing

    with _user_errors():
        table = captured.read(directory, "calls", captured.CALL_FIGURES, rollout=rollout)
        if rollout is not None and table.num_rows == 0:
            fail(f"no calls of rollout {rollout!r} under {directory} ({_known(directory)})")
    rows = call_rows(table)
    if as_json:  # JSON lines: `| jq`, `| head`, a log shipper read one call per line
        for row in rows:
            click.echo(json.dumps(row, default=str))
        return
    emit([calls_listing(rows, directory)], plain, console)


def _known(directory: str) -> str:
    """A short list of the rollout ids there are, for "unknown rollout" errors."""
    from . import captured

    ids: list[str] = []
    for dataset in ("traces", "calls"):
        table = captured.read(directory, dataset, ["rollout_id"], required=False, progress=False)
        ids += [r for r in table["rollout_id"].to_pylist() if r not in ids]
    if not ids:
        return "there are none"
    shown = ", ".join(ids[:8])
    return f"rollouts: {shown}" + (f" and {len(ids) - 8} more" if len(ids) > 8 else "")


TOKENIZER = click.option(
    "--tokenizer",
    envvar="POLAR_TOKENIZER",
    default=None,
    help="Policy tokenizer to decode with: a Hugging Face tokenizer dir or tiktoken:NAME "
    "(env POLAR_TOKENIZER). Default: the one the proxy recorded with the shards (its "
    "polar_tokenizer), else the served model's if it is in the local Hugging Face cache.",
)


def _show_tokenizer(
    directory: str, spec: str | None, call_list: list[dict]
) -> tuple[object | None, str]:
    """The tokenizer `show` decodes with and a note saying which: ``--tokenizer``, else the one
    the proxy recorded with the shards (`tokenizer_record`), else the served model's tokenizer
    from the local Hugging Face cache; None (ids shown) when none loads."""
    from .. import tokenizer_record
    from .token_text import TokenizerError, resolve

    if spec:
        tok, where = resolve(spec)
        return tok, f"decoded with {where}"
    recorded = tokenizer_record.read(directory)
    problem = ""
    if recorded is not None:
        try:
            tok, where = resolve(recorded["spec"])
            return tok, f"decoded with {where} (the proxy's polar_tokenizer)"
        except TokenizerError as e:
            problem = f"the proxy's tokenizer does not load here ({e}); "
    tok, where = resolve(None, [c.get("model_served") for c in call_list])
    if tok is not None:
        return tok, f"{problem}decoded with {where}"
    return None, f"{problem}no tokenizer (--tokenizer): showing ids"


@main.command(short_help="One trace, policy vs environment tokens in colour.")
@DIRECTORY
@click.argument("rollout_arg", metavar="[ROLLOUT]", required=False)
@click.option("--rollout", "-r", "rollout_opt", default=None, help="The rollout (same as ROLLOUT).")
@click.option(
    "--trace", "-t", default=None, help="Trace id or a unique prefix (default: the main trace)."
)
@click.option("--ids", is_flag=True, help="Show each token's id after it.")
@click.option("--logprobs", is_flag=True, help="Shade policy tokens by logprob (red: unlikely).")
@TOKENIZER
@click.option(
    "--pager/--no-pager", default=True, show_default=True, help="Page long output on a terminal."
)
def show(
    directory: str,
    rollout_arg: str | None,
    rollout_opt: str | None,
    trace: str | None,
    ids: bool,
    logprobs: bool,
    tokenizer: str | None,
    pager: bool,
) -> None:
    """One trace as a person reads it: decoded tokens, environment vs policy in two colours.

    Environment tokens (loss_mask 0: prompts, tool output, the chat template) are cyan, policy
    tokens (loss_mask 1: what the model sampled and training updates) bold green. A rule marks
    each call boundary with the tokens it added and sampled; the header gives the trace's role,
    break reason and evidence, and lists the rollout's other traces. Without ROLLOUT, DIR must
    hold one rollout. Without --trace, the rollout's main trace (the main agent's root chain).
    The tokenizer: --tokenizer, else the one the proxy recorded with the shards (its
    polar_tokenizer), else the served model's from the local Hugging Face cache; without one,
    token ids are shown instead of text.
    """
    from ..trajectory.traceview import pick_trace
    from . import captured
    from .listing import terminal_width
    from .show import render
    from .token_text import token_pieces

    if rollout_arg and rollout_opt and rollout_arg != rollout_opt:
        fail(f"two rollouts given: {rollout_arg} and --rollout {rollout_opt}")
    rollout = rollout_arg or rollout_opt
    with _user_errors():
        if rollout is None:
            table = captured.read(directory, "traces", ["rollout_id"], progress=False)
            known = list(dict.fromkeys(table["rollout_id"].to_pylist()))
            if len(known) != 1:
                fail(f"{directory} holds {len(known)} rollouts: name one ({_known(directory)})")
            rollout = known[0]
        traces = captured.read(directory, "traces", rollout=rollout, required=False).to_pylist()
        call_list = captured.read(
            directory, "calls", captured.CALL_FIGURES, rollout=rollout, required=False
        ).to_pylist()
        if not traces:
            if call_list:
                fail(
                    f"rollout {rollout} has {len(call_list)} call(s) but no traces yet (traces "
                    "are written when it ends: control plane, polar_rollout_idle or proxy exit)"
                )
            fail(f"no rollout {rollout!r} under {directory} ({_known(directory)})")
        try:
            chosen = pick_trace(traces, trace)
        except LookupError as e:
            fail(str(e))
        tok, note = _show_tokenizer(directory, tokenizer, call_list)
        pieces = token_pieces(tok, chosen["input_ids"]) if tok else None
        parts = render(
            chosen,
            traces,
            pieces,
            {c["call_id"]: c for c in call_list},
            ids=ids,
            logprobs=logprobs,
            tokenizer_note=note,
            marks=console.color_system is None,  # no colours: mark the policy tokens in text
        )
    if pager and sys.stdout.isatty():
        os.environ.setdefault("LESS", "-RFX")  # colours; quit at once when it fits one screen
        with console.pager(styles=True):
            for part in parts:
                console.print(part)
        return
    piped = terminal_width(console) is None  # no terminal, no COLUMNS: the natural width
    for part in parts:  # piped: the text as it decodes, never folded at rich's default 80
        console.print(part, soft_wrap=piped and isinstance(part, Text))


@main.command(short_help="Traces in slime / verl / NeMo Gym / JSONL / Parquet format.")
@DIRECTORY
@click.option(
    "--format",
    "-f",
    "fmt",
    required=True,
    type=click.Choice(sorted(FORMATS)),
    help="Trainer format (see docs/export.md).",
)
@click.option(
    "--out",
    "-o",
    required=True,
    type=click.Path(dir_okay=False, allow_dash=True),
    help="File to write; - for standard output (then the messages go to stderr).",
)
@click.option("--all", "include_all", is_flag=True, help="Also untrainable and unfinished traces.")
@click.option(
    "--role",
    "--roles",
    "roles",
    multiple=True,
    type=click.Choice(["main", "sub", "side", "all"]),
    help="Only traces of this role (repeatable; default: all, for nemo-gym: main; "
    "'all' for every role).",
)
@TOKENIZER
@click.option(
    "--pad-id", default=0, show_default=True, type=int, help="verl: id that fills the padding."
)
def export(
    directory: str,
    fmt: str,
    out: str,
    include_all: bool,
    roles: tuple[str, ...],
    tokenizer: str | None,
    pad_id: int,
) -> None:
    """Write the traces under DIR in a trainer's own format.

    \b
    slime     JSONL of slime Sample dicts (Sample.from_dict): tokens, response_length,
              loss_mask, rollout_log_probs, reward, status, metadata
    verl      .npz of verl's batch keys: prompts, responses, response_mask, input_ids,
              attention_mask, position_ids, rollout_log_probs (+ rm_scores, uid, ...)
    nemo-gym  JSONL of NeMo Gym rollout results: per-turn prompt_token_ids,
              generation_token_ids, generation_log_probs
    jsonl     the trace rows as JSON lines (schema column names) with per-call segments
    parquet   one row per trace (its latest revision and reward), schema column names:
              datasets.load_dataset("parquet"), Ray Data and DuckDB read it as is

    By default only trainable, completed traces go out (--all for every one). A tokenizer
    fills the text fields (slime prompt/response, NeMo Gym output text); the ids are
    exported either way; the default is the tokenizer the proxy recorded with the shards, as
    for `show`. The file appears whole or not at all.
    """
    from ..export import ExportOptions, build_records, select
    from ..export import export as write_export
    from . import captured
    from .export_out import export_to_stdout, left_out_hint

    if not roles and fmt == NEMO_GYM:
        # NeMo RL takes one result per rollout: the main agent's chains; sub-agents' and side
        # chains (compaction summaries, titles) are left out and counted unless asked for.
        roles = ("main",)
    roles = () if "all" in roles else roles
    with _user_errors():
        traces = captured.read(directory, "traces").to_pylist()
        kept, skipped = select(traces, include_all, roles)
        if not kept:
            # say what would help: --all brings back unfinished and untrainable traces, never
            # those of another role (--role does); ending rollouts is the usual cure
            why = ", ".join(f"{n} {k}{left_out_hint(k)}" for k, n in skipped.items())
            fail(f"nothing to export from {directory}: {len(traces)} trace(s), left out: {why}")
        calls_t = captured.read(
            directory,
            "calls",
            ["finish_reason", "model_served", "model_requested", "purpose", "status"],
            required=False,
        )
        call_list = calls_t.to_pylist()
        by_id = {c["call_id"]: c for c in call_list}
        tok, _ = _show_tokenizer(directory, tokenizer, call_list)
        records = build_records(kept, by_id)
    options = ExportOptions(pad_id=pad_id, tokenizer=tok)
    try:
        if out == "-":
            result = export_to_stdout(FORMATS[fmt], records, options)
        else:
            result = write_export(FORMATS[fmt], records, out, options)
    except (OSError, ValueError) as e:
        fail(f"cannot write {out}: {e}")
    click.echo(
        f"wrote {result.records} {fmt} record(s) of {result.rollouts} rollout(s), "
        f"{result.policy_tokens} policy tokens, to {'standard output' if out == '-' else out}",
        err=out == "-",
    )
    for why, n in skipped.items():
        hint = " (--role to include)" if why.startswith("role ") else " (--all to include)"
        click.echo(f"left out {n} trace(s): {why}{hint}", err=True)
    if result.without_reward:
        click.echo(
            f"warning: {result.without_reward} record(s) have no reward "
            "(end the rollout with one, or polar-mitm reward DIR FILE)",
            err=True,
        )


@main.command(short_help="Join rewards from a JSONL/CSV file (new shards).")
@DIRECTORY
@click.argument("reward_file", metavar="FILE", type=click.Path(dir_okay=False))
@click.option("--skip-unknown", is_flag=True, help="Ignore rollouts in FILE that have no traces.")
@click.option("--dry-run", is_flag=True, help="Say what would be written, write nothing.")
@click.option(
    "--journal",
    type=click.Path(file_okay=False),
    default=None,
    help="Local journal dir for the new rows (default: DIR/_journal_reward; required when "
    "DIR is remote).",
)
def reward(
    directory: str, reward_file: str, skip_unknown: bool, dry_run: bool, journal: str | None
) -> None:
    """Join rewards from FILE into the traces under DIR, as new shards.

    FILE is JSONL ({"rollout_id": "task.3", "reward": 1.0} per line) or CSV with a header
    naming rollout_id and reward. Each trace of a named rollout is written again with the
    reward and a higher revision, into new shards; no shard is changed, and readers keep the
    highest revision. Nothing is written unless every line is valid and every rollout has
    traces (--skip-unknown ignores those that have none). Traces that already have the
    reward are left alone, so a second run writes nothing.
    """
    from . import captured
    from .rewards import default_journal, plan, read_rewards
    from .rewards import write as write_rewards

    with _user_errors():
        rewards = read_rewards(reward_file)
        traces = captured.read(directory, "traces").to_pylist()
    p = plan(traces, rewards)
    if p.unknown and not skip_unknown:
        shown = ", ".join(p.unknown[:5]) + (" ..." if len(p.unknown) > 5 else "")
        fail(
            f"{len(p.unknown)} rollout(s) in {reward_file} have no traces under {directory}: "
            f"{shown} (--skip-unknown ignores them)"
        )
    verb = "would write" if dry_run else "wrote"
    if not p.rows:
        click.echo(
            f"nothing to write: {p.unchanged} trace(s) of {len(p.rollouts)} rollout(s) already have their reward"
        )
        return
    if not dry_run:
        journal = journal or default_journal(directory)
        if journal is None:
            fail(f"{directory} is remote: give --journal, a local directory")
        try:
            shards = write_rewards(directory, p.rows, journal)
        except (OSError, RuntimeError, ValueError) as e:
            fail(f"cannot write the rewarded traces: {e}")
    click.echo(
        f"{verb} {len(p.rows)} trace(s) of {len(p.rollouts)} rollout(s) with their reward"
        + (f" into {len(shards)} new shard(s)" if not dry_run else "")
        + (f"; {p.unchanged} already had it" if p.unchanged else "")
        + (f"; skipped {len(p.unknown)} unknown rollout(s)" if p.unknown else "")
    )


@main.command(short_help="A self-contained HTML report with charts.")
@DIRECTORY
@click.option(
    "--html",
    "html_out",
    required=True,
    type=click.Path(dir_okay=False, allow_dash=True),
    help="Page to write; - for standard output.",
)
@click.option(
    "--max-rollouts",
    default=500,
    show_default=True,
    type=click.IntRange(min=1),
    help="Draw at most this many rollouts (all are counted).",
)
def report(directory: str, html_out: str, max_rollouts: int) -> None:
    """A self-contained HTML page (no network) of what is under DIR.

    Totals, GRPO groups, and per rollout: tokens per call, the mask spans of each trace
    (environment vs policy tokens, call boundaries), latency per call and fidelity flags.
    """
    from . import captured
    from .report_html import render as render_report
    from .summary import call_rows, summarize

    with _user_errors():
        calls_t = captured.read(directory, "calls", captured.CALL_FIGURES, required=False)
        traces_t = captured.read(
            directory,
            "traces",
            [*captured.TRACE_FIGURES, "loss_mask", "call_offsets"],
            required=False,
        )
        if calls_t.num_rows == 0 and traces_t.num_rows == 0:
            captured.read(directory, "calls")
    result = summarize(calls_t, traces_t)
    page = render_report(directory, result, call_rows(calls_t), traces_t.to_pylist(), max_rollouts)
    if html_out == "-":
        sys.stdout.write(page)
        sys.stdout.flush()
    else:
        try:
            Path(html_out).write_text(page, encoding="utf-8")
        except OSError as e:
            fail(f"cannot write {html_out}: {e}")
    click.echo(
        f"wrote {'the page to standard output' if html_out == '-' else html_out} "
        f"({len(page) // 1024} KiB, {min(len(result.rollouts), max_rollouts)} rollouts)",
        err=html_out == "-",
    )


def _proxy_output(directory: str, journal: str | None) -> None:
    """A local DIR must be a proxy's output (or the journal given must exist): `recover` and
    `migrate` write into it, and a typo must not become a new folder and exit 0."""
    if "://" in directory:
        return
    path = Path(directory)
    if not path.is_dir():
        fail(f"no such folder: {directory}")
    if journal is not None and Path(journal).is_dir():
        return
    if not any((path / name).is_dir() for name in ("calls", "traces", "_journal")):
        fail(f"{directory} is not a proxy's output folder (no calls/, traces/ or _journal/ in it)")


@main.command(short_help="Turn a crashed proxy's journal into shards.")
@DIRECTORY
@click.option(
    "--journal",
    type=click.Path(file_okay=False),
    default=None,
    help="Journal dir (default: DIR/_journal).",
)
def recover(directory: str, journal: str | None) -> None:
    """Turn a journal left by a crashed proxy into shards (nothing is written twice).

    The proxy does this itself at start-up; use this when it will not be restarted.
    """
    _proxy_output(directory, journal)
    from ..store import recover as recover_journal

    try:
        report = recover_journal(directory, journal_dir=journal)
    except (OSError, ValueError, RuntimeError) as e:
        fail(f"cannot recover {directory}: {e}")
    click.echo(str(report))


@main.command(short_help="Rewrite schema-1/2 calls shards as schema 3.")
@DIRECTORY
@click.option(
    "--journal",
    type=click.Path(file_okay=False),
    default=None,
    help="Journal dir whose lock keeps a proxy out meanwhile (default: DIR/_journal).",
)
def migrate(directory: str, journal: str | None) -> None:
    """Rewrite old calls shards in the current schema (3).

    Schema 1: each call stored as what it adds to its rollout's previous call (smaller).
    Schema 2: the stored parts moved to prompt_suffix_ids / request_middle, so readers without
    polar-mitm never take a suffix for a prompt. Both read the same through polar-mitm without
    it (docs/store.md, "Schema and migrations").
    """
    from ..store.migrate import migrate as migrate_shards

    _proxy_output(directory, journal)
    try:
        report = migrate_shards(directory, journal_dir=journal)
    except (OSError, ValueError, RuntimeError, pa_errors()) as e:
        fail(f"cannot migrate {directory}: {e}")
    click.echo(str(report))


def pa_errors() -> type[Exception]:
    import pyarrow as pa

    return pa.ArrowException


def _register_optional() -> None:
    """Commands whose modules are written separately, imported when they are run."""
    LazyGroup.lazy["top"] = "polar_mitm.cli.top:top"
    LazyGroup.lazy["sql"] = "polar_mitm.cli.sql:sql"
    LazyGroup.lazy["addon"] = "polar_mitm.cli.proxy:addon"
    LazyGroup.lazy["proxy"] = "polar_mitm.cli.proxy:proxy"
    LazyGroup.lazy["status"] = "polar_mitm.cli.control_cmds:status"
    LazyGroup.lazy["end"] = "polar_mitm.cli.control_cmds:end"


_register_optional()
main.add_command(__import__("polar_mitm.cli.fidelity_report", fromlist=["fidelity"]).fidelity)

if __name__ == "__main__":
    main()
