"""Bad input to any command is one `error:` line on stderr and exit status 1: never a traceback,
never a usage dump, never an exit 0, never a folder created where none was (issue 46). Each
command that reads a proxy's output gets a missing folder, an empty one and one whose shards are
corrupt; each that takes a URL gets one that is not a URL.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from polar_mitm.cli.app import main

READERS = {
    "summary": [],
    "calls": [],
    "fidelity": [],
    "show": [],
    "export": ["--format", "jsonl", "--out", "{tmp}/out.jsonl"],
    "reward": ["{tmp}/rewards.jsonl"],
    "report": ["--html", "{tmp}/report.html"],
    "recover": [],
    "migrate": [],
    "sql": ["SELECT count(*) FROM calls"],
}
URLS = {
    "env": ["env", "--proxy", "notaurl"],
    "status": ["status", "--proxy", "http://:x"],
    "end": ["end", "task.0", "--reward", "1", "--proxy", "notaurl:port"],
    "top": ["top", "--once", "--control", "notaurl"],
    "proxy": ["proxy", "--upstream", "notaurl", "--dry-run"],
}


def one_error_line(result) -> None:
    assert result.exit_code == 1, (result.exit_code, result.output, result.stderr)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr


def folder(tmp: Path, kind: str) -> Path:
    path = tmp / kind
    if kind == "empty":
        path.mkdir()
    elif kind == "corrupt":
        for dataset in ("calls", "traces"):
            part = path / dataset / "date=2026-12-07"
            part.mkdir(parents=True)
            (part / "part-1-bad.parquet").write_bytes(b"PAR1 not a parquet file PAR1")
    return path


@pytest.mark.parametrize("kind", ["missing", "empty", "corrupt"])
@pytest.mark.parametrize("command", sorted(READERS))
def test_readers_refuse_bad_folders(tmp_path: Path, command: str, kind: str, monkeypatch):
    monkeypatch.setenv("POLAR_CONTROL_TOKEN", "t")
    (tmp_path / "rewards.jsonl").write_text('{"rollout_id": "task.0", "reward": 1.0}\n')
    if (command, kind) == ("recover", "corrupt"):
        pytest.skip(
            "recover reads the journal, not the shards: a folder of shards and no journal "
            "is a clean proxy output with nothing to recover"
        )
    data = folder(tmp_path, kind)
    args = [a.replace("{tmp}", str(tmp_path)) for a in READERS[command]]
    result = CliRunner().invoke(main, [command, str(data), *args])
    one_error_line(result)
    if kind == "missing":
        assert not data.exists(), f"{command} created {data}"
    assert not (tmp_path / "out.jsonl").exists() and not (tmp_path / "report.html").exists()


@pytest.mark.parametrize("command", sorted(URLS))
def test_bad_urls_are_one_line(tmp_path: Path, command: str, monkeypatch):
    monkeypatch.setenv("POLAR_CONTROL_TOKEN", "t")
    monkeypatch.setenv("POLAR_MITM_CONFDIR", str(tmp_path / "ca"))
    result = CliRunner().invoke(main, URLS[command])
    one_error_line(result)


@pytest.mark.parametrize("command", ["status", "end"])
def test_unreachable_proxy_is_an_error(command: str, monkeypatch):
    monkeypatch.setenv("POLAR_CONTROL_TOKEN", "t")
    args = ["end", "task.0"] if command == "end" else ["status"]
    result = CliRunner().invoke(main, [*args, "--proxy", "http://127.0.0.1:9"])
    one_error_line(result)
    assert "not reachable" in result.stderr


def test_control_commands_need_a_token_not_on_the_command_line(tmp_path: Path, monkeypatch):
    monkeypatch.delenv("POLAR_CONTROL_TOKEN", raising=False)
    monkeypatch.delenv("POLAR_CONTROL_TOKEN_FILE", raising=False)
    result = CliRunner().invoke(main, ["status", "--proxy", "http://127.0.0.1:9"])
    one_error_line(result)
    assert "POLAR_CONTROL_TOKEN" in result.stderr
    empty = tmp_path / "token"
    empty.write_text("\n")
    result = CliRunner().invoke(
        main, ["status", "--proxy", "http://127.0.0.1:9", "--token-file", str(empty)]
    )
    one_error_line(result)
    assert "is empty" in result.stderr


def test_env_refuses_a_confdir_without_a_ca(tmp_path: Path):
    """`env --confdir <typo>` used to make a new CA there: the harness would trust a CA that no
    proxy signs with."""
    result = CliRunner().invoke(
        main, ["env", "--proxy", "http://127.0.0.1:8080", "--confdir", str(tmp_path / "typo")]
    )
    one_error_line(result)
    assert not (tmp_path / "typo").exists()


def test_top_reads_a_control_port_named_control():
    """`--proxy` is the proxy's own port in env, status and end; top's URL is a control port,
    so top takes --control and refuses --proxy rather than read it two ways."""
    result = CliRunner().invoke(main, ["top", "--once", "--proxy", "http://127.0.0.1:8099"])
    one_error_line(result)
    assert "--control" in result.stderr


def test_top_once_json_and_an_unreachable_proxy_exits_1():
    result = CliRunner().invoke(
        main, ["top", "--once", "--json", "--control", "http://127.0.0.1:9"]
    )
    assert result.exit_code == 1 and result.stderr.startswith("error: ")
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert rows[0]["proxy"] == "http://127.0.0.1:9" and rows[0]["state"].startswith("unreachable")
