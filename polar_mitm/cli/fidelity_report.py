"""`polar-mitm fidelity DIR`: what a retokenize-the-text pipeline would have trained on.

Reads the `calls/` shards under DIR (polar_output) and prints, per harness dialect and
harness, the calls checked, the calls carrying each fidelity flag, and the headline: the share
of policy (sampled) tokens that a pipeline rebuilding token ids from the text would have got
wrong. A sampled turn's wrong tokens are the ones outside the stretches its sampled ids share
with the ids that pipeline gets — the text decoded and encoded again (found on the call
itself), or the turn as the chat template re-rendered it into a later prompt (found on the
later call, `fidelity_json.wrong_tokens` names the turn). Each turn counts once, with the
largest count any check found; it is grouped with the call that sampled it.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..core.record_facts import checked_with_tokenizer, harness_of_agent
from ..tokens.drift import FLAGS
from .listing import Column, Listing, emit


def harness_of(headers_json: str | None) -> str:
    """The harness, from the request's User-Agent (codex, claude-code, pi, SDK name, …)."""
    try:
        headers = json.loads(headers_json or "{}")
    except ValueError:
        headers = {}
    return harness_of_agent(str(headers.get("user-agent", "")) if isinstance(headers, dict) else "")


@dataclass(slots=True)
class ExactPrefixFigures:
    """Exact-prefix mode (`fidelity_json.exact_prefix`): the calls sent as the policy's own
    tokens, and the drift chat mode would have had in their prompts."""

    token_in_calls: int = 0
    compared: int = 0  # token-in calls whose record says what chat mode would have sent
    chat_calls: int = 0
    chat_reasons: dict[str, int] = field(default_factory=dict)
    calls_drift_removed: int = 0
    drift_tokens_removed: int = 0

    def add(self, note: dict[str, Any]) -> None:
        if note.get("path") == "token_in":
            self.token_in_calls += 1
            drift = note.get("drift_tokens")
            self.compared += isinstance(drift, int)
            if isinstance(drift, int) and drift > 0:
                self.calls_drift_removed += 1
                self.drift_tokens_removed += drift
        else:
            self.chat_calls += 1
            reason = str(note.get("reason") or "unknown").split(":", 1)[0]
            self.chat_reasons[reason] = self.chat_reasons.get(reason, 0) + 1

    def merge(self, other: ExactPrefixFigures) -> None:
        self.token_in_calls += other.token_in_calls
        self.compared += other.compared
        self.chat_calls += other.chat_calls
        self.calls_drift_removed += other.calls_drift_removed
        self.drift_tokens_removed += other.drift_tokens_removed
        for reason, n in other.chat_reasons.items():
            self.chat_reasons[reason] = self.chat_reasons.get(reason, 0) + n

    def as_dict(self) -> dict[str, Any]:
        return {
            "token_in_calls": self.token_in_calls,
            "compared": self.compared,
            "chat_calls": self.chat_calls,
            "chat_reasons": dict(self.chat_reasons),
            "calls_drift_removed": self.calls_drift_removed,
            "drift_tokens_removed": self.drift_tokens_removed,
        }


@dataclass(slots=True)
class Group:
    dialect: str
    harness: str
    calls: int = 0
    checked: int = 0  # any check ran (without a tokenizer: token positions only)
    with_tokenizer: int = 0  # the checks ran with the policy tokenizer
    policy_tokens: int = 0
    wrong: int = 0
    flags: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FLAGS, 0))
    exact: ExactPrefixFigures = field(default_factory=ExactPrefixFigures)
    # sampled under a grammar (calls' constrained_from on; docs/constrained.md): their
    # logprobs are the grammar's, whatever the text pipeline does
    constrained_calls: int = 0
    constrained_tokens: int = 0
    constrained_by: dict[str, int] = field(default_factory=dict)

    @property
    def share(self) -> float | None:
        return self.wrong / self.policy_tokens if self.policy_tokens else None

    def as_dict(self) -> dict[str, Any]:
        return {
            "dialect": self.dialect,
            "harness": self.harness,
            "calls": self.calls,
            "checked": self.checked,
            "checked_with_tokenizer": self.with_tokenizer,
            "flags": dict(self.flags),
            "policy_tokens": self.policy_tokens,
            "wrong_policy_tokens": self.wrong,
            "wrong_share": self.share,
            "exact_prefix": self.exact.as_dict(),
            "constrained_calls": self.constrained_calls,
            "constrained_tokens": self.constrained_tokens,
            "constrained_by": dict(self.constrained_by),
        }

    def add_constrained(self, row: dict[str, Any]) -> None:
        start = row.get("constrained_from")
        for reason in row.get("constrained_by") or ():
            self.constrained_by[reason] = self.constrained_by.get(reason, 0) + 1
        if start is not None:
            self.constrained_calls += 1
            self.constrained_tokens += max(0, len(row.get("output_token_ids") or ()) - start)

    def merge_constrained(self, other: Group) -> None:
        self.constrained_calls += other.constrained_calls
        self.constrained_tokens += other.constrained_tokens
        for reason, n in other.constrained_by.items():
            self.constrained_by[reason] = self.constrained_by.get(reason, 0) + n


