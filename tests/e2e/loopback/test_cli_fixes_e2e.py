"""The CLI as a user meets it piped, mistyped and scripted (issue 46), on shards a real session
left (tests/helpers/capture_session.py). Each test failed before its fix: `show` piped kept no
trace of which tokens the policy sampled and folded at 80 columns; `-o -` / `--html -` wrote a
file named `-`; `export --role` suggested `--all`; export ignored the tokenizer the proxy recorded
(slime's prompt/response empty); `calls --json` printed one array; `summary` printed its totals
above the groups and trees; every start printed transformers' "PyTorch was not found".
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from polar_mitm import tokenizer_record
from polar_mitm.assets import qwen3_tokenizer_dir
from polar_mitm.cli.show import POLICY_CLOSE, POLICY_OPEN
from polar_mitm.store import read_table
from polar_mitm.trajectory.traceview import segments
from tests.helpers.capture_session import produce
from tests.helpers.procs import BIN

POLAR = str(BIN / "polar-mitm")
QWEN = str(qwen3_tokenizer_dir())


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory, confdir: Path) -> Path:
    out = produce(tmp_path_factory.mktemp("cli-fixes"), confdir).output
    tokenizer_record.write(str(out), QWEN, "hf", "proxy-1")  # as a proxy with polar_tokenizer
    return out


def run(*args: str, cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    """The installed script in a real process, its stdout a pipe (no COLUMNS: `| less`)."""
    clean = {k: v for k, v in os.environ.items() if k not in ("POLAR_TOKENIZER", "COLUMNS")}
    clean.pop("TRANSFORMERS_NO_ADVISORY_WARNINGS", None)
    return subprocess.run(
        [POLAR, *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env={**clean, **env},
    )


def test_show_piped_marks_the_policy_tokens_and_does_not_fold(data: Path):
    main = next(
        t for t in read_table(str(data), "traces").to_pylist()
        if t["rollout_id"] == "loop.0" and t["role"] == "main"
    )  # fmt: skip
    sampled = [s for s in segments(main) if s.gen_start < s.end]
    shown = run("show", str(data), "loop.0")
    assert shown.returncode == 0, shown.stderr
    assert "PyTorch was not found" not in shown.stderr  # transformers' advice, silenced
    legend = f"policy tokens (loss_mask 1) are between {POLICY_OPEN} and {POLICY_CLOSE}\n"
    assert legend in shown.stdout
    out = shown.stdout.split(legend, 1)[1]
    assert out.count(POLICY_OPEN) == out.count(POLICY_CLOSE) == len(sampled) >= 2
    assert max(len(line) for line in out.splitlines()) > 80  # not folded at rich's default 80
    # the first call's sampled text, whole, between the marks (its tool call, on one line)
    span = out.split(POLICY_OPEN, 1)[1].split(POLICY_CLOSE, 1)[0]
    assert "<tool_call>" in span and '{"name": "run_shell"' in span


def test_dash_writes_to_stdout_and_says_so_on_stderr(data: Path, tmp_path: Path):
    piped = run("export", str(data), "--format", "slime", "--out", "-", cwd=tmp_path)
    assert piped.returncode == 0, piped.stderr
    samples = [json.loads(line) for line in piped.stdout.splitlines()]
    assert samples and all(s["tokens"] for s in samples)
    assert "wrote" in piped.stderr and "standard output" in piped.stderr
    page = run("report", str(data), "--html", "-", cwd=tmp_path)
    assert page.returncode == 0, page.stderr
    assert page.stdout.lstrip().lower().startswith("<!doctype html") and "wrote" in page.stderr
    assert list(tmp_path.iterdir()) == []  # no file named "-"


def test_export_uses_the_tokenizer_the_proxy_recorded(data: Path, tmp_path: Path):
    out = tmp_path / "s.jsonl"
    done = run("export", str(data), "--format", "slime", "--out", str(out))
    assert done.returncode == 0, done.stderr
    samples = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(s["prompt"] and s["response"] for s in samples), samples[0]
    assert any("<|im_start|>" in s["prompt"] for s in samples)


def only_role(data: Path, tmp_path: Path, role: str) -> Path:
    """A copy of the session's output whose traces are all of one role."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    copy = tmp_path / "data"
    shutil.copytree(data, copy, ignore=shutil.ignore_patterns("LOCK"))
    for shard in (copy / "traces").rglob("*.parquet"):
        table = pq.read_table(shard)
        pq.write_table(table.filter(pc.equal(table["role"], role)), shard)
    return copy


