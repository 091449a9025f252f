"""The `polar-mitm` commands on shards a real session left (tests/helpers/capture_session.py: the
reference policy server, mitmdump with the addon, HTTPS through the proxy, rewards through the
control plane). Each command's figures are checked against the Parquet shards themselves."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import subprocess
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from rich.console import Console

from polar_mitm.assets import qwen3_tokenizer_dir
from polar_mitm.cli.app import main
from polar_mitm.cli.show import render
from polar_mitm.cli.token_text import resolve, token_pieces
from polar_mitm.store import list_shards, read_table
from polar_mitm.trajectory.traceview import segments
from tests.helpers.ansi import cells
from tests.helpers.capture_session import LIVE_REWARDS, produce
from tests.helpers.procs import BIN

POLAR = str(BIN / "polar-mitm")
QWEN = str(qwen3_tokenizer_dir())
ROLLOUTS = ["loop.0", "combo.0", "task.0", "task.1", "task.2", "task.3", "bad.0", "stream.0"]


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory, confdir: Path):
    return produce(tmp_path_factory.mktemp("cli-session"), confdir)


@pytest.fixture(scope="module")
def data(session) -> Path:
    return session.output


@pytest.fixture(scope="module")
def truth(data: Path) -> dict:
    """The figures, straight from the Parquet shards (the store's reader)."""
    calls = read_table(str(data), "calls").to_pylist()
    traces = read_table(str(data), "traces").to_pylist()
    return {"calls": calls, "traces": traces}


@pytest.fixture
def copy(data: Path, tmp_path: Path) -> Path:
    """A private copy of the session's output, for commands that write."""
    out = tmp_path / "data"
    shutil.copytree(data, out, ignore=shutil.ignore_patterns("LOCK"))
    return out


def cli(*args: str) -> object:
    result = CliRunner().invoke(main, list(args))
    return result


def run(*args: str, **env: str) -> subprocess.CompletedProcess:
    """The installed `polar-mitm` script in a real process."""
    return subprocess.run(
        [POLAR, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={
            **{k: v for k, v in os.environ.items() if k != "POLAR_TOKENIZER"},
            "COLUMNS": "220",
            **env,
        },
    )


def of(rows: list[dict], rollout: str) -> list[dict]:
    return [r for r in rows if r["rollout_id"] == rollout]


def sampled(calls: list[dict]) -> int:
    """Tokens the policy sampled in the calls that were merged (completed, with ids)."""
    return sum(len(c["output_token_ids"] or []) for c in calls if c["status"] == "completed")


# -- summary ------------------------------------------------------------------------------------


def test_summary_json_is_the_parquet_sums(data, truth):
    result = cli("summary", str(data), "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    by_id = {r["rollout_id"]: r for r in out["rollouts"]}
    assert list(by_id) == ROLLOUTS  # in order of first call
    for rid in ROLLOUTS:
        calls, traces, r = of(truth["calls"], rid), of(truth["traces"], rid), by_id[rid]
        assert r["calls"] == len(calls)
        assert r["prompt_tokens"] == sum(len(c["prompt_token_ids"] or []) for c in calls)
        assert r["output_tokens"] == sum(len(c["output_token_ids"] or []) for c in calls)
        assert r["errors"] == sum(c["status"] != "completed" for c in calls)
        assert r["traces"] == len(traces)
        assert r["policy_tokens"] == sum(sum(t["loss_mask"]) for t in traces)
        assert r["env_tokens"] == sum(len(t["input_ids"]) - sum(t["loss_mask"]) for t in traces)
        # every token the policy sampled is trained exactly once
        assert r["policy_tokens"] == sampled(calls)
        assert r["break_reasons"] == dict(Counter(t["break_reason"] for t in traces))
        assert r["reward"] == LIVE_REWARDS.get(rid)
        assert r["status"] == ("incomplete" if rid == "task.3" else "completed")
        assert r["trainable"] is (rid != "bad.0")
    assert by_id["combo.0"]["break_reasons"] == {
        "first_call": 1,
        "side_call": 1,
        "sub_agent": 1,
        "compaction": 1,
    }
    assert by_id["combo.0"]["roles"] == {"main": 2, "side": 1, "sub": 1}
    assert by_id["bad.0"]["untrainable"] == ["call_error"] and by_id["bad.0"]["errors"] == 1
    [task] = [g for g in out["groups"] if g["group_id"] == "task"]
    assert task["rollouts"] == ["task.0", "task.1", "task.2", "task.3"]
    assert (task["rewarded"], task["reward_mean"], task["reward_std"]) == (2, 0.5, 0.5)
    assert task["statuses"] == {"completed": 3, "incomplete": 1}
    totals = out["totals"]
    assert totals["rollouts"] == 8 and totals["calls"] == len(truth["calls"])
    assert totals["traces"] == len(truth["traces"])
    assert totals["output_tokens"] == sum(len(c["output_token_ids"] or []) for c in truth["calls"])
    assert totals["policy_tokens"] == sum(sum(t["loss_mask"]) for t in truth["traces"])
    assert totals["trainable_traces"] == sum(bool(t["trainable"]) for t in truth["traces"])


def test_summary_table_in_a_real_process(data, truth):
    p = run("summary", str(data))
    assert p.returncode == 0, p.stderr
    rows = {line.split()[0]: line.split() for line in p.stdout.splitlines() if line.strip()}
    loop = rows["loop.0"]
    calls, traces = of(truth["calls"], "loop.0"), of(truth["traces"], "loop.0")
    # rollout group calls err prompt sampled grammar traces policy env ...
    assert loop[1:10] == [
        "loop",
        str(len(calls)),
        "0",
        str(sum(len(c["prompt_token_ids"]) for c in calls)),
        str(sampled(calls)),
        "0",  # no call sampled under a grammar (docs/constrained.md)
        "1",
        str(sum(traces[0]["loss_mask"])),
        str(len(traces[0]["input_ids"]) - sum(traces[0]["loss_mask"])),
    ]
    assert "no:" in " ".join(rows["bad.0"]) and "call_error" in " ".join(rows["bad.0"])
    assert "GRPO groups" in p.stdout
    # a narrow terminal gets fewer columns, not a mangled table
    narrow = run("summary", str(data), COLUMNS="100")
    assert narrow.returncode == 0
    assert all(len(line) <= 100 for line in narrow.stdout.splitlines())
    cells = row_cells(narrow.stdout, "loop.0", "rollout")
    assert cells["calls"] == str(len(calls)) and cells["sampled"] == str(sampled(calls))
    assert cells.get("policy", str(sampled(calls))) == str(sampled(calls))


def row_cells(text: str, first: str, header: str) -> dict[str, str]:
    """The cells of the table line starting with ``first``, by the names of the header line
    starting with ``header`` (columns whose cells have no spaces, read in order)."""
    lines = text.splitlines()
    head = next(ln for ln in lines if ln.split()[:1] == [header])
    line = next(ln for ln in lines if ln.split()[:1] == [first])
    return dict(zip(head.split(), line.split(), strict=False))


# -- every listing, wherever it is printed ----------------------------------------------------

LISTINGS = ["summary", "calls", "fidelity"]


def whole_ids(truth: dict, command: str) -> list[str]:
    """The ids a listing shows, each of which must appear whole on one line."""
    rollouts = sorted({c["rollout_id"] for c in truth["calls"]})
    if command == "summary":
        return rollouts + sorted({c["group_id"] for c in truth["calls"] if c["group_id"]})
    if command == "calls":
        return rollouts + [c["call_id"] for c in truth["calls"]]
    return sorted({c["dialect"] for c in truth["calls"] if c["dialect"]})


@pytest.mark.parametrize("command", LISTINGS)
def test_listings_keep_ids_whole_piped_and_at_any_width(data, truth, command):
    """Piped (no COLUMNS: the table's natural width) and at 80, 100 and 200 columns, every id is
    whole on one line, every line fits the width, and each call's figures sit on its line."""
    counts = {c["call_id"]: c for c in truth["calls"]}
    for width in ("", "80", "100", "200"):
        p = run(command, str(data), COLUMNS=width)
        assert p.returncode == 0, p.stderr
        lines = p.stdout.splitlines()
        words = [set(line.split()) for line in lines]
        for id_ in whole_ids(truth, command):
            assert any(id_ in w for w in words), f"{id_} is not whole at width {width!r}"
        if width:
            assert max(len(line) for line in lines) <= int(width), (width, p.stdout)
        if command == "calls":
            head = next(
                line.split() for line in lines if line.split()[:1] in (["started"], ["rollout"])
            )
            for line, w in zip(lines, words, strict=True):
                for call_id in w & counts.keys():
                    c = counts[call_id]
                    if "prompt" in head:
                        assert str(len(c["prompt_token_ids"] or [])) in w, line
                    if "sampled" in head:
                        assert str(len(c["output_token_ids"] or [])) in w, line
    piped = run(command, str(data), COLUMNS="").stdout
    assert "not checked" in piped  # this session ran without polar_tokenizer
    assert "no fidelity flags" not in piped


def test_show_decodes_with_the_tokenizer_recorded_with_the_shards(copy, tmp_path):
    """The proxy records polar_tokenizer in DIR/_polar_tokenizer.json: `show` uses it by itself;
    --tokenizer overrides it; one that does not load here falls back to ids, saying why."""
    from polar_mitm import tokenizer_record

    plain = " ".join(run("show", str(copy), "loop.0", "--no-pager").stdout.split())
    assert "showing ids" in plain and "<|im_start|>" not in plain  # none recorded
    tokenizer_record.write(str(copy), QWEN, "hf", "proxy-1")
    shown = run("show", str(copy), "loop.0", "--no-pager")
    assert shown.returncode == 0, shown.stderr
    assert f"decoded with {QWEN} (the proxy's polar_tokenizer)" in " ".join(shown.stdout.split())
    assert "<|im_start|>assistant" in shown.stdout
    override = run("show", str(copy), "loop.0", "--no-pager", "--tokenizer", QWEN)
    assert "(the proxy's polar_tokenizer)" not in override.stdout
    tokenizer_record.write(str(copy), str(tmp_path / "gone"), "hf")
    gone = " ".join(run("show", str(copy), "loop.0", "--no-pager").stdout.split())
    assert "the proxy's tokenizer does not load here" in gone and "showing ids" in gone


def test_report_says_not_checked_without_a_tokenizer(data, tmp_path):
    """This session ran without polar_tokenizer: the page must not claim a clean bill."""
    page = tmp_path / "r.html"
    result = cli("report", str(data), "--html", str(page))
    assert result.exit_code == 0, result.output
    html = page.read_text()
    assert "no fidelity flags" not in html
    assert html.count("fidelity not checked") == len(ROLLOUTS)


@pytest.mark.parametrize("command", LISTINGS)
def test_plain_is_tsv_and_json_parses(data, truth, command):
    import csv
    import io

    p = run(command, str(data), "--plain", COLUMNS="80")
    assert p.returncode == 0, p.stderr
    rows = list(csv.reader(io.StringIO(p.stdout), delimiter="\t"))
    head, body = rows[0], rows[1:]
    assert body and all(len(r) == len(head) for r in body), p.stdout
    table = [dict(zip(head, r, strict=True)) for r in body]
    if command == "calls":
        assert [r["call"] for r in table] == [
            c["call_id"] for c in sorted(truth["calls"], key=lambda c: c["started_at"])
        ]
        by_id = {c["call_id"]: c for c in truth["calls"]}
        for r in table:
            assert r["prompt"] == str(len(by_id[r["call"]]["prompt_token_ids"] or []))
            assert r["flags"] == "not checked"
    elif command == "summary":
        assert sorted(r["rollout"] for r in table) == sorted(
            {c["rollout_id"] for c in truth["calls"]}
        )
        groups = run(command, str(data), "--plain", "--groups").stdout.splitlines()
        assert groups[0].split("\t")[0] == "group" and "task" in {g.split("\t")[0] for g in groups}
    else:
        assert {r["dialect"] for r in table} == {c["dialect"] for c in truth["calls"]}
        assert all(r["with tokenizer"] == "0" for r in table)  # positions only: not checked
    out = run(command, str(data), "--json").stdout  # calls: JSON lines, one call each
    assert (
        [json.loads(line) for line in out.splitlines()] if command == "calls" else json.loads(out)
    )


def test_errors_a_user_meets_are_one_line(data, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    bad_reward = tmp_path / "rewards.jsonl"
    bad_reward.write_text('{"rollout_id": "loop.0", "reward": "high"}\n')
    cases = [
        (["summary", str(tmp_path / "nope")], "does not exist"),
        (["summary", str(tmp_path / "file")], "is not a directory"),
        (["summary", str(tmp_path / "empty")], "no calls shards under"),
        (["calls", str(data), "--rollout", "nobody.0"], "no calls of rollout 'nobody.0'"),
        (["show", str(data), "nobody.0"], "no rollout 'nobody.0'"),
        (["show", str(data)], "holds 8 rollouts: name one"),
        (["show", str(data), "loop.0", "--trace", "zzz"], "--trace zzz is not a trace"),
        (["show", str(data), "loop.0", "--tokenizer", str(tmp_path)], "cannot load a tokenizer"),
        (
            ["export", str(tmp_path / "empty"), "-f", "slime", "-o", str(tmp_path / "x")],
            "no traces shards",
        ),
        (["export", str(data), "-f", "verl", "-o", str(tmp_path / "no" / "x.npz")], "cannot write"),
        (["reward", str(data), str(bad_reward)], "rewards.jsonl:1: reward must be a number"),
        (["reward", str(data), str(tmp_path / "missing.csv")], "cannot read"),
        (
            ["report", str(tmp_path / "empty"), "--html", str(tmp_path / "r.html")],
            "no calls shards",
        ),
    ]
    for args, needle in cases:
        p = run(*args)
        assert p.returncode == 1, (args, p.stdout, p.stderr)
        assert p.stderr.startswith("error: ") and needle in p.stderr, (args, p.stderr)
        assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr
    p = run("show", str(data), "nobody.0")
    assert "rollouts: loop.0, combo.0" in p.stderr  # says which there are


def test_every_command_has_complete_help():
    for command, needles in {
        "summary": ["--json", "--plain", "--groups", "GRPO group"],
        "calls": ["--rollout", "--json", "--plain", "ttfb"],
        "fidelity": ["--json", "--plain", "--examples"],
        "top": ["--control", "--token-file", "--interval", "--once", "/metrics"],
        "show": ["--trace", "--ids", "--logprobs", "--tokenizer", "--pager", "main trace"],
        "export": ["slime", "verl", "nemo-gym", "jsonl", "--all", "--role", "--out"],
        "reward": ["rollout_id", "revision", "--skip-unknown", "--dry-run", "--journal"],
        "report": ["--html", "--max-rollouts", "no network"],
        "env": ["--proxy", "--rollout"],
        "certs": ["--confdir"],
        "recover": ["--journal"],
    }.items():
        result = cli(command, "--help")
        assert result.exit_code == 0, result.output
        text = " ".join(result.output.split())
        for needle in needles:
            assert needle in text, (command, needle)


# -- calls --------------------------------------------------------------------------------------


def test_calls_json_and_table(data, truth):
    result = cli("calls", str(data), "--rollout", "bad.0", "--json")
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.output.splitlines()]  # one call per line
    expected = sorted(of(truth["calls"], "bad.0"), key=lambda c: c["started_at"])
    assert [r["call_id"] for r in rows] == [c["call_id"] for c in expected]
    bad, good = rows
    assert (bad["status"], bad["http_status"]) == ("error", 400) and "messages" in bad["error"]
    assert good["status"] == "completed" and good["dialect"] == "openai_chat"
    assert good["model_requested"] == "gpt-4.1" and good["model_served"] == "Qwen/Qwen3-4B"
    assert good["prompt_tokens"] == len(expected[1]["prompt_token_ids"])
    assert good["output_tokens"] == len(expected[1]["output_token_ids"])
    c = expected[1]
    latency = (c["finished_at"] - c["started_at"]).total_seconds() * 1000
    ttfb = (c["first_byte_at"] - c["started_at"]).total_seconds() * 1000
    assert good["latency_ms"] == pytest.approx(latency) and good["ttfb_ms"] == pytest.approx(ttfb)
    assert 0 <= good["ttfb_ms"] <= good["latency_ms"]

    p = run("calls", str(data))
    assert p.returncode == 0, p.stderr
    total = next(line for line in p.stdout.splitlines() if line.strip().startswith("total"))
    all_calls = truth["calls"]
    assert total.split()[1:4] == [
        str(len(all_calls)),
        str(sum(len(c["prompt_token_ids"] or []) for c in all_calls)),
        str(sum(len(c["output_token_ids"] or []) for c in all_calls)),
    ]
    assert "1 failed" in total


# -- show ---------------------------------------------------------------------------------------


def expected_cells(trace: dict, pieces: list[str]) -> list[tuple[str, str]]:
    """(char, "env"|"policy") for every visible character of the trace's tokens."""
    out = []
    for seg in segments(trace):
        for i in range(seg.start, seg.end):
            kind = "policy" if i >= seg.gen_start else "env"
            assert (trace["loss_mask"][i] == 1) is (kind == "policy")
            out += [(ch, kind) for ch in pieces[i] if ch != "\n"]
    return out


def coloured(text: str) -> list[tuple[str, str]]:
    kinds = {("cyan", False): "env", ("green", True): "policy"}
    return [
        (c.char, kinds[(c.fg, c.bold)])
        for c in cells(text)
        if (c.fg, c.bold) in kinds and c.char != "\n"
    ]


@pytest.mark.parametrize("rollout", ["loop.0", "combo.0"])
def test_show_colours_every_token_by_its_mask(truth, rollout):
    """Rich's recorded console (a terminal's escape codes): each character of each token is in
    the environment colour or the policy colour exactly as its loss_mask says."""
    tok, _ = resolve(QWEN)
    for trace in of(truth["traces"], rollout):
        pieces = token_pieces(tok, trace["input_ids"])
        assert "".join(pieces) == tok.decode(trace["input_ids"])
        parts = render(trace, [trace], pieces, {})
        console = Console(record=True, force_terminal=True, color_system="truecolor", width=20000)
        for part in parts[1:]:  # the header's legend is coloured too: tokens only
            console.print(part)
        got = coloured(console.export_text(styles=True))
        assert got == expected_cells(trace, pieces)
        assert sum(k == "policy" for _, k in got) > 0 and sum(k == "env" for _, k in got) > 0


def test_show_ids_and_logprob_shading(truth):
    [trace] = of(truth["traces"], "loop.0")
    tok, _ = resolve(QWEN)
    pieces = token_pieces(tok, trace["input_ids"])
    console = Console(record=True, force_terminal=True, color_system="truecolor", width=20000)
    for part in render(trace, [trace], pieces, {}, ids=True, logprobs=True)[1:]:
        console.print(part)
    text = console.export_text(styles=True)
    plain = "".join(c.char for c in cells(text))
    # each token is followed by its id
    for i in (0, len(pieces) // 2, len(pieces) - 1):
        assert f"{pieces[i]}[{trace['input_ids'][i]}]" in plain
    # policy tokens below p=0.9 get a red background, the likely ones none
    shaded = {c.bg for c in cells(text) if c.fg == "green" and c.bold and c.bg}
    assert shaded and all(bg.startswith("rgb(") and bg.endswith(",0,0)") for bg in shaded)
    unlikely = [
        i
        for i, (m, lp) in enumerate(zip(trace["loss_mask"], trace["logprobs"], strict=True))
        if m and math.exp(lp) < 0.9
    ]
    assert unlikely, "the reference server's logprobs should vary"
    # without --logprobs nothing is shaded
    console = Console(record=True, force_terminal=True, color_system="truecolor", width=20000)
    for part in render(trace, [trace], pieces, {})[1:]:
        console.print(part)
    assert not any(c.bg for c in cells(console.export_text(styles=True)))


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], capture_output=True, text=True, check=True).stdout


def test_show_in_a_real_terminal_with_the_pager(data, truth, tmp_path):
    """tmux gives `show` a real terminal: it pages through less (colours kept, -R), picks the
    main trace by itself, and the screen holds the two colours where the tokens are."""
    if shutil.which("tmux") is None:
        pytest.fail("tmux is not installed (scripts/test.sh installs it)")
    name = f"polar-show-{os.getpid()}"
    socket = str(tmp_path / "tmux.sock")
    done = tmp_path / "done"
    cmd = (
        f"env -u LESS COLUMNS= LINES= {POLAR} show {data} --rollout combo.0 --tokenizer {QWEN}; "
        f"echo $? > {done}"
    )
    tmux("-S", socket, "new-session", "-d", "-s", name, "-x", "160", "-y", "40", cmd)
    try:
        deadline = time.monotonic() + 60
        screen = ""
        while time.monotonic() < deadline:
            screen = tmux("-S", socket, "capture-pane", "-e", "-p", "-t", name)
            if "break first_call" in screen:
                break
            time.sleep(0.2)
        assert "rollout" in screen and "combo.0" in screen, screen
        assert not done.exists(), "the output did not go through the pager"
        first = coloured(screen)
        assert {k for _, k in first} == {"env", "policy"}, screen
        tmux("-S", socket, "send-keys", "-t", name, "G")  # to the end of the trace
        while time.monotonic() < deadline:
            screen = tmux("-S", socket, "capture-pane", "-e", "-p", "-t", name)
            if "end of trace" in screen:
                break
            time.sleep(0.2)
        assert "end of trace" in screen, screen
        tmux("-S", socket, "send-keys", "-t", name, "q")
        while time.monotonic() < deadline and not done.exists():
            time.sleep(0.1)
        assert done.read_text().strip() == "0"
    finally:
        subprocess.run(["tmux", "-S", socket, "kill-server"], capture_output=True)
    # what was on screen is the main agent's root trace, in its colours
    main_trace = next(
        t for t in of(truth["traces"], "combo.0") if t["break_reason"] == "first_call"
    )
    tok, _ = resolve(QWEN)
    pieces = token_pieces(tok, main_trace["input_ids"])
    want = "".join(ch for ch, k in expected_cells(main_trace, pieces) if k == "policy")
    tail = "".join(ch for ch, k in coloured(screen) if k == "policy")
    assert tail and tail in want  # the last screen's policy text is the end of the main trace


def test_show_picks_the_main_trace_and_lists_the_others(data, truth):
    p = run("show", str(data), "combo.0", "--tokenizer", QWEN)
    assert p.returncode == 0, p.stderr
    traces = of(truth["traces"], "combo.0")
    main_trace = next(t for t in traces if t["break_reason"] == "first_call")
    assert f"trace      {main_trace['trace_id']}" in p.stdout
    for t in traces:  # the rollout's other traces, to pick with --trace
        assert t["trace_id"] in p.stdout
    sub = next(t for t in traces if t["role"] == "sub")
    p = run(
        "show",
        str(data),
        "--rollout",
        "combo.0",
        "--trace",
        sub["trace_id"][:10],
        "--tokenizer",
        QWEN,
    )
    assert p.returncode == 0, p.stderr
    assert "break sub_agent from " + main_trace["trace_id"] in p.stdout
    assert "[sub-agent] You count lines." in p.stdout
    # no tokenizer anywhere: ids, said so
    p = run("show", str(data), "task.0")
    assert p.returncode == 0, p.stderr
    [t0] = of(truth["traces"], "task.0")
    assert "no tokenizer" in p.stdout
    assert " ".join(str(i) for i in t0["input_ids"][:5]) in p.stdout


# -- export -------------------------------------------------------------------------------------

# slime's Sample fields (slime/utils/types.py, THUDM/slime@0d234f3e3a83c81b7d37209994e0b994deacbb24)
SLIME_SAMPLE_FIELDS = {
    "group_index": (int, type(None)),
    "index": (int, type(None)),
    "prompt": (str, list),
    "tokens": list,
    "multimodal_inputs": (dict, type(None)),
    "multimodal_train_inputs": (dict, type(None)),
    "response": str,
    "response_length": int,
    "label": (str, type(None)),
    "reward": (float, int, dict, type(None)),
    "loss_mask": (list, type(None)),
    "weight_versions": list,
    "rollout_log_probs": (list, type(None)),
    "rollout_routed_experts": (list, type(None)),
    "remove_sample": bool,
    "teacher_log_probs": (list, type(None)),
    "status": str,
    "metadata": dict,
    "generate_function_path": (str, type(None)),
    "train_metadata": (dict, type(None)),
    "session_id": (str, type(None)),
    "non_generation_time": float,
    "spec_info": dict,
    "prefix_cache_info": dict,
}
SLIME_STATUS = {"pending", "completed", "truncated", "aborted", "failed"}  # Sample.Status


def exported(data: Path, tmp_path: Path, fmt: str, *extra: str) -> tuple[Path, str]:
    out = tmp_path / f"out.{fmt}"
    result = cli("export", str(data), "--format", fmt, "--out", str(out), *extra)
    assert result.exit_code == 0, result.output
    return out, result.output


def default_selection(truth: dict) -> list[dict]:
    return [t for t in truth["traces"] if t["trainable"] and t["status"] == "completed"]


def merged_sampled(truth: dict, traces: list[dict]) -> int:
    """Tokens the policy sampled in the calls of these traces, from calls/."""
    by_id = {c["call_id"]: c for c in truth["calls"]}
    return sum(len(by_id[c]["output_token_ids"]) for t in traces for c in t["call_ids"])


def test_export_slime_reads_back_as_samples(data, truth, tmp_path):
    out, said = exported(data, tmp_path, "slime")
    samples = [json.loads(line) for line in out.read_text().splitlines()]
    want = {t["trace_id"]: t for t in default_selection(truth)}
    assert {s["metadata"]["trace_id"] for s in samples} == set(want)
    assert f"wrote {len(want)} slime record(s)" in said
    assert "left out 1 trace(s): untrainable (call_error)" in said
    assert "left out 1 trace(s): status incomplete" in said
    groups: dict[str, int] = {}
    for i, s in enumerate(samples):
        # what Sample.from_dict accepts: known fields of the right types, a Status value
        for key, value in s.items():
            assert key in SLIME_SAMPLE_FIELDS, key
            assert isinstance(value, SLIME_SAMPLE_FIELDS[key]), (key, value)
        assert s["status"] in SLIME_STATUS and s["status"] == "completed"
        trace = want[s["metadata"]["trace_id"]]
        # RolloutManager._convert_samples_to_train_data's invariants
        assert len(s["loss_mask"]) == s["response_length"] == len(s["rollout_log_probs"])
        assert s["tokens"] == trace["input_ids"] and all(type(x) is int for x in s["tokens"])
        p = len(s["tokens"]) - s["response_length"]
        assert s["loss_mask"] == trace["loss_mask"][p:] and not any(trace["loss_mask"][:p])
        assert s["rollout_log_probs"] == pytest.approx(trace["logprobs"][p:], abs=1e-6)
        assert s["reward"] == trace["reward"] and s["index"] == i
        assert groups.setdefault(trace["group_id"], s["group_index"]) == s["group_index"]
    assert sorted(groups.values()) == list(range(len(groups)))
    assert sum(sum(s["loss_mask"]) for s in samples) == merged_sampled(truth, list(want.values()))


def test_export_verl_npz_has_the_batch_keys_and_dtypes(data, truth, tmp_path):
    out, said = exported(data, tmp_path, "verl")
    z = np.load(out)  # no pickle needed
    want = default_selection(truth)
    b = len(want)
    p, r = z["prompts"].shape[1], z["responses"].shape[1]
    for key, dtype, shape in [
        ("prompts", np.int64, (b, p)),
        ("responses", np.int64, (b, r)),
        ("response_mask", np.int64, (b, r)),
        ("input_ids", np.int64, (b, p + r)),
        ("attention_mask", np.int64, (b, p + r)),
        ("position_ids", np.int64, (b, p + r)),
        ("rollout_log_probs", np.float32, (b, r)),
    ]:
        assert z[key].dtype == dtype and z[key].shape == shape, key
    assert "rm_scores" not in z.files  # task.2 has no reward yet
    assert "warning: 1 record(s) have no reward" in said
    by_id = {t["trace_id"]: t for t in want}
    assert sorted(z["trace_id"].tolist()) == sorted(by_id)
    for i, trace_id in enumerate(z["trace_id"].tolist()):
        t = by_id[trace_id]
        attn = z["attention_mask"][i].astype(bool)
        assert z["input_ids"][i][attn].tolist() == t["input_ids"]
        assert z["position_ids"][i][attn].tolist() == list(range(len(t["input_ids"])))
        n = int(z["attention_mask"][i, p:].sum())
        assert z["response_mask"][i, :n].tolist() == t["loss_mask"][len(t["input_ids"]) - n :]
        assert not z["response_mask"][i, n:].any()  # padding is masked
        lp = z["rollout_log_probs"][i, :n]
        assert lp.tolist() == pytest.approx(t["logprobs"][len(t["input_ids"]) - n :], abs=1e-6)
        assert z["uid"][i] == t["group_id"]
    # verl's GRPO key groups the task rollouts together
    assert Counter(z["uid"].tolist())["task"] == 3
    assert int(z["response_mask"].sum()) == merged_sampled(truth, want)
    assert [k for k in z.files if z[k].ndim == 1] and all(z[k].dtype.kind != "O" for k in z.files)


def test_export_nemo_gym_reads_back_as_responses(data, truth, tmp_path):
    from openai.types.responses import Response

    out, output = exported(data, tmp_path, "nemo-gym")
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    # NeMo RL takes the main agent's chains; the sub-agent's is left out, and said so
    selected = default_selection(truth)
    want = {t["trace_id"]: t for t in selected if t["role"] == "main"}
    assert len(want) < len(selected) and "role sub (--role to include)" in output
    total = 0
    for line in lines:
        Response.model_validate(line["response"])  # Gym's NeMoGymResponse is this + token fields
        trace = want[line["response"]["id"]]
        assert line["reward"] == trace["reward"]
        # NeMo RL's postprocessing: each turn's prompt continues what was seen so far
        seen: list[int] = []
        rebuilt_mask: list[int] = []
        for item in line["response"]["output"]:
            assert item["type"] == "message" and item["role"] == "assistant"
            assert len(item["generation_token_ids"]) == len(item["generation_log_probs"])
            assert item["prompt_token_ids"][: len(seen)] == seen
            env = item["prompt_token_ids"][len(seen) :]
            seen += env + item["generation_token_ids"]
            rebuilt_mask += [0] * len(env) + [1] * len(item["generation_token_ids"])
            total += len(item["generation_token_ids"])
        assert seen == trace["input_ids"] and rebuilt_mask == trace["loss_mask"]
        assert [i["id"] for i in line["response"]["output"]] == trace["call_ids"]
    assert total == merged_sampled(truth, list(want.values()))


def test_export_jsonl_all_and_roles(data, truth, tmp_path):
    out, _ = exported(data, tmp_path, "jsonl", "--all")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["trace_id"] for r in rows) == sorted(t["trace_id"] for t in truth["traces"])
    by_id = {t["trace_id"]: t for t in truth["traces"]}
    for r in rows:
        t = by_id[r["trace_id"]]
        assert r["input_ids"] == t["input_ids"] and r["loss_mask"] == t["loss_mask"]
        assert r["segments"][0]["start"] == 0 and r["segments"][-1]["end"] == len(t["input_ids"])
    assert sum(sum(r["loss_mask"]) for r in rows) == sampled(truth["calls"])
    out, _ = exported(data, tmp_path, "jsonl", "--role", "sub")
    [sub] = [json.loads(line) for line in out.read_text().splitlines()]
    assert sub["role"] == "sub" and sub["rollout_id"] == "combo.0"
    # a real process, a file the user can read like any other
    p = run("export", str(data), "-f", "slime", "-o", str(tmp_path / "s.jsonl"), "--all")
    assert p.returncode == 0, p.stderr
    assert len((tmp_path / "s.jsonl").read_text().splitlines()) == len(truth["traces"])
    assert (tmp_path / "s.jsonl").stat().st_mode & 0o044  # not mkstemp's 0600
    assert not list(tmp_path.glob(".export-*"))  # no temp file left behind


# -- reward -------------------------------------------------------------------------------------


def shard_digests(output: Path) -> dict[str, str]:
    return {
        p: hashlib.sha256(Path(p).read_bytes()).hexdigest()
        for d in ("calls", "traces")
        for p in list_shards(str(output), d)
    }


def test_reward_joins_into_new_shards(copy, tmp_path):
    before = shard_digests(copy)
    revisions = {t["trace_id"]: t["revision"] for t in read_table(str(copy), "traces").to_pylist()}
    rewards = tmp_path / "rewards.jsonl"
    rewards.write_text(
        '{"rollout_id": "task.2", "reward": 0.75}\n\n{"rollout_id": "combo.0", "reward": 0.25}\n'
        '{"rollout_id": "loop.0", "reward": 1.0}\n'  # already has it: not rewritten
    )
    p = run("reward", str(copy), str(rewards))
    assert p.returncode == 0, p.stderr
    assert "wrote 5 trace(s) of 3 rollout(s)" in p.stdout and "1 already had it" in p.stdout
    after = shard_digests(copy)
    assert {k: after[k] for k in before} == before  # no shard changed
    new = sorted(set(after) - set(before))
    assert len(new) == 1 and "/traces/" in new[0]
    traces = read_table(str(copy), "traces").to_pylist()
    for t in traces:
        if t["rollout_id"] in ("task.2", "combo.0"):
            assert t["revision"] == revisions[t["trace_id"]] + 1
            assert t["reward"] == {"task.2": 0.75, "combo.0": 0.25}[t["rollout_id"]]
        else:
            assert t["revision"] == revisions[t["trace_id"]]
    summary = json.loads(cli("summary", str(copy), "--json").output)
    [task] = [g for g in summary["groups"] if g["group_id"] == "task"]
    assert task["rewarded"] == 3 and task["reward_mean"] == pytest.approx((0 + 1 + 0.75) / 3)
    # again: nothing to do, nothing written
    p = run("reward", str(copy), str(rewards))
    assert p.returncode == 0 and "nothing to write" in p.stdout
    assert shard_digests(copy) == after
    # every selected trace has a reward now: verl gets rm_scores on the last response token
    out, said = exported(copy, tmp_path, "verl")
    z = np.load(out)
    assert "rm_scores" in z.files and "warning" not in said
    for i in range(len(z["trace_id"])):
        n = int(z["attention_mask"][i, z["prompts"].shape[1] :].sum())
        assert z["rm_scores"][i, n - 1] == pytest.approx(z["reward"][i])
        assert np.count_nonzero(z["rm_scores"][i]) <= 1


def test_reward_csv_unknown_and_dry_run(copy, tmp_path):
    before = shard_digests(copy)
    csv_file = tmp_path / "rewards.csv"
    csv_file.write_text("rollout_id,reward\ntask.3,0.5\nnobody.7,1\n")
    p = run("reward", str(copy), str(csv_file))
    assert p.returncode == 1 and "1 rollout(s) in" in p.stderr and "nobody.7" in p.stderr
    assert shard_digests(copy) == before  # nothing written
    p = run("reward", str(copy), str(csv_file), "--skip-unknown", "--dry-run")
    assert p.returncode == 0 and "would write 1 trace(s)" in p.stdout
    assert shard_digests(copy) == before
    result = cli("reward", str(copy), str(csv_file), "--skip-unknown")
    assert result.exit_code == 0, result.output
    [t] = [t for t in read_table(str(copy), "traces").to_pylist() if t["rollout_id"] == "task.3"]
    assert (t["reward"], t["revision"], t["status"]) == (0.5, 1, "incomplete")


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("", "no rewards in it"),
        ("rollout,score\nx,1\n", "want JSONL lines or a CSV header with rollout_id and reward"),
        ('{"rollout_id": "a.0"}\n', ":1: missing 'reward'"),
        (
            '{"rollout_id": "a.0", "reward": 1}\n{"rollout_id": "a.0", "reward": 2}\n',
            ":2: a.0 has two different rewards",
        ),
        ('{"rollout_id": "a.0", "reward": 1}\nnot json\n', ":2: not JSON"),
        ("rollout_id,reward\na.0,nan\n", ":2: reward must be finite"),
        ('{"rollout_id": 7, "reward": 1}\n', "rollout_id must be a non-empty string"),
    ],
)
def test_bad_reward_files(data, tmp_path, content, needle):
    f = tmp_path / "r.txt"
    f.write_text(content)
    result = cli("reward", str(data), str(f))
    assert result.exit_code == 1 and needle in result.output, result.output