@dataclass(slots=True)
class Example:
    call_id: str
    flag: str
    detail: dict[str, Any]


def fidelity_report(rows: list[dict[str, Any]]) -> tuple[list[Group], Group, list[Example]]:
    """Per (dialect, harness) groups, the total, and every flag's detail in finishing order."""
    rows = sorted(rows, key=lambda r: (r.get("finished_at") is None, r.get("finished_at") or 0))
    group_of: dict[str, tuple[str, str]] = {}
    groups: dict[tuple[str, str], Group] = {}
    wrong: dict[str, int] = {}
    examples: list[Example] = []
    for row in rows:
        key = (row.get("dialect") or "unknown", harness_of(row.get("headers_json")))
        group = groups.setdefault(key, Group(*key))
        group.calls += 1
        group_of[row["call_id"]] = key
        group.add_constrained(row)
        data = _json(row.get("fidelity_json"))
        if isinstance(data.get("exact_prefix"), dict):
            group.exact.add(data["exact_prefix"])
        if "checked" not in data:
            continue
        group.checked += 1
        group.with_tokenizer += checked_with_tokenizer(row.get("fidelity_json"))
        group.policy_tokens += len(row.get("output_token_ids") or ())
        for flag in row.get("fidelity_flags") or ():
            if flag in group.flags:
                group.flags[flag] += 1
                if isinstance(data.get(flag), dict):
                    examples.append(Example(row["call_id"], flag, data[flag]))
        for turn, n in (data.get("wrong_tokens") or {}).items():
            wrong[turn] = max(wrong.get(turn, 0), int(n))
    for turn, n in wrong.items():
        key = group_of.get(turn)
        if key is not None:
            groups[key].wrong += n
    total = Group("all", "all")
    for g in groups.values():
        total.calls += g.calls
        total.checked += g.checked
        total.with_tokenizer += g.with_tokenizer
        total.policy_tokens += g.policy_tokens
        total.wrong += g.wrong
        for flag, n in g.flags.items():
            total.flags[flag] += n
        total.exact.merge(g.exact)
        total.merge_constrained(g)
    return sorted(groups.values(), key=lambda g: (g.dialect, g.harness)), total, examples


def _json(text: str | None) -> dict[str, Any]:
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _pct(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.2f}%"


def _listing(groups: list[Group], total: Group, directory: str) -> Listing:
    # a narrow terminal loses the flag columns first (the last flag first), then the counts
    # the headline repeats; --json and --plain have them all
    drop = {f: len(FLAGS) - i for i, f in enumerate(FLAGS)}
    drop.update(
        {"policy tokens": len(FLAGS) + 2, "wrong": len(FLAGS) + 1, "checked": len(FLAGS) + 3}
    )
    names = ("calls", "checked", "with tokenizer", *FLAGS, "policy tokens", "wrong", "wrong %")
    names += ("grammar",)  # policy tokens sampled under a grammar (constrained_from on)
    drop["grammar"] = len(FLAGS) + 4
    columns = [Column("dialect"), Column("harness")]
    columns += [
        Column(name.replace("_", " "), numeric=True, drop=drop.get(name, 0)) for name in names
    ]
    listing = Listing(f"polar-mitm token fidelity: {directory}", columns)

    def row(g: Group) -> list[str]:
        return [
            g.dialect,
            g.harness,
            str(g.calls),
            str(g.checked),
            str(g.with_tokenizer),
            *(str(g.flags[f]) for f in FLAGS),
            str(g.policy_tokens),
            str(g.wrong),
            _pct(g.share),
            str(g.constrained_tokens),
        ]

    listing.rows = [row(g) for g in groups]
    listing.totals.append(row(total))
    return listing


def _show(tokens: list[str], theirs: list[str], style: str) -> Text:
    text = Text()
    for i, token in enumerate(tokens):
        same = i < len(theirs) and theirs[i] == token
        if i:
            text.append("|", style="dim")
        text.append(repr(token)[1:-1] or "·", style="" if same else style)
    return text


