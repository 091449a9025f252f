"""`polar-mitm reward`: rewards computed after the fact, joined into the traces.

The live way is the control plane (`POST /v1/rollouts/{id}/end {"reward": r}`); this is for rewards
that come from an offline judge or test run. Shards are immutable: a rewarded trace is written
again, whole, with a higher ``revision`` into NEW shards through the store's own writer (same
layout, metadata and journal durability), and readers keep the highest revision
(`store.dedupe`). Nothing is written unless the whole file is valid and every rollout it names
has traces (``skip_unknown`` relaxes the latter). Traces that already carry the reward are not
rewritten, so running it twice changes nothing.

A rollout rewarded both here and through the control plane afterwards ends up with whichever
wrote the higher revision; give a rollout its reward one way.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from ..store import Store, list_shards


class RewardFileError(ValueError):
    """The reward file cannot be used; the message names the file and line."""


def _reward(value: Any, where: str) -> float:
    if isinstance(value, bool) or value is None:
        raise RewardFileError(f"{where}: reward must be a number, got {value!r}")
    try:
        r = float(value)
    except (TypeError, ValueError):
        raise RewardFileError(f"{where}: reward must be a number, got {value!r}") from None
    if not math.isfinite(r):
        raise RewardFileError(f"{where}: reward must be finite, got {value!r}")
    return r


def _rollout(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise RewardFileError(f"{where}: rollout_id must be a non-empty string, got {value!r}")
    return value.strip()


def parse_rewards(text: str, name: str) -> dict[str, float]:
    """``rollout_id -> reward`` from JSONL (``{"rollout_id": ..., "reward": ...}`` per line) or
    CSV with a header naming ``rollout_id`` and ``reward``; the format is told by the first
    character (``{`` is JSONL)."""
    pairs: list[tuple[str, float, str]] = []
    text = text.removeprefix("\ufeff")  # a BOM from spreadsheet exports
    if not text.strip():
        raise RewardFileError(f"{name}: no rewards in it")
    if text.lstrip().startswith("{"):
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            where = f"{name}:{n}"
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise RewardFileError(f"{where}: not JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise RewardFileError(f"{where}: want an object with rollout_id and reward")
            for key in ("rollout_id", "reward"):
                if key not in obj:
                    raise RewardFileError(f"{where}: missing {key!r}")
            pairs.append((_rollout(obj["rollout_id"], where), _reward(obj["reward"], where), where))
    else:
        reader = csv.DictReader(io.StringIO(text))
        header = [h.strip() for h in reader.fieldnames or []]
        if "rollout_id" not in header or "reward" not in header:
            raise RewardFileError(
                f"{name}: want JSONL lines or a CSV header with rollout_id and reward "
                f"(got {', '.join(header) or 'nothing'})"
            )
        reader.fieldnames = header
        for row in reader:
            where = f"{name}:{reader.line_num}"
            pairs.append((_rollout(row["rollout_id"], where), _reward(row["reward"], where), where))
    if not pairs:
        raise RewardFileError(f"{name}: no rewards in it")
    out: dict[str, float] = {}
    for rollout, reward, where in pairs:
        if rollout in out and out[rollout] != reward:
            raise RewardFileError(
                f"{where}: {rollout} has two different rewards ({out[rollout]} and {reward})"
            )
        out[rollout] = reward
    return out


def read_rewards(path: str) -> dict[str, float]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise RewardFileError(f"cannot read {path}: {e}") from None
    return parse_rewards(text, path)


@dataclass
class JoinPlan:
    rows: list[dict[str, Any]] = field(default_factory=list)  # the new revisions to write
    unchanged: int = 0  # traces that already had their reward
    rollouts: set[str] = field(default_factory=set)  # rewarded rollouts that have traces
    unknown: list[str] = field(default_factory=list)  # rewarded rollouts without traces


def plan(traces: list[dict[str, Any]], rewards: dict[str, float]) -> JoinPlan:
    """What to write: for every trace of a rewarded rollout whose reward differs, the same row
    with the reward, ``revision + 1`` and a new ``created_at``."""
    p = JoinPlan()
    now = dt.datetime.now(dt.UTC)
    for t in traces:
        reward = rewards.get(t["rollout_id"])
        if reward is None:
            continue
        p.rollouts.add(t["rollout_id"])
        if t.get("reward") == reward:
            p.unchanged += 1
            continue
        row = dict(t)
        row["reward"] = reward
        row["revision"] = (t.get("revision") or 0) + 1
        row["created_at"] = now
        p.rows.append(row)
    p.unknown = [r for r in rewards if r not in p.rollouts]
    return p


def default_journal(output: str) -> str | None:
    """A journal of the reward command's own (a running proxy holds ``_journal``'s lock)."""
    if "://" in output:
        return None
    return os.path.join(output, "_journal_reward")


def write(output: str, rows: list[dict[str, Any]], journal_dir: str) -> list[str]:
    """Write ``rows`` as new traces shards through the store; returns the new shard paths."""
    before = set(list_shards(output, "traces"))
    store = Store(output, journal_dir=journal_dir, flush_rows=max(len(rows), 1), flush_age_s=3600)
    store.start()
    try:
        for row in rows:
            store.append("traces", row)
    finally:
        store.close()
    stats = store.stats
    if stats["rejected"] or stats["dropped"]:
        raise RuntimeError(
            f"{stats['rejected'] + stats['dropped']} row(s) were not stored ({stats['last_error']})"
        )
    if stats["rows_in_shards"] < len(rows):
        raise RuntimeError(
            f"only {stats['rows_in_shards']} of {len(rows)} rows reached shards "
            f"({stats['last_error'] or 'timeout'}); the rest are in {journal_dir} and are "
            "written by the next run"
        )
    return sorted(set(list_shards(output, "traces")) - before)