def test_export_role_hint_names_role_not_all(data: Path, tmp_path: Path):
    """Traces of another role: --all does not bring them back, --role does."""
    copy = only_role(data, tmp_path, "main")
    none = run("export", str(copy), "-f", "jsonl", "-o", str(tmp_path / "x"), "--role", "sub")
    assert none.returncode == 1
    assert "(--role to include)" in none.stderr and "--all" not in none.stderr, none.stderr


def test_export_incomplete_says_to_end_the_rollouts(data: Path, tmp_path: Path):
    """A folder whose rollouts never ended: the hint is to end them, not only --all."""
    copy = tmp_path / "data"
    shutil.copytree(data, copy, ignore=shutil.ignore_patterns("LOCK"))
    import pyarrow.parquet as pq

    for shard in (copy / "traces").rglob("*.parquet"):
        table = pq.read_table(shard)
        status = table.schema.get_field_index("status")
        table = table.set_column(status, "status", [["incomplete"] * table.num_rows])
        pq.write_table(table, shard)
    none = run("export", str(copy), "-f", "jsonl", "-o", str(tmp_path / "x"))
    assert none.returncode == 1
    assert "never ended: end them with a reward" in none.stderr, none.stderr


def test_calls_json_is_one_object_per_line(data: Path):
    shown = run("calls", str(data), "--json")
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    rows = [json.loads(line) for line in lines]
    assert len(rows) == len(read_table(str(data), "calls")) and all("call_id" in r for r in rows)


def test_summary_ends_with_its_totals(data: Path):
    shown = run("summary", str(data))
    assert shown.returncode == 0, shown.stderr
    last = [line for line in shown.stdout.splitlines() if line.strip()][-1]
    rollouts = len({r["rollout_id"] for r in read_table(str(data), "calls").to_pylist()})
    assert last.startswith(f"total: {rollouts} rollout(s)"), last


def test_proxy_takes_the_control_token_from_a_file_never_its_command_line(
    tmp_path: Path, make_policy_server
):
    """`polar-mitm proxy --control-token-file`: the proxy answers that token, `ps` never shows
    it, and `status` / `end` read it from a file as well."""
    from tests.helpers.procs import Proc, free_port

    server = make_policy_server()
    secret = "s3cret-" + os.urandom(8).hex()
    token = tmp_path / "token"
    token.write_text(secret + "\n")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("POLAR_")}
    env["POLAR_MITM_CONFDIR"] = str(tmp_path / "ca")
    args = [POLAR, "proxy", "--upstream", server.url, "--output", str(tmp_path / "data")]
    args += ["--listen-port", str(port), "--control-token-file", str(token)]
    proxy = Proc(args, tmp_path / "proxy.log", env=env)
    try:
        proxy.wait_for("polar-mitm: capturing", timeout=90)
        cmdline = Path(f"/proc/{proxy.popen.pid}/cmdline").read_bytes()
        assert b"mitmdump" in cmdline and secret.encode() not in cmdline  # the exec'd proxy
        url = f"http://127.0.0.1:{port}"
        ok = run("status", "--proxy", url, "--token-file", str(token), **env)
        assert ok.returncode == 0 and json.loads(ok.stdout)["paused"] is False, ok.stderr
        wrong = tmp_path / "wrong"
        wrong.write_text("not-it")
        refused = run("status", "--proxy", url, "--token-file", str(wrong), **env)
        assert refused.returncode == 1 and refused.stderr.startswith("error: 401"), refused.stderr
    finally:
        proxy.stop()