def _example_table(ex: Example) -> Table:
    d = ex.detail
    where = d.get("turn_call_id")
    title = f"{ex.flag} in call {ex.call_id}" + (
        f" (turn of call {where})" if where and where != ex.call_id else ""
    )
    facts = [f"{k}={d[k]}" for k in ("part", "in", "position", "offset", "note", "token") if k in d]
    table = Table(title=title, caption=", ".join(facts), show_lines=False)
    sampled = [str(t) for t in d.get("sampled", d.get("sampled_ids", []))]
    other = [str(t) for t in d.get("other", d.get("other_ids", []))]
    before = [str(t) for t in d.get("before", d.get("before_ids", []))]
    if ex.flag in ("count_mismatch",) or (
        ex.flag == "special_tokens" and d.get("part") == "prompt"
    ):
        table.add_column("context")
        table.add_row(Text(d.get("text") or " ".join(repr(t)[1:-1] for t in before)))
        return table
    table.add_column("before", style="dim")
    table.add_column("sampled (the ids the policy generated)")
    table.add_column("retokenized / re-rendered (what a text pipeline trains on)")
    table.add_row(
        Text("|".join(repr(t)[1:-1] for t in before)),
        _show(sampled, other, "bold red"),
        _show(other, sampled, "bold green"),
    )
    return table


def fail(message: str) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(1)


@click.command("fidelity")
@click.argument("directory", metavar="DIR", type=click.Path())
@click.option(
    "--examples",
    "n_examples",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Also show the first N flagged differences, sampled vs retokenized tokens side by side.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
@click.option("--plain", is_flag=True, help="Tab-separated lines, one per dialect and harness.")
def fidelity(directory: str, n_examples: int, as_json: bool, plain: bool) -> None:
    """Token fidelity of the calls captured under DIR (polar_output): per dialect and
    harness, the calls checked and flagged, and the share of policy tokens a
    retokenize-the-text pipeline would have got wrong."""
    from ..store import read_table

    if "://" not in directory and not Path(directory).exists():
        fail(f"{directory} does not exist")
    try:
        calls = read_table(directory, "calls")
    except (OSError, ValueError) as e:
        fail(f"cannot read shards under {directory}: {e}")
    columns = [
        c
        for c in (
            "call_id",
            "dialect",
            "headers_json",
            "finished_at",
            "output_token_ids",
            "fidelity_flags",
            "fidelity_json",
            "constrained_by",
            "constrained_from",
        )
        if c in calls.column_names
    ]
    rows = calls.select(columns).to_pylist()
    if not rows:
        fail(f"no captured calls under {directory}")
    groups, total, examples = fidelity_report(rows)
    if as_json:
        out = {
            "groups": [g.as_dict() for g in groups],
            "total": total.as_dict(),
            "examples": [
                {"call_id": e.call_id, "flag": e.flag, "detail": e.detail}
                for e in examples[:n_examples]
            ],
        }
        click.echo(json.dumps(out, indent=2, default=str))
        return
    if plain:
        emit([_listing(groups, total, directory)], plain=True)
        return
    console = Console()
    emit([_listing(groups, total, directory)], console=console)
    if total.with_tokenizer == 0:
        only = f"; {total.checked} call(s) had token positions compared" if total.checked else ""
        console.print(
            "Fidelity: not checked. No call was checked with the policy tokenizer (the proxy had "
            f"no polar_tokenizer, polar_fidelity=off, or the records predate the checks{only})."
        )
    else:
        console.print(
            f"A retokenize-the-text pipeline would have got [bold]{total.wrong}[/bold] of "
            f"{total.policy_tokens} policy tokens wrong: [bold]{_pct(total.share)}[/bold] "
            f"({sum(1 for _ in examples)} flagged differences in {total.checked} checked calls)."
        )
    exact = total.exact
    if exact.token_in_calls or exact.chat_calls:
        reasons = ", ".join(f"{r} {n}" for r, n in sorted(exact.chat_reasons.items()))
        console.print(
            f"Exact-prefix mode: [bold]{exact.token_in_calls}[/bold] of "
            f"{exact.token_in_calls + exact.chat_calls} calls were sent as the policy's own tokens; "
            + (
                f"in chat mode [bold]{exact.calls_drift_removed}[/bold] of the "
                f"{exact.compared} compared would have had a re-rendered prompt "
                f"({exact.drift_tokens_removed} tokens from the first difference on). "
                if exact.compared
                else "what chat mode would have sent was not compared (polar_exact_compare). "
            )
            + f"Sent the chat way: {reasons or 'none'}."
        )
    if total.constrained_by:
        reasons = ", ".join(f"{r} {n}" for r, n in sorted(total.constrained_by.items()))
        console.print(
            f"Grammar-constrained sampling: [bold]{total.constrained_tokens}[/bold] policy tokens "
            f"in {total.constrained_calls} calls were sampled under a grammar, whose logprobs are "
            f"not the policy's ({reasons}; docs/constrained.md)."
        )
    for ex in examples[:n_examples]:
        console.print(_example_table(ex))