# -- report -------------------------------------------------------------------------------------


def chromium(*args: str, tmp: Path) -> subprocess.CompletedProcess:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.fail("chromium is not installed (scripts/test.sh installs Debian's chromium)")
    profile = tmp / f"profile-{time.monotonic_ns()}"
    return subprocess.run(
        [
            exe,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            f"--user-data-dir={profile}",
            "--enable-logging=stderr",
            "--v=0",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


def console_lines(stderr: str, page: Path) -> list[str]:
    """Chromium logs every console message and uncaught error of the page as INFO:CONSOLE."""
    return [ln for ln in stderr.splitlines() if ":CONSOLE" in ln and page.name in ln]


def test_report_opens_in_headless_chromium_without_console_errors(data, truth, tmp_path):
    page = tmp_path / "report.html"
    p = run("report", str(data), "--html", str(page))
    assert p.returncode == 0, p.stderr
    html = page.read_text()
    # self-contained: nothing to fetch
    for needle in ("<link", " src=", "@import", "url("):
        assert needle not in html
    for rid in ROLLOUTS:
        assert f'id="r-{rid}"' in html
    # mask spans to scale: one rect per run of equal mask values, per trace
    runs = sum(
        1 + sum(a != b for a, b in zip(t["loss_mask"], t["loss_mask"][1:], strict=False))
        for t in truth["traces"]
    )
    assert (
        html.count("environment (mask 0): tokens") + html.count("policy (mask 1): tokens") == runs
    )
    assert html.count("<title>call ") >= 2 * len(truth["calls"])
    shot = tmp_path / "report.png"
    r = chromium("--window-size=1280,2400", f"--screenshot={shot}", page.as_uri(), tmp=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
    assert console_lines(r.stderr, page) == []
    dom = chromium("--dump-dom", page.as_uri(), tmp=tmp_path)
    assert console_lines(dom.stderr, page) == []
    assert "8 of 8 rollouts shown" in dom.stdout  # the page's script ran
    # the same check sees a page that does log errors
    broken = tmp_path / "broken.html"
    broken.write_text("<html><body><script>console.error('x'); missing();</script></body></html>")
    r = chromium(f"--screenshot={tmp_path / 'broken.png'}", broken.as_uri(), tmp=tmp_path)
    assert len(console_lines(r.stderr, broken)) == 2


def test_long_scans_show_a_progress_bar_on_a_terminal(copy, truth):
    """Ten shards (copies: the reader dedupes them) make a long scan; a terminal (FORCE_COLOR
    makes rich treat stderr as one) gets a progress bar there, a pipe gets none."""
    shard = list_shards(str(copy), "calls")[0]
    for i in range(9):
        shutil.copy(shard, Path(shard).with_name(f"part-copy{i}.parquet"))
    tty = run("summary", str(copy), "--json", FORCE_COLOR="1")
    assert tty.returncode == 0, tty.stderr
    assert "reading calls" in tty.stderr and "100%" in tty.stderr
    assert json.loads(tty.stdout)["totals"]["calls"] == len(truth["calls"])
    pipe = run("summary", str(copy), "--json")
    assert pipe.returncode == 0 and pipe.stderr == ""
    assert json.loads(pipe.stdout) == json.loads(tty.stdout)
